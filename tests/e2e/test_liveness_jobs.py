"""Liveness on real jobs of the local pool (gpuflex.elastic.membership.liveness; its unit tests,
members as threads against a real TCPStore, are tests/elastic/membership/test_liveness.py): rank 0
busy past the process-group timeout is waited for, a frozen member is fenced, a worker that raises
leaves its crash record, compiled workers warm up before they are ready, and a forger at the job's
store port changes nothing. tests/fakes/liveness_job.py is the script."""

from __future__ import annotations

import ast
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.distributed import TCPStore

from gpuflex.elastic.membership.liveness import outcome_key
from gpuflex.elastic.protocol.keys import arrivals_key, counter_key
from tests import TESTS
from tests.conftest import GpuflexCLI, cleanup_jobs, wait_for
from tests.elastic.membership.test_liveness import BOUND_S, wait_until

pytestmark = pytest.mark.e2e   # jobs of real workers and coordinators

JOB = str(TESTS / "fakes" / "liveness_job.py")
E2E_DEADLINE_S = 300
JOB_ARGS = ("--hidden", "32", "--global-batch-size", "64", "--seed", "4")


@pytest.fixture
def lj(home):
    """CLI whose jobs have a 3 s process-group timeout and a 3 s heartbeat timeout."""
    cfg = home / "g.toml"
    cfg.write_text(
        f'[database]\nurl = "sqlite:///{home}/g.db"\n\n'
        "[jobs]\ncancel_grace_s = 10\ncheckpoint_interval_s = 1\npg_timeout_s = 3\nheartbeat_timeout_s = 3\nfork_start = true\n\n"
        f'[[hosts]]\nname = "local"\ngpus = "cpu:4"\nworkdir = "{home}/work"\n')
    cli = GpuflexCLI(home, cfg)
    yield cli
    cleanup_jobs(cli, home / "g.db")


_refs: dict[tuple, dict] = {}


def reference(tmp_path_factory, epochs: int, *extra: str) -> dict:
    """The standalone run of the same script, without the busy wait or the exception."""
    key = (epochs, *extra)
    if key not in _refs:
        out = tmp_path_factory.mktemp("ref") / "ref.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
        subprocess.run([sys.executable, JOB, *JOB_ARGS, *extra, "--epochs", str(epochs), "--report", str(out)],
                       check=True, env=env, timeout=300)
        _refs[key] = json.loads(out.read_text())
    return _refs[key]


def assert_matches(report: dict, ref: dict) -> None:
    assert report["steps"] == ref["steps"]
    got, want = torch.tensor(report["params"]), torch.tensor(ref["params"])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    for epoch, ids in report["samples"].items():
        assert sorted(ids) == list(range(2048)), f"epoch {epoch} not exactly once"
    assert [s for s, _, _ in report["step_log"]] == list(range(ref["steps"]))


def poll(cli: GpuflexCLI, job_id: int, pred: Callable[[dict], Any], what: str) -> dict:
    return wait_for(cli, job_id, pred, what, E2E_DEADLINE_S, every_s=0.5)


def members_of(job: dict) -> list[dict]:
    return sorted((w for w in job["workers"] if w["rank"] is not None and w["state"] == "running"),
                  key=lambda w: w["rank"])


def test_rank_0_busy_longer_than_the_process_group_timeout_is_waited_for_without_rollback(
        lj, tmp_path_factory, home):
    report = home / "r.json"
    job = lj.submit([sys.executable, JOB, *JOB_ARGS, "--epochs", "2", "--step-sleep", "0.02",
                     "--busy-at", "5", "--busy-s", "8", "--report", str(report)], "--workers", "2")
    running = poll(lj, job["id"], lambda j: len(members_of(j)) == 2, "two members")
    rank0 = members_of(running)[0]["wid"]
    seen = poll(lj, job["id"], lambda j: any(rank0 in w["for"] for w in j.get("waiting") or ()),
                "the other member to be shown waiting for rank 0")
    (w,) = [w for w in seen["waiting"] if rank0 in w["for"]]
    assert w["wid"] != rank0 and w["phase"] == "backward"
    done = lj.wait_final(job["id"], E2E_DEADLINE_S)
    assert done["state"] == "succeeded", done
    assert done["generation"] == 1   # no recovery, no rollback: the busy member was waited for
    assert_matches(json.loads(report.read_text()), reference(tmp_path_factory, 2))
    kinds = {e["kind"] for e in lj.json("events", str(job["id"]))}
    assert not kinds & {"fault", "rollback"}, kinds
    # Issue 28 item 3: rank 0's 8 s between the batch and its forward (an evaluation) is not
    # its compute: the speed split did not take it for a worker 100 times slower and give it
    # the least share it allows (it did, {'0': 1, '1': 63}, when a step was timed from its
    # batch); each rank's step is timed from its first training forward (run/context.py)
    plans = split_plans(lj.ok("logs", str(job["id"])).stdout)
    assert plans, "no split plan in the workers' logs"
    for reason, shares in plans:
        assert min(shares.values()) >= 64 / len(shares) / 4, (reason, shares)


