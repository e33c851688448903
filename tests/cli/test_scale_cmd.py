"""gpuflex.cli.scale_cmd: `gpuflex scale`'s checks before it asks, and its bounded wait for
a refresh (real resizes: tests/cli/test_scale_cmd_wait.py and the elastic job tests)."""

from __future__ import annotations

import threading
import time

import pytest

from gpuflex.cli import scale_cmd
from tests.clirun import invoke


def test_a_job_that_does_not_exist_is_refused_before_anything_is_asked(home, config_path):
    r = invoke(home, config_path, "scale", "7", "2")
    assert (r.exit_code, r.stderr) == (2, "error: no job '7'. Run 'gpuflex status' to list jobs.\n")


@pytest.mark.parametrize("args,message", [
    (["1", "0"], "error: N 0: give a whole number from 1 to 2147483647."),
    (["1", "2", "--timeout", "0.5"], "error: --timeout 0.5: give seconds from 1 to 86400."),
])
def test_bad_arguments_are_usage_errors(home, config_path, args, message):
    r = invoke(home, config_path, "scale", *args)
    assert (r.exit_code, r.stderr.strip()) == (2, message)


def test_work_within_the_deadline_returns_true_and_its_error_is_raised_here():
    assert scale_cmd._within(time.monotonic() + 5, lambda: None) is True

    def fails():
        raise RuntimeError("lock held")

    with pytest.raises(RuntimeError, match="lock held"):
        scale_cmd._within(time.monotonic() + 5, fails)


def test_work_past_the_deadline_is_left_running_and_false_returned():
    release = threading.Event()
    try:
        assert scale_cmd._within(time.monotonic() + 0.05, release.wait) is False
    finally:
        release.set()
