"""What the host modules log where they carry on after an error instead of raising."""

from __future__ import annotations

import logging

from gpuflex.config import HostConfig
from gpuflex.hosts import hostops
from gpuflex.hosts.fanout import fan_out


def test_a_missing_exit_record_is_silent(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="gpuflex.hosts"):
        assert hostops.read_exit(str(tmp_path / "worker-0.exit")) is None
    assert caplog.records == []


def test_a_corrupt_exit_record_reads_as_none_and_is_logged(tmp_path, caplog):
    path = tmp_path / "worker-0.exit"
    path.write_text('{"returncode": ')
    with caplog.at_level(logging.WARNING, logger="gpuflex.hosts"):
        assert hostops.read_exit(str(path)) is None
    [record] = caplog.records
    assert record.levelno == logging.WARNING and str(path) in record.getMessage()


def test_an_unexpected_error_on_one_host_keeps_its_traceback_in_the_log(caplog):
    def fn(h: HostConfig) -> str:
        if h.name == "bad":
            raise KeyError("gpus")
        return h.name

    with caplog.at_level(logging.DEBUG, logger="gpuflex.hosts.fanout"):
        results = fan_out([HostConfig(name="good"), HostConfig(name="bad")], fn, timeout=10)
    assert results["good"].value == "good"
    assert str(results["bad"].error) == "bad: KeyError: 'gpus'"
    [record] = caplog.records
    assert record.getMessage() == "bad: unexpected error" and record.exc_info[0] is KeyError
