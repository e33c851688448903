"""`submit --sync` over SSH (issue 33): the workers run in the copy sent to the host, never
in the submit directory, a second job of the same tree sends nothing, and `gpuflex fetch`
brings a file and a directory back by SFTP.

The bed's sshd logs in as the test's own user (root on the test machines), who reads
every directory, so "a submit directory the SSH user cannot read" is made the strongest
way available: the directory is removed after submit, before the job starts (it waits
`--after` a first job), so no path to it works on the host at all.
"""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import GpuflexCLI, cleanup_jobs
from tests.sshbed import host_toml, ssh_hosts  # noqa: F401

SCRIPT = ("#!/bin/sh\necho \"ran in $(pwd)\"\ncat data.txt\necho written >> result.txt\ncat result.txt\n"
          "mkdir -p out/sub && echo deep > out/sub/d.txt && ln -sf /etc/hostname out/leak\n")


@pytest.fixture
def one_host(ssh_hosts, home):
    bed = ssh_hosts
    bed.reset_smi()
    cfg = home / "g.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{home}/g.db"\n\n[jobs]\ncancel_grace_s = 3\n\n'
                   + host_toml(bed.hosts[0], bed))
    cli = GpuflexCLI(home, cfg)
    yield cli, bed.hosts[0]
    cleanup_jobs(cli, home / "g.db")


def make_tree(d):
    d.mkdir()
    (d / "mine.sh").write_text(SCRIPT)
    (d / "mine.sh").chmod(0o755)
    (d / "data.txt").write_text("the data\n")
    (d / ".gitignore").write_text("*.ckpt\n")
    (d / "old.ckpt").write_text("not sent\n")


def code_events(cli: GpuflexCLI, job_id: int) -> list[str]:
    return [e["message"] for e in cli.json("events", str(job_id)) if e["kind"] == "code"]


def test_sync_runs_the_sent_copy_and_a_second_job_sends_nothing(one_host, home):
    cli, host = one_host
    src = home / "src"
    make_tree(src)
    first = cli.submit(["sleep", "2"])
    job = cli.submit(["./mine.sh"], "--sync", "--after", str(first["id"]), "--workdir", str(src))
    sha = job["code_sha256"]
    assert job["state"] == "queued" and len(sha) == 64
    shutil.rmtree(src)     # gone before the job starts: only the sent copy can run
    done = cli.wait_final(job["id"])
    assert done["state"] == "succeeded", done
    code = host.workdir / ".gpuflex" / "code" / sha
    out = cli.ok("logs", str(job["id"])).stdout
    assert f"ran in {code}" in out and "the data" in out
    assert not (code / "old.ckpt").exists()                 # .gitignore kept it home
    assert (code / "result.txt").read_text() == "written\n"   # outputs stay on the host
    assert f"code: {sha[:12]} (--sync" in cli.ok("status", str(job["id"])).stdout
    assert code_events(cli, job["id"]) == [f"sent the code ({sha[:12]}) to {host.name}: {code}"]

    make_tree(src)         # the same tree again: the host holds it already
    again = cli.submit(["./mine.sh"], "--sync", "--workdir", str(src))
    assert again["code_sha256"] == sha
    done = cli.wait_final(again["id"])
    assert done["state"] == "succeeded", done
    assert "written\nwritten" in cli.ok("logs", str(again["id"])).stdout   # the same directory
    assert code_events(cli, again["id"]) == []

    back = home / "back"
    cli.ok("fetch", str(again["id"]), "result.txt", "--to", str(back))
    assert (back / "result.txt").read_text() == "written\nwritten\n"
    r = cli.ok("fetch", str(again["id"]), "out", "--to", str(back))
    assert (back / "out" / "sub" / "d.txt").read_text() == "deep\n"
    assert not (back / "out" / "leak").exists() and "left out leak" in r.stderr   # never followed out