def split_plans(logs: str) -> list[tuple[str, dict[str, int]]]:
    """The split plans the workers logged: (reason, {wid: share})."""
    return [(m[1], ast.literal_eval(m[2]))
            for m in re.finditer(r"split plan \d+ from step \d+ \((\w+)\): (\{.*?\})", logs)]


def test_a_frozen_member_is_fenced_within_the_heartbeat_timeout_and_the_others_go_on(
        lj, tmp_path_factory, home):
    report = home / "r.json"
    # 8 epochs of 32 steps, >= 50 ms each: the freeze lands long before the end, even on a busy host
    job = lj.submit([sys.executable, JOB, *JOB_ARGS, "--epochs", "8", "--step-sleep", "0.05",
                     "--report", str(report)], "--workers", "2:3")
    lj.ok("scale", str(job["id"]), "3", "--wait", "--timeout", str(E2E_DEADLINE_S))
    running = poll(lj, job["id"], lambda j: len(members_of(j)) == 3 and (j.get("step") or 0) >= 3,
                   "steps at world size 3")
    assert running["step"] < 200, "the job is too close to its end for the test to mean anything"
    frozen = members_of(running)[1]
    os.kill(frozen["pid"], signal.SIGSTOP)
    try:
        after = poll(lj, job["id"], lambda j: j["generation"] > running["generation"] and j["world_size"] == 2
                     and (j.get("step") or 0) > (running.get("step") or 0) + 5, "the others to go on without it")
        assert frozen["wid"] not in [w["wid"] for w in members_of(after)]
    finally:
        os.kill(frozen["pid"], signal.SIGCONT)
    done = lj.wait_final(job["id"], E2E_DEADLINE_S)
    assert done["state"] == "succeeded", done
    assert_matches(json.loads(report.read_text()), reference(tmp_path_factory, 8))


def test_a_worker_that_raises_writes_its_crash_record_and_the_survivor_never_trains_alone(lj, home):
    report = home / "r.json"
    job = lj.submit([sys.executable, JOB, *JOB_ARGS, "--epochs", "2", "--step-sleep", "0.05",
                     "--raise-at", "12", "--raise-wid", "1", "--report", str(report)], "--workers", "2")
    done = lj.wait_final(job["id"], E2E_DEADLINE_S)
    assert done["state"] == "failed", done
    text = json.dumps(done)
    assert "ZeroDivisionError: division by zero" in text, text[:2000]
    crashed = {w["wid"]: w for w in done["workers"]}[1]
    assert crashed["exit_code"] == 1
    survivor = {w["wid"]: w for w in done["workers"]}[0]
    assert survivor["exit_code"] == 0   # it waited, then the control side stopped it
    assert done["generation"] == 1      # no generation without the crashed worker: never alone
    r = json.loads(report.read_text())  # the stopped survivor's report: step 12 undone, none alone
    assert r["steps"] == 12 and {ws for _, _, ws in r["step_log"]} == {2}


