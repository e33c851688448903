"""gpuflex.cli.web_cmd: `gpuflex web`'s bad input (a bad --bind, a port in use, a bad
header name) as one line and exit 2 before any server starts; the web packages imported
only by the command. The pages themselves: tests/web/test_app.py; in a browser:
tests/e2e/test_web_browser.py."""

from __future__ import annotations

import ast
import builtins
import socket
from pathlib import Path

import pytest

from gpuflex.cli import web_cmd
from gpuflex.errors import UsageError
from tests.clirun import invoke

CLI = Path(web_cmd.__file__).parent


@pytest.mark.parametrize("text, want", [
    ("127.0.0.1:8470", ("127.0.0.1", 8470)), (":9000", ("127.0.0.1", 9000)), ("[::1]:80", ("::1", 80)),
    ("0.0.0.0:1", ("0.0.0.0", 1)), ("lab-box:65535", ("lab-box", 65535)),
])
def test_bind_is_host_and_port(text, want):
    assert web_cmd.parse_bind(text) == want


@pytest.mark.parametrize("text", ["8470", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "[::zz]:80", "a:b:80",
                                  "127.0.0.1:-1", ""])
def test_a_bad_bind_is_a_usage_error(text):
    with pytest.raises(UsageError, match="--bind"):
        web_cmd.parse_bind(text)


def test_a_bad_bind_on_the_command_line_is_one_line_and_exit_2(home, config_path):
    r = invoke(home, config_path, "web", "--bind", "localhost")
    assert r.exit_code == 2
    assert r.stderr.startswith("error: --bind 'localhost': give HOST:PORT") and r.stderr.count("\n") == 1


def test_a_port_in_use_is_one_line_and_exit_2(home, config_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = invoke(home, config_path, "web", "--bind", f"127.0.0.1:{port}")
    assert r.exit_code == 2, r.output
    assert "cannot listen there" in r.stderr and r.stderr.count("\n") == 1
    assert "Traceback" not in r.output


def test_a_bad_header_name_is_refused(home, config_path):
    r = invoke(home, config_path, "web", "--user-header", "X User: 1")
    assert r.exit_code == 2 and "--user-header 'X User: 1'" in r.stderr


def test_without_the_web_packages_it_says_what_to_install(home, config_path, monkeypatch):
    real = builtins.__import__

    def no_uvicorn(name, *args, **kwargs):
        if name == "uvicorn":
            raise ModuleNotFoundError("No module named 'uvicorn'", name="uvicorn")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvicorn)
    r = invoke(home, config_path, "web")
    assert r.exit_code == 2
    assert "gpuflex web needs the uvicorn package" in r.stderr and "gpuflex[web]" in r.stderr


def test_no_cli_module_imports_the_web_packages_at_start_up():
    """Only inside the command's function: `gpuflex --help` and every other command start
    without starlette, uvicorn or the dashboard's modules."""
    for path in CLI.glob("*.py"):
        for node in ast.parse(path.read_text()).body:   # the module's top level only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.split(".")[0] in ("starlette", "uvicorn") or
                        n.startswith("gpuflex.web")], (path.name, names)


def test_the_help_has_an_example():
    r = invoke(Path("/nonexistent"), Path("/nonexistent"), "web", "--help")
    assert r.exit_code == 0 and "Example: gpuflex web --bind 127.0.0.1:8470" in r.stdout
    assert "X-Forwarded-User" in r.stdout
