"""gpuflex.hosts.zygote: a run's Python workers forked from one warm interpreter, through the
real `hostops spawn` (a process of its own, as every transport runs it), each behaving as
`python SCRIPT` or `python -m MODULE` would: argv, sys.path[0], directory, environment,
torch's threads, exit codes, tracebacks, signals; the exit record its supervisor writes;
and what starts cold instead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuflex.hosts import zygote
from gpuflex.hosts.transport import SpawnSpec, spawn_request

pytestmark = pytest.mark.e2e   # hostops spawn, the zygote and its workers are processes

SCRIPT = """\
import json, os, sys
import torch
out = {"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "mine": os.environ.get("GPUFLEX_WORKER_ID"), "job": os.environ.get("MINE"),
       "threads": torch.get_num_threads(), "name": __name__, "file": os.path.basename(__file__),
       "stdin": sys.stdin.read(), "warm": "torch._dynamo" in sys.modules}
print(json.dumps(out), flush=True)
if len(sys.argv) > 1 and sys.argv[1] == "boom":
    def inner():
        raise RuntimeError("boom at step 3")
    inner()
if len(sys.argv) > 1 and sys.argv[1] == "sleep":
    import time
    time.sleep(60)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 0)
"""


@pytest.fixture
def run(tmp_path):
    """A run's directories and a spawner; every process it started is ended afterwards."""
    sock = tmp_path / "sock"
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(SCRIPT)
    (code / "pkgmod.py").write_text(SCRIPT)
    groups: list[int] = []

    def spawn(name: str, argv: list[str], *, env: dict | None = None, fork_start: bool = True) -> dict:
        spec = SpawnSpec(argv=argv, cwd=str(code), env={"MINE": "job", "GPUFLEX_WORKER_ID": name, "OMP_NUM_THREADS": "1", **(env or {})},
                         log=str(tmp_path / "logs" / f"{name}.log"), exit_path=str(tmp_path / "logs" / f"{name}.exit"),
                         private_dirs=[str(tmp_path / "logs")], socket_dir=str(sock), fork_start=fork_start,
                         fork_ready_s=60.0)
        p = subprocess.run([sys.executable, "-m", "gpuflex.hosts.hostops", "spawn"], text=True,
                           input=json.dumps(spawn_request(spec, time.time())), capture_output=True, timeout=120)
        reply = json.loads(p.stdout.strip().splitlines()[-1])
        if "ok" in reply:
            groups.append(reply["ok"]["pgid"])
        return reply

    yield spawn, tmp_path
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    for pid_file in sock.glob("zygote-*.pid") if sock.exists() else ():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def exit_record(tmp_path: Path, name: str, timeout_s: float = 60.0) -> dict:
    path = tmp_path / "logs" / f"{name}.exit"
    end = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < end, f"no exit record for {name}"
        time.sleep(0.05)
    return json.loads(path.read_text())


def output(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / "logs" / f"{name}.log").read_text().splitlines()[0])


def test_workers_fork_from_one_warm_interpreter_and_run_as_python_would(run):
    spawn, tmp = run
    a = spawn("a", [sys.executable, "train.py", "3"], env={"OMP_NUM_THREADS": "1"})["ok"]
    b = spawn("b", [sys.executable, "-u", "train.py"], env={"OMP_NUM_THREADS": "2"})["ok"]
    assert exit_record(tmp, "a")["returncode"] == 3 and exit_record(tmp, "b")["returncode"] == 0
    out_a, out_b = output(tmp, "a"), output(tmp, "b")
    code = str(tmp / "code")
    assert out_a == {"argv": ["train.py", "3"], "path0": code, "cwd": code, "mine": "a", "job": "job", "threads": 1,
                     "name": "__main__", "file": "train.py", "stdin": "", "warm": True}
    assert out_b["argv"] == ["train.py"] and out_b["mine"] == "b" and out_b["threads"] == 2
    # each its own group, led by its supervisor; one zygote for both (what differs between
    # them is a worker's own: GPUFLEX_*, OMP_NUM_THREADS), in a group of its own
    assert a["pgid"] != b["pgid"] and a["pid"] != a["pgid"]
    (pid_file,) = (tmp / "sock").glob("zygote-*.pid")
    zygote_pid = int(pid_file.read_text())
    assert os.getpgid(zygote_pid) not in (a["pgid"], b["pgid"])
    assert (tmp / "logs" / "zygote.log").read_text().count("serving") == 1
    # another environment (what a worker's imports may have read): another zygote
    spawn("c", [sys.executable, "train.py"], env={"MINE": "other"})
    assert exit_record(tmp, "c")["returncode"] == 0 and output(tmp, "c")["job"] == "other"
    assert output(tmp, "c")["warm"] is True and len(list((tmp / "sock").glob("zygote-*.pid"))) == 2
    # the run's socket directory gone: the zygote ends by itself
    for f in (tmp / "sock").iterdir():
        f.unlink()
    (tmp / "sock").rmdir()
    end = time.monotonic() + 30
    while zygote._alive(zygote_pid):
        assert time.monotonic() < end, "the zygote outlived its run's directory"
        time.sleep(0.1)


