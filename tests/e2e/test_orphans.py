"""No orphans (issue 16, item 3): a coordinator ends itself once its job is gone (no worker
heartbeat and no command for its orphan timeout, or its job directory removed), leaves an
exit record the next command reads, and its workers then exit STORE_LOST_EXIT.

The watch and the policy's reading of the record as tables; then real jobs on the local
pool: the control host's database deleted under a running job, the job's directory
removed. Every wait is bounded."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from gpuflex.elastic.coordinator.main import Coordinator, leave_status, run
from gpuflex.elastic.protocol import run_dir
from gpuflex.elastic.protocol.wire import parse_status
from gpuflex.elastic.coordinator.failures import Heartbeats, OrphanWatch
from gpuflex.elastic.coordinator.generations import Generations
from gpuflex.elastic.protocol.keys import ORPHAN_EXIT, STORE_LOST_EXIT
from gpuflex.hosts.hostops import group_alive, read_exit
from gpuflex.policy.lifecycle import Adopt, Finish, Observation, ProcSeen, Record, Requeue, decide
from gpuflex.states import WorkerState as W
from gpuflex.states import JobState as J
from tests.conftest import GpuflexCLI, cleanup_jobs, db_rows
from tests.fakes.store_fake import Clock, FakeStore
from tests.policy.test_lifecycle import job as job_facts
from tests.policy.test_lifecycle import coord as coord_reply
from tests.policy.test_lifecycle import w

ORPHAN_S = 8          # the test config's orphan timeout
BOUND_S = 120         # far above every deadline here: only a hang reaches it


# ---- the watch -----------------------------------------------------------------------------
def test_the_watch_says_orphan_only_after_the_timeout_without_a_sign_of_life(tmp_path):
    clock = Clock()
    watch = OrphanWatch(10, str(tmp_path), clock)
    clock.advance(9.9)
    assert watch.reason() is None
    watch.contact()                    # a command
    clock.advance(9.9)
    assert watch.reason() is None
    watch.beat(clock() - 1)            # a heartbeat moved a second ago
    clock.advance(8.5)
    assert watch.reason() is None
    watch.beat(None)                   # no heartbeat ever seen: no sign
    watch.beat(clock() - 100)          # an old one does not turn the clock back
    clock.advance(0.6)
    why = watch.reason()
    assert why is not None and "no worker heartbeat and no command for 10 s" in why


def test_the_watch_says_orphan_once_the_job_directory_is_removed_or_replaced(tmp_path):
    d = tmp_path / "job"
    d.mkdir()
    watch = OrphanWatch(100, str(d), Clock())
    assert watch.reason() is None
    d.rmdir()
    assert "was removed" in (watch.reason() or "")
    d.mkdir()                          # another directory of the same name is not the job's
    assert "was removed" in (watch.reason() or "")
    assert "was removed" in (OrphanWatch(100, str(tmp_path / "never"), Clock()).reason() or "")


def test_the_watch_refuses_a_timeout_that_is_not_positive():
    with pytest.raises(ValueError, match="above 0"):
        OrphanWatch(0, None, Clock())


def test_heartbeats_tell_when_a_counter_last_changed():
    clock, store = Clock(), FakeStore()
    beats = Heartbeats(lambda key: store.check([key]), store.get, 3, clock)
    assert beats.last_change() is None
    store.set("hb/0", "1")
    beats.alive(0)
    seen = clock()
    clock.advance(5)
    beats.alive(0)                     # unchanged: no newer sign
    assert beats.last_change() == seen
    store.set("hb/0", "2")
    beats.alive(0)
    assert beats.last_change() == clock()


def test_a_coordinator_without_signs_of_life_ends_with_orphan_exit(tmp_path):
    gens = Generations(FakeStore(), [0, 1], hb_timeout_s=3)
    coord = Coordinator(gens, OrphanWatch(0.2, str(tmp_path), time.monotonic))
    stop = threading.Event()
    timer = threading.Timer(BOUND_S, stop.set)   # a hang ends the loop with 0: the test fails
    timer.start()
    try:
        assert run(coord, stop) == ORPHAN_EXIT
    finally:
        timer.cancel()


def test_a_coordinator_that_ends_itself_leaves_its_last_status_in_the_run_directory(tmp_path):
    run_directory = tmp_path / "run"
    run_directory.mkdir(mode=0o700)
    gens = Generations(FakeStore(), [0, 1], hb_timeout_s=3)
    coord = Coordinator(gens, OrphanWatch(0.2, str(tmp_path), time.monotonic))
    stop = threading.Event()
    timer = threading.Timer(BOUND_S, stop.set)
    timer.start()
    try:
        assert run(coord, stop, last_words=leave_status(str(run_directory / "coord.sock"))) == ORPHAN_EXIT
    finally:
        timer.cancel()
    left = run_directory / run_dir.LAST_STATUS
    assert oct(left.stat().st_mode & 0o777) == "0o600"
    status = parse_status(json.loads(left.read_text()))   # read back as the next command reads it
    assert status.desired == (0, 1) and status.generation == 0
    assert not run_dir.marked_groups(str(run_directory))


def test_a_job_that_finished_while_no_command_ran_is_judged_by_the_status_its_coordinator_left():
    """Seen in the soak: a host was cut off, the job shrank past its worker (generation 2,
    worker 1 alone) and finished, and its coordinator ended itself before a command heard
    of generation 2. The database still says generation 1 with worker 0, lost: by that the
    job failed (what the soak saw; since issue 28's fix, a fault beside a member that exited
    0 requeues it from its last checkpoint instead, a restart with nothing left to train);
    by the status the coordinator left, worker 1's exit 0 ends it succeeded."""
    facts = job_facts(w(0, host="b"), w(1))
    seen = dict(procs={0: ProcSeen(False, None), 1: ProcSeen(False, 0, exited=True)}, coordinator=None,
                coordinator_alive=False, coordinator_exit=ORPHAN_EXIT)
    before = decide(facts, Observation(**seen))
    assert isinstance(before[-1], Requeue) and before[-1].cause == "fault", before[-1]
    left = parse_status({**coord_reply(2, [1]), "finished": True})
    actions = decide(facts, Observation(**seen, recorded_status=left))
    assert Adopt(2, (1,)) in actions or Adopt(2, [1]) in actions
    assert actions[-1] == Finish(J.SUCCEEDED, 0, "all workers exited 0", 0)
    assert [a for a in actions if getattr(a, "state", None) is W.LOST and getattr(a, "wid", None) == 0]


