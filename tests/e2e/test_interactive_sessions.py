"""`gpuflex run` for real (marked e2e by its `gf` fixture): an interactive bash on a PTY
driven as a user would (a line typed, its output read back), seen by `status` while it
runs, the devices free once it exits; a full pool refused; a time limit and a cancel
ending a session. Without processes: tests/control/test_interactive.py."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import time

import pytest

from tests.conftest import db_rows

READ_LIMIT_S = 60   # a hang guard, not a timing: a PTY that never says it fails the test


def read_until(fd: int, wanted: bytes) -> bytes:
    seen = b""
    end = time.monotonic() + READ_LIMIT_S
    while wanted not in seen:
        assert time.monotonic() < end, f"never saw {wanted!r} in {seen!r}"
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:   # EIO: the PTY closed
                chunk = b""
            assert chunk, f"the PTY closed before {wanted!r}: {seen!r}"
            seen += chunk
    return seen


def wait_exit(pid: int) -> int:
    end = time.monotonic() + READ_LIMIT_S
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("gpuflex run did not exit")


def test_a_shell_on_a_pty_gets_its_slots_shows_in_status_and_frees_them_at_exit(gf, db_path):
    env = gf.env(PS1="ready> ", SHELL="/bin/bash")
    pid, fd = pty.fork()
    if pid == 0:   # the user's terminal: gpuflex run is its foreground program
        os.chdir(gf.home)
        os.execve(gf.script, [gf.script, "run", "--gpus", "2", "--", "bash", "--norc", "--noprofile", "-i"], env)
    try:
        read_until(fd, b"ready> ")
        os.write(fd, b'echo "SL""OTS=[$GPUFLEX_SLOTS] JOB=[$GPUFLEX_JOB_ID] TTY=[$(tty)]"\n')
        out = read_until(fd, b"ready> ").decode()
        assert "SLOTS=[0,1] JOB=[1]" in out and "TTY=[/dev/pts/" in out, out
        (job,) = gf.json("status")
        assert (job["id"], job["kind"], job["state"], job["workers"][0]["gpus"]) == \
            (1, "interactive", "running", [0, 1])
        # the pool (4 slots) cannot hold 3 more now: refused, with nothing recorded
        full = gf("run", "--gpus", "3", "--", "true")
        assert full.returncode == 2 and full.stderr.count("\n") == 1 and "not started" in full.stderr
        assert db_rows(db_path, "SELECT count(*) FROM jobs") == [(1,)]
        os.write(fd, b"exit 5\n")
        assert wait_exit(pid) == 5
    finally:
        os.close(fd)
    job = gf.json("status", "1")
    assert (job["state"], job["exit_code"]) == ("failed", 5)
    # every slot is free again: a session of all 4 runs (without a terminal: inherited stdio)
    p = gf("run", "--gpus", "4", "--", "sh", "-c", 'echo "got $GPUFLEX_SLOTS"')
    assert (p.returncode, p.stdout) == (0, "got 0,1,2,3\n"), p.stderr
    assert gf.json("status", "2")["state"] == "succeeded"


def test_a_session_ends_at_its_time_limit_and_at_a_cancel(gf):
    p = gf("run", "--time", "1s", "--", "sleep", "600")
    assert p.returncode == 128 + signal.SIGTERM, p.stderr
    job = gf.json("status", "1")
    assert (job["state"], job["kind"]) == ("timeout", "interactive")
    run = subprocess.Popen([gf.script, "run", "--", "sleep", "600"], env=gf.env(), cwd=gf.home,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + READ_LIMIT_S
        while not [j for j in gf.json("status") if j["id"] == 2 and j["state"] == "running"]:
            assert time.monotonic() < end and run.poll() is None, run.stderr
            time.sleep(0.2)
        gf.ok("cancel", "2")
        assert run.wait(timeout=READ_LIMIT_S) == 128 + signal.SIGTERM
    finally:
        if run.poll() is None:
            run.kill()
    assert gf.json("status", "2")["state"] == "cancelled"


def test_alloc_holds_slots_for_the_printed_environment_until_a_cancel(gf, db_path):
    p = gf.ok("alloc", "--gpus", "3", "--time", "1h")
    first, export = p.stdout.strip().splitlines()
    assert first.startswith("job 1 holds slot(s) 0,1,2 on local until ") and "'gpuflex cancel 1'" in first
    assert export == "export GPUFLEX_JOB_ID=1 GPUFLEX_SLOTS=0,1,2 CUDA_VISIBLE_DEVICES=''"
    (job,) = gf.json("status")
    assert (job["kind"], job["state"], job["name"]) == ("alloc", "running", "alloc")
    full = gf("alloc", "--gpus", "2")
    assert full.returncode == 2 and "gpuflex alloc: not started" in full.stderr
    assert db_rows(db_path, "SELECT count(*) FROM jobs") == [(1,)]
    gf.ok("cancel", "1")
    assert gf.json("status", "1")["state"] == "cancelled"
    assert gf.ok("run", "--gpus", "4", "--", "true").returncode == 0   # every slot free again
