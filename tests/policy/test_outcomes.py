"""gpuflex.policy.outcomes: how a run comes out once its workers end (pure rules, no I/O).
gpuflex.policy.lifecycle's decide applies them; tests/policy/test_lifecycle.py covers them
through it, these hold each rule on its own."""

from __future__ import annotations

import dataclasses

import pytest

from gpuflex.elastic.protocol.keys import ABORTED_EXIT, SHARDS_LOST_EXIT, STORE_LOST_EXIT
from gpuflex.policy.outcomes import (CRASH_CAUSE, CRASH_DEFERRED_KIND, CRASH_KIND, CRASH_PEER_WAIT_S, FAULT_CAUSE, GANG_CAUSE, GANG_FAILED_KIND, LOST_EXIT,
                                     RESTART, SHARDS_LOST_CAUSE, STOP_CAUSE, STOP_EXIT, STOP_RESTARTS, STUCK_RUNS,
                                     FAULT_RELAUNCHES,
                                     TRACEBACK_LINES, Crash, Finish, JobFacts, Requeue,
                                     WorkerFacts, gang_exit, gang_failure, instant, is_crash_exit, is_fault, outcome,
                                     printable_lines)
from gpuflex.states import JobState, WorkerState as W


def job(**kw) -> JobFacts:
    return JobFacts(**{"id": 1, "state": JobState.RUNNING, "min_workers": 1, "workers": (), "generation": 2,
                       **kw})


def worker(wid: int, state: W, rc: int | None, *, generation: int = 2, ended_at: float | None = None,
           started_at: float = 10.0) -> WorkerFacts:
    return WorkerFacts(wid, f"h{wid}", state, generation, started_at, rc, ended_at)


@pytest.mark.parametrize("rc,crash", [(1, True), (2, True), (0, False), (None, False), (-9, False),
                                      (STORE_LOST_EXIT, False), (ABORTED_EXIT, False)])
def test_a_crash_is_a_positive_exit_code_the_runtime_does_not_use(rc, crash):
    assert is_crash_exit(rc) is crash


def test_a_gang_worker_exit_code_is_torchruns():
    assert gang_exit(worker(0, W.FAILED, 3))[0] == 3
    assert gang_exit(worker(0, W.FAILED, -15)) == (143, "was killed by signal 15 (exit code 143)")
    assert gang_exit(worker(0, W.LOST, None))[0] == LOST_EXIT


def test_a_fault_is_a_signal_or_a_lost_worker_not_an_exit_code():
    assert is_fault(worker(0, W.LOST, None))
    assert is_fault(worker(0, W.FAILED, -9))
    assert not is_fault(worker(0, W.FAILED, 1))
    assert not is_fault(worker(0, W.EXITED, 0))


def test_all_members_exiting_0_succeed():
    assert outcome(job(restarts=2), [worker(0, W.EXITED, 0), worker(1, W.EXITED, 0)], 2) == \
        Finish(JobState.SUCCEEDED, 0, "all workers exited 0", 2)


STOPPED = {"wid": 1, "by": "a SIGTERM", "step": 30, "of": 320}


def test_members_exiting_0_after_a_stop_nobody_in_gpuflex_asked_for_are_restarted_then_failed():
    exited = [worker(0, W.EXITED, 0), worker(1, W.EXITED, 0)]
    first = outcome(job(id=4), exited, 2, STOPPED)
    assert first == Requeue(
        "worker 1 got a SIGTERM at step 30 of 320 that no cancel, time limit or requeue sent (a host shutting "
        "down, or someone's kill), and the job stopped before the end of its training; restarting from its "
        "checkpoint (1 of 3; 'gpuflex cancel 4' ends a job)", STOP_CAUSE)
    last = outcome(job(stop_restarts=STOP_RESTARTS, restarts=5), exited, 2, STOPPED)
    assert isinstance(last, Finish) and (last.state, last.exit_code, last.restarts) == (JobState.FAILED, STOP_EXIT, 5)
    assert last.reason.endswith("4 times: not restarted again")
    # a crash, or a member lost, still decides first
    assert outcome(job(), [worker(0, W.FAILED, 1), worker(1, W.EXITED, 0)], 2, STOPPED).state is JobState.FAILED


def test_a_stop_record_is_formatted_without_trusting_its_fields():
    odd = outcome(job(), [worker(0, W.EXITED, 0)], 2, {"wid": "1; rm", "by": "x\n" * 100, "step": None})
    assert isinstance(odd, Requeue) and f"worker ? got {'x' * 40} at step ? of ? that" in odd.reason


