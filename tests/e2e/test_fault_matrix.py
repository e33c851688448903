"""The fault matrix (issue 16 item 1; the table is in docs/architecture.md, "Fault
matrix"): the cells no other test covers, each fault landed by a failpoint
(gpuflex/elastic/protocol/failpoints.py) in one exact phase of one exact process.

Faults from outside land wherever the victim happens to be on a loaded machine; a
failpoint armed at submit (`--env GPUFLEX_FAILPOINTS=...`, which reaches the coordinator
and every worker, newcomers included) or in the CLI's own environment (`gpuflex scale`)
fires at its place every run. Worker ids are never reused, so a rule filtered on a wid
picks one process of one run. Independent cells share a job run (the suite's budget):

- a resize at each phase, one run resized 3 -> 2 -> 3 -> 3 -> 3 that must still end
  allclose to the fixed-size run with every sample once;
- the first formation, a run that falls below MIN (requeued, naming the worker) and then
  recovers from a frozen member in the restart's formation;
- the coordinator killed as it publishes a resize (requeued, restarts), then a cancel
  whose rank 0 dies and whose last rank freezes at the stop.

Each check asserts the outcome and that the failpoint fired (its line in the process's
log). No timed assertion: every wait has its own generous limit, and the time from the
fault to the outcome is printed (`pytest -s`) against the bound the table documents.
The cell a failpoint showed to be broken (a newcomer dead before it was ready) is a unit
test of the coordinator's decisions, below."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from gpuflex.elastic.protocol import keys
from gpuflex.elastic.protocol.failpoints import ENV as FAILPOINTS
from gpuflex.elastic.protocol.keys import EVICTED_EXIT
from gpuflex.hosts.hostops import group_alive
from tests.conftest import GpuflexCLI, cleanup_jobs, db_rows, wait_for
from tests.e2e.test_elastic_jobs import ARGS, EXAMPLE, assert_matches_reference, example_argv, live_members, \
    reference, step_of

pytestmark = pytest.mark.e2e   # jobs of real workers and coordinators

BOUND_S = 300          # far above every documented bound: only a hang reaches it
PG_TIMEOUT_S = 3
HEARTBEAT_S = 3
GRACE_S = 5
FINAL_WORKER = ("exited", "failed", "lost", "stopped")

# The example with its per-step sleep only while the gate file exists: slow while the test
# lands its faults (so the job cannot end first), then at full speed to the end. Only a
# sleep of exactly the step's length is gated; the runtime's own waits are untouched.
GATED = """\
import os, runpy, sys, time
gate, step_sleep = sys.argv[1], float(sys.argv[2])
sleep = time.sleep
def gated(seconds):
    if seconds != step_sleep or os.path.exists(gate):
        sleep(seconds)
time.sleep = gated
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gated(home: Path, report: Path, epochs: int, step_sleep: str) -> tuple[list[str], Path]:
    """The example's argv, gated (`step_sleep` exact in binary), and its gate, open."""
    gate, wrapper = home / "gate", home / "gated.py"
    gate.touch()
    wrapper.write_text(GATED)
    return [sys.executable, str(wrapper), str(gate), step_sleep, EXAMPLE, *ARGS, "--epochs", str(epochs),
            "--step-sleep", step_sleep, "--report", str(report)], gate


@pytest.fixture
def fm(home):
    """CLI over 4 CPU slots: 3 s process-group and heartbeat timeouts, 1 s checkpoints."""
    cfg = home / "g.toml"
    cfg.write_text(
        f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
        f"[jobs]\ncancel_grace_s = {GRACE_S}\ncheckpoint_interval_s = 1\npg_timeout_s = {PG_TIMEOUT_S}\n"
        f"heartbeat_timeout_s = {HEARTBEAT_S}\nfork_start = true\n\n"
        f'[[hosts]]\nname = "local"\ngpus = "cpu:4"\nworkdir = "{home}/work"\n')
    cli = GpuflexCLI(home, cfg)
    yield cli
    cleanup_jobs(cli, home / "g.db")


def armed(*rules: str) -> tuple[str, str]:
    return "--env", f"{FAILPOINTS}={';'.join(rules)}"


