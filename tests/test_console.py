"""gpuflex.console: Ctrl-C at any moment of a command, the CLI's imports included, is one
line and exit 130, never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import sqlalchemy

import gpuflex.cli
from gpuflex import console
from gpuflex.cli import common
from tests.clirun import invoke


@pytest.fixture
def restore_sigint():
    old = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, old)


def test_an_interrupt_while_the_cli_starts_is_one_line_and_exit_130(monkeypatch, capsys, restore_sigint):
    def interrupted_import() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gpuflex.cli, "main", interrupted_import)
    with pytest.raises(SystemExit) as e:
        console.main()
    assert e.value.code == 130
    assert capsys.readouterr().err == "\nerror: interrupted.\n"
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN   # a second Ctrl-C while it exits: no traceback


def test_an_interrupt_during_a_command_is_one_line_and_exit_130(home, config_path, monkeypatch):
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(common.Context, "service", interrupted)
    r = invoke(home, config_path, "status")
    assert r.exit_code == 130
    assert r.stderr.strip() == "error: interrupted."


def past_the_interpreters_start(p: subprocess.Popen, site_packages: str) -> None:
    """Wait until the process maps a library from site-packages: the interpreter and its
    site module are done and the CLI imports (the first such library is SQLAlchemy's or
    pydantic's). A Ctrl-C in the interpreter's own first milliseconds, before it imported
    its site module, is Python's fatal error, out of any program's reach."""
    maps = f"/proc/{p.pid}/maps"
    end = time.monotonic() + 60
    while time.monotonic() < end and p.poll() is None:
        try:
            with open(maps) as f:
                if site_packages in f.read():
                    return
        except OSError:
            break
        time.sleep(0.002)
    pytest.fail(f"the console script never loaded a library from {site_packages} (exit {p.poll()})")


@pytest.mark.e2e
def test_ctrl_c_at_any_moment_of_the_console_script_gives_no_traceback(home, config_path):
    """SIGINT at delays across the CLI's imports and the command: each run ends 130 with
    one line (or 0 when the command was done first), never with a traceback; the
    imports' window is hit (no delay at all)."""
    env = dict(os.environ, HOME=str(home), GPUFLEX_CONFIG=str(config_path))
    script = os.path.join(os.path.dirname(sys.executable), "gpuflex")
    site_packages = os.path.dirname(os.path.dirname(sqlalchemy.__file__))
    codes = []
    for delay in (0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8):
        p = subprocess.Popen([script, "status"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        past_the_interpreters_start(p, site_packages)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, (delay, err)
        assert p.returncode in (0, 130), (delay, p.returncode, err)
        if p.returncode == 130:
            assert err.strip() == "error: interrupted.", (delay, err)
        codes.append(p.returncode)
    assert codes[0] == 130, codes


def test_a_ctrl_c_that_pydantic_turned_into_a_schema_error_is_still_a_ctrl_c():
    """pydantic-core wraps a KeyboardInterrupt raised while it builds a schema (seen in
    the Ctrl-C test above, at 0.2 s: 'SchemaError: Error building `literal` serializer:
    KeyboardInterrupt:'): still one line and 130, not a traceback; other errors are not."""
    SchemaError = type("SchemaError", (Exception,), {})   # pydantic_core's, by name
    assert console.interrupt_inside(SchemaError("Error building `default` serializer: KeyboardInterrupt: "))
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise ValueError("while building") from e
    except ValueError as chained:
        assert console.interrupt_inside(chained)
    assert not console.interrupt_inside(SchemaError("Error building `literal` serializer: bad value"))
    assert not console.interrupt_inside(RuntimeError("KeyboardInterrupt"))   # only pydantic's, by type name


def test_a_ctrl_c_python_could_not_raise_is_sent_again_and_other_unraisables_go_to_the_default_hook(restore_sigint):
    """A KeyboardInterrupt raised in a weakref's callback (where Python cannot raise it) goes
    to the hook, which returns without raising (it raised from inside the hook before, and
    Python printed that with a traceback); the Ctrl-C then lands in ordinary code. Other
    unraisables go to the default hook."""
    import gc
    import weakref
    from types import SimpleNamespace

    signal.signal(signal.SIGINT, signal.default_int_handler)
    passed: list = []
    hook = console.interrupt_again(passed.append)
    other = SimpleNamespace(exc_value=ValueError("x"))
    hook(other)
    assert passed == [other]

    class Thing:
        pass

    def callback(_ref):
        raise KeyboardInterrupt   # Python cannot raise it here: it goes to the unraisable hook

    before = sys.unraisablehook
    landed = False
    sys.unraisablehook = hook
    try:
        thing = Thing()
        ref = weakref.ref(thing, callback)
        del thing
        gc.collect()
        for _ in range(500):   # bounded: 5 s for a timer of 10 ms
            time.sleep(0.01)
    except KeyboardInterrupt:
        landed = True
    finally:
        sys.unraisablehook = before
    assert ref() is None and landed and passed == [other]
