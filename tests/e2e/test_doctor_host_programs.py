"""`gpuflex doctor`'s host-side programs, run here: what gpuflex.hosts.hostfacts tells of a
host's workdir (tried as a job's launch uses it, and left as it was) and python, and how
gpuflex.hosts.pgcheck's rank 0 says its port is taken (the whole pair check runs over the
sshd bed in tests/e2e/ssh/test_doctor.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpuflex.hosts import hostfacts

pytestmark = pytest.mark.e2e   # runs the doctor's probes and pgcheck as processes


def test_a_workdir_under_a_regular_file_fails_even_for_root(tmp_path):
    (tmp_path / "afile").write_text("x")
    facts = hostfacts.workdir_facts(str(tmp_path / "afile" / "work"))
    assert facts["error"] == f"Not a directory: {tmp_path / 'afile' / 'work'}"
    assert not facts["modes_kept"]


def test_a_workdir_in_proc_fails_even_for_root():
    facts = hostfacts.workdir_facts("/proc/gpuflex-doctor-nope/work")
    assert facts["error"] is not None and not facts["existed"]


def test_a_missing_workdir_is_tried_and_removed_again(tmp_path):
    path = tmp_path / "a" / "b" / "work"
    facts = hostfacts.workdir_facts(str(path))
    assert (facts["existed"], facts["is_dir"], facts["modes_kept"], facts["error"]) == (False, True, True, None)
    assert facts["free_bytes"] > 0
    assert list(tmp_path.iterdir()) == []   # nothing of it left behind


def test_an_existing_workdir_is_described_and_left_as_it_was(tmp_path):
    work = tmp_path / "work"
    work.mkdir(mode=0o755)
    os.chmod(work, 0o755)
    (work / "jobs").mkdir()
    facts = hostfacts.workdir_facts(str(work))
    assert (facts["existed"], facts["owned"], facts["mode"], facts["modes_kept"]) == (True, True, 0o755, True)
    assert sorted(p.name for p in work.iterdir()) == ["jobs"]
    assert oct(work.stat().st_mode & 0o777) == oct(0o755)


def test_the_probe_runs_where_gpuflex_is_missing_and_says_so(tmp_path):
    """Sent as source on stdin, as the doctor sends it; `-S` leaves out site-packages (no
    gpuflex, no torch there), as a python without them would."""
    source = Path(hostfacts.__file__).read_text()
    p = subprocess.run([sys.executable, "-S", "-", str(tmp_path / "work")], input=source, capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout.strip().splitlines()[-1])
    assert data["gpuflex"]["error"].startswith("ModuleNotFoundError")
    assert data["torch"]["error"].startswith("ModuleNotFoundError")
    assert data["python"]["version"] == sys.version.split()[0]
    assert data["workdir"]["modes_kept"] is True


def test_pgcheck_rank_0_on_a_taken_port_says_so_before_importing_torch():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        p = subprocess.run([sys.executable, "-X", "importtime", "-m", "gpuflex.hosts.pgcheck", "--rank", "0",
                            "--addr", "127.0.0.1", "--port", str(port), "--timeout", "5"],
                           capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert json.loads(p.stdout) == {"rank": 0, "stage": "listen", "backend": None,
                                    "error": "Address already in use", "results": {}}
    assert "| torch" not in p.stderr   # -X importtime lists every module imported


SLOW_TORCH = '''
import importlib.abc, sys, time


class SlowTorch(importlib.abc.MetaPathFinder):
    """`import torch` takes DELAY s longer, as on a host whose torch sits on a slow NFS."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            time.sleep(DELAY)
        return None


sys.meta_path.insert(0, SlowTorch())
'''


def test_pgcheck_sides_meet_when_one_imports_torch_much_later(tmp_path):
    """Rank 0's torch takes 3x --timeout longer to import than rank 1's: rank 1 reaches
    the port at once (bound before the import) and waits for the store within --start."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_TORCH.replace("DELAY", "6"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "gpuflex.hosts.pgcheck", "--addr", "127.0.0.1", "--port", str(port),
            "--timeout", "2", "--start", "60"]
    env0 = {**os.environ, "PYTHONPATH": os.pathsep.join([str(slow), os.environ.get("PYTHONPATH", "")])}
    r0 = subprocess.Popen(argv + ["--rank", "0"], stdout=subprocess.PIPE, text=True, env=env0)
    r1 = subprocess.Popen(argv + ["--rank", "1"], stdout=subprocess.PIPE, text=True)
    out0, _ = r0.communicate(timeout=120)
    out1, _ = r1.communicate(timeout=120)
    assert json.loads(out0)["stage"] == "done", out0
    assert json.loads(out1)["stage"] == "done", out1
    assert set(json.loads(out1)["results"]) == {"gloo"}


def test_pgcheck_rank_1_at_a_port_where_no_store_speaks_gives_up_at_its_bound():
    """Something listens there and never answers (torch's own client would wait on it for
    ever): rank 1 says so once --timeout + --start have passed, before its watchdog."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "gpuflex.hosts.pgcheck", "--rank", "1", "--addr", "127.0.0.1",
                            "--port", str(port), "--timeout", "2", "--start", "3", "--budget", "600"],
                           capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    assert json.loads(p.stdout) == {"rank": 1, "stage": "store", "backend": None,
                                    "error": "no store answered within 5 s", "results": {}}
