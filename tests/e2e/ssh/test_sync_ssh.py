"""`submit --sync` over SSH (issue 33): the workers run in the copy sent to the host, never
in the submit directory, a second job of the same tree sends nothing, and `gpuflex fetch`
brings a file and a directory back by SFTP.

"A submit directory the SSH user cannot read" is played two ways. The bed's sshd logs in
as the test's own user (root on the test machines), who reads every directory, so the
first test removes the directory after submit, before the job starts (it waits `--after`
a first job): no path to it works on the host at all. The last test logs in as a unix
user made for it (root only; skipped otherwise), to whom the submit directory under
pytest's tmp_path (root's 0700 /tmp/pytest-of-root) is closed while it exists: without
--sync the job fails at once, naming the host, that user, the directory and --sync; with
--sync it runs as that user in the copy under the host workdir that user owns. Its host
python and fake nvidia-smi are ones that user can run (the venv's interpreter may lie
under root's 0700 home), and the bed's key is put in that user's ~/.ssh/authorized_keys.
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

from tests import REPO
from tests.conftest import GpuflexCLI, cleanup_jobs
from tests.sshbed import FAKE_SMI, default_gpus, host_toml, one_host_cli, ssh_hosts  # noqa: F401

SSH_USER = "gpuflex-sync-u"   # this file's own SSH user (other test files make theirs)

SCRIPT = ("#!/bin/sh\necho \"ran in $(pwd)\"\ncat data.txt\necho written >> result.txt\ncat result.txt\n"
          "mkdir -p out/sub && echo deep > out/sub/d.txt && ln -sf /etc/hostname out/leak\n")


@pytest.fixture
def one_host(ssh_hosts, home):
    yield from one_host_cli(ssh_hosts, home)


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


# ---- a submit directory the SSH user cannot read, for real --------------------------------
WHO_SCRIPT = "#!/bin/sh\necho \"ran as $(id -un) in $(pwd)\"\ncat data.txt\n"


def as_user(user: str, command: str) -> subprocess.CompletedProcess:
    """`command` run by `sh` as `user`."""
    return subprocess.run(["su", "-s", "/bin/sh", user, "-c", command], capture_output=True, text=True,
                          timeout=60)


def closed_dir(user: str, path: str) -> str | None:
    """The first directory above `path` that `user` (in none of its groups) cannot enter."""
    for d in reversed(Path(path).parents):
        st = os.stat(d)
        if st.st_uid != pwd.getpwnam(user).pw_uid and not st.st_mode & 0o001:
            return str(d)
    return None


def host_python(user: str, tools: Path) -> tuple[str, str]:
    """(host `python`, a plain interpreter for the fake nvidia-smi) that `user` can run and
    import gpuflex's host modules with: the test's own interpreter, else a system python3
    with this repository on its path (a wrapper in `tools`); the test skips if neither can."""
    probe = "import gpuflex.hosts.hostops, gpuflex.hosts.unpack"
    own = as_user(user, f"{shlex.quote(sys.executable)} -c {shlex.quote(probe)}")
    if own.returncode == 0:
        return sys.executable, sys.executable
    tried = [f"{sys.executable}: {(own.stderr or own.stdout).strip()[-200:]}"]
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.access(cand, os.X_OK):
            continue
        wrapper = tools / "python"
        wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(REPO))} exec {shlex.quote(cand)} \"$@\"\n")
        wrapper.chmod(0o755)
        r = as_user(user, f"{shlex.quote(str(wrapper))} -c {shlex.quote(probe)}")
        if r.returncode == 0:
            return str(wrapper), cand
        tried.append(f"{cand} with PYTHONPATH={REPO}: {(r.stderr or r.stdout).strip()[-200:]}")
    closed = closed_dir(user, os.path.realpath(sys.executable))
    pytest.skip(f"no host python that {user} can run and import gpuflex with: the test's interpreter "
                f"{sys.executable} ({os.path.realpath(sys.executable)})"
                + (f" lies under {closed}, which {user} cannot enter" if closed else "")
                + f", and no system python3 imports this repository ({REPO}) as {user}; tried: "
                + "; ".join(tried))


@pytest.fixture(scope="module")
def ssh_user(ssh_hosts):
    """A unix user the bed's first host is reached as (the bed's key in its
    ~/.ssh/authorized_keys), with a host workdir of its own (0700) and a host python and
    fake nvidia-smi it can run; removed at the end."""
    if os.geteuid() != 0:
        pytest.skip("needs root: makes a second unix user to log in as over SSH")
    for tool in ("useradd", "usermod", "userdel", "su"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (package passwd / util-linux)")
    made = False
    try:
        pwd.getpwnam(SSH_USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", SSH_USER], check=True,
                       capture_output=True)
        made = True
    tools = Path(tempfile.mkdtemp(prefix="gf-sync-user-"))
    try:
        # useradd leaves the password "!" (locked), and sshd without PAM refuses a locked
        # account even to a key: "*" is no password and not locked
        subprocess.run(["usermod", "-p", "*", SSH_USER], check=True, capture_output=True)
        entry = pwd.getpwnam(SSH_USER)
        ssh_dir = Path(entry.pw_dir) / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        keys = ssh_dir / "authorized_keys"
        keys.write_text(Path(str(ssh_hosts.user_key) + ".pub").read_text())
        for p in (ssh_dir, keys):
            os.chown(p, entry.pw_uid, entry.pw_gid)
        keys.chmod(0o600)
        os.chmod(tools, 0o755)
        python, plain = host_python(SSH_USER, tools)
        host = ssh_hosts.hosts[0]
        state = tools / "smi.json"   # the bed's own state file lies under root's 0700 temp dir
        state.write_text(json.dumps({"gpus": default_gpus(host.name), "processes": []}))
        state.chmod(0o644)
        smi = tools / "nvidia-smi"
        smi.write_text("#!/bin/sh\nexec " + shlex.join([plain, "-I", "-S", str(FAKE_SMI), "--state", str(state)])
                       + ' "$@"\n')
        smi.chmod(0o755)
        workdir = tools / "work"
        workdir.mkdir(mode=0o700)
        os.chown(workdir, entry.pw_uid, entry.pw_gid)
        yield types.SimpleNamespace(name=SSH_USER, python=python, nvidia_smi=smi, workdir=workdir)
    finally:
        shutil.rmtree(tools, ignore_errors=True)
        if made:
            subprocess.run(["userdel", "--remove", SSH_USER], capture_output=True)


@pytest.fixture
def as_other_user(ssh_hosts, ssh_user, home):
    bed = ssh_hosts
    host = bed.hosts[0]
    cfg = home / "g.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{home}/g.db"\n\n[jobs]\ncancel_grace_s = 3\n\n'
                   + host_toml(host, bed, user=ssh_user.name, python=ssh_user.python,
                               nvidia_smi=str(ssh_user.nvidia_smi), workdir=str(ssh_user.workdir)))
    cli = GpuflexCLI(home, cfg)
    yield cli, host, ssh_user
    cleanup_jobs(cli, home / "g.db")


def test_a_submit_directory_the_ssh_user_cannot_read_names_host_user_and_sync_and_sync_runs_there(
        as_other_user, home):
    cli, host, user = as_other_user
    src = home / "src"   # under pytest's tmp_path: root's 0700 /tmp/pytest-of-root/...
    src.mkdir()
    (src / "who.sh").write_text(WHO_SCRIPT)
    (src / "who.sh").chmod(0o755)
    (src / "data.txt").write_text("the data\n")
    seen = as_user(user.name, f"ls {shlex.quote(str(src))}")
    assert seen.returncode != 0 and "Permission denied" in seen.stderr   # the premise: closed to it

    p = cli("submit", "--workdir", str(src), "--json", "--", "./who.sh")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    [job] = cli.json("status", "--all")
    done = cli.wait_final(job["id"])
    # the host's words, as they are
    said = (f"{host.name}: cannot start './who.sh': user {user.name} cannot read the "
            f"job's directory {src} (Permission denied); the workers run there as this host's SSH "
            "user: give it a path this user shares, or submit with --sync to send the code")
    assert (done["state"], done["exit_reason"]) == ("failed", said), done
    events = cli.json("events", str(job["id"]))
    assert [e["message"] for e in events if e["kind"] == "state"][-1].endswith(f"launch failed: {said}")
    assert not [e for e in events if e["kind"] == "launch-failed"]   # failed at once, no retry

    job = cli.submit(["./who.sh"], "--sync", "--workdir", str(src))
    done = cli.wait_final(job["id"])
    assert done["state"] == "succeeded", done
    code = user.workdir / ".gpuflex" / "code" / job["code_sha256"]
    out = cli.ok("logs", str(job["id"])).stdout
    assert f"ran as {user.name} in {code}\nthe data\n" in out, out
    assert code_events(cli, job["id"]) == [f"sent the code ({job['code_sha256'][:12]}) to {host.name}: {code}"]
    assert code.stat().st_uid == pwd.getpwnam(user.name).pw_uid   # unpacked by that user
