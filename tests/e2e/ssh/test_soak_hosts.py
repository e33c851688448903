"""The multi-host chaos soak's short form (issue 28 item 6): `benchmarks/soak.py --hosts` for
5 minutes with a fixed seed (three sshd hosts and the local pool, PostgreSQL, three unix
users, every fault kind), which must exit 0 (its end checks all held) and print its figures.
The soak builds its own beds (benchmarks/soak_lab.py); skipped where it cannot (not root); as root a
missing sshd, PostgreSQL, iptables or C compiler is a failure, as for the other beds: `make test`
installs them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]   # its own sshd bed, PostgreSQL, users and jobs

sys.path.insert(0, str(REPO / "benchmarks"))
import soak_lab  # noqa: E402

MINUTES, SEED = 5, 20261127
FIGURES = ("jobs: ", "by user: ", "faults injected: partition ", "in-place jobs succeeded: ",
           "time not training ", "recoveries (", "left: ", "PostgreSQL: amcheck")


def counts(out: str, prefix: str) -> dict[str, int]:
    """The "kind N, kind N" line that starts with `prefix`, as a dict."""
    line = out.split(prefix)[1].splitlines()[0].split(", clock_skew")[0]
    return {k: int(n) for k, n in (x.rsplit(" ", 1) for x in line.split(", "))}


def test_the_five_minute_multi_host_soak_ends_with_every_check_held():
    why = soak_lab.missing()
    if why:
        if os.geteuid() == 0:    # as pg_cluster: root's `make test` installs every tool the soak needs
            pytest.fail(f"{why}: run make test")
        pytest.skip(why)
    began = time.monotonic()
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "soak.py"), "--hosts", "--minutes", str(MINUTES),
                        "--seed", str(SEED), "--drain-s", "240", "--hang-s", "150"],
                       capture_output=True, text=True, timeout=MINUTES * 60 + 900, cwd=REPO)
    print(p.stdout[-6000:], p.stderr[-3000:])
    print(f"the soak took {time.monotonic() - began:.0f} s ({MINUTES} min of schedule, then the drain "
          f"and the checks)")
    for figure in FIGURES:
        assert figure in p.stdout, figure
    injected = counts(p.stdout, "faults injected: ")
    skipped = counts(p.stdout, "planned but nothing there to hit (no victim, no process on the host): ")
    kinds = {"partition", "reboot", "pg_restart", "disk_full", "kill_worker", "kill_newcomer", "kill_coordinator"}
    assert set(injected) == set(skipped) == kinds, (injected, skipped)
    assert all(injected[k] + skipped[k] >= 1 for k in kinds), (injected, skipped)   # every kind planned
    # the database faults always hit (a command runs); the others hit when a victim is there
    assert injected["pg_restart"] >= 1 and injected["disk_full"] >= 1, injected
    assert "Traceback" not in p.stdout.split("==== multi-host soak summary")[1], p.stdout[-4000:]
    assert p.returncode == 0 and f"seed {SEED}: OK" in p.stdout, p.stdout[-4000:] + p.stderr[-2000:]
