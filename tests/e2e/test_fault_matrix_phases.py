"""The fault matrix's remaining cells (issue 16 item 1; the table is docs/architecture.md
"Fault matrix"), landed by failpoints as in tests/e2e/test_fault_matrix.py, whose fixtures and
helpers these use. Two job runs, many cells each (the suite's budget):

- worker faults at the phases tests/e2e/test_fault_matrix.py leaves: a newcomer's start-up,
  a first formation's group, a recovery's join, group and verify, each phase of a resize
  (detect, agree, rebuild, copy, verify, first step) and a checkpoint write, by kill -9 of
  rank 0, of the last rank, of a newcomer and SIGSTOP; the job must end allclose to the
  fixed-size run, every sample once;
- the coordinator killed while a worker is held at a phase (a `sleep` failpoint keeps it
  there while the test kills the coordinator's process group): a first formation's join
  and group, a resize's rebuild, a checkpoint write and a start-up each requeue the job,
  which restarts; then a cancel whose coordinator and last rank die at the stop, on a
  full checkpoint disk, ends cancelled, nothing left, the last checkpoint kept.

A checkpoint write does not know its worker: a `wid` filter there is the worker's own id
from its environment (failpoints.py). No timed assertion: each time from a fault to what
a `status` poll saw is printed (`pytest -s`) beside its bound."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from gpuflex.elastic.state.checkpoints import load_checkpoint
from gpuflex.elastic.state.training import CHECKPOINT_FILE
from gpuflex.elastic.protocol.env import WORKER_ID
from gpuflex.elastic.protocol.failpoints import ENV as FAILPOINTS
from gpuflex.elastic.protocol.keys import EVICTED_EXIT, STORE_LOST_EXIT
from gpuflex.hosts.hostops import group_alive
from tests.conftest import db_rows, wait_for
from tests.e2e.test_elastic_jobs import assert_matches_reference, example_argv, live_members, reference, step_of
from tests.e2e.test_fault_matrix import B1, BOUND_S, FINAL_WORKER, armed, fired_lines, fm, gated, member_wids, \
    pid_in, took, wait_fired, wake, worker  # noqa: F401 (fm: a fixture)

pytestmark = pytest.mark.e2e   # jobs of real workers and coordinators

EPOCHS = 48  # the run above: long enough, while gated, for all its faults
HOLD_S = 6   # how long a `sleep` failpoint holds a worker at its phase while the test kills the coordinator
STOP_HOLD_S = 2   # rank 0 at the cancel's stop: less than cancel_grace_s, so it then writes its last checkpoint


def settled(cli, job_id: int, members: list[int], what: str) -> dict:
    """The job running on exactly `members` (ranks in that order), the victims gone, in a
    generation of that size: a victim's row ends before the coordinator forms the recovery,
    and a grow asked in between joins the recovery's formation instead of a resize's."""
    return wait_for(cli, job_id, lambda j: j["state"] == "running" and member_wids(j) == members
                    and j["world_size"] == len(members), what, BOUND_S, every_s=0.5)


def woken_ends_evicted(cli, job_id: int, line: str, wid: int, cell: str) -> None:
    """SIGCONT the worker a `stop` failpoint froze; left out while frozen, it must end (exit 3)."""
    wake(line)
    woke = time.monotonic()
    ended = wait_for(cli, job_id, lambda j: worker(j, wid)["state"] in FINAL_WORKER, f"woken worker {wid} to end",
                     BOUND_S)
    took(f"{cell}: woken, it ended", woke, "pg_timeout_s + a poll")
    assert worker(ended, wid)["exit_code"] == EVICTED_EXIT, worker(ended, wid)


def fault(cli, job: dict, wid: int, point: str, nth: int = 1) -> tuple[str, float]:
    return wait_fired(worker(cli.json("status", str(job["id"])), wid)["log"], point, nth)


def held_then_killed(cli, job: dict, held: int, point: str, victim: int, nth: int = 1) -> float:
    """Worker `held` stops itself at `point` (a `stop` failpoint, its `nth` line); meanwhile
    the test kills -9 worker `victim`, who is then in the same phase waiting for `held` (a
    collective or a barrier of the new generation), and wakes `held` at once (well within
    pg_timeout_s: it is not the fault). Returns when the victim died."""
    pid = worker(cli.json("status", str(job["id"])), victim)["pid"]
    line, _ = fault(cli, job, held, point, nth)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    wake(line)
    return killed


def left_out_and_stopped(cli, job: dict, wid: int, members: list[int]) -> None:
    """A newcomer frozen at start-up: the coordinator leaves it out once its heartbeat is
    stale, the job goes back to running on `members`, and the next reconcile stops the
    frozen process (it would not read its rejection); the event names worker, host, phase.
    The test sends the SIGSTOP while a `sleep` failpoint holds the newcomer there: frozen
    by its own `stop`, it froze before its heartbeat thread's first beat (no warm-up
    passes: it joins as it starts) and was left out as never started, after
    formation_timeout_s (seen: 53 s)."""
    line, _ = fault(cli, job, wid, "startup.before_join")
    os.kill(pid_in(line), signal.SIGSTOP)
    t = time.monotonic()
    done = wait_for(cli, job["id"], lambda j: worker(j, wid)["state"] in FINAL_WORKER and j["state"] == "running"
                    and member_wids(j) == members, f"newcomer {wid} left out and stopped", BOUND_S, every_s=0.5)
    took("startup.before_join x SIGSTOP of a newcomer: left out, stopped", t, "B2, heartbeat_timeout_s + 30 s")
    assert worker(done, wid)["state"] == "stopped", worker(done, wid)
    left = [e["message"] for e in cli.json("events", str(job["id"])) if e["kind"] == "left-out"]
    assert any(f"worker {wid} on local left out of the resize (warm-up)" in m for m in left), left


# ---- a place that does not know its worker -------------------------------------------------------
def test_a_wid_filter_at_a_place_without_one_is_the_workers_own_id():
    """checkpoint.write passes no wid: a rule filtered on one fires in that worker only
    (its GPUFLEX_WORKER_ID), and in no process without an id; a wid the place passes wins."""
    code = ("import sys\nfrom gpuflex.elastic.protocol import failpoints\n"
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


def test_a_hit_filter_counts_the_reaches_another_rule_fired_at():
    """Two rules on one place and one worker: the one filtered `hit=2` fires at the second
    reach, though the other rule fired at the first (it used to count from the second)."""
    from gpuflex.elastic.protocol import failpoints

    failpoints.arm("resize.detect@wid=1=oserror:ENOSPC;resize.detect@wid=1,hit=2=raise")
    try:
        with pytest.raises(OSError):
            failpoints.hit("resize.detect", wid=1)
        with pytest.raises(RuntimeError):
            failpoints.hit("resize.detect", wid=1)
        failpoints.hit("resize.detect", wid=1)   # both fired: nothing more
    finally:
        failpoints.disarm()


def test_a_member_woken_after_two_recoveries_ends_instead_of_waiting():
    """resize.first_step x SIGSTOP of rank 0, the woken worker: while it was frozen the others
    recovered without it (generation 2, whose `prev` lists it) and then lost another member
    (generation 3, whose `prev` does not). It looks first at generation 3, the newest: it
    must still see that 2 left it out and end (Evicted, exit 3). It used to wait for a
    generation that would include it until the job finished. A real store and Rendezvous."""
    from gpuflex.elastic.protocol import keys
    from gpuflex.elastic.membership.rendezvous import Evicted
    from tests.elastic.membership.test_liveness import Job as StoreJob

    job = StoreJob([3, 4, 5], hb_timeout_s=3)   # generation 1: members 3, 4, 5
    try:
        for g, members, prev in ((2, [4, 5], [3, 4, 5]), (3, [4], [4, 5])):
            job.write(keys.members(g), json.dumps({"generation": g, "kind": "recover", "members": members,
                                                   "prev": prev, "created": 0}))
        job.store.set(keys.LATEST, "3")
        polls = iter(range(200))                 # bounded: a wait that never ends returns None
        with pytest.raises(Evicted, match="left out of generation 2"):
            job.worker(3).rdzv.wait_for_generation(1, True, lambda: next(polls, None) is None)
    finally:
        job.close()


# ---- worker faults at the remaining phases -------------------------------------------------------
def test_faults_at_the_remaining_phases_end_exactly_as_the_fixed_size_run(fm, home, tmp_path_factory):
    """Workers 0, 1, 2 (MIN 1), each fault one cell (two where a recovery's formation
    takes the second), each grow `scale 3`:
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
    ends. Then: a newcomer (14) freezes at start-up -> left out, stopped; the old last
    rank (12) dies before the new group -> [6, 15]; the old last rank (15) freezes after
    agreeing -> [6, 16]; rank 0 (6) is killed in the new group's connect -> [16, 17], then
    in the state copy (16, the sender) -> [17, 18]; rank 0 (17) freezes as it detects a
    grow -> in that recovery the last rank (19) freezes once its group is built -> [18];
    while rank 0 (18) is held at detect a newcomer (21) is killed -> [18, 20], then the
    last rank (20) -> [18, 22]; rank 0 (18) dies after agreeing -> [22, 23]; rank 0 (22)
    dies in its first step -> in that recovery rank 0 (23) dies as it joins -> [24]; rank
    0 (24) freezes in its first step -> in that recovery the last rank (26) freezes before
    the checksum -> [25]; the frozen ones, woken, end. It ends allclose to the fixed-size
    run, every sample once. A rule on a worker that reaches its place more than once
    counts (`hit`); a victim killed from outside is landed by holding another worker at
    the phase (held_then_killed)."""
    report = home / "r.json"
    argv, gate = gated(home, report, EPOCHS, "0.375")   # 1536 steps take >= 576 s while gated
    job = fm.submit(argv, "--workers", "1:3",
                    *armed("formation.group@wid=0=kill", "checkpoint.write@wid=1=stop",
                           "resize.verify@wid=4=kill", "resize.agree@wid=3=kill", "resize.detect@wid=2,hit=3=kill",
                           "checkpoint.write@wid=5=kill", "resize.rebuild@wid=8=stop",
                           "resize.first_step@wid=9=kill", "formation.join@wid=7,hit=2=kill",
                           "resize.copy@wid=11=kill", "formation.verify@wid=10=kill", "resize.verify@wid=13=stop",
                           "startup.before_join@wid=14=sleep:2", "resize.rebuild@wid=12,hit=2=kill",
                           "resize.agree@wid=15=stop", "resize.rebuild@wid=17=stop", "resize.copy@wid=18=stop",
                           "resize.detect@wid=17=stop", "formation.group@wid=19=stop",
                           "resize.detect@wid=18=stop", "resize.detect@wid=18,hit=2=stop",
                           "resize.agree@wid=18,hit=2=kill", "resize.first_step@wid=22=kill",
                           "formation.join@wid=23,hit=2=kill", "resize.first_step@wid=24,hit=2=stop",
                           "formation.verify@wid=26=stop"))
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
    settled(fm, job["id"], [6], "recovery without the last rank")
    took("formation.join (a recovery's) x kill -9 of the last rank", t7, B1)

    fm.ok("scale", jid, "3")
    _, t = fault(fm, job, 11, "resize.copy")
    _, t10 = fault(fm, job, 10, "formation.verify")
    took("resize.copy x kill -9 of a newcomer (the last rank): its recovery verifying", t, B1)
    settled(fm, job["id"], [6], "recovery without the last rank")
    took("formation.verify (a recovery's) x kill -9 of the last rank", t10, B1)

    fm.ok("scale", jid, "3")
    line, t = fault(fm, job, 13, "resize.verify")
    settled(fm, job["id"], [6, 12], "recovery without the frozen newcomer")
    took("resize.verify x SIGSTOP of a newcomer (the last rank)", t, B1)
    woken_ends_evicted(fm, job["id"], line, 13, "resize.verify x SIGSTOP")
    later_phases(fm, job)

    now = fm.json("status", jid)
    assert step_of(now) < EPOCHS * 32, "the job was at its end before the faults were done: slow it down"
    gate.unlink()
    done = fm.wait_final(job["id"], BOUND_S)
    assert done["state"] == "succeeded", done
    assert_matches_reference(json.loads(report.read_text()), reference(tmp_path_factory, EPOCHS))
    for wid in (0, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 16, 18, 20, 21, 22, 23):
        assert worker(done, wid)["state"] not in ("running", "leaving"), worker(done, wid)


def later_phases(fm, job: dict) -> None:
    """The run's second part, from [6, 12]: a newcomer's start-up, and a resize's rebuild,
    agree and copy at rank 0, the old last rank and SIGSTOP."""
    jid, woken = str(job["id"]), woken_ends_evicted
    fm.ok("scale", jid, "3")
    left_out_and_stopped(fm, job, 14, [6, 12])

    fm.ok("scale", jid, "3")
    _, t = fault(fm, job, 12, "resize.rebuild")
    settled(fm, job["id"], [6, 15], "recovery without the old last rank")
    took("resize.rebuild x kill -9 of the (old) last rank", t, B1)

    fm.ok("scale", jid, "3")
    line, t = fault(fm, job, 15, "resize.agree")
    settled(fm, job["id"], [6, 16], "recovery without the frozen last rank")
    took("resize.agree x SIGSTOP of the (old) last rank", t, B1)
    woken(fm, job["id"], line, 15, "resize.agree x SIGSTOP")

    fm.ok("scale", jid, "3")
    t = held_then_killed(fm, job, 17, "resize.rebuild", 6)
    settled(fm, job["id"], [16, 17], "recovery without rank 0")
    took("resize.rebuild x kill -9 of rank 0 (in the new group's connect)", t, B1)

    fm.ok("scale", jid, "3")
    t = held_then_killed(fm, job, 18, "resize.copy", 16)
    settled(fm, job["id"], [17, 18], "recovery without rank 0")
    took("resize.copy x kill -9 of rank 0 (the sender)", t, B1)
    detect_agree_first_step(fm, job)


def detect_agree_first_step(fm, job: dict) -> None:
    """The run's last part, from [17, 18]: a resize's detect, agree and first step at rank
    0, the old last rank, a newcomer and SIGSTOP, with recoveries' formations."""
    jid, woken = str(job["id"]), woken_ends_evicted
    fm.ok("scale", jid, "3")
    line17, t = fault(fm, job, 17, "resize.detect")
    line19, t19 = fault(fm, job, 19, "formation.group")
    took("resize.detect x SIGSTOP of rank 0: its recovery building the group", t, B1)
    settled(fm, job["id"], [18], "recovery without the frozen ones")
    took("formation.group (a recovery's) x SIGSTOP of the last rank", t19, B1)
    woken(fm, job["id"], line17, 17, "resize.detect x SIGSTOP")
    woken(fm, job["id"], line19, 19, "formation.group x SIGSTOP")

    fm.ok("scale", jid, "3")
    t = held_then_killed(fm, job, 18, "resize.detect", 21)
    settled(fm, job["id"], [18, 20], "recovery without the newcomer")
    took("resize.detect x kill -9 of a newcomer (the last rank)", t, B1)

    fm.ok("scale", jid, "3")
    t = held_then_killed(fm, job, 18, "resize.detect", 20, nth=2)
    settled(fm, job["id"], [18, 22], "recovery without the last rank")
    took("resize.detect x kill -9 of the (old) last rank", t, B1)

    fm.ok("scale", jid, "3")
    _, t = fault(fm, job, 18, "resize.agree")
    settled(fm, job["id"], [22, 23], "recovery without rank 0")
    took("resize.agree x kill -9 of rank 0", t, B1)

    fm.ok("scale", jid, "3")
    _, t = fault(fm, job, 22, "resize.first_step")
    _, t23 = fault(fm, job, 23, "formation.join")
    took("resize.first_step x kill -9 of rank 0: its recovery joining", t, B1)
    settled(fm, job["id"], [24], "recovery without both ranks 0")
    took("formation.join (a recovery's) x kill -9 of rank 0", t23, B1)

    fm.ok("scale", jid, "3")
    line24, t = fault(fm, job, 24, "resize.first_step")
    line26, t26 = fault(fm, job, 26, "formation.verify")
    took("resize.first_step x SIGSTOP of rank 0: its recovery verifying", t, B1)
    settled(fm, job["id"], [25], "recovery without the frozen ones")
    took("formation.verify (a recovery's) x SIGSTOP of the last rank", t26, B1)
    woken(fm, job["id"], line24, 24, "resize.first_step x SIGSTOP")
    woken(fm, job["id"], line26, 26, "formation.verify x SIGSTOP")


