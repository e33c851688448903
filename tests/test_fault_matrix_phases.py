"""The fault matrix's remaining cells (issue 16 item 1; the table is docs/architecture.md
"Fault matrix"), landed by failpoints as in tests/test_fault_matrix.py, whose fixtures and
helpers these use. Two job runs, many cells each (the suite's budget):

- worker faults at the phases tests/test_fault_matrix.py leaves: a first formation's
  group and a recovery's join, each phase of a resize not yet faulted (detect, agree,
  rebuild, verify, first step) and a checkpoint write, by kill -9 of rank 0, of the last
  rank, of a newcomer and SIGSTOP; the job must end allclose to the fixed-size run, every
  sample once;
- the coordinator killed while a worker is held at a phase (a `sleep` failpoint keeps it
  there while the test kills the coordinator's process group): a first formation's join,
  a resize's rebuild and a checkpoint write each requeue the job, which restarts; then a
  cancel whose coordinator and last rank die at the stop ends cancelled, nothing left.

A checkpoint write does not know its worker: a `wid` filter there is the worker's own id
from its environment (failpoints.py). No timed assertion: each time from a fault to what
a `status` poll saw is printed (`pytest -s`) beside its bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from gpuflex.elastic.env import WORKER_ID
from gpuflex.elastic.failpoints import ENV as FAILPOINTS
from gpuflex.elastic.keys import EVICTED_EXIT, STORE_LOST_EXIT
from gpuflex.hosts.hostops import group_alive
from tests.conftest import db_rows, wait_for
from tests.test_elastic_jobs import assert_matches_reference, example_argv, live_members, reference, step_of
from tests.test_fault_matrix import B1, BOUND_S, FINAL_WORKER, armed, fired_lines, fm, gated, member_wids, \
    pid_in, took, wait_fired, worker  # noqa: F401 (fm: a fixture)

HOLD_S = 6   # how long a `sleep` failpoint holds a worker at its phase while the test kills the coordinator


def settled(cli, job_id: int, members: list[int], what: str) -> dict:
    """The job running on exactly `members` (ranks in that order), the victims gone."""
    return wait_for(cli, job_id, lambda j: j["state"] == "running" and member_wids(j) == members, what,
                    BOUND_S, every_s=0.5)


def woken_ends_evicted(cli, job_id: int, line: str, wid: int, cell: str) -> None:
    """SIGCONT the worker a `stop` failpoint froze; left out while frozen, it must end (exit 3)."""
    os.kill(pid_in(line), signal.SIGCONT)
    woke = time.monotonic()
    ended = wait_for(cli, job_id, lambda j: worker(j, wid)["state"] in FINAL_WORKER, f"woken worker {wid} to end",
                     BOUND_S)
    took(f"{cell}: woken, it ended", woke, "pg_timeout_s + a poll")
    assert worker(ended, wid)["exit_code"] == EVICTED_EXIT, worker(ended, wid)


def fault(cli, job: dict, wid: int, point: str) -> tuple[str, float]:
    return wait_fired(worker(cli.json("status", str(job["id"])), wid)["log"], point)


# ---- a place that does not know its worker -------------------------------------------------------
def test_a_wid_filter_at_a_place_without_one_is_the_workers_own_id():
    """checkpoint.write passes no wid: a rule filtered on one fires in that worker only
    (its GPUFLEX_WORKER_ID), and in no process without an id; a wid the place passes wins."""
    code = ("import sys\nfrom gpuflex.elastic import failpoints\n"
            "failpoints.hit('steady.collective', wid=int(sys.argv[1]))\n"
            "failpoints.hit('checkpoint.write', step=5)\nprint('after')\n")

    def run(own: str | None, passed: int) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
        env[FAILPOINTS] = "checkpoint.write@wid=7=exit:9;steady.collective@wid=7=exit:8"
        if own is not None:
            env[WORKER_ID] = own
        return subprocess.run([sys.executable, "-c", code, str(passed)], env=env, capture_output=True,
                              text=True, timeout=120)

    assert run("7", 1).returncode == 9
    assert run("6", 1).stdout == "after\n"
    assert run(None, 1).stdout == "after\n"
    assert run("6", 7).returncode == 8


# ---- worker faults at the remaining phases -------------------------------------------------------
def test_faults_at_the_remaining_phases_end_exactly_as_the_fixed_size_run(fm, home, tmp_path_factory):
    """Workers 0, 1, 2 (MIN 1), each fault one cell, each grow `scale 3`:
    rank 0 (0) dies in the first formation once its group is built -> [1, 2]; the new
    rank 0 (1) freezes in its first checkpoint write -> [2], woken it ends; a grow's
    newcomer and last rank (4) dies before the checksum -> [2, 3]; a grow's last rank (3)
    dies after agreeing to switch -> [2, 5]; rank 0 (2) dies as it detects its third grow
    -> [5, 6]; the new rank 0 (5) dies in its first checkpoint write -> [6]; a grow's
    newcomer and last rank (8) freezes before the new group -> [6, 7], woken it ends; a
    grow's newcomer and last rank (9) dies in its first step -> in that recovery the last
    rank (7) dies as it joins -> [6]; a grow's newcomer and last rank (11) dies before
    the state copy -> in that recovery the last rank (10) dies before the checksum -> [6];
    a grow's newcomer and last rank (13) freezes before the checksum -> [6, 12], woken it
    ends. It ends allclose to the fixed-size run, every sample once. A rule on a worker that reaches its place more than once counts (`hit`)."""
    report = home / "r.json"
    argv, gate = gated(home, report, 32, "0.375")   # 1024 steps take >= 384 s while gated
    job = fm.submit(argv, "--workers", "1:3",
                    *armed("formation.group@wid=0=kill", "checkpoint.write@wid=1=stop",
                           "resize.verify@wid=4=kill", "resize.agree@wid=3=kill", "resize.detect@wid=2,hit=3=kill",
                           "checkpoint.write@wid=5=kill", "resize.rebuild@wid=8=stop",
                           "resize.first_step@wid=9=kill", "formation.join@wid=7,hit=2=kill",
                           "resize.copy@wid=11=kill", "formation.verify@wid=10=kill", "resize.verify@wid=13=stop"))
    jid = str(job["id"])

    # each second fault comes within a second of the first one's recovery (a new rank 0
    # checkpoints at once): too soon for a `status` poll to see the generation between
    _, t = fault(fm, job, 0, "formation.group")
    line, t1 = fault(fm, job, 1, "checkpoint.write")
    took("formation.group x kill -9 of rank 0: recovered, the new rank 0 checkpointing", t, B1)
    t = t1
    settled(fm, job["id"], [2], "recovery without the frozen rank 0")
    took("checkpoint.write x SIGSTOP of rank 0", t, B1)
    woken_ends_evicted(fm, job["id"], line, 1, "checkpoint.write x SIGSTOP")

    fm.ok("scale", jid, "3")
    _, t = fault(fm, job, 4, "resize.verify")
    settled(fm, job["id"], [2, 3], "recovery without the newcomer")
    took("resize.verify x kill -9 of a newcomer (the last rank)", t, B1)

    fm.ok("scale", jid, "3")
    _, t = fault(fm, job, 3, "resize.agree")
    settled(fm, job["id"], [2, 5], "recovery without the last rank")
    took("resize.agree x kill -9 of the last rank", t, B1)

    fm.ok("scale", jid, "3")
    _, t = fault(fm, job, 2, "resize.detect")
    _, t5 = fault(fm, job, 5, "checkpoint.write")
    took("resize.detect x kill -9 of rank 0: recovered, the new rank 0 checkpointing", t, B1)
    t = t5
    settled(fm, job["id"], [6], "recovery without rank 0")
    took("checkpoint.write x kill -9 of rank 0", t, B1)

    fm.ok("scale", jid, "3")
    line, t = fault(fm, job, 8, "resize.rebuild")
    settled(fm, job["id"], [6, 7], "recovery without the frozen newcomer")
    took("resize.rebuild x SIGSTOP of a newcomer (the last rank)", t, B1)
    woken_ends_evicted(fm, job["id"], line, 8, "resize.rebuild x SIGSTOP")

    fm.ok("scale", jid, "3")
    _, t = fault(fm, job, 9, "resize.first_step")
    _, t7 = fault(fm, job, 7, "formation.join")
    took("resize.first_step x kill -9 of a newcomer (the last rank): its recovery joining", t, B1)
    now = settled(fm, job["id"], [6], "recovery without the last rank")
    took("formation.join (a recovery's) x kill -9 of the last rank", t7, B1)

    fm.ok("scale", jid, "3")
    _, t = fault(fm, job, 11, "resize.copy")
    _, t10 = fault(fm, job, 10, "formation.verify")
    took("resize.copy x kill -9 of a newcomer (the last rank): its recovery verifying", t, B1)
    settled(fm, job["id"], [6], "recovery without the last rank")
    took("formation.verify (a recovery's) x kill -9 of the last rank", t10, B1)

    fm.ok("scale", jid, "3")
    line, t = fault(fm, job, 13, "resize.verify")
    now = settled(fm, job["id"], [6, 12], "recovery without the frozen newcomer")
    took("resize.verify x SIGSTOP of a newcomer (the last rank)", t, B1)
    woken_ends_evicted(fm, job["id"], line, 13, "resize.verify x SIGSTOP")
    assert step_of(now) < 32 * 32, "the job was at its end before the faults were done: slow it down"

    gate.unlink()
    done = fm.wait_final(job["id"], BOUND_S)
    assert done["state"] == "succeeded", done
    assert_matches_reference(json.loads(report.read_text()), reference(tmp_path_factory, 32))
    for wid in (0, 2, 3, 4, 5, 7, 9, 10, 11):
        assert worker(done, wid)["state"] not in ("running", "leaving"), worker(done, wid)


# ---- the coordinator killed at phases, and a cancel ----------------------------------------------
def coordinator_pgid(home, job_id: int) -> int:
    (pgid,) = db_rows(home / "g.db", "SELECT store_pgid FROM jobs WHERE id = ?", (job_id,))[0]
    assert pgid, f"job {job_id} has no coordinator recorded"
    return pgid


def kill_coordinator(home, job_id: int) -> None:
    os.killpg(coordinator_pgid(home, job_id), signal.SIGKILL)


def killed_at(fm, home, job: dict, wid: int, point: str, restarts: int) -> list[int]:
    """Kill the coordinator while worker `wid` is held at `point`; the job must be requeued
    (its workers exit 75) and restart. Returns the restart's members."""
    _, t = fault(fm, job, wid, point)
    kill_coordinator(home, job["id"])
    again = wait_for(fm, job["id"], lambda j: j["restarts"] == restarts and j["state"] == "running"
                     and len(live_members(j)) >= 2 and step_of(j) >= 1, "the restart", BOUND_S, every_s=0.5)
    took(f"{point} x kill -9 of the coordinator: requeued and restarted", t, "B4")
    assert worker(again, wid)["exit_code"] == STORE_LOST_EXIT, worker(again, wid)
    return member_wids(again)