def test_a_module_a_traceback_and_a_signal_end_as_they_would_in_a_fresh_interpreter(run):
    spawn, tmp = run
    spawn("m", [sys.executable, "-m", "pkgmod", "5"])
    spawn("boom", [sys.executable, "train.py", "boom"])
    sleeper = spawn("sleep", [sys.executable, "train.py", "sleep"])["ok"]
    assert exit_record(tmp, "m")["returncode"] == 5
    out_m = output(tmp, "m")
    assert out_m["name"] == "__main__" and out_m["argv"][1:] == ["5"] and out_m["argv"][0].endswith("pkgmod.py")
    assert exit_record(tmp, "boom")["returncode"] == 1
    log = (tmp / "logs" / "boom.log").read_text()
    assert log.splitlines()[-1] == "RuntimeError: boom at step 3"
    assert "Traceback (most recent call last):" in log and "runpy" not in log and "forkrun.py" not in log and "zygote.py" not in log
    assert 'train.py", line' in log and "in inner" in log
    end = time.monotonic() + 60
    while not (tmp / "logs" / "sleep.log").read_text():
        assert time.monotonic() < end
        time.sleep(0.05)
    # what /proc shows of the forked worker (ps, a lab's accounting): its own command line
    # and environment, not the zygote's
    cmdline = Path(f"/proc/{sleeper['pid']}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    assert cmdline == [sys.executable.encode(), b"train.py", b"sleep"]
    environ = dict(v.split(b"=", 1) for v in Path(f"/proc/{sleeper['pid']}/environ").read_bytes().split(b"\0")
                   if b"=" in v)
    assert environ[b"GPUFLEX_WORKER_ID"] == b"sleep" and b"GPUFLEX_ZYGOTE_ROOM" not in environ
    os.killpg(sleeper["pgid"], signal.SIGTERM)   # the supervisor ignores it; the worker dies of it
    assert exit_record(tmp, "sleep")["returncode"] == -signal.SIGTERM


def test_what_a_fork_cannot_run_the_same_way_starts_cold(run):
    spawn, tmp = run
    for name, argv, fork_start in (("shell", ["sh", "-c", "echo cold; exit 4"], True),
                                   ("flag", [sys.executable, "-X", "dev", "train.py", "4"], True),
                                   ("off", [sys.executable, "train.py", "4"], False)):
        assert "ok" in spawn(name, argv, fork_start=fork_start)
        assert exit_record(tmp, name)["returncode"] == 4
    assert not list((tmp / "sock").glob("zygote-*.pid"))
    assert output(tmp, "flag")["warm"] is False


def test_a_worker_that_cannot_start_is_a_spawn_error_and_a_failed_zygote_leaves_spawns_cold(run, tmp_path):
    spawn, tmp = run
    reply = spawn("gone", [sys.executable, "missing.py"])
    assert "ok" in reply and exit_record(tmp, "gone")["returncode"] == 2   # as python: "can't open file"
    assert "missing.py" in (tmp / "logs" / "gone.log").read_text()
    # an interpreter that cannot run the zygote (here: no gpuflex on its path) marks it failed
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nif [ \"$1\" = -m ]; then exit 1; fi\nexec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    assert "ok" in spawn("cold", [str(fake), "train.py", "6"])
    assert exit_record(tmp, "cold")["returncode"] == 6 and output(tmp, "cold")["warm"] is False
    assert len(list((tmp / "sock").glob("zygote-*.failed"))) == 1
