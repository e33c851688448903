"""The fault matrix's "SSH host lost" column (issue 16 item 1; docs/architecture.md
"Fault matrix") outside steady training, on the real sshd bed of tests/e2e/ssh/test_ssh_jobs.py
(gpu01..gpu03, two fake GPUs each). One job run: a worker on gpu03 is held at a phase by
a `sleep` failpoint while the host dies (its sshd stopped, its processes SIGKILLed, as
test_ssh_jobs loses one), in the first formation, then in a grow's rebuild, then at a
grow's start-up, then in a cancel. In the first three the job goes on, formed on the
others, the worker marked lost (the recovery's path; the run ends by the cancel, so its
model is not compared: the steady-training loss in tests/e2e/ssh/test_ssh_jobs.py is); the cancel
ends cancelled with nothing left. No timed assertion: the time from each loss is printed
(`pytest -s`) beside its bound."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from gpuflex.hosts.hostops import group_alive
from tests.conftest import db_rows, wait_for
from tests.sshbed import _stop, bed_cli, restart_sshd, ssh_hosts  # noqa: F401 (ssh_hosts: a fixture)
from tests.e2e.test_elastic_jobs import example_argv, live_members, step_of
from tests.e2e.test_fault_matrix import BOUND_S, armed, member_wids, took, wait_fired, worker

HOLD_S = 8   # a `sleep` failpoint holds the worker at its phase while its host dies


@pytest.fixture
def fs(ssh_hosts, home):
    """CLI over the bed: 3 s process-group and heartbeat timeouts, 5 s cancel grace."""
    yield from bed_cli(ssh_hosts, home, "[jobs]\ncancel_grace_s = 5\ncheckpoint_interval_s = 2\npg_timeout_s = 3\n"
                                        "heartbeat_timeout_s = 3\n\n")


def lose_gpu03(bed, job: dict) -> None:
    """gpu03 dies: no sshd, and its workers' processes gone."""
    h3 = bed.host("gpu03")
    _stop(h3.proc)
    h3.proc = None
    for w in job["workers"]:
        if w["host"] == "gpu03" and w["state"] in ("starting", "running") and w["pid"]:
            try:
                os.killpg(os.getpgid(w["pid"]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def on_gpu03(job: dict, wid: int) -> None:
    assert worker(job, wid)["host"] == "gpu03", job["workers"]


def lost_and_recovered(fs, bed, job_id: int, wid: int, point: str, members: int) -> None:
    line_job = fs.json("status", str(job_id))
    on_gpu03(line_job, wid)
    _, t = wait_fired(worker(line_job, wid)["log"], point)
    lose_gpu03(bed, fs.json("status", str(job_id)))
    after = wait_for(fs, job_id, lambda j: worker(j, wid)["state"] == "lost" and j["state"] == "running"
                     and len(member_wids(j)) == members and wid not in member_wids(j),
                     f"the job to go on without gpu03 ({point})", BOUND_S, every_s=0.5)
    took(f"{point} x SSH host lost: worker {wid} lost, the others formed", t, "H + a command, then B1")
    assert all(w["host"] != "gpu03" for w in live_members(after))
    restart_sshd(bed, bed.host("gpu03"))


def newcomer_lost_at_start_up(fs, bed, job_id: int, wid: int) -> None:
    """A grow's newcomer on gpu03 held at start-up, before it joins, when gpu03 dies: the
    coordinator leaves it out (its heartbeat stale), the job goes back to running on the
    others, the newcomer is marked lost and the event names worker, host and phase."""
    job = fs.json("status", str(job_id))
    on_gpu03(job, wid)
    _, t = wait_fired(worker(job, wid)["log"], "startup.before_join")
    lose_gpu03(bed, fs.json("status", str(job_id)))
    after = wait_for(fs, job_id, lambda j: worker(j, wid)["state"] == "lost" and j["state"] == "running"
                     and member_wids(j) == [0, 1, 2, 3], "the grow given up without gpu03 (start-up)", BOUND_S,
                     every_s=0.5)
    took(f"startup.before_join x SSH host lost: newcomer {wid} left out and lost", t, "B2, H + 30 s")
    left = [e["message"] for e in fs.json("events", str(job_id)) if e["kind"] == "left-out"]
    assert any(f"worker {wid} on gpu03 left out of the resize (warm-up)" in m for m in left), left
    assert all(w["host"] != "gpu03" for w in live_members(after))
    restart_sshd(bed, bed.host("gpu03"))


def test_a_host_lost_in_a_formation_a_resize_and_a_cancel(fs, ssh_hosts, home):
    """Workers 0..4 on gpu01, gpu02 (two each) and gpu03 (worker 4), MIN 2. gpu03 dies
    while worker 4 waits in the first formation's join: the job forms on 0..3. gpu03 comes
    back; `scale 5` puts newcomer 5 there, and gpu03 dies while it waits before the grow's
    new group: the job goes on, on 0..3. Again `scale 5`: gpu03 dies while newcomer 6 waits
    at start-up, before it joins: the grow is given up, 6 lost. Again `scale 5` (newcomer 7
    on gpu03); a cancel during which gpu03 dies while 7 waits at the stop ends cancelled,
    nothing left."""
    hold = f"sleep:{HOLD_S}"
    job = fs.submit(example_argv(home / "r.json", epochs=200, sleep=0.05), "--workers", "2:5",
                    *armed(f"formation.join@wid=4={hold}", f"resize.rebuild@wid=5={hold}",
                           f"startup.before_join@wid=6={hold}", f"cancel.stop@wid=7={hold}"))
    jid = str(job["id"])
    lost_and_recovered(fs, ssh_hosts, job["id"], 4, "formation.join", 4)
    fs.ok("scale", jid, "5")
    lost_and_recovered(fs, ssh_hosts, job["id"], 5, "resize.rebuild", 4)

    fs.ok("scale", jid, "5")
    newcomer_lost_at_start_up(fs, ssh_hosts, job["id"], 6)

    fs.ok("scale", jid, "5")
    running = wait_for(fs, job["id"], lambda j: member_wids(j) == [0, 1, 2, 3, 7] and step_of(j) > 0,
                       "training on five again", BOUND_S, every_s=0.5)
    on_gpu03(running, 7)
    result: dict[str, subprocess.CompletedProcess] = {}
    cancel = threading.Thread(target=lambda: result.setdefault("p", fs("cancel", jid, timeout=BOUND_S)))
    started = time.monotonic()
    cancel.start()
    wait_fired(worker(running, 7)["log"], "cancel.stop")
    lose_gpu03(ssh_hosts, running)
    cancel.join(BOUND_S + 30)
    took("cancel.stop x SSH host lost", started, "B5, cancel_grace_s + a poll (+ the ssh connect timeout)")
    assert not cancel.is_alive() and result["p"].returncode == 0, result
    done = fs.json("status", jid)
    assert done["state"] == "cancelled", done
    alive = [w["pgid"] for w in done["workers"] if w["host"] != "gpu03" and w.get("pgid")]
    pgids = [r[0] for r in db_rows(home / "g.db", "SELECT pgid FROM workers WHERE pgid IS NOT NULL")]
    assert not any(group_alive(p) for p in pgids + alive)