def test_earlier_generations_and_runs_are_history():
    old_run = worker(5, W.FAILED, 1, started_at=1.0)
    left_earlier = worker(4, W.FAILED, -9, generation=1)
    result = outcome(job(started_at=5.0), [old_run, left_earlier, worker(0, W.EXITED, 0)], 2)
    assert result.state is JobState.SUCCEEDED


def test_a_lost_store_and_lost_shards_requeue_uncounted():
    assert outcome(job(store_host="ctl"), [worker(0, W.FAILED, STORE_LOST_EXIT)], 2).cause == "store-lost"
    result = outcome(job(), [worker(0, W.FAILED, SHARDS_LOST_EXIT), worker(1, W.FAILED, -9)], 2)
    assert result.cause == SHARDS_LOST_CAUSE and "worker 1 on h1 was killed by signal 9" in result.reason


def test_a_crash_restarts_while_retries_last_then_fails():
    crashed = [worker(0, W.FAILED, 1), worker(1, W.EXITED, 0)]
    assert outcome(job(retries=1), crashed, 2) == Requeue("worker 0 on h0 crashed: exit code 1; restart 1 of 1",
                                                           CRASH_CAUSE)
    final = outcome(job(retries=1, crash_restarts=1, restarts=1), crashed, 2)
    assert (final.state, final.exit_code, final.restarts) == (JobState.FAILED, 1, 1)


def test_an_aborted_run_fails_with_the_abort_code():
    assert outcome(job(), [worker(0, W.FAILED, ABORTED_EXIT)], 2).exit_code == ABORTED_EXIT


def test_an_inplace_job_whose_last_members_all_faulted_resumes():
    assert outcome(job(), [worker(0, W.LOST, None)], 2).cause == FAULT_CAUSE
    gang = outcome(job(elastic=None), [worker(0, W.LOST, None)], 2)
    assert isinstance(gang, Finish) and gang.state is JobState.FAILED


def test_a_leaver_that_exited_0_does_not_make_the_loss_of_the_kept_workers_a_failure():
    """The 2-hour soak's job 716: shrunk 3 -> 1, then the host of the kept worker 0, of
    leaver 1 and of the coordinator rebooted; leaver 2 had already exited 0. The database
    still knew generation 2 {0, 1, 2} only. Leaving is not finishing: the fault requeues."""
    def retired(wid, state, rc):
        return dataclasses.replace(worker(wid, state, rc), retired=True)
    ended = [worker(0, W.LOST, None), retired(1, W.LOST, None), retired(2, W.EXITED, 0)]
    assert outcome(job(), ended, 2) == Requeue(
        "worker 0 on h0 was lost (no exit record: killed with its supervisor, or its host went down; exit code "
        "137) in generation 2, steady, and no member is left; restarting from its checkpoint", FAULT_CAUSE)
    # a member that exited 0 without being asked to leave had finished the training; the ones
    # lost beside it had not finished the script: the job resumes from the last checkpoint
    finished = [worker(0, W.LOST, None), worker(1, W.LOST, None), worker(2, W.EXITED, 0)]
    assert outcome(job(), finished, 2) == Requeue(
        "worker 0 on h0 was lost (no exit record: killed with its supervisor, or its host went down; exit code "
        "137) in generation 2, steady, beside members that exited 0; restarting from its checkpoint", FAULT_CAUSE)
    # the kept worker finished after the leavers left: a success, whatever the leavers did
    done = [worker(0, W.EXITED, 0), retired(1, W.EXITED, 0), retired(2, W.EXITED, 0)]
    assert outcome(job(), done, 2) == Finish(JobState.SUCCEEDED, 0, "all workers exited 0")


