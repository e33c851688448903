"""gpuflex.elastic.protocol.logs: the one handler a worker or coordinator process installs,
and an exception in one line."""

from __future__ import annotations

import io
import logging

import pytest

from gpuflex.elastic.protocol.logs import ROOT, describe, ensure_handler


@pytest.fixture
def bare_logger():
    """The "gpuflex" logger without handlers for the test (the autouse fixture in conftest
    puts the originals back)."""
    logger = logging.getLogger(ROOT)
    logger.handlers[:] = []
    return logger


def test_a_bare_process_gets_the_messages_alone_once(bare_logger):
    stream = io.StringIO()
    ensure_handler(stream)
    logging.getLogger(f"{ROOT}.elastic.run").info("generation %d formed", 3)
    logging.getLogger(f"{ROOT}.elastic").debug("not shown at INFO")
    assert stream.getvalue() == "generation 3 formed\n"
    assert bare_logger.propagate is False


def test_a_handler_the_script_installed_is_left_alone(bare_logger):
    mine = logging.StreamHandler(io.StringIO())
    bare_logger.addHandler(mine)
    bare_logger.setLevel(logging.WARNING)
    ensure_handler(io.StringIO())
    assert bare_logger.handlers == [mine]
    assert bare_logger.level == logging.WARNING


def test_an_exception_is_described_in_one_bounded_line():
    assert describe(ValueError("bad size\nTraceback of pages")) == "ValueError: bad size"
    assert describe(RuntimeError("x" * 500), limit=10) == "RuntimeError: " + "x" * 10
    assert describe(KeyError()) == "KeyError:"
    assert describe(OSError("   ")) == "OSError:"
