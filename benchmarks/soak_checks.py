"""The multi-host soak's end: the checks (every job final with a reason, the in-place jobs
that succeeded exact against their fixed-size references, nothing left running or held,
PostgreSQL clean) and the figures (jobs, faults injected by kind, time not training,
recoveries by kind with p50/p99 beside their bounds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import soak_faults as faults
import soak_lab
import soak_plan
from soak import compare, not_training
from soak_pool import EXAMPLE, FINAL, kind_of

_refs: dict[tuple, dict] = {}


def reference(root: Path, job_args: list[str]) -> dict:
    """The standalone run of the same script and options (cached per distinct argv)."""
    key = tuple(job_args)
    if key not in _refs:
        out = root / f"reference-{len(_refs)}.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
        subprocess.run([sys.executable, str(EXAMPLE), *job_args, "--report", str(out)], check=True,
                       env={**env, "OMP_NUM_THREADS": "1"}, timeout=600, capture_output=True)
        _refs[key] = json.loads(out.read_text())
    return _refs[key]


def pg_checks(lab: soak_lab.Lab, db: str) -> list[str]:
    """amcheck over every B-tree index, and the rows that must agree with each other."""
    bad = []
    lab.pg.sql("CREATE EXTENSION IF NOT EXISTS amcheck", db)
    idx = lab.pg.sql("SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                     "JOIN pg_am a ON a.oid = c.relam JOIN pg_namespace n ON n.oid = c.relnamespace "
                     "WHERE a.amname = 'btree' AND n.nspname = 'public'", db).split()
    for name in idx:
        try:
            lab.pg.sql(f"SELECT bt_index_parent_check('public.\"{name}\"'::regclass, true)", db)
        except RuntimeError as e:
            bad.append(f"amcheck {name}: {str(e)[:200]}")
    queries = {
        "live workers of ended jobs": "SELECT count(*) FROM workers w JOIN jobs j ON j.id = w.job_id "
                                      "WHERE j.state IN ('succeeded','failed','cancelled','timeout') "
                                      "AND w.state IN ('starting','running','leaving')",
        "ended jobs without an end time": "SELECT count(*) FROM jobs WHERE state IN "
                                          "('succeeded','failed','cancelled','timeout') AND ended_at IS NULL",
        "workers of no job": "SELECT count(*) FROM workers w LEFT JOIN jobs j ON j.id = w.job_id WHERE j.id IS NULL",
    }
    for what, sql in queries.items():
        n = lab.pg.sql(sql, db).strip()
        if n != "0":
            bad.append(f"{what}: {n}")
    print(f"PostgreSQL: amcheck (bt_index_parent_check, heapallindexed) on {len(idx)} indexes, "
          f"{len(queries)} consistency queries: " + ("clean" if not bad else f"{len(bad)} problems"))
    return bad


def job_events(lab, db: str, job_id: int, last: int = 25) -> str:
    """The last `last` events of a job and its workers' rows, as lines for the log (the
    lab's directory, database included, is removed after a run that passes)."""
    try:
        events = lab.pg.sql(f"SELECT round(time::numeric, 1), kind, left(replace(message, E'\\n', ' '), 160) "
                            f"FROM events WHERE job_id = {int(job_id)} ORDER BY id DESC LIMIT {int(last)}", db)
        workers = lab.pg.sql(f"SELECT wid, host, state, generation, exit_code, retired_at IS NOT NULL "
                             f"FROM workers WHERE job_id = {int(job_id)} ORDER BY wid", db)
    except Exception as e:   # noqa: BLE001 - evidence only: never what ends the summary
        return f"      (its events could not be read: {e})"
    lines = [f"      event {r}" for r in reversed(events.splitlines())]
    return "\n".join(lines + [f"      worker {r}" for r in workers.splitlines()])