@pytest.mark.parametrize("steps,restarted", [
    ((), True),                                # a first run
    ((379, 379), True),                        # twice from the same checkpoint
    ((109, 379, 379), True),                   # the run that reached 379 started before it
    ((379, 379, 379), False),                  # three runs from 379, none past it
    ((0, 0, 0), False),                        # none ever reached a first checkpoint
    ((379, None, 379), True),                  # a formation that named no step: not judged
    ((96, 379, 379, 379), False),              # only the newest STUCK_RUNS count
])
def test_faults_that_keep_coming_back_at_the_same_checkpoint_end_the_job(steps, restarted):
    """On an H200 a sharded job crashed (SIGSEGV) in its last step: every restart from the
    checkpoint before it died there again, and was restarted without end."""
    assert STUCK_RUNS == 3
    segv = [worker(0, W.FAILED, -11), worker(1, W.FAILED, -11)]
    before = (FAULT_CAUSE, SHARDS_LOST_CAUSE)
    end = outcome(job(run_start_steps=steps, restarts=len(steps), restart_causes=before), segv, 2)
    if restarted:
        assert isinstance(end, Requeue) and end.cause == FAULT_CAUSE
    else:
        assert isinstance(end, Finish) and (end.state, end.exit_code) == (JobState.FAILED, 139)
        assert end.reason.startswith("worker 0 on h0 was killed by signal 11 (exit code 139)")
        assert f"its last 3 runs each restarted from the checkpoint at step {steps[-1]}" in end.reason
        assert "not restarted again" in end.reason
    shards = outcome(job(run_start_steps=steps, restarts=len(steps), restart_causes=before),
                     [worker(0, W.LOST, None), worker(1, W.FAILED, SHARDS_LOST_EXIT)], 2)
    assert isinstance(shards, Requeue if restarted else Finish)
    if not restarted:
        assert shards.exit_code == LOST_EXIT and "with the only copy of its shards; its last 3 runs" in shards.reason


@pytest.mark.parametrize("causes", [(), (FAULT_CAUSE,), ("preempted", FAULT_CAUSE), (FAULT_CAUSE, "below-min")])
def test_runs_that_ended_otherwise_are_no_repeated_fault(causes):
    """Three runs from the same step, but not all ended by faults (a preemption, a requeue
    below MIN, or too few causes on record): the fault restarts it."""
    end = outcome(job(run_start_steps=(0, 0, 0), restarts=2, restart_causes=causes), [worker(0, W.LOST, None)], 2)
    assert isinstance(end, Requeue) and end.cause == FAULT_CAUSE


@pytest.mark.parametrize("causes,relaunched", [
    ((), True),
    ((FAULT_CAUSE,) * 4, True),
    (("scale",) + (FAULT_CAUSE,) * 4, True),                 # a run ended otherwise among the last five
    ((FAULT_CAUSE, "scale") + (FAULT_CAUSE,) * 4, True),
    ((FAULT_CAUSE,) * 5, False),
    (("scale",) + (FAULT_CAUSE,) * 5, False),
])
def test_a_restart_job_relaunched_for_faults_five_times_in_a_row_is_not_relaunched_again(causes, relaunched):
    """A restart job's runs name no step, so a fault that comes back every run (a segfault
    in its script) is bounded by count: FAULT_RELAUNCHES fault relaunches in a row."""
    assert FAULT_RELAUNCHES == 5
    segv = [worker(0, W.FAILED, -11, ended_at=1.0)]
    record, end = gang_failure(job(elastic=RESTART, restart_causes=causes, restarts=len(causes)), segv, None, {})
    assert record.kind == GANG_FAILED_KIND
    if relaunched:
        assert isinstance(end, Requeue) and end.cause == FAULT_CAUSE
    else:
        assert isinstance(end, Finish) and (end.state, end.exit_code) == (JobState.FAILED, 139)
        assert "relaunched 5 times in a row for such faults" in end.reason and "not relaunched again" in end.reason


def test_the_first_gang_worker_to_end_badly_decides():
    late = worker(0, W.FAILED, -9, ended_at=20.0)
    first = worker(1, W.LOST, None, ended_at=15.0)
    record, end = gang_failure(job(elastic=None), [late, first, worker(2, W.RUNNING, None)], None, {})
    assert record.kind == GANG_FAILED_KIND and record.data["wid"] == 1
    assert end == Finish(JobState.FAILED, LOST_EXIT, "worker 1 on h1 " + gang_exit(first)[1], 0)
    assert gang_failure(job(elastic=None), [worker(0, W.RUNNING, None)], None, {}) == []


def test_a_gang_relaunches_for_retries_and_a_restart_job_for_a_fault():
    killed = [worker(0, W.FAILED, -9, ended_at=1.0)]
    assert gang_failure(job(elastic=None, retries=2), killed, None, {})[1].cause == GANG_CAUSE
    assert gang_failure(job(elastic=RESTART), killed, None, {})[1].cause == FAULT_CAUSE


def test_a_gang_crash_is_told_from_the_coordinators_record():
    records = [{"wid": 0, "error": "ValueError: bad", "traceback": ["Traceback (most recent call last):",
                                                                                    '  File "t.py"', "ValueError: bad"],
                "phase": "step"}]
    record, end = gang_failure(job(elastic=None), [worker(0, W.FAILED, 1, ended_at=1.0)], records, {})
    assert record.kind == CRASH_KIND and record.data["traceback"] == ['  File "t.py"', "ValueError: bad"]
    assert end.reason.startswith("worker 0 on h0 crashed (exit code 1, in step): ValueError: bad\n  File")