def test_compiled_workers_warm_up_through_the_loop_before_they_are_ready_and_leave_no_trace(
        lj, tmp_path_factory, home):
    """A torch.compile'd model: every worker, the first two and a newcomer, makes one pass
    through the user's own loop (it compiles there) before it says it is ready, cut for the
    place it expects, not primary, its gradients dropped; the state before the pass is put
    back (rank 0's is the first generation's) or replaced by the copy, so the job still ends
    equal to a standalone run."""
    report, warm, hold = home / "r.json", home / "warm", home / "hold"
    hold.touch()   # the pace is held until both resizes are done (a loaded machine's compiles are slow)
    job = lj.submit([sys.executable, JOB, *JOB_ARGS, "--compile", "--epochs", "6", "--step-sleep", "0.5",
                     "--sleep-while", str(hold), "--warm-log", str(warm), "--report", str(report)],
                    "--workers", "1:2")
    poll(lj, job["id"], lambda j: (j.get("step") or 0) >= 3 and j["world_size"] == 2, "steps at world size 2")
    lj.ok("scale", str(job["id"]), "1", "--wait", "--timeout", str(E2E_DEADLINE_S))
    lj.ok("scale", str(job["id"]), "2", "--wait", "--timeout", str(E2E_DEADLINE_S))
    hold.unlink()
    done = lj.wait_final(job["id"], E2E_DEADLINE_S)
    assert done["state"] == "succeeded", done
    places = {}
    for w in done["workers"]:
        passes = [json.loads(line) for line in Path(f"{warm}.w{w['wid']}").read_text().splitlines()]
        places[w["wid"]] = [(p["is_primary"], p["rank"], p["world_size"], p["step"]) for p in passes]
    newcomer = max(places)
    assert newcomer >= 2 and len(places) == 3, places
    assert places == {0: [(False, 0, 2, 0)], 1: [(False, 1, 2, 0)], newcomer: [(False, 1, 2, 0)]}
    log = lj("logs", str(job["id"]), "--worker", str(newcomer)).stdout
    assert log.index("warm-up pass as rank 1 of 2") < log.index("rank 1 of 2 at step"), log[-3000:]
    assert_matches(json.loads(report.read_text()), reference(tmp_path_factory, 6, "--compile"))


def _store_of_job_with(marker: str) -> str:
    """GPUFLEX_STORE of a running worker whose command line holds `marker` (as an attacker
    finds the port with `ss -ltn`; root reads the environment)."""
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            env = dict(v.split(b"=", 1) for v in (d / "environ").read_bytes().split(b"\0") if b"=" in v)
        except (OSError, ValueError):
            continue
        if any(marker.encode() in a for a in argv) and b"GPUFLEX_STORE" in env:
            return env[b"GPUFLEX_STORE"].decode()
    return ""


FORGED_TEXT = "text-of-the-forger-7f3a"


def test_a_job_under_a_forger_at_its_store_port_succeeds_exact(lj, tmp_path_factory, home):
    """Issue 28's attack and its kin on a real job: outcomes forged ahead with "fail: ..."
    for every coming barrier, arrival lines with the forger's votes, counts pushed to
    "everyone arrived". The job ends succeeded, equal to the standalone run, and no text
    of the forger's reaches its events or its reason."""
    report = home / "r.json"
    job = lj.submit([sys.executable, JOB, *JOB_ARGS, "--epochs", "3", "--step-sleep", "0.02",
                     "--report", str(report)], "--workers", "3")
    poll(lj, job["id"], lambda j: len(members_of(j)) == 3, "three members")
    address = wait_for_value(lambda: _store_of_job_with(str(report)), "the job's store address")
    host, _, port = address.rpartition(":")
    forger = TCPStore(host, int(port), is_master=False, timeout=dt.timedelta(seconds=BOUND_S))
    stop = threading.Event()

    def attack() -> None:
        rounds = 0
        while not stop.is_set() and rounds < 400:   # bounded: at most 400 rounds of writes
            rounds += 1
            try:
                for g in range(1, 4):
                    for n in range(1, 200):
                        forger.set(outcome_key(g, n), f"fail: {FORGED_TEXT}")
                    forger.add(counter_key(g), 3)
                    forger.append(arrivals_key(g, rounds % 150 + 1), "0 1073741824\n1 5\n")
            except Exception:   # the job ended and its store with it
                return
            stop.wait(0.2)

    t = threading.Thread(target=attack, daemon=True)
    t.start()
    try:
        done = lj.wait_final(job["id"], E2E_DEADLINE_S)
    finally:
        stop.set()
        t.join(BOUND_S)
    assert done["state"] == "succeeded", done
    events = lj("events", str(job["id"])).stdout
    assert FORGED_TEXT not in events and FORGED_TEXT not in json.dumps(done)
    assert_matches(json.loads(report.read_text()), reference(tmp_path_factory, 3))


def wait_for_value(fn: Callable[[], Any], what: str) -> Any:
    return wait_until(fn, what)