def summary(chaos, seed: int, stopped: str | None) -> bool:
    lab = chaos.lab
    problems = list(chaos.problems)
    jobs = lab.jobs() or []
    print(f"\n==== multi-host soak summary (seed {seed}) ====")
    kinds = Counter((kind_of(j), j["state"]) for j in jobs)
    print(f"jobs: {len(jobs)}: " + ", ".join(f"{k} {s} {n}" for (k, s), n in sorted(kinds.items())))
    print("by user: " + ", ".join(f"{u} {n}" for u, n in sorted(Counter(j["owner"] for j in jobs).items())))
    for j in jobs:
        if j["state"] not in FINAL or not j.get("exit_reason"):
            problems.append(f"job {j['id']} ({j['name']}) is {j['state']}, reason {j.get('exit_reason')!r}")
        elif j["state"] != "succeeded":
            print(f"   job {j['id']} {j['name']} {j['state']}: {j['exit_reason'][:150]}")
            if kind_of(j) in ("inplace", "restart"):   # built to outlive its faults: its evidence, kept
                print(job_events(lab, chaos.db_name, j["id"]))
    print("faults injected: " + ", ".join(f"{k} {chaos.injected.get(k, 0)}" for k in soak_plan.FAULTS)
          + f", clock_skew 1 ({soak_lab.SKEWED_HOST} {soak_lab.SKEW_S} s ahead, the whole run)")
    print("planned but nothing there to hit (no victim, no process on the host): "
          + ", ".join(f"{k} {chaos.skipped.get(k, 0)}" for k in soak_plan.FAULTS))
    exact, total_nt, span = 0, 0.0, 0.0
    for j in jobs:
        if kind_of(j) != "inplace" or j["state"] != "succeeded":
            continue
        path, job_args = chaos.reports.get(j["id"], (None, None))
        if path is None or not path.exists():
            problems.append(f"job {j['id']} succeeded without its report")
            continue
        report = json.loads(path.read_text())
        match, text = compare(report, reference(lab.root, job_args))
        exact += match
        if not match:
            problems.append(f"job {j['id']} not exact: {text}")
        nt = not_training(report["step_log"], j["created_at"])
        total_nt += nt["total_s"] or 0.0
        span += nt.get("span_s") or 0.0
    n_ok = sum(1 for j in jobs if kind_of(j) == "inplace" and j["state"] == "succeeded")
    print(f"in-place jobs succeeded: {n_ok}, exact against their fixed-size reference: {exact} "
          f"({len(_refs)} distinct argv)")
    print(f"time not training (succeeded in-place jobs, from submit): {total_nt:.1f} s of {span:.1f} s")
    print("recoveries (fault injected -> training again / the command answering again):")
    for row in soak_plan.recovery_rows(dict(chaos.recoveries), dict(chaos.unrecovered)):
        print("   " + row)
    left = soak_lab.leftovers(lab)
    live = [(j["id"], w["wid"]) for j in jobs for w in j["workers"] if w["state"] in faults.LIVE]
    sockets = sorted({str(Path(w["control"]).parent) for j in jobs for w in j["workers"] if w.get("control")
                      and Path(w["control"]).parent.exists()})
    # each recorded group and the latest end of the jobs that recorded it (0: one has not ended)
    rows = lab.pg.sql("SELECT pgid, CASE WHEN bool_or(ended_at IS NULL) THEN 0 ELSE max(ended_at) END FROM ("
                      "SELECT w.pgid, j.ended_at FROM workers w JOIN jobs j ON j.id = w.job_id "
                      "WHERE w.pgid IS NOT NULL UNION ALL "
                      "SELECT store_pgid, ended_at FROM jobs WHERE store_pgid IS NOT NULL) g "
                      "GROUP BY pgid ORDER BY pgid", chaos.db_name).split()
    alive = [int(g) for g, at in (r.split("|") for r in rows)
             if faults.our_group_alive(int(g), lab.root, float(at) or None)]
    print(f"left: {len(left)} processes, {len(sockets)} socket directories, {len(live)} live worker rows, "
          f"{len(alive)} process groups alive")
    problems += [f"left running: {x}" for x in left] + [f"socket dir left: {s}" for s in sockets]
    problems += [f"worker row live: job {a} wid {b}" for a, b in live] + [f"group {g} alive" for g in alive]
    problems += pg_checks(lab, chaos.db_name)
    for p in problems:
        print(f"problem: {p}")
    if stopped:
        print(f"STOPPED: {stopped}")
    ok = not problems and stopped is None
    print(f"\nseed {seed}: {'OK' if ok else 'FAILED'}")
    return ok