def worker(job: dict, wid: int) -> dict:
    return next(w for w in job["workers"] if w["wid"] == wid)


def fired_lines(log: Path | str, name: str) -> list[str]:
    try:
        text = Path(log).read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [line for line in text.splitlines() if line.startswith(f"failpoint {name} ")]


def wait_fired(log: Path | str, name: str, nth: int = 1) -> tuple[str, float]:
    """The `nth` line failpoint `name` wrote to `log`, and when (monotonic) it was first seen."""
    end = time.monotonic() + BOUND_S
    while len(lines := fired_lines(log, name)) < nth:
        if time.monotonic() > end:
            pytest.fail(f"failpoint {name} never fired {nth} time(s) in {log}")
        time.sleep(0.2)
    return lines[nth - 1], time.monotonic()


def pid_in(line: str) -> int:
    return int(line.split(" pid=")[1].split()[0])


def wake(line: str) -> None:
    """SIGCONT the worker a `stop` failpoint froze, once it is stopped: the failpoint writes
    its line and then stops itself, so a SIGCONT sent on seeing the line can come first
    and leave it stopped for good (a loaded host). Bounded: a process gone is not waited for."""
    pid, end = pid_in(line), time.monotonic() + BOUND_S
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    break
        except OSError:   # gone
            return
        time.sleep(0.01)
    os.kill(pid, signal.SIGCONT)


def coordinator_log(home: Path, job_id: int) -> Path:
    (token,) = db_rows(home / "g.db", "SELECT token FROM jobs WHERE id = ?", (job_id,))[0]
    return home / "work" / "jobs" / token / "coordinator.log"


def member_wids(job: dict) -> list[int]:
    return [w["wid"] for w in live_members(job)]


def settled_on(cli: GpuflexCLI, job_id: int, members: list[int], after_generation: int, what: str) -> dict:
    return wait_for(cli, job_id, lambda j: j["state"] == "running" and j["generation"] > after_generation
                    and member_wids(j) == members, what, BOUND_S, every_s=0.5)


def took(cell: str, since: float, bound: str) -> None:
    print(f"\nfault matrix: {cell}: {time.monotonic() - since:.1f} s from the fault (bound: {bound})")


B1 = "B1, pg_timeout_s + heartbeat_timeout_s + 30 s"


