"""`gpuflex run` and `gpuflex alloc` on an SSH host (issue 33), on the sshd bed's gpu01
(two fake GPUs) alone: an interactive bash on a real PTY runs there (sshd's own
SSH_CONNECTION says so), in the caller's directory, with its GPUs and job id, and its
exit code is run's; a session ended by its time limit, by a cancel from another
command, and by its `gpuflex run` killed outright, each leaving no process and the
GPUs free; an allocation listed in status with the ssh command that reaches it. The
local sessions: tests/e2e/test_interactive_sessions.py."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import time

import pytest

from gpuflex.hosts.hostops import group_alive
from tests.conftest import GpuflexCLI, db_rows
from tests.e2e.test_interactive_sessions import READ_LIMIT_S, read_until, wait_exit
from tests.sshbed import one_host_cli, ssh_hosts  # noqa: F401


@pytest.fixture
def one_host(ssh_hosts, home):
    yield from one_host_cli(ssh_hosts, home)


def wait_running(cli: GpuflexCLI, job_id: int, run: subprocess.Popen) -> dict:
    end = time.monotonic() + READ_LIMIT_S
    while True:
        found = [j for j in cli.json("status") if j["id"] == job_id and j["state"] == "running"]
        if found:
            return found[0]
        assert time.monotonic() < end and run.poll() is None, run.communicate()
        time.sleep(0.2)


def background_run(cli: GpuflexCLI, *args: str) -> subprocess.Popen:
    return subprocess.Popen([cli.script, "run", *args], env=cli.env(), cwd=cli.home, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_shell_on_a_pty_runs_on_the_ssh_host_with_its_gpus_and_returns_its_exit_code(one_host, home):
    cli, h = one_host
    pid, fd = pty.fork()
    if pid == 0:   # the user's terminal: gpuflex run is its foreground program
        os.chdir(home)
        os.execve(cli.script, [cli.script, "run", "--gpus", "2", "--", "bash", "--norc", "--noprofile", "-i"],
                  cli.env())
    try:   # the host's environment is sshd's, not this one (as ssh's): the prompt is set there
        os.write(fd, b"PS1='rea''dy> '\n")
        read_until(fd, b"ready> ")
        os.write(fd, b'echo "GP""US=[$CUDA_VISIBLE_DEVICES] JOB=[$GPUFLEX_JOB_ID] TTY=[$(tty)] '
                     b'AT=[${SSH_CONNECTION##* }] DIR=[$(pwd)]"\n')
        out = read_until(fd, b"ready> ").decode()
        assert "GPUS=[0,1] JOB=[1] TTY=[/dev/pts/" in out and f"AT=[{h.port}] DIR=[{home}]" in out, out
        (job,) = cli.json("status")
        assert (job["kind"], job["state"], job["workers"][0]["host"], job["workers"][0]["gpus"]) == \
            ("interactive", "running", "gpu01", [0, 1])
        full = cli("run", "--", "true")   # no GPU left: one line, exit 2, nothing recorded
        assert full.returncode == 2 and full.stderr.count("\n") == 1 and "not started" in full.stderr
        assert db_rows(home / "g.db", "SELECT count(*) FROM jobs") == [(1,)]
        os.write(fd, b"exit 7\n")
        assert wait_exit(pid) == 7
    finally:
        os.close(fd)
    job = cli.json("status", "1")
    assert (job["state"], job["exit_code"]) == ("failed", 7)
    # without a terminal: stdin, stdout and stderr relayed as they are
    p = subprocess.run([cli.script, "run", "--gpus", "2", "--", "sh", "-c", 'cat; echo "got $CUDA_VISIBLE_DEVICES"'],
                       input="piped\n", env=cli.env(), cwd=home, capture_output=True, text=True,
                       timeout=READ_LIMIT_S)
    assert (p.returncode, p.stdout) == (0, "piped\ngot 0,1\n"), p.stderr


def test_a_session_on_an_ssh_host_ends_at_its_time_limit_at_a_cancel_and_with_its_caller(one_host, home):
    cli, _ = one_host
    p = cli("run", "--time", "1s", "--", "sleep", "600")
    assert p.returncode == 128 + signal.SIGTERM, p.stderr
    assert cli.json("status", "1")["state"] == "timeout"
    run = background_run(cli, "--", "sleep", "600")
    try:
        pgid = wait_running(cli, 2, run)["workers"][0]["pid"]
        assert group_alive(pgid)   # the bed's host is this machine: its groups are ours to see
        cli.ok("cancel", "2")
        assert run.wait(timeout=READ_LIMIT_S) == 128 + signal.SIGTERM
    finally:
        if run.poll() is None:
            run.kill()
    assert cli.json("status", "2")["state"] == "cancelled" and not group_alive(pgid)
    # gpuflex run killed outright: its command on the host is hung up, and the session ends
    run = background_run(cli, "--gpus", "2", "--", "sleep", "600")
    pgid = wait_running(cli, 3, run)["workers"][0]["pid"]
    run.kill()
    run.wait()
    end = time.monotonic() + READ_LIMIT_S
    while group_alive(pgid):
        assert time.monotonic() < end, "the command outlived its gpuflex run"
        time.sleep(0.2)
    assert cli.json("status", "3")["state"] == "failed"
    assert cli.ok("run", "--gpus", "2", "--", "true").returncode == 0   # both GPUs free again


def test_alloc_on_an_ssh_host_prints_how_to_reach_it_and_shows_in_status(one_host, home):
    cli, h = one_host
    p = cli.ok("alloc", "--gpus", "1", "--time", "1h")
    first, login, export = p.stdout.strip().splitlines()
    assert first.startswith("job 1 holds GPU(s) 0 on gpu01 until ") and "'gpuflex cancel 1'" in first
    assert login.startswith("on gpu01: ssh -p ") and login.endswith(f"@{h.address}") and str(h.port) in login
    assert export == "export GPUFLEX_JOB_ID=1 CUDA_VISIBLE_DEVICES=0 GPUFLEX_GPUS=0"
    (job,) = cli.json("status")
    assert (job["kind"], job["state"], job["workers"][0]["host"]) == ("alloc", "running", "gpu01")
    ((pgid,),) = db_rows(home / "g.db", "SELECT pgid FROM workers WHERE job_id = 1")   # its supervisor's
    assert group_alive(pgid)
    cli.ok("cancel", "1")
    assert cli.json("status", "1")["state"] == "cancelled" and not group_alive(pgid)
