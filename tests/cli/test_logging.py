"""The CLI chooses the library's log handler: one `gpuflex: message` line on stderr,
warnings unless --verbose, debug too with it."""

from __future__ import annotations

import logging

import pytest
from typer.testing import CliRunner

from gpuflex.cli import app
from gpuflex.cli.common import setup_logging


@pytest.fixture(autouse=True)
def restore_level():
    logger = logging.getLogger("gpuflex")
    level = logger.level
    ssh = logging.getLogger("paramiko")
    handlers, propagate = list(ssh.handlers), ssh.propagate
    yield
    logger.setLevel(level)
    ssh.handlers[:], ssh.propagate = handlers, propagate


@pytest.mark.parametrize("verbose,shown", [(False, ["gpuflex: a warning"]),
                                           (True, ["gpuflex: a skipped poke", "gpuflex: a warning"])])
def test_messages_are_one_prefixed_line_on_stderr_and_debug_needs_verbose(capsys, verbose, shown):
    setup_logging(verbose)
    setup_logging(verbose)          # a second command in one process adds no second handler
    log = logging.getLogger("gpuflex.control.executor")
    log.debug("a skipped poke")
    log.warning("a warning")
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == shown


@pytest.mark.parametrize("flag", ["--verbose", "-v"])
def test_the_global_verbose_option_turns_on_debug(home, config_path, flag):
    r = CliRunner().invoke(app, ["--config", str(config_path), flag, "status", "--json"])
    assert r.exit_code == 0, r.output
    assert logging.getLogger("gpuflex").level == logging.DEBUG
    r = CliRunner().invoke(app, ["--config", str(config_path), "status", "--json"])
    assert r.exit_code == 0 and logging.getLogger("gpuflex").level == logging.WARNING


@pytest.mark.parametrize("verbose", [False, True])
def test_paramikos_traceback_of_a_failed_connection_reaches_the_terminal_only_with_verbose(capsys, verbose):
    setup_logging(verbose)
    setup_logging(verbose)
    log = logging.getLogger("paramiko.transport")   # its transport thread, on a reset banner read
    log.error("Exception (client): Error reading SSH protocol banner[Errno 104] Connection reset by peer")
    log.error("Traceback (most recent call last):")
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == (["gpuflex: Exception (client): Error reading SSH protocol banner[Errno 104] "
                                 "Connection reset by peer", "gpuflex: Traceback (most recent call last):"]
                                if verbose else [])