# ---- a resize, at each phase ---------------------------------------------------------------------
def test_faults_at_the_phases_of_a_resize_end_exactly_as_the_fixed_size_run(fm, home, tmp_path_factory):
    """Workers 0, 1, 2. The last rank (2) is killed in a steady step's gradient collective;
    `gpuflex scale 3` is killed after spawning newcomer 3, then a grow's newcomer (4) is
    killed after it joined, before the new group; a grow whose CLI is killed after its
    request (newcomer 5) loses rank 0 (0) before the checksum; a grow (newcomer 6) whose
    rank 0 (1) freezes as it sends the state, past the process-group timeout, then wakes.
    Each rank 0's second checkpoint fails as on a full disk. The job ends on 5 and 6,
    allclose to the fixed-size run, every sample once."""
    report = home / "r.json"
    argv, gate = gated(home, report, 16, "0.375")   # 512 steps take >= 192 s while gated
    job = fm.submit(argv, "--workers", "1:3",
                    *armed("steady.collective@wid=2,step=3=kill",
                           "resize.rebuild@wid=4=kill",
                           "resize.verify@wid=0=kill",
                           "resize.copy@wid=1,rank=0=stop",
                           "checkpoint.write@hit=2=oserror:ENOSPC"))
    jid = str(job["id"])

    # steady training: the last rank dies inside the gradient collective (at step 3 of generation 1)
    _, t = wait_fired(worker(job, 2)["log"], "steady.collective")
    now = settled_on(fm, job["id"], [0, 1], 1, "recovery without the last rank")
    took("steady.collective x kill -9 of the last rank", t, B1)

    # gpuflex scale killed after spawning its newcomer: the next command stops it
    p = fm("scale", jid, "3", env=fm.env(**{FAILPOINTS: "scale.spawned=kill"}))
    assert p.returncode == -signal.SIGKILL and "failpoint scale.spawned kill" in p.stderr, p
    t = time.monotonic()
    after = wait_for(fm, job["id"], lambda j: worker(j, 3)["state"] == "stopped", "the unasked newcomer stopped",
                     BOUND_S)
    took("scale.spawned x gpuflex scale killed", t, "B7, the next command")
    assert member_wids(after) == [0, 1] and not group_alive(pgid_of(home, job["id"], 3))

    # a newcomer killed after joining, before the new process group
    fm.ok("scale", jid, "3")
    _, t = wait_fired(worker(fm.json("status", jid), 4)["log"], "resize.rebuild")
    now = settled_on(fm, job["id"], [0, 1], now["generation"], "recovery without the newcomer")
    took("resize.rebuild x kill -9 of a newcomer", t, B1)

    # gpuflex scale killed after its request: the grow happens; rank 0 dies before the checksum
    p = fm("scale", jid, "3", env=fm.env(**{FAILPOINTS: "scale.requested=kill"}))
    assert p.returncode == -signal.SIGKILL and "failpoint scale.requested kill" in p.stderr, p
    _, t = wait_fired(worker(fm.json("status", jid), 0)["log"], "resize.verify")
    now = settled_on(fm, job["id"], [1, 5], now["generation"], "recovery without rank 0")
    took("resize.verify x kill -9 of rank 0", t, B1)

    # rank 0 frozen while it sends the state to a newcomer, then woken
    fm.ok("scale", jid, "3")
    line, t = wait_fired(worker(now, 1)["log"], "resize.copy")
    now = settled_on(fm, job["id"], [5, 6], now["generation"], "recovery without the frozen rank 0")
    took("resize.copy x SIGSTOP of rank 0 (sender)", t, B1)
    wake(line)
    woke = time.monotonic()
    ended = wait_for(fm, job["id"], lambda j: worker(j, 1)["state"] in FINAL_WORKER,
                     "the woken rank 0 to end", BOUND_S)
    assert worker(ended, 1)["exit_code"] == EVICTED_EXIT, worker(ended, 1)
    took("the frozen rank 0 after SIGCONT", woke, "pg_timeout_s + a poll")
    assert step_of(ended) < 16 * 32, "the job was at its end before the faults were done: slow it down"

    gate.unlink()
    done = fm.wait_final(job["id"], BOUND_S)
    assert done["state"] == "succeeded", done
    assert_matches_reference(json.loads(report.read_text()), reference(tmp_path_factory, 16))
    full = [e["message"] for e in fm.json("events", jid) if e["kind"] == "checkpoint-failed"]
    # the reason is the progress record's last error, cleared by the next write that works:
    # a command that reads it after that one says only "a checkpoint write failed"
    assert full and all("No space left on device" in m or "a checkpoint write failed" in m for m in full), full
    assert fired_lines(worker(done, 0)["log"], "checkpoint.write"), "rank 0's second checkpoint did not fail"
    assert "failed: No space left on device" in Path(worker(done, 0)["log"]).read_text(errors="replace")


def pgid_of(home: Path, job_id: int, wid: int) -> int:
    rows = db_rows(home / "g.db", "SELECT pgid FROM workers WHERE job_id = ? AND wid = ?", (job_id, wid))
    assert rows and rows[0][0], f"worker {wid} has no process group recorded"
    return rows[0][0]