def test_a_request_on_the_control_socket_is_a_sign_of_life():
    clock = Clock()
    gens = Generations(FakeStore(), [0], hb_timeout_s=3, clock=clock, wall=clock)
    coord = Coordinator(gens, OrphanWatch(10, None, clock))
    clock.advance(9)
    assert coord.handlers()["status"]({"op": "status"})["generation"] == 0
    clock.advance(9)
    assert coord.orphaned() is None
    clock.advance(2)
    assert coord.orphaned() is not None


# ---- the next command reads the record -------------------------------------------------------
def test_a_running_job_whose_coordinator_ended_as_orphan_is_requeued_with_that_reason():
    facts = job_facts(w(0), w(1))
    seen = Observation({0: ProcSeen(True), 1: ProcSeen(True)}, coordinator=None,
                       coordinator_alive=False, coordinator_exit=ORPHAN_EXIT)
    actions = decide(facts, seen)
    assert actions == [Requeue(actions[0].reason, "orphan")]
    assert "ended itself" in actions[0].reason and "orphan timeout" in actions[0].reason


@pytest.mark.parametrize("code", [None, 0, -9])
def test_a_coordinator_gone_otherwise_is_still_store_lost(code):
    seen = Observation({0: ProcSeen(True)}, coordinator=None, coordinator_alive=False, coordinator_exit=code)
    assert decide(job_facts(w(0)), seen) == [Record("store-lost", "the job's coordinator (store) is gone")]


# ---- real jobs -----------------------------------------------------------------------------
@pytest.fixture
def oj(home):
    """CLI with a config for elastic jobs and a short orphan timeout."""
    cfg = home / "g.toml"
    cfg.write_text(
        f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
        "[jobs]\ncancel_grace_s = 2\ncheckpoint_interval_s = 1\nheartbeat_timeout_s = 3\n"
        f"orphan_timeout_s = {ORPHAN_S}\n\n"
        f'[[hosts]]\nname = "local"\ngpus = "cpu:4"\nworkdir = "{home}/work"\n')
    cli = GpuflexCLI(home, cfg)
    yield cli
    cleanup_jobs(cli, home / "g.db")


class Running:
    """A job of two workers, training; its process groups and paths, read from the DB."""

    def __init__(self, cli: GpuflexCLI, home: Path, epochs: int = 200, workers: str = "2") -> None:
        from tests.e2e.test_elastic_jobs import example_argv, step_of, wait_for
        job = cli.submit(example_argv(home / "r.json", epochs=epochs, sleep=0.05), "--workers", workers,
                         "--elastic", "inplace")
        self.id = job["id"]
        wait_for(cli, self.id, lambda j: step_of(j) >= 5, "training", BOUND_S)
        db = home / "g.db"
        token, self.store_pgid = db_rows(db, "SELECT token, store_pgid FROM jobs WHERE id = ?", (self.id,))[0]
        rows = db_rows(db, "SELECT pgid, exit_path FROM workers WHERE job_id = ? ORDER BY wid", (self.id,))
        self.pgids = [pgid for pgid, _ in rows]
        self.exit_paths = [path for _, path in rows]
        self.dir = home / "work" / "jobs" / token

    def signal_workers(self, sig: int) -> None:
        for pgid in self.pgids:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass

    def kill_all(self) -> None:
        for pgid in [*self.pgids, self.store_pgid]:
            if group_alive(pgid):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def wait_until(pred, bound_s: float, what: str) -> None:
    end = time.monotonic() + bound_s
    while not pred():
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting {bound_s} s for {what}")
        time.sleep(0.2)


