"""gpuflex.hosts.pgcheck, one side of `gpuflex doctor`'s process-group check: its report
line, its budget, its options and its reachability probe (in this process; the two real
sides run as processes in tests/e2e/ssh/test_doctor.py)."""

from __future__ import annotations

import argparse
import json
import socket

import pytest

from gpuflex.hosts import pgcheck


def test_the_report_is_printed_once_with_the_stage_it_stopped_at(capsys):
    report = pgcheck.Report(rank=1)
    report.at("allreduce", "gloo")
    report.results["gloo"] = {"sum": 2.0, "s": 0.1}
    assert report.emit("Connection reset by peer")
    assert not report.emit(None)   # the watchdog and the main path race: the first one wins
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(x) for x in lines] == [{"rank": 1, "stage": "allreduce", "backend": "gloo",
                                               "error": "Connection reset by peer",
                                               "results": {"gloo": {"sum": 2.0, "s": 0.1}}}]


def test_a_run_that_succeeded_reports_done_without_a_backend(capsys):
    report = pgcheck.Report(rank=0)
    report.at("finish", "gloo")
    report.emit(None)
    line = json.loads(capsys.readouterr().out)
    assert (line["stage"], line["backend"], line["error"]) == ("done", None, None)


def test_the_budget_covers_the_start_and_every_wait():
    assert pgcheck.budget_s(10, 1, 60) == 2 * 60 + 10 * 5
    assert pgcheck.budget_s(10, 2, 60) - pgcheck.budget_s(10, 1, 60) == 20   # a formation and a collective


def test_backends_are_gloo_or_nccl():
    assert pgcheck.backends("gloo,nccl,") == ["gloo", "nccl"]
    for text in ("", "mpi", "gloo,ucc"):
        with pytest.raises(argparse.ArgumentTypeError, match="backends are gloo, nccl"):
            pgcheck.backends(text)


def test_an_error_is_one_bounded_line():
    assert pgcheck.one_line(RuntimeError("a\n  b\tc")) == "a b c"
    assert pgcheck.one_line(TimeoutError()) == "TimeoutError"
    assert len(pgcheck.one_line(ValueError("x" * 1000))) == 400


def test_reach_answers_none_for_a_listening_port_and_the_error_for_a_closed_one():
    server = pgcheck.listen("127.0.0.1", 0)
    try:
        port = server.getsockname()[1]
        assert pgcheck.reach("127.0.0.1", port, 2.0) is None
    finally:
        server.close()
    with socket.socket() as s:   # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
        assert pgcheck.reach("127.0.0.1", closed, 0.3) == "Connection refused"


def test_rank_0_reports_a_port_it_cannot_bind_before_importing_torch():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = argparse.Namespace(rank=0, addr="127.0.0.1", port=taken.getsockname()[1], timeout=1.0,
                                  start=1.0, backends=["gloo"])
        report = pgcheck.Report(0)
        assert pgcheck.run(args, report) == "Address already in use"
        assert report.stage == "listen"