# ---- the first formation ------------------------------------------------------------------------
def test_faults_in_the_first_formation_requeue_naming_the_worker_then_recover(fm, home, tmp_path_factory):
    """Workers 0, 1, 2, MIN 2. The last rank (2) dies once its process group is built; in
    the recovery, rank 0 (0) dies before the checksum: one left, below MIN, so the job is
    requeued naming worker 0. The restart's last worker (5) freezes after joining, before
    the group: the others go on without it; woken, it ends. The job succeeds after one
    restart, equal to the standalone run."""
    report = home / "r.json"
    argv, gate = gated(home, report, 2, "1.5")   # 64 steps take >= 96 s while gated
    job = fm.submit(argv, "--workers", "2:3",
                    *armed("formation.group@wid=2,gen=1=kill", "formation.verify@wid=0,gen=2=kill",
                           "formation.join@wid=5=stop"))
    jid = str(job["id"])
    _, t = wait_fired(worker(job, 2)["log"], "formation.group")
    _, t0 = wait_fired(worker(job, 0)["log"], "formation.verify")
    took("formation.group x kill -9 of the last rank: recovered, rank 0 at its verify", t, B1)
    wait_for(fm, job["id"], lambda j: j["restarts"] == 1, "the requeue below MIN", BOUND_S, every_s=0.5)
    took("formation.verify x kill -9 of rank 0: requeued", t0, "B3, B1 + the next command")
    (cause, *_) = [e for e in fm.json("events", jid) if e["kind"] == "state" and e["data"].get("cause") == "below-min"]
    print(f"\nfault matrix: the requeue's reason: {cause['message']}")
    assert "worker(s) [0]" in cause["message"], cause

    restarted = wait_for(fm, job["id"], lambda j: 5 in [w["wid"] for w in j["workers"]], "the restart's workers",
                         BOUND_S)
    line, t = wait_fired(worker(restarted, 5)["log"], "formation.join")
    wait_for(fm, job["id"], lambda j: j["generation"] >= 2 and 5 not in member_wids(j)
             and len(member_wids(j)) == 2, "the restart formed without the frozen worker", BOUND_S, every_s=0.5)
    took("formation.join x SIGSTOP of the last rank", t, B1)
    wake(line)
    woke = time.monotonic()
    ended = wait_for(fm, job["id"], lambda j: worker(j, 5)["state"] in FINAL_WORKER, "the woken worker to end",
                     BOUND_S)
    took("the frozen worker 5 after SIGCONT", woke, "its group's connect timeout + a poll")
    assert worker(ended, 5)["exit_code"] == EVICTED_EXIT, worker(ended, 5)   # left out: it ends, not waits
    assert step_of(ended) < 2 * 32, "the job was at its end before the woken worker was: slow it down"
    gate.unlink()
    done = fm.wait_final(job["id"], BOUND_S)
    assert done["state"] == "succeeded" and done["restarts"] == 1, done
    assert_matches_reference(json.loads(report.read_text()), reference(tmp_path_factory, 2))


# ---- the coordinator, and a cancel ---------------------------------------------------------------
def test_the_coordinator_killed_at_a_resize_requeues_and_a_cancel_with_faults_ends_clean(fm, home):
    """The coordinator kills itself as it publishes the shrink's generation: the workers
    lose the store and exit 75, the next command requeues the job, which restarts. Then a
    cancel during which rank 0 dies and the last rank freezes at the stop: it ends
    cancelled within the grace period, no process left."""
    job = fm.submit(example_argv(home / "r.json", epochs=200, sleep=0.05), "--workers", "2:3",
                    *armed("coordinator.publish@gen=2=kill", "cancel.stop@wid=3=kill",
                           "cancel.stop@wid=4=stop", "cancel.stop@wid=5=stop"))
    jid = str(job["id"])
    wait_for(fm, job["id"], lambda j: step_of(j) >= 3 and len(live_members(j)) == 3, "training on three",
             BOUND_S)
    pgids = [r[0] for r in db_rows(home / "g.db", "SELECT pgid FROM workers WHERE job_id = ?", (job["id"],))]
    fm.ok("scale", jid, "2")
    _, t = wait_fired(coordinator_log(home, job["id"]), "coordinator.publish")
    end = time.monotonic() + BOUND_S
    while any(group_alive(p) for p in pgids):   # no command runs meanwhile: nothing requeues yet
        if time.monotonic() > end:
            pytest.fail("the workers outlived their store")
        time.sleep(0.2)
    took("coordinator.publish x kill -9 of the coordinator: every worker gone", t, "heartbeat_timeout_s + a step")
    restarted = wait_for(fm, job["id"], lambda j: j["restarts"] == 1 and step_of(j) >= 1
                         and j["state"] == "running", "the restart", BOUND_S)
    assert [worker(restarted, w)["exit_code"] for w in (0, 1)] == [75, 75], restarted["workers"]
    causes = [e["data"].get("cause") for e in fm.json("events", jid) if e["kind"] == "state"]
    assert "store-lost" in causes, causes

    members = member_wids(restarted)
    assert members[0] == 3 and len(members) >= 2, members
    started = time.monotonic()
    p = fm("cancel", jid, timeout=BOUND_S)
    took("cancel.stop x kill -9 of rank 0 and SIGSTOP of the last rank", started, "cancel_grace_s + a poll")
    assert p.returncode == 0, p.stdout + p.stderr
    done = fm.json("status", jid)
    assert done["state"] == "cancelled", done
    assert fired_lines(worker(done, 3)["log"], "cancel.stop")[0].split()[2] == "kill"
    assert fired_lines(worker(done, members[-1])["log"], "cancel.stop")[0].split()[2] == "stop"
    left = [r[0] for r in db_rows(home / "g.db", "SELECT pgid FROM workers WHERE pgid IS NOT NULL")]
    assert left and not any(group_alive(p) for p in left)