# ---- the coordinator killed at phases, and a cancel ----------------------------------------------
def coordinator_pgid(home, job_id: int) -> int:
    (pgid,) = db_rows(home / "g.db", "SELECT store_pgid FROM jobs WHERE id = ?", (job_id,))[0]
    assert pgid, f"job {job_id} has no coordinator recorded"
    return pgid


def kill_coordinator(home, job_id: int) -> None:
    os.killpg(coordinator_pgid(home, job_id), signal.SIGKILL)


def killed_at(fm, home, job: dict, wid: int, point: str, restarts: int, trained: bool = True) -> list[int]:
    """Kill the coordinator while worker `wid` is held at `point`; the job must be requeued
    (its workers exit 75) and restart. Returns the restart's members (`trained`: once it
    trains on two or more) or, at once, its workers (the next fault holds one at start-up)."""
    _, t = fault(fm, job, wid, point)
    kill_coordinator(home, job["id"])
    again = wait_for(fm, job["id"], lambda j: j["restarts"] == restarts and j["state"] == "running"
                     and (not trained or len(live_members(j)) >= 2 and step_of(j) >= 1), "the restart", BOUND_S,
                     every_s=0.5)
    took(f"{point} x kill -9 of the coordinator: requeued and restarted", t, "B4")
    assert worker(again, wid)["exit_code"] == STORE_LOST_EXIT, worker(again, wid)
    return member_wids(again) if trained else [w["wid"] for w in again["workers"] if w["state"] not in FINAL_WORKER]


