"""One SQLite database shared by a lab (issue 14, item 3a), with real unix users.

The test makes three users in a group `lab` (one of them also in an `admins` group named
in [access] admins) and one outside it, and the documented directory: `install -d -m 2770
-g lab DIR`. Each runs gpuflex as themselves with Debian's /usr/bin/python3 (root's
interpreter lives under /root, 0700, which they cannot run), this checkout and the test
venv's packages on PYTHONPATH (the same Python minor: the compiled packages fit), and a
umask of 077, so the group bits come from gpuflex, not from the umask. The job waits for
a GPU the pool cannot see, so nothing runs: what is tested is the database's sharing.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests import REPO

pytestmark = pytest.mark.e2e   # makes unix users and groups and runs the CLI as them

PYTHON = "/usr/bin/python3"
SUFFIX = f"{os.getpid() % 100000}"
LAB, ADMINS = f"gfs-lab{SUFFIX}", f"gfs-adm{SUFFIX}"
ALICE, BOB, CAROL, DAVE = (f"gfs-{n}{SUFFIX}" for n in ("a", "b", "c", "d"))   # CAROL: admin; DAVE: no lab
SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root: makes unix users and groups"
    if not all(shutil.which(c) for c in ("useradd", "userdel", "groupadd", "groupdel", "su")):
        return "needs useradd, groupadd and su"
    if not os.access(PYTHON, os.X_OK):
        return f"needs {PYTHON}"
    minor = subprocess.run([PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                           text=True).stdout.strip()
    if minor != str(tuple(sys.version_info[:2])):
        return f"{PYTHON} is Python {minor}, not this venv's {tuple(sys.version_info[:2])}"
    return None


@pytest.fixture(scope="module")
def lab():
    """The users and groups (removed at the end) and a directory every user may enter."""
    why = _usable()
    if why:
        pytest.skip(why)
    made_groups, made_users = [], []
    top = Path(tempfile.mkdtemp(prefix="gf-lab-"))
    try:
        for g in (LAB, ADMINS):
            subprocess.run(["groupadd", g], check=True, capture_output=True)
            made_groups.append(g)
        for user, groups in ((ALICE, LAB), (BOB, LAB), (CAROL, f"{LAB},{ADMINS}"), (DAVE, None)):
            subprocess.run(["useradd", "-M", "-s", "/bin/sh", *(["-G", groups] if groups else []), user],
                           check=True, capture_output=True)
            made_users.append(user)
        os.chmod(top, 0o755)
        subprocess.run(["install", "-d", "-m", "2770", "-g", LAB, str(top / "db")], check=True)
        for user in made_users:
            subprocess.run(["install", "-d", "-m", "700", "-o", user, str(top / user)], check=True)
        cfg = top / "gpuflex.toml"
        cfg.write_text(f'[database]\nurl = "sqlite:///{top}/db/g.db"\n\n[access]\nadmins = ["@{ADMINS}"]\n\n'
                       '[[hosts]]\nname = "local"\ngpus = [0]\n')
        os.chmod(cfg, 0o644)
        yield top
    finally:
        for user in made_users:
            subprocess.run(["userdel", user], capture_output=True)
        for g in made_groups:
            subprocess.run(["groupdel", g], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)


def gpuflex(top: Path, user: str, *args: str) -> subprocess.CompletedProcess:
    """`python3 -m gpuflex ARGS` as `user`, umask 077, in their own home."""
    return python(top, user, "-m", "gpuflex", *args)


def python(top: Path, user: str, *args: str) -> subprocess.CompletedProcess:
    """`python3 ARGS` as `user`, umask 077, in their own home."""
    env = {"HOME": str(top / user), "GPUFLEX_CONFIG": str(top / "gpuflex.toml"), "COLUMNS": "200",
           "PYTHONPATH": f"{REPO}:{SITE}", "PATH": "/usr/bin:/bin"}
    script = "umask 077; exec " + shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), PYTHON, *args])
    p = subprocess.run(["su", "-s", "/bin/sh", user, "-c", script], capture_output=True, text=True, timeout=120,
                       cwd=top)
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    return p


def modes(directory: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in sorted(directory.iterdir())}


def one_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    return lines[0]


def test_two_users_share_one_database(lab):
    db_dir = lab / "db"
    up = gpuflex(lab, ALICE, "db", "upgrade")
    assert up.returncode == 0, up.stderr
    assert modes(db_dir) == {"g.db": 0o660, "g.db.harvest.lock": 0o660, "g.db.lock": 0o660, "g.db.ops.lock": 0o660}
    assert {p.stat().st_gid for p in db_dir.iterdir()} == {__import__("grp").getgrnam(LAB).gr_gid}

    sub = gpuflex(lab, ALICE, "submit", "--json", "--", "sleep", "5")
    assert sub.returncode == 0, sub.stderr
    job = json.loads(sub.stdout)
    assert (job["owner"], job["state"]) == (ALICE, "queued")

    seen = gpuflex(lab, BOB, "status", "--json")
    assert seen.returncode == 0, seen.stderr
    assert [(j["id"], j["owner"]) for j in json.loads(seen.stdout)] == [(job["id"], ALICE)]
    assert ALICE in gpuflex(lab, BOB, "status").stdout

    before = (db_dir / "g.db").read_bytes()
    assert one_error(gpuflex(lab, BOB, "cancel", str(job["id"]))) == \
        f"error: job {job['id']} belongs to {ALICE}; only {ALICE} or an admin ([access] admins) may cancel it."
    assert (db_dir / "g.db").read_bytes() == before
    for verb in ("logs", "events"):   # issue 30: another member sees the job, not its output or history
        assert one_error(gpuflex(lab, BOB, verb, str(job["id"]))) == \
            f"error: job {job['id']} belongs to {ALICE}; only {ALICE} or an admin ([access] admins) may read its {verb}."
    assert (db_dir / "g.db").read_bytes() == before

    denied = one_error(gpuflex(lab, DAVE, "status"))
    assert f"permission denied on the database directory {db_dir}" in denied and f"group {LAB}" in denied

    # while a connection is open, SQLite's -wal and -shm (made by bob here) are the group's too
    held = python(lab, BOB, "-c", "import os, sqlalchemy as sa; from gpuflex.db.engine import open_database; "
                  f"s = open_database('sqlite:///{db_dir}/g.db'); c = s(); c.execute(sa.text('SELECT 1 FROM jobs')); "
                  f"print(sorted((f, oct(os.stat('{db_dir}/' + f).st_mode & 0o777)) for f in os.listdir('{db_dir}')))")
    assert held.returncode == 0, held.stderr
    assert ("g.db-wal", "0o660") in eval(held.stdout) and ("g.db-shm", "0o660") in eval(held.stdout)

    done = gpuflex(lab, CAROL, "cancel", str(job["id"]))   # an admin through the @group
    assert done.returncode == 0, done.stderr
    assert json.loads(gpuflex(lab, ALICE, "status", str(job["id"]), "--json").stdout)["state"] == "cancelled"
    history = gpuflex(lab, CAROL, "events", str(job["id"]), "--json")   # an admin reads it, and is named in it
    assert history.returncode == 0, history.stderr
    [cancel] = [e for e in json.loads(history.stdout) if e["kind"] == "state" and "cancelled" in e["message"]]
    assert cancel["message"] == f"cancelled: cancelled by {CAROL} (admin)" and cancel["data"]["by"] == CAROL
    # every file the three users' commands made or used is still the group's, none narrower
    assert set(modes(db_dir).values()) == {0o660}
    assert {p.stat().st_uid for p in db_dir.iterdir()} == {__import__("pwd").getpwnam(ALICE).pw_uid}


def test_a_members_running_job_is_left_to_them_and_each_keeps_their_own_launch_record(lab):
    """With a job running, another member's commands neither fail on the first member's
    launch record (one private file per user) nor touch the job; its owner's next command
    sees it end well."""
    cfg = lab / "run.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{lab}/db/run.db"\n\n[[hosts]]\nname = "slots"\ngpus = "cpu:1"\n')
    os.chmod(cfg, 0o644)
    sub = gpuflex(lab, ALICE, "--config", str(cfg), "submit", "--json", "--", "sleep", "4")
    assert sub.returncode == 0, sub.stderr
    job = json.loads(sub.stdout)
    assert job["state"] == "running"
    launches = sorted(p.name for p in (lab / "db").iterdir() if ".launches" in p.name)
    alice_uid = __import__("pwd").getpwnam(ALICE).pw_uid
    assert launches == [f"run.db.launches.{alice_uid}"]
    assert stat.S_IMODE((lab / "db" / launches[0]).stat().st_mode) == 0o600

    seen = gpuflex(lab, BOB, "--config", str(cfg), "status", "--json")   # no PermissionError
    assert seen.returncode == 0, seen.stderr
    assert [(j["id"], j["owner"], j["state"]) for j in json.loads(seen.stdout)] == [(job["id"], ALICE, "running")]

    for _ in range(60):   # bounded: the job sleeps 4 s
        state = json.loads(gpuflex(lab, ALICE, "--config", str(cfg), "status", str(job["id"]), "--json").stdout)
        if state["state"] != "running":
            break
        time.sleep(1)
    assert state["state"] == "succeeded"


def test_root_as_admin_cancels_another_users_running_job_where_a_non_root_admin_cannot(lab):
    """On the local host a job runs as its owner: carol, an admin through her group, cannot
    signal alice's processes and is refused with nothing recorded; root, listed in
    [access] admins, reaches every process and cancels it (issue 33)."""
    cfg = lab / "adm.toml"
    cfg.write_text(f'[database]\nurl = "sqlite:///{lab}/db/adm.db"\n\n[access]\nadmins = ["root", "@{ADMINS}"]\n\n'
                   '[jobs]\ncancel_grace_s = 2\n\n[[hosts]]\nname = "slots"\ngpus = "cpu:1"\n')
    os.chmod(cfg, 0o644)
    sub = gpuflex(lab, ALICE, "--config", str(cfg), "submit", "--json", "--", "sleep", "600")
    assert sub.returncode == 0, sub.stderr
    job = json.loads(sub.stdout)
    assert job["state"] == "running"
    try:
        refused = one_error(gpuflex(lab, CAROL, "--config", str(cfg), "cancel", str(job["id"])))
        assert f"only {ALICE}'s own gpuflex can cancel it" in refused
        env = {**os.environ, "GPUFLEX_CONFIG": str(cfg), "COLUMNS": "200"}
        done = subprocess.run([sys.executable, "-m", "gpuflex", "cancel", str(job["id"])], capture_output=True,
                              text=True, timeout=120, env=env, cwd=lab)
        assert (done.returncode, done.stdout.strip()) == (0, f"job {job['id']} cancelled"), done.stderr
        after = json.loads(gpuflex(lab, ALICE, "--config", str(cfg), "status", str(job["id"]), "--json").stdout)
        assert (after["state"], after["exit_reason"]) == ("cancelled", "cancelled by root (admin)")
        assert [w["state"] for w in after["workers"]] == ["stopped"]
    finally:
        gpuflex(lab, ALICE, "--config", str(cfg), "cancel", str(job["id"]))