# ---- what the matrix found broken ----------------------------------------------------------------
def test_a_newcomer_killed_before_it_is_ready_does_not_leave_the_resize_pending_forever():
    """startup.before_join x kill -9 of a newcomer: the resize's newcomer started beating
    (importing, warming up) and died before it said it was ready. The coordinator drops it
    (as it drops one that dies before joining a published generation) and says so in its
    status, naming the worker and the phase, instead of waiting for it for the rest of the
    job (`_resize` used to return "newcomers still warming up" at every tick)."""
    from tests.elastic.coordinator.test_generations import HB_TIMEOUT_S, Job

    job = Job([0, 1], formation_timeout_s=30).settled([0, 1])
    job.gens.resize([0, 1, 2])
    job.beat(2)
    job.gens.tick()
    for _ in range(int(HB_TIMEOUT_S) + 60):
        job.clock.advance(1.0)
        job.beat(0, 1)
        job.gens.tick()
    status = job.gens.status()
    assert status["desired"] == [0, 1] and job.store.check([keys.rejected(2)]), status
    assert status["settled"] and job.latest() == 1
    [left] = status["left_out"]
    assert (left["wid"], left["phase"]) == (2, "warm-up") and left["reason"].startswith("stopped beating")


def test_a_worker_left_out_after_its_formation_failed_ends_instead_of_waiting(monkeypatch):
    """formation.join x SIGSTOP, the woken worker: frozen in its first formation (no state
    yet) and woken after the others went on without it, its formation of generation 1
    fails and generation 2 leaves it out. It was listed in generation 1, so it was
    dropped: it ends (Evicted, exit 3). It used to wait to be included, holding its device,
    until the job finished. A real store and Rendezvous; the formation's group fails."""
    from types import SimpleNamespace

    from gpuflex.elastic.membership.joining import Formation
    from gpuflex.elastic.membership.rendezvous import Evicted
    from tests.elastic.membership.test_liveness import Job as StoreJob

    job = StoreJob([3, 4, 5], hb_timeout_s=3)   # generation 1: members 3, 4, 5
    job.store.set(keys.LATEST, "1")
    rdzv = job.worker(5).rdzv
    polls = iter(range(200))                   # bounded: a wait that never ends returns None
    signals = SimpleNamespace(stop_requested=lambda: next(polls, None) is None)
    formation = Formation(wid=5, rdzv=rdzv, group=SimpleNamespace(close=lambda: None),
                          state=SimpleNamespace(has_state=False), signals=signals, timeout_s=1)

    def group_fails(info, **_):
        job.write(keys.members(2), json.dumps({"generation": 2, "kind": "recover", "members": [3, 4],
                                               "prev": [3, 4, 5], "created": 0}))
        job.store.set(keys.LATEST, "2")
        raise RuntimeError("Gloo connectFullMesh failed: Connect timeout")

    monkeypatch.setattr(formation, "_form", group_fails)
    try:
        with pytest.raises(Evicted, match="left out of generation 2"):
            formation.enter(after=0, was_member=False, failed_at=None)
        assert job.signer.verify(keys.fail(1, 5), job.store.get(keys.fail(1, 5))).startswith("formation: ")
    finally:
        job.close()
