"""Issue 12 end to end: the split of the global batch by measured speed on the local pool.

Three workers, the one on slot 0 three times slower per sample (the example's test bed:
simulated device time, outside the runtime). The first newcomer is killed (SIGKILL, a
failpoint) while it makes its first re-plan, before the step that would commit it; the
job goes on without it and grows again. The members measure, agree and re-plan; then
a fast worker is killed with SIGKILL after the re-plan and the job grows back (the newcomer
receives the plan with the state). The run ends allclose to a standalone run of the same
script, every sample of every epoch once, and the progress record showed the slow worker
with the smaller share."""

from __future__ import annotations

import json
import os
import signal
import sys

from tests.conftest import wait_for
from tests.e2e.test_fault_matrix import armed
from tests.e2e.test_elastic_jobs import (ARGS, DEADLINE_S, EXAMPLE, assert_matches_reference, ej,  # noqa: F401
                                     live_members, reference, scale, step_of)

EPOCHS = 12   # 384 steps of 64 samples

FORK_START = True   # the `ej` fixture's jobs fork their workers from a warm interpreter


def favours_the_fast(progress: dict | None) -> bool:
    """A re-plan by speed has given the slowest member the smallest share."""
    workers = (progress or {}).get("workers") or {}
    replans = (progress or {}).get("replans") or []
    if len(workers) != 3 or not any(r["reason"] == "speeds" for r in replans):
        return False
    rel = {w: v["relative"] for w, v in workers.items()}
    if any(r is None for r in rel.values()):
        return False
    slow = min(rel, key=rel.get)
    return rel[slow] < 0.6 and workers[slow]["share"] < min(v["share"] for w, v in workers.items() if w != slow)


def test_speed_split_with_a_3x_slower_worker_survives_kill_9_and_a_grow_exactly(ej, tmp_path_factory, home):
    report, hold = home / "r.json", home / "hold"
    hold.touch()   # paced until the last grow's plan is seen: forked workers start in a blink
    argv = [sys.executable, EXAMPLE, *ARGS, "--epochs", str(EPOCHS), "--step-sleep", "0.05",
            "--device-work-s", "0.002", "--slow-slots", "0=3", "--report", str(report), "--sleep-while", str(hold)]
    job = ej.submit(argv, "--workers", "1:3", *armed("split.replan@wid=2=kill"))
    assert ej("scale", str(job["id"]), "3").returncode == 0          # wid 2 dies in its first re-plan
    # recovered without it: at 2, or at 3 when the job formed at 3 before wid 2's first re-plan
    # (forked starts) and its replacement joined the recovery
    lost = wait_for(ej, job["id"], lambda j: any(w["wid"] == 2 and w["state"] in ("lost", "failed")
                                                 for w in j["workers"]) and j["state"] == "running"
                    and j["world_size"] >= 2 and 2 not in [w["wid"] for w in live_members(j)],
                    "recovery without the newcomer killed in its re-plan")
    assert next(w for w in lost["workers"] if w["wid"] == 2)["exit_code"] in (-9, None)
    scale(ej, job["id"], 3)
    planned = wait_for(ej, job["id"], lambda j: favours_the_fast(j.get("progress")), "a re-plan by speed")
    progress = planned["progress"]
    assert progress["split"] == "speed"
    seqs = [r["seq"] for r in progress["replans"]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for r in progress["replans"]:
        assert sum(r["new"].values()) == 64
    speeds = next(r for r in progress["replans"] if r["reason"] == "speeds")
    assert speeds["predicted_step_s"] < speeds["previous_step_s"]

    fast = [w for w in live_members(planned) if progress["workers"][str(w["wid"])]["relative"] > 0.6]
    victim = fast[-1]
    os.kill(victim["pid"], signal.SIGKILL)
    after = wait_for(ej, job["id"], lambda j: j["generation"] > planned["generation"] and j["state"] == "running"
                     and j["world_size"] == 2 and step_of(j) > step_of(planned), "recovery without the victim")
    scale(ej, job["id"], 3)
    grown = wait_for(ej, job["id"], lambda j: j["world_size"] == 3 and j["generation"] > after["generation"]
                     and favours_the_fast(j.get("progress"))
                     and str(victim["wid"]) not in j["progress"]["workers"], "the grown job's plan by speed")
    last = grown["progress"]["replans"][-1]
    assert last["seq"] > max(seqs)                     # the counter went on from the committed state
    hold.unlink()

    done = ej.wait_final(job["id"], DEADLINE_S)
    assert done["state"] == "succeeded", done
    assert_matches_reference(json.loads(report.read_text()), reference(tmp_path_factory, EPOCHS))
    dead = {w["wid"]: w for w in done["workers"]}
    assert dead[victim["wid"]]["exit_code"] == -9