def fill(path: Path) -> None:
    """Write zeros to `path` until its file system is full (already full: even creating
    `path` fails)."""
    try:
        with open(path, "wb") as f:
            while True:
                f.write(bytes(1 << 16))
                f.flush()
    except OSError as e:
        assert e.errno == errno.ENOSPC, e


@contextlib.contextmanager
def full_disk(path: Path) -> Iterator[dict[str, str] | None]:
    """Checkpoint directory `path` on a tmpfs that holds a copy of its files and is full (a
    filler took the rest): a real full disk from here on; unmounted after. Yields the files'
    digests, or None where no tmpfs can be mounted (not root)."""
    saved = {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}
    size = sum(len(d) for d in saved.values()) + (4 << 20)   # the copies fit, whatever the run wrote
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                                            str(path)], capture_output=True).returncode != 0:
        yield None
        return
    try:
        for name, data in saved.items():
            (path / name).write_bytes(data)
        fill(path / "filler")
        yield {name: hashlib.sha256(data).hexdigest() for name, data in saved.items()}
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_the_coordinator_killed_at_each_phase_requeues_and_a_cancel_then_ends_clean(fm, home):
    """Workers 0, 1, 2 (MIN 2). The coordinator is killed while rank 0 waits in the first
    formation's join, then (restarted on 3, 4, 5; `scale 2`) while rank 0 waits before the
    shrink's new group, then (restarted on 6, 7) while rank 0 waits in a checkpoint write,
    then (restarted on 8, 9) while the last rank waits at start-up, before it joins, then
    (restarted on 10, 11) while rank 0 waits in the formation once its group is built:
    each time every worker exits 75 and the job restarts (on 12, 13). Then a cancel: the
    last rank dies and rank 0 is held at the stop while the coordinator is killed and
    the checkpoint disk fills up: cancelled, nothing left, the last checkpoint kept."""
    hold = f"sleep:{HOLD_S}"
    job = fm.submit(example_argv(home / "r.json", epochs=200, sleep=0.05), "--workers", "2:3",
                    *armed(f"formation.join@wid=0={hold}", f"resize.rebuild@wid=3={hold}",
                           f"checkpoint.write@wid=6,hit=3={hold}", f"startup.before_join@wid=9={hold}",
                           f"formation.group@wid=10={hold}", f"cancel.stop@wid=12=sleep:{STOP_HOLD_S}",
                           "cancel.stop@wid=13=kill"))
    jid = str(job["id"])
    assert killed_at(fm, home, job, 0, "formation.join", 1) == [3, 4, 5]
    # a shrink watches its leaver until it exits (up to 30 s): the fault lands meanwhile
    shrink = subprocess.Popen([fm.script, "scale", jid, "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=fm.env(), cwd=fm.home)
    try:
        assert killed_at(fm, home, job, 3, "resize.rebuild", 2) == [6, 7]   # a restart keeps the scaled size
        out, err = shrink.communicate(timeout=BOUND_S)
    finally:
        if shrink.poll() is None:
            shrink.kill()
    assert shrink.returncode == 0 and "resizing to 2" in out, out + err
    assert killed_at(fm, home, job, 6, "checkpoint.write", 3, trained=False) == [8, 9]
    assert killed_at(fm, home, job, 9, "startup.before_join", 4, trained=False) == [10, 11]
    members = killed_at(fm, home, job, 10, "formation.group", 5)
    assert members == [12, 13], members
    causes = [e["data"].get("cause") for e in fm.json("events", jid) if e["kind"] == "state"]
    assert causes.count("store-lost") == 5, causes
    cancel_with_a_full_disk(fm, home, job)


def cancel_with_a_full_disk(fm, home, job: dict) -> None:
    """The cancel of the test above: rank 0 (12) held at the stop while the last rank (13)
    has died there, the coordinator is killed and the disk under the checkpoints is full."""
    jid = str(job["id"])
    pgids = [r[0] for r in db_rows(home / "g.db", "SELECT pgid FROM workers WHERE job_id = ?", (job["id"],))]
    (ckpts,) = db_rows(home / "g.db", "SELECT checkpoint_dir FROM jobs WHERE id = ?", (job["id"],))[0]
    # read before the cancel: it holds the lock every other command (a `status`) waits for
    log, coordinator = worker(fm.json("status", jid), 12)["log"], coordinator_pgid(home, job["id"])
    started = time.monotonic()
    result: dict[str, subprocess.CompletedProcess] = {}
    cancel = threading.Thread(target=lambda: result.setdefault("p", fm("cancel", jid, timeout=BOUND_S)))
    cancel.start()
    wait_fired(log, "cancel.stop")
    assert group_alive(coordinator), "the cancel ended the coordinator before the fault"
    with full_disk(Path(ckpts)) as kept:
        os.killpg(coordinator, signal.SIGKILL)
        cancel.join(BOUND_S + 30)
        took("cancel.stop x kill -9 of the coordinator and of the last rank, a full disk",
             started, "B5, cancel_grace_s + a poll")
        assert not cancel.is_alive() and result["p"].returncode == 0, result
        if kept is not None:   # the final checkpoint failed; the one before it is whole
            assert "failed: No space left on device" in Path(log).read_text(errors="replace")
            now = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in Path(ckpts).iterdir()
                   if p.name != "filler"}
            assert now == kept and load_checkpoint(str(Path(ckpts) / CHECKPOINT_FILE)) is not None, now
    done = fm.json("status", jid)
    assert done["state"] == "cancelled", done
    assert fired_lines(worker(done, 13)["log"], "cancel.stop")[0].split()[2] == "kill"
    assert pgids and not any(group_alive(p) for p in pgids if p)
    (store,) = db_rows(home / "g.db", "SELECT store_pgid FROM jobs WHERE id = ?", (job["id"],))[0]
    assert store is None or not group_alive(store)
    if kept is None:
        pytest.skip("the full disk at the cancel needs root (a tmpfs); the rest passed")