def test_a_crash_beside_a_peer_lost_with_its_host_is_that_loss():
    """The 2-hour soak's restart job: its worker 0's host rebooted, worker 1's all-reduce
    then failed with a reset connection (exit 1), known before worker 0's end (its host
    was down). Judged a crash, it counted against --retries; it is the host's loss."""
    crashed = worker(1, W.FAILED, 1, ended_at=5.0)
    lost = worker(0, W.LOST, None)
    record, end = gang_failure(job(elastic=RESTART), [lost, crashed], None, {})
    assert record.kind == GANG_FAILED_KIND and record.data["wid"] == 0, record
    assert isinstance(end, Requeue) and end.cause == FAULT_CAUSE, end
    assert "worker 1 on h1 ended with exit code 1 beside it" in end.reason and "not a crash" in end.reason
    # a fixed gang: relaunched for --retries as any lost worker, failed with LOST_EXIT without
    _, end = gang_failure(job(elastic=None), [lost, crashed], None, {})
    assert isinstance(end, Finish) and end.exit_code == LOST_EXIT, end


def test_a_crash_while_a_peers_host_is_silent_waits_for_it_then_takes_the_peer_as_lost():
    crashed = worker(1, W.FAILED, 1, ended_at=5.0)
    silent = worker(0, W.RUNNING, None)
    down = {"h0": "connect timed out"}
    (wait,) = gang_failure(job(elastic=RESTART), [silent, crashed], None, {}, down, now=100.0)
    assert wait.kind == CRASH_DEFERRED_KIND and wait.data == {"wid": 1, "host": "h1", "exit_code": 1, "peer": 0,
                                                               "peer_host": "h0"}
    assert "does not answer" in wait.message and f"at most {CRASH_PEER_WAIT_S:.0f} s" in wait.message
    began = job(elastic=RESTART, crash_deferred_at=100.0)
    assert gang_failure(began, [silent, crashed], None, {}, down, now=100.0 + CRASH_PEER_WAIT_S - 1)[0].kind \
        == CRASH_DEFERRED_KIND
    record, end = gang_failure(began, [silent, crashed], None, {}, down, now=100.0 + CRASH_PEER_WAIT_S)
    assert record.kind == GANG_FAILED_KIND and record.data["wid"] == 0 and end.cause == FAULT_CAUSE, (record, end)
    # the host answers, the peer still runs: the crash was one
    record, end = gang_failure(began, [silent, crashed], None, {}, {}, now=100.0)
    assert record.kind == CRASH_KIND and record.data["wid"] == 1 and end.reason.startswith("worker 1 on h1 crashed")
    # no clock given: judged at once, as before
    assert gang_failure(job(elastic=RESTART), [silent, crashed], None, {}, down)[0].kind == CRASH_KIND


def test_a_crash_before_a_peers_signal_stays_a_crash():
    crashed = worker(1, W.FAILED, 1, ended_at=5.0)
    killed = worker(0, W.FAILED, -15, ended_at=6.0)
    record, _ = gang_failure(job(elastic=RESTART), [killed, crashed], None, {})
    assert record.kind == CRASH_KIND and record.data["wid"] == 1


def test_a_crash_from_a_log_tail_names_its_last_line():
    tails = {0: ("Traceback (most recent call last):", "  x()", "RuntimeError: boom", "")}
    record, end = gang_failure(job(elastic=None), [worker(0, W.FAILED, 1, ended_at=1.0)], None, tails)
    assert record.message == "worker 0 on h0 crashed: RuntimeError: boom"


def test_a_crash_reason_keeps_the_last_traceback_lines():
    crash = Crash(3, "gpu01", "boom", tuple(f"line {i}" for i in range(30)), None, 1)
    assert crash.reason.splitlines()[1:] == [f"line {i}" for i in range(30 - TRACEBACK_LINES, 30)]


@pytest.mark.parametrize("value,expected", [(12.5, 12.5), (3, 3.0), (0, None), (-1, None), (True, None),
                                            (float("nan"), None), (float("inf"), None), ("7", None)])
def test_an_instant_is_a_finite_positive_number(value, expected):
    assert instant(value) == expected


def test_printable_lines_drop_the_header_and_control_characters():
    assert printable_lines(["Traceback (most recent call last):", "a\x1b[31mb", "x" * 400]) == ("a[31mb", "x" * 300)
