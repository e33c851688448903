"""How long probing the pool takes over 1, 4 and 16 loopback sshd hosts.

Starts 16 real OpenSSH servers on 127.0.0.2..17 with the test bed's helpers
(tests/sshbed.py), each with the fake nvidia-smi (2 GPUs; every other host has a foreign
process, so the `ps` step runs too), then times what `gpuflex hosts --json` does before
rendering: open connections, run the probe on every host in parallel, record into SQLite.

- cold: a fresh Pool (new SSH connections: TCP + key exchange + public-key auth) per run
- warm: the same Pool again (pooled connections: only the commands)
- cli: the whole `gpuflex hosts --json` process (interpreter, imports, DB, render)

Target: 16 hosts probed (cold) in at most 2 s. Figures only, no assertion.
Run: .venv/bin/python benchmarks/probe_hosts.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuflex.config import load_config  # noqa: E402
from gpuflex.control.pool import Pool  # noqa: E402
from gpuflex.db.engine import open_database  # noqa: E402
from gpuflex.control.probes import record_probes  # noqa: E402
from gpuflex.hosts.probe import collect_probes  # noqa: E402
from tests.sshbed import find_sshd, start_bed, write_config  # noqa: E402

SIZES = (1, 4, 16)


def timed_probe(pool: Pool, sessions) -> tuple[float, int]:
    t0 = time.perf_counter()
    results = collect_probes(pool)
    with sessions.begin() as s:
        record_probes(pool, s, results)
    dt = time.perf_counter() - t0
    return dt, sum(r.ok for r in results.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure (the median is printed)")
    args = ap.parse_args()
    if find_sshd() is None:
        print("sshd not found: install openssh-server to run this benchmark")
        return 0
    root = Path(tempfile.mkdtemp(prefix="gpuflex-bench-"))
    t0 = time.perf_counter()
    bed = start_bed(root, n=max(SIZES), gpus_per_host=2)
    print(f"started {len(bed.hosts)} sshd on 127.0.0.2..{1 + len(bed.hosts)} in {time.perf_counter() - t0:.2f} s"
          f" ({os.cpu_count()} CPUs)")
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        for i, h in enumerate(bed.hosts):
            if i % 2:
                h.set_smi(processes=[{"gpu_uuid": f"GPU-{h.name}-0000-fake", "pid": sleeper.pid,
                                      "used_memory": 1000}])
        print(f"{'hosts':>5} {'cold s':>8} {'per host':>9} {'warm s':>8} {'per host':>9} {'cli s':>7}  ok")
        for n in SIZES:
            cfg_path = write_config(bed, root / f"gpuflex-{n}.toml", hosts=bed.hosts[:n])
            cfg = load_config(str(cfg_path))
            sessions = open_database(cfg.database_url)
            cold, warm, cli, ok = [], [], [], 0
            for _ in range(args.repeat):
                pool = Pool(cfg)
                dt, ok = timed_probe(pool, sessions)
                cold.append(dt)
                warm.append(timed_probe(pool, sessions)[0])
                pool.close()
                t1 = time.perf_counter()
                p = subprocess.run([sys.executable, "-m", "gpuflex", "--config", str(cfg_path), "hosts", "--json"],
                                   capture_output=True, text=True)
                cli.append(time.perf_counter() - t1)
                if p.returncode != 0:
                    print(p.stderr)
            c, w, k = statistics.median(cold), statistics.median(warm), statistics.median(cli)
            print(f"{n:>5} {c:>8.3f} {c / n * 1000:>7.1f}ms {w:>8.3f} {w / n * 1000:>7.1f}ms {k:>7.2f}  {ok}/{n}")
        print("target: 16 hosts cold in <= 2 s")
    finally:
        sleeper.kill()
        bed.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