def test_the_coordinator_killed_at_each_phase_requeues_and_a_cancel_then_ends_clean(fm, home):
    """Workers 0, 1, 2 (MIN 2). The coordinator is killed while rank 0 waits in the first
    formation's join, then (restarted on 3, 4, 5; `scale 2`) while rank 0 waits before the
    shrink's new group, then (restarted on 6, 7) while rank 0 waits in a checkpoint write: each
    time every worker exits 75 and the job restarts (on 8, 9). Then a cancel: the last rank dies
    and rank 0 is held at the stop while the coordinator is killed: cancelled, nothing left."""
    hold = f"sleep:{HOLD_S}"
    job = fm.submit(example_argv(home / "r.json", epochs=200, sleep=0.05), "--workers", "2:3",
                    *armed(f"formation.join@wid=0={hold}", f"resize.rebuild@wid=3={hold}",
                           f"checkpoint.write@wid=6,hit=3={hold}", f"cancel.stop@wid=8={hold}",
                           "cancel.stop@wid=9=kill"))
    jid = str(job["id"])
    assert killed_at(fm, home, job, 0, "formation.join", 1) == [3, 4, 5]
    fm.ok("scale", jid, "2")
    assert killed_at(fm, home, job, 3, "resize.rebuild", 2) == [6, 7]   # a restart keeps the scaled size
    members = killed_at(fm, home, job, 6, "checkpoint.write", 3)
    assert members == [8, 9], members
    causes = [e["data"].get("cause") for e in fm.json("events", jid) if e["kind"] == "state"]
    assert causes.count("store-lost") == 3, causes

    pgids = [r[0] for r in db_rows(home / "g.db", "SELECT pgid FROM workers WHERE job_id = ?", (job["id"],))]
    # read before the cancel: it holds the lock every other command (a `status`) waits for
    log, coordinator = worker(fm.json("status", jid), 8)["log"], coordinator_pgid(home, job["id"])
    started = time.monotonic()
    result: dict[str, subprocess.CompletedProcess] = {}
    cancel = threading.Thread(target=lambda: result.setdefault("p", fm("cancel", jid, timeout=BOUND_S)))
    cancel.start()
    wait_fired(log, "cancel.stop")
    assert group_alive(coordinator), "the cancel ended the coordinator before the fault"
    os.killpg(coordinator, signal.SIGKILL)
    cancel.join(BOUND_S + 30)
    took("cancel.stop x kill -9 of the coordinator and of the last rank", started, "B5, cancel_grace_s + a poll")
    assert not cancel.is_alive() and result["p"].returncode == 0, result
    done = fm.json("status", jid)
    assert done["state"] == "cancelled", done
    assert fired_lines(worker(done, 9)["log"], "cancel.stop")[0].split()[2] == "kill"
    assert pgids and not any(group_alive(p) for p in pgids if p)
    (store,) = db_rows(home / "g.db", "SELECT store_pgid FROM jobs WHERE id = ?", (job["id"],))[0]
    assert store is None or not group_alive(store)
