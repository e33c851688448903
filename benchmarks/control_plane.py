"""The control plane under a lab's load (issue 14): `status`, `acct`, `submit` and `metrics`
latency with 10,000 jobs in the database, and 32 CLIs at once, on SQLite and PostgreSQL
side by side.

Each backend gets a throw-away database, seeded through the models (not through the
CLI): 10,000 jobs of 10 users over the last 30 days, in a mix of states (succeeded,
failed, cancelled, timeout; 200 queued), each with its workers (1-4, ended) and events (a
state change per move, a few worker events); one real job (`sleep`, 2 workers, submitted
before the queued ones) holds the pool's two CPU slots, so every command reconciles a
running job and tries the queued ones, and every submit stays queued behind it (no launch
in the figures). Each
command is the whole console-script process, as a user runs it: interpreter, imports,
config, database, the refresh every command does first, render.

- start-up (issue 30): `python -c pass` (the interpreter alone: the baseline), `gpuflex
  --help` and `status` on an empty database, N runs each, interleaved, before any job is
  seeded
- sequential: N runs of each command, one at a time: median and p95 wall seconds; and,
  inside each process, how long its imports and the command itself took (median); a
  command whose first run takes over SLOW_S gets 2 runs
- concurrent: 32 CLIs started at once (16 `status ID`, 16 `submit`): median, p95, the
  slowest, and how many failed (exit code not 0, or a traceback)

PostgreSQL: a throw-away cluster started by tests/pgbed.py (Debian's postgresql, run as
the `postgres` user when we are root); or `--pg-url postgresql+psycopg://USER@HOST:PORT/DB`
to use a server of your own (an empty database: the benchmark fills it).
- web: `gpuflex web` started once on a free loopback port, each of its pages fetched N
  times over HTTP (the server's answer, whole: read, drawn, sent): median and p95 seconds

Goals (issue 14): status <= 0.3 s, no failed command; (issue 30) `status --all`,
`status --json` and `acct` under 1 s of command for a page, each web page under 1 s.
Figures only, no assertion.
`--before DIR` runs every command of SQLite a second time with the gpuflex package of DIR
(an export of an earlier commit: git archive COMMIT | tar -x -C DIR), beside this one's:
a command the older code does not know fails there and shows as "-".
Run: .venv/bin/python benchmarks/control_plane.py [--jobs 10000] [--repeat 10] [--before DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import update  # noqa: E402

from gpuflex.db.engine import open_database  # noqa: E402
from gpuflex.db.models import Event, Job, Worker  # noqa: E402
from gpuflex.states import JobState  # noqa: E402

GPUFLEX = str(Path(sys.executable).parent / "gpuflex")
# the console script's work, run by `python -c` so the process also says how long its
# imports took and how long the command itself (config, database, refresh, render) did.
# Since issue 30 a command imports the config (pydantic) and the service (the ORM) itself,
# after the CLI: for a command other than --help they are imported first here, with the
# CLI, so "the command itself" still counts no import
TIMED = ("import sys, time\nt0 = time.perf_counter()\nfrom gpuflex.cli import main\n"
         "if sys.argv[1:2] != ['--help']:\n    import gpuflex.config, gpuflex.control.service\n"
         "t1 = time.perf_counter()\n"
         "try:\n    main()\nfinally:\n"
         "    sys.stderr.write(f'\\n#timing {t1 - t0:.4f} {time.perf_counter() - t1:.4f}\\n')\n")
USERS = [f"user{i}" for i in range(10)]
FINAL = [("succeeded", 70), ("failed", 15), ("cancelled", 10), ("timeout", 5)]
QUEUED = 200
DAY_S = 86400.0
COMMAND_TIMEOUT_S = 600
SLOW_S = 10.0   # a command whose first run takes longer gets 2 runs (the whole listings before issue 30)


def seed(url: str, first: int, n: int, rng: random.Random, queued: bool = False) -> None:
    """`n` jobs through the models (ended ones, or queued ones), 1,000 per transaction."""
    sessions = open_database(url)
    now = time.time()
    states = [s for s, weight in FINAL for _ in range(weight)]
    for start in range(first, first + n, 1000):
        with sessions.begin() as s:
            s.add_all([_job(i, "queued" if queued else rng.choice(states), now, rng)
                       for i in range(start, min(first + n, start + 1000))])
    sessions.kw["bind"].dispose()


def _job(i: int, state: str, now: float, rng: random.Random) -> Job:
    created = now - rng.uniform(60, 30 * DAY_S) if state != "queued" else now - rng.uniform(1, 3600)
    workers = rng.randint(1, 4)
    j = Job(token=f"b{i:011d}", name=f"train-{i % 97}", state=state, argv=["python", "train.py", str(i)],
            workdir="/tmp", env={}, min_workers=1, max_workers=workers, gpus_per_worker=1,
            user=rng.choice(USERS), created_at=created, priority=rng.choice([0, 0, 0, 10]))
    j.events.append(Event(kind="state", message="queued: submitted", time=created, data={"state": "queued"}))
    if state == "queued":
        j.queue_reason = "waiting for 1 free slots on local (0 free now)"
        return j
    started = created + rng.uniform(1, 600)
    ended = started + rng.uniform(60, 12 * 3600)
    j.started_at, j.ended_at = started, ended
    j.exit_code = {"succeeded": 0, "failed": 1}.get(state)
    for wid in range(workers):
        j.workers.append(Worker(wid=wid, host="local", gpus=[wid % 2], state="exited" if state == "succeeded"
                                else "stopped", log_path=f"/tmp/{i}-{wid}.log", exit_path=f"/tmp/{i}-{wid}.exit",
                                started_at=started, ended_at=ended, generation=1))
        j.events.append(Event(kind="worker", message=f"worker {wid} on local exited 0", time=ended,
                              data={"wid": wid, "host": "local"}))
    j.events.append(Event(kind="state", message="running: started", time=started, data={"state": "running"}))
    j.events.append(Event(kind="state", message=f"{state}: done", time=ended, data={"state": state}))
    return j


class Setup:
    """A config for one backend: one local host of 2 CPU slots, the database at `url`."""

    def __init__(self, root: Path, url: str, code: str | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.config = root / "gpuflex.toml"
        self.config.write_text(f'[database]\nurl = "{url}"\n\n[jobs]\ncancel_grace_s = 2\n\n'
                               f'[[hosts]]\nname = "local"\ngpus = "cpu:2"\nworkdir = "{root}/work"\n')
        # run in `root`: `python -c` puts its working directory first on sys.path, and in a
        # checkout that is the checkout's gpuflex, whatever PYTHONPATH says
        self.env = {**os.environ, "GPUFLEX_CONFIG": str(self.config), "COLUMNS": "160"}
        if code is not None:   # sys.path's PYTHONPATH comes before the installed (editable) gpuflex
            self.env["PYTHONPATH"] = str(Path(code).resolve())

    def baseline(self) -> tuple[float, bool, str, None]:
        """`timed`'s answer for `python -c pass`: the interpreter's own start-up."""
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", "pass"], env=self.env, cwd=self.config.parent,
                           timeout=COMMAND_TIMEOUT_S)
        return time.perf_counter() - t0, p.returncode == 0, "", None

    def run(self, *args: str) -> tuple[float, bool, str]:
        """(wall seconds, ok, the first error line) of one whole CLI process."""
        took, ok, error, _ = self.timed(*args)
        return took, ok, error

    def timed(self, *args: str) -> tuple[float, bool, str, tuple[float, float] | None]:
        """`run`'s answer and the process's own (imports, command) seconds (None if it died)."""
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, "-c", TIMED, *args], capture_output=True, text=True,
                               env=self.env, cwd=self.config.parent, timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return time.perf_counter() - t0, False, f"timed out after {COMMAND_TIMEOUT_S} s", None
        took = time.perf_counter() - t0
        marks = [line.split()[1:] for line in p.stderr.splitlines() if line.startswith("#timing ")]
        stderr = "\n".join(line for line in p.stderr.splitlines() if not line.startswith("#timing "))
        ok = p.returncode == 0 and "Traceback" not in stderr
        error = "" if ok else (stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return took, ok, error, (float(marks[-1][0]), float(marks[-1][1])) if marks else None


def stats(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, max(0, round(0.95 * len(ordered)) - 1))]
    return {"n": len(times), "median_s": round(statistics.median(ordered), 3), "p95_s": round(p95, 3),
            "max_s": round(ordered[-1], 3)}


def startup(setup: Setup, repeat: int) -> dict[str, list]:
    """The start-up runs on the (empty) database of `setup`: the baseline, `--help` and
    `status`, interleaved so the host's load falls on each alike. The database is created
    and migrated by a first `status` that is not counted."""
    _must(setup, "status")
    out: dict[str, list] = {"python -c pass (baseline)": [], "gpuflex --help": [], "status (empty database)": []}
    for _ in range(repeat):
        out["python -c pass (baseline)"].append(setup.baseline())
        out["gpuflex --help"].append(setup.timed("--help"))
        out["status (empty database)"].append(setup.timed("status"))
    return out


def bench_backend(name: str, url: str, root: Path, args: argparse.Namespace, code: str | None = None) -> dict:
    rng = random.Random(14)
    out: dict = {"backend": name, "jobs": args.jobs, "sequential": {}, "split": {}, "failures": {}}
    first = Setup(root, url, code)
    for label, runs in startup(first, args.repeat).items():
        record(out, label, runs)
    t0 = time.perf_counter()
    seed(url, 0, args.jobs - QUEUED - 1, rng)
    seeded_s = time.perf_counter() - t0
    setup = Setup(root, url, code)
    blocker = json.loads(_must(setup, "submit", "--json", "--name", "blocker", "--workers", "2", "--", "sleep", "3600"))
    seed(url, args.jobs, QUEUED, rng, queued=True)   # behind the blocker: they wait
    one = str(args.jobs // 2)
    commands = {
        "status (table)": ("status",),   # the jobs not ended and the 20 ended last
        "status ID": ("status", one),
        "status --user user3": ("status", "--user", "user3"),
        "status --all (a page)": ("status", "--all"),   # before issue 30: every job
        "status --json --limit 100": ("status", "--json", "--limit", "100"),
        "status --json (every job)": ("status", "--json"),   # since issue 30: streamed
        "acct (a page of 100)": ("acct",),
        "acct --user user3 --since 7d": ("acct", "--user", "user3", "--since", "7d"),
        "acct --totals (every job)": ("acct", "--totals"),
        "submit (queued)": ("submit", "--name", "bench", "--", "true"),
        "metrics": ("metrics",),
    }
    out["seed_s"] = round(seeded_s, 1)
    try:
        for label, argv in commands.items():
            # listing every job renders thousands of rows: fewer runs of those
            n = max(2, args.repeat // 3) if "(every job)" in label else args.repeat
            runs = [setup.timed(*argv)]
            while len(runs) < (2 if runs[0][0] > SLOW_S else n):
                runs.append(setup.timed(*argv))
            record(out, label, runs)
        out["web"] = bench_web(setup, one, args.repeat)
        mix = [("status", one)] * (args.concurrent // 2) + [("submit", "--name", "c", "--", "true")] * \
            (args.concurrent - args.concurrent // 2)
        with concurrent.futures.ThreadPoolExecutor(len(mix)) as pool:
            t1 = time.perf_counter()
            results = list(pool.map(lambda a: (a[0], *setup.run(*a)), mix))
            wall = time.perf_counter() - t1
        failed = [(cmd, e) for cmd, _, ok, e in results if not ok]
        out["concurrent"] = {
            "clis": len(mix), "wall_s": round(wall, 2), "failed": len(failed),
            "first_failure": failed[0] if failed else None,
            **{cmd: stats([t for c, t, _, _ in results if c == cmd]) for cmd in ("status", "submit")}}
    finally:
        unqueue(url)   # else the blocker's end would start them
        setup.run("cancel", str(blocker["id"]))
    return out


def bench_web(setup: Setup, one: str, repeat: int) -> dict:
    """Each page of `gpuflex web` (one server process, on this database), fetched `repeat`
    times: {page: stats}, and the first failure of each page that failed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([GPUFLEX, "web", "--bind", f"127.0.0.1:{port}"], env=setup.env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    pages = {"web: pool (1d)": "/?range=1d", "web: pool (7d)": "/?range=7d", "web: queue": "/queue",
             f"web: job {one}": f"/jobs/{one}", "web: accounting (7d)": "/acct?range=7d",
             "web: accounting (30d)": "/acct?range=30d"}
    out: dict = {}
    try:
        for _ in range(300):   # the server's start (imports, database): not timed
            try:
                urllib.request.urlopen(base + "/queue", timeout=COMMAND_TIMEOUT_S).read()
                break
            except OSError:
                if proc.poll() is not None:
                    return {"failed": (proc.stderr.read() if proc.stderr else "").strip()[-500:]}
                time.sleep(0.2)
        for label, path in pages.items():
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                urllib.request.urlopen(base + path, timeout=COMMAND_TIMEOUT_S).read()
                times.append(time.perf_counter() - t0)
            out[label] = stats(times)
    except OSError as e:
        out["failed"] = str(e)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return out


def record(out: dict, label: str, runs: list) -> None:
    """The figures of one command's `runs` (`Setup.timed` answers) into `out`; a command
    that failed every run (an option older code lacks) has none."""
    good = [r for r in runs if r[1]]
    bad = [e for _, ok, e, _ in runs if not ok]
    if bad:
        out["failures"][label] = {"count": len(bad), "first": bad[0]}
    out["sequential"][label] = stats([t for t, *_ in good]) if good else None
    marks = [m for *_, m in good if m]
    out["split"][label] = {"imports_s": round(statistics.median(m[0] for m in marks), 3),
                           "command_s": round(statistics.median(m[1] for m in marks), 3)} if marks else None


def unqueue(url: str) -> None:
    """Mark every queued job cancelled, straight in the database."""
    sessions = open_database(url)
    with sessions.begin() as s:
        s.execute(update(Job).where(Job.state == JobState.QUEUED).values(state=JobState.CANCELLED))
    sessions.kw["bind"].dispose()


def _must(setup: Setup, *args: str) -> str:
    p = subprocess.run([GPUFLEX, *args], capture_output=True, text=True, env=setup.env, cwd=setup.config.parent,
                       timeout=COMMAND_TIMEOUT_S)
    if p.returncode != 0:
        raise SystemExit(f"gpuflex {' '.join(args)} -> {p.returncode}: {p.stderr.strip()}")
    return p.stdout


def print_table(results: list[dict]) -> None:
    labels = list(results[0]["sequential"])
    names = [r["backend"] for r in results]
    print(f"\n{results[0]['jobs']} jobs in the database; whole CLI processes; seconds (median / p95)")
    print(f"{'command':32}" + "".join(f"{n:>22}" for n in names))
    for label in labels:
        cells = [f"{r['sequential'][label]['median_s']:.3f} / {r['sequential'][label]['p95_s']:.3f}"
                 if r["sequential"].get(label) else "-" for r in results]
        print(f"{label:32}" + "".join(f"{c:>22}" for c in cells))
    print("\nthe same runs inside each process: imports / the command itself (median seconds)")
    for label in labels:
        cells = [f"{r['split'][label]['imports_s']:.3f} / {r['split'][label]['command_s']:.3f}"
                 if r["split"].get(label) else "-" for r in results]
        print(f"{label:32}" + "".join(f"{c:>22}" for c in cells))
    web = [label for label in results[0].get("web", {}) if label != "failed"]
    if web:
        print("\ngpuflex web, one server process: each page's answer over HTTP (median / p95 seconds)")
    for label in web:
        cells = [f"{r['web'][label]['median_s']:.3f} / {r['web'][label]['p95_s']:.3f}" if label in r.get("web", {})
                 else "-" for r in results]
        print(f"{label:32}" + "".join(f"{c:>22}" for c in cells))
    for r in results:
        if "failed" in r.get("web", {}):
            print(f"{r['backend']}: web: {r['web']['failed']}")
    print()
    for cmd in ("status", "submit"):
        cells = [f"{r['concurrent'][cmd]['median_s']:.2f} / {r['concurrent'][cmd]['p95_s']:.2f}" for r in results]
        print(f"{str(results[0]['concurrent']['clis']) + ' at once: ' + cmd:32}" + "".join(f"{c:>22}" for c in cells))
    print(f"{str(results[0]['concurrent']['clis']) + ' at once: wall, failed':32}"
          + "".join(f"{str(r['concurrent']['wall_s']) + ' s, ' + str(r['concurrent']['failed']):>22}"
                    for r in results))
    for r in results:
        for label, f in r["failures"].items():
            print(f"{r['backend']}: {label}: {f['count']} failed, e.g. {f['first']}")
        if r["concurrent"]["first_failure"]:
            print(f"{r['backend']}: concurrent: first failure {r['concurrent']['first_failure']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=10, help="runs of each command, one at a time")
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--pg-url", default=None, help="an empty PostgreSQL database to use instead of a "
                    "throw-away cluster")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("--before", default=None, help="a directory holding an earlier gpuflex package (an export "
                    "of an earlier commit): SQLite's commands run with it too, in a column beside")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="gpuflex-cp-") as tmp:
        for backend in args.backends.split(","):
            root = Path(tmp) / backend
            if backend == "sqlite":
                if args.before:
                    before = Path(tmp) / "sqlite-before"
                    results.append(bench_backend("sqlite before", f"sqlite:///{before}/g.db", before, args,
                                                 code=args.before))
                    print(json.dumps(results[-1]), flush=True)
                results.append(bench_backend("sqlite", f"sqlite:///{root}/g.db", root, args))
            elif args.pg_url:
                results.append(bench_backend("postgresql", args.pg_url, root, args))
            else:
                from tests import pgbed

                why = pgbed.missing_reason()
                if why:
                    print(f"postgresql skipped: {why}; or give --pg-url")
                    continue
                cluster = pgbed.start_cluster()
                try:
                    results.append(bench_backend("postgresql", cluster.database("bench"), root, args))
                finally:
                    cluster.stop()
            print(json.dumps(results[-1]), flush=True)
    if results:
        print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
