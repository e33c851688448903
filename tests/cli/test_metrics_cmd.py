"""gpuflex.cli.metrics_cmd: `gpuflex metrics`, Prometheus' text format on stdout."""

from __future__ import annotations

import builtins
import socket

from gpuflex.cli import metrics_cmd  # noqa: F401 (the module under test, run through the CLI)
from tests.clirun import invoke
from tests.conftest import db_dump


def test_the_pool_is_printed_in_the_exposition_format(home, config_path):
    r = invoke(home, config_path, "metrics")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert any(line.startswith("# TYPE gpuflex_") for line in lines)
    samples = [line for line in lines if line and not line.startswith("#")]
    assert samples and all(line.startswith("gpuflex_") for line in samples)


def test_without_prometheus_client_it_says_what_to_install(home, config_path, monkeypatch):
    real = builtins.__import__

    def no_prometheus(name, *args, **kwargs):
        if name == "gpuflex.control.metrics" or name.startswith("prometheus_client"):
            raise ModuleNotFoundError("No module named 'prometheus_client'", name="prometheus_client")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    r = invoke(home, config_path, "metrics", "--no-refresh")
    assert r.exit_code == 2
    assert "gpuflex metrics needs the prometheus_client package" in r.stderr


def _one_error(r, says: str) -> None:
    assert r.exit_code == 2, r.output
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1 and says in r.stderr, r.stderr


def test_bad_serve_options_are_one_line_and_exit_2_with_the_database_unchanged(home, config_path):
    assert invoke(home, config_path, "metrics", "--no-refresh").exit_code == 0   # the database exists
    before = db_dump(home / "g.db")
    _one_error(invoke(home, config_path, "metrics", "--serve", "--bind", "localhost"), "give ADDR:PORT")
    _one_error(invoke(home, config_path, "metrics", "--serve", "--bind", "127.0.0.1:99999"), "the port must be")
    _one_error(invoke(home, config_path, "metrics", "--bind", "127.0.0.1:9464"), "add --serve")
    _one_error(invoke(home, config_path, "metrics", "--serve", "--refresh"), "--serve never refreshes")
    _one_error(invoke(home, config_path, "metrics", "--serve", "--bind", "192.0.2.1:9464"),
               "no interface of this machine has that address")
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        _one_error(invoke(home, config_path, "metrics", "--serve", "--bind", f"127.0.0.1:{port}"),
                   f"error: --bind 127.0.0.1:{port}: cannot listen there: the port is in use")
    assert db_dump(home / "g.db") == before