def orphan_lines(log: Path) -> list[dict]:
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    return [json.loads(line) for line in lines if '"orphan"' in line]


def test_the_coordinator_ends_itself_when_the_database_is_deleted_under_a_running_job(oj, home):
    """The control host's database is deleted (nothing will ever ask the coordinator again)
    and the workers stop beating (their host is cut off: SIGSTOP). The coordinator ends
    itself, exit ORPHAN_EXIT in its exit record and a JSON line in its log; once the
    workers can run again they find the store gone and exit STORE_LOST_EXIT."""
    job = Running(oj, home)
    try:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{home / 'g.db'}{suffix}").unlink(missing_ok=True)
        job.signal_workers(signal.SIGSTOP)
        wait_until(lambda: not group_alive(job.store_pgid), ORPHAN_S + 30, "the coordinator to end itself")
        assert (read_exit(str(job.dir / "coordinator.exit")) or {}).get("returncode") == ORPHAN_EXIT
        [line] = orphan_lines(job.dir / "coordinator.log")
        assert line["exit_code"] == ORPHAN_EXIT and "no worker heartbeat and no command" in line["reason"]
        job.signal_workers(signal.SIGCONT)
        wait_until(lambda: not any(group_alive(p) for p in job.pgids), BOUND_S, "the workers to end")
        assert [(read_exit(p) or {}).get("returncode") for p in job.exit_paths] == [STORE_LOST_EXIT] * 2
    finally:
        job.signal_workers(signal.SIGCONT)
        job.kill_all()


def test_the_next_command_requeues_a_job_whose_coordinator_ended_as_orphan(oj, home):
    job = Running(oj, home)
    try:
        job.signal_workers(signal.SIGSTOP)   # no heartbeat, and no command runs meanwhile
        wait_until(lambda: not group_alive(job.store_pgid), ORPHAN_S + 30, "the coordinator to end itself")
        after = oj.json("status", str(job.id))
        assert after["restarts"] == 1 and after["state"] in (J.QUEUED, J.RUNNING), after
        messages = [e["message"] for e in oj.json("events", str(job.id))]
        assert any("ended itself" in m for m in messages), messages
    finally:
        job.signal_workers(signal.SIGCONT)
        job.kill_all()


def test_a_job_that_shrank_and_finished_while_no_command_ran_succeeds_by_its_coordinators_last_status(oj, home):
    """Worker 1 is killed with its supervisor (no exit record: lost) while no command runs;
    the job goes on at world size 1 (a generation no command hears of), finishes, and its
    coordinator ends itself. The next command judges the run by the status the coordinator
    left: succeeded, worker 1 lost, not failed for a member of a generation long gone."""
    job = Running(oj, home, epochs=4, workers="1:2")   # 128 steps of 0.05 s, at 2 then 1
    try:
        os.killpg(job.pgids[1], signal.SIGKILL)
        wait_until(lambda: not group_alive(job.pgids[0]), BOUND_S, "worker 0 to finish alone")
        wait_until(lambda: not group_alive(job.store_pgid), ORPHAN_S + 30, "the coordinator to end itself")
        done = oj.json("status", str(job.id))
        assert done["state"] == J.SUCCEEDED, (done, [e["message"] for e in oj.json("events", str(job.id))])
        assert [(w["wid"], w["state"]) for w in done["workers"]] == [(0, "exited"), (1, "lost")]
        assert done["world_size"] == 1 and done["generation"] >= 2
        report = json.loads((home / "r.json").read_text())
        assert [s for s, _, _ in report["step_log"]] == list(range(report["steps"])) and report["steps"] == 128
    finally:
        job.kill_all()


def test_the_coordinator_ends_itself_when_its_job_directory_is_removed(oj, home):
    job = Running(oj, home)
    try:
        shutil.rmtree(job.dir)
        wait_until(lambda: not group_alive(job.store_pgid), 30, "the coordinator to end itself")
        wait_until(lambda: not any(group_alive(p) for p in job.pgids), BOUND_S,
                   "the workers to end once the store is gone")
    finally:
        job.kill_all()
