"""The multi-host soak's lab: three sshd hosts (tests/sshbed.py) plus this machine's own
pool, a PostgreSQL cluster (tests/pgbed.py) whose data lies on a small tmpfs (so that its
disk can be filled: the PostgreSQL form of the control host's database disk full), three
unix users sharing its database, and gpu03's SSH logins 10 minutes ahead (the clock shim of
tests/e2e/ssh/test_clock_skew_ssh.py) for the whole run.

Each user runs the real CLI as themselves (su, umask 077, Debian's python3 with this
checkout and the venv's packages on PYTHONPATH, as tests/e2e/test_shared_sqlite.py does),
with a config of their own that differs from the others' in the SSH key's path (a copy
each user owns) and the login: each logs in to the bed hosts as themselves, so that a job's
processes and files are its owner's on every host of the one shared filesystem (a job first
placed on the local pool and later on gpu01 reuses its checkpoint directory, which gpuflex
refuses to use when another uid owns it). Root, named an admin, polls `status` and cancels
what is left at the end.

`Lab.close()` undoes everything: jobs cancelled, sshd and PostgreSQL stopped, the tmpfs
unmounted, the users removed.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests import pgbed, sshbed   # noqa: E402 (the beds live with the tests)

PYTHON = "/usr/bin/python3"
SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
GPUFLEX = str(Path(sys.executable).parent / "gpuflex")
FAKE_SMI = ROOT / "tests" / "fakes" / "nvidia-smi"
EXAMPLE = ROOT / "examples" / "elastic_mlp.py"
RESTART_EXAMPLE = ROOT / "examples" / "restart" / "ddp_ckpt.py"
SKEWED_HOST, SKEW_S = "gpu03", 600
PG_DISK = "160m"
JOBS = {"checkpoint_interval_s": 5, "heartbeat_timeout_s": 3, "pg_timeout_s": 10, "cancel_grace_s": 5,
        "formation_timeout_s": 60, "orphan_timeout_s": 60}
CLI_TIMEOUT_S = 240   # a command slower than this is a hang (CPU-starved 2-core runs take ~100 s)


def missing() -> str | None:
    """Why the lab cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (unix users, a tmpfs, iptables)"
    if sshbed.find_sshd() is None or shutil.which("ssh-keygen") is None:
        return "OpenSSH sshd/ssh-keygen are not installed"
    if pgbed.missing_reason():
        return pgbed.missing_reason()
    for tool in ("useradd", "usermod", "userdel", "su", "iptables", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not (shutil.which("cc") or shutil.which("gcc")):
        return "no C compiler for the clock shim"
    if not os.access(PYTHON, os.X_OK):
        return f"needs {PYTHON}"
    minor = subprocess.run([PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                           text=True).stdout.strip()
    if minor != str(tuple(sys.version_info[:2])):
        return f"{PYTHON} is Python {minor}, not this venv's {tuple(sys.version_info[:2])}"
    return None


class Lab:
    def __init__(self, root: Path, users: int = 3) -> None:
        self.root = root
        os.chmod(root, 0o755)
        self.users = [f"gfsoak{os.getpid() % 100000}{chr(97 + i)}" for i in range(users)]
        self.made_users: list[str] = []
        self.bed: sshbed.SshBed | None = None
        self.pg: pgbed.PgCluster | None = None
        self.pg_disk = root / "pgdisk"
        self.mounted = False
        self.shared = root / "shared"      # reports, checkpoints, host workdirs: every user writes here
        self.url = ""

    # -- building --
    def start(self) -> None:
        self.shared.mkdir()
        os.chmod(self.shared, 0o1777)
        self.pg_disk.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={PG_DISK},mode=0755", "tmpfs", str(self.pg_disk)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"mount tmpfs: {r.stderr.strip()}")
        self.mounted = True
        saved, tempfile.tempdir = tempfile.tempdir, str(self.pg_disk)
        try:
            self.pg = pgbed.start_cluster()
        finally:
            tempfile.tempdir = saved
        self.url = self.pg.database("soak")
        self.bed = sshbed.start_bed(self.root / "bed", n=3)
        from tests.e2e.ssh.test_clock_skew_ssh import build_shim, skew_clock
        shim = build_shim(self.root)
        os.chmod(self.root / "bed", 0o755)
        skew_clock(self.bed, self.bed.host(SKEWED_HOST), shim, SKEW_S)
        smi = self.root / "local-nvidia-smi"
        self.local_smi_state = self.root / "local-smi.json"
        self.local_smi_state.write_text(json.dumps({"gpus": sshbed.default_gpus("local"), "processes": []}))
        smi.write_text("#!/bin/sh\nexec " + shlex.join([PYTHON, "-I", "-S", str(FAKE_SMI), "--state",
                                                        str(self.local_smi_state)]) + ' "$@"\n')
        smi.chmod(0o755)
        self.local_smi = smi
        # each user's own workdir on every host (a job's directories are private to its owner)
        for who in [*self.users, "root"]:
            for h in ["local", *(h.name for h in self.bed.hosts)]:
                (self.shared / "work" / who / h).mkdir(parents=True)
        os.chmod(self.shared / "work", 0o755)
        # what a user runs on a bed host: root's interpreter lies under /root (0700)
        self.host_python = self.shared / "python3"
        self.host_python.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(f'{ROOT}:{SITE}')} exec {PYTHON} \"$@\"\n")
        self.host_python.chmod(0o755)
        for h in self.bed.hosts:
            smi = self.shared / f"nvidia-smi-{h.name}"
            smi.write_text("#!/bin/sh\nexec " + shlex.join([PYTHON, "-I", "-S", str(FAKE_SMI), "--state",
                                                            str(h.smi_state)]) + ' "$@"\n')
            smi.chmod(0o755)
        (self.root / "users").mkdir()
        os.chmod(self.root / "users", 0o755)
        for name in self.users:
            # each user logs in to the bed hosts as themselves (the bed's key in their
            # ~/.ssh/authorized_keys), as on a lab's shared filesystem: a job's files are its
            # owner's on every host. "*": no password and not locked (sshd without PAM
            # refuses a locked account even to a key)
            home = self.root / "users" / name
            subprocess.run(["useradd", "-m", "-d", str(home), "-s", "/bin/sh", name], check=True, capture_output=True)
            self.made_users.append(name)
            subprocess.run(["usermod", "-p", "*", name], check=True, capture_output=True)
            (home / ".ssh").mkdir(mode=0o700, exist_ok=True)
            (home / ".ssh" / "authorized_keys").write_text(Path(str(self.bed.user_key) + ".pub").read_text())
            for src, dst in ((self.bed.user_key, home / "id_ed25519"), (self.bed.known_hosts, home / "known_hosts")):
                shutil.copy(src, dst)
            self.write_config(home, home / "id_ed25519", home / "known_hosts", user=name)
            for mine in (home, self.shared / "work" / name):
                subprocess.run(["chown", "-R", f"{name}:{name}", str(mine)], check=True)
            os.chmod(home, 0o700)
            for f in ("id_ed25519", ".ssh/authorized_keys"):
                os.chmod(home / f, 0o600)
        self.admin_home = self.root / "admin"
        self.admin_home.mkdir()
        self.write_config(self.admin_home, self.bed.user_key, self.bed.known_hosts)

    def write_config(self, home: Path, key: Path, known: Path, user: str | None = None) -> None:
        """`home`'s gpuflex.toml; `user`: the unix user whose gpuflex it is (None: root, the
        admin, with the bed's own programs)."""
        jobs = "".join(f"{k} = {v}\n" for k, v in JOBS.items())
        # no `[[hosts]] user`: each logs in as the unix user running the command ("reached as
        # each user"); with it set, gpuflex takes the host for one shared account, where any
        # user's command may start and end anyone's job (gpuflex.control.access)
        as_user = {"user": None} if user is None else {"user": None, "python": str(self.host_python)}
        hosts = "".join(sshbed.host_toml(h, self.bed, identity_file=str(key), known_hosts=str(known),
                                         workdir=str(self.shared / "work" / (user or "root") / h.name),
                                         command_timeout_s=20,
                                         **as_user, **({} if user is None else
                                                       {"nvidia_smi": str(self.shared / f"nvidia-smi-{h.name}")}))
                        for h in self.bed.hosts)
        local = (f'[[hosts]]\nname = "local"\naddress = "local"\nnvidia_smi = "{self.local_smi}"\n'
                 f'python = "{PYTHON}"\nworkdir = "{self.shared / "work" / (user or "root") / "local"}"\n')
        (home / "gpuflex.toml").write_text(
            f'[database]\nurl = "{self.url}"\n\n[access]\nadmins = ["root"]\n\n'
            "[harvest]\ninterval_s = 5\nidle_samples = 1\nreclaim_deadline_s = 20\n\n"
            f"[jobs]\n{jobs}\n{local}\n{hosts}")

    # -- the CLI --
    def env(self, home: Path) -> dict[str, str]:
        return {"HOME": str(home), "GPUFLEX_CONFIG": str(home / "gpuflex.toml"), "COLUMNS": "200",
                "PYTHONPATH": f"{ROOT}:{SITE}", "PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8",
                "PYTHONFAULTHANDLER": "1"}   # a hung command's stack, on the SIGABRT the soak sends it

    def argv(self, user: str | None, args: list[str]) -> tuple[list[str], dict[str, str] | None, Path]:
        """The command line running `gpuflex ARGS` as `user` (None: root, the admin)."""
        if user is None:
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")},
                   **self.env(self.admin_home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            return [GPUFLEX, *args], env, self.admin_home
        home = self.root / "users" / user
        script = "umask 077; exec " + shlex.join(["env", *(f"{k}={v}" for k, v in self.env(home).items()),
                                                  PYTHON, "-m", "gpuflex", *args])
        return ["su", "-s", "/bin/sh", user, "-c", script], None, home

    def cli(self, user: str | None, *args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
        argv, env, cwd = self.argv(user, list(args))
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(argv, 124, e.stdout or "", f"did not return in {timeout:.0f} s")

    def popen(self, user: str | None, args: list[str], out: Path) -> subprocess.Popen:
        argv, env, cwd = self.argv(user, args)
        with open(out, "w") as o, open(out.with_suffix(".err"), "w") as e:
            return subprocess.Popen(argv, stdout=o, stderr=e, env=env, cwd=cwd, start_new_session=True)

    def jobs(self, timeout_s: float = 60.0) -> list[dict] | None:
        """Every job (the admin's `status --json --limit 0`), or None when the CLI failed
        or did not answer within `timeout_s`."""
        p = self.cli(None, "status", "--json", "--limit", "0", timeout=timeout_s)
        if p.returncode != 0:
            return None
        try:
            data = json.loads(p.stdout)
        except json.JSONDecodeError:
            return None
        return data if isinstance(data, list) else [data]

    def pg_answers(self) -> bool:
        try:
            return self.pg.sql("SELECT 1").strip() == "1"
        except (RuntimeError, subprocess.TimeoutExpired):
            return False

    # -- the end --
    def close(self) -> None:
        if self.pg is not None and self.url:
            try:
                jobs = self.jobs() or []
                for j in jobs:
                    if j["state"] not in ("succeeded", "failed", "cancelled", "timeout"):
                        self.cli(None, "cancel", str(j["id"]), timeout=60)
            except Exception as e:   # the cleanup goes on whatever the CLI does
                print(f"cleanup: cancel failed: {e}")
        if self.bed is not None:
            self.bed.stop()
        for pid in _pids_under(self.root):
            try:
                os.kill(pid, 9)
                print(f"cleanup: killed pid {pid} left over")
            except ProcessLookupError:
                pass
        if self.pg is not None:
            self.pg.stop()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.pg_disk)], check=False)
        for name in self.made_users:
            subprocess.run(["userdel", name], capture_output=True)   # the home lies in the lab's dir


def job_command(kind: str, n: int, shared: Path) -> tuple[list[str], Path | None, list[str]]:
    """`submit`'s options and command for the soak's `n`th job of `kind`: small jobs, so that
    2 cores carry three hosts and the local pool. The trainers (in-place, restart) have
    priority 1, as a lab's training jobs ahead of its short batch jobs: they start as soon
    as a device frees, so the job faults find one to hit. Returns them, the in-place job's report
    path and its script options (its reference's argv), or None and [] for other kinds."""
    env = ["--env", f"PYTHONPATH={ROOT}:{SITE}", "--env", "OMP_NUM_THREADS=1"]
    if kind == "inplace":
        report = shared / f"report-{n}.json"
        job_args = ["--hidden", "16", "--global-batch-size", "64", "--seed", str(n % 2), "--epochs", "8"]
        return ([*env, "--name", f"mlp{n}", "--workers", "1:3", "--priority", "1", "--json", "--", PYTHON, str(EXAMPLE),
                 *job_args, "--step-sleep", "0.2", "--report", str(report)], report, job_args)
    if kind == "restart":
        ck = shared / f"ckpt-{n}"
        ck.mkdir()
        ck.chmod(0o777)    # the workers run as the submitting user locally, as root over SSH
        return ([*env, "--name", f"ddp{n}", "--elastic", "restart", "--workers", "1:2", "--priority", "1", "--json", "--",
                 PYTHON, str(RESTART_EXAMPLE), "--hidden", "16", "--epochs", "2", "--step-sleep", "0.1",
                 "--ckpt-dir", str(ck)], None, [])
    if kind == "gang":
        return [*env, "--name", f"gang{n}", "--workers", "2", "--json", "--", "sleep", "12"], None, []
    if kind == "array":
        return ([*env, "--name", f"arr{n}", "--array", "0-2%2", "--", "sh", "-c",
                 'sleep 4; echo "$GPUFLEX_ARRAY_INDEX"'], None, [])
    raise ValueError(f"unknown job kind {kind!r}")


def _pids_under(root: Path, keep: set[int] = frozenset()) -> list[int]:
    """Processes (not postgres's, not ours) whose command line names `root`."""
    mark, out = str(root).encode(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in keep or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if mark in cmd and not cmd.startswith(b"postgres") and b"/postgres" not in cmd.split(b"\0")[0]:
            out.append(int(entry.name))
    return out


def leftovers(lab: Lab) -> list[str]:
    """Processes left running that name the lab's directory, sshd and PostgreSQL aside."""
    sshd = set()
    for h in lab.bed.hosts:
        if h.proc is not None:
            sshd |= {p for p in _pids_under(lab.root) if _sid(p) == h.proc.pid}
    out = []
    for pid in _pids_under(lab.root, sshd):
        try:
            out.append(f"pid {pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                       .decode(errors="replace")[:160])
        except OSError:
            pass
    return out


def _sid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rfind(")") + 2:].split()[3])
    except (OSError, ValueError, IndexError):
        return None


def dump_and_kill(p) -> None:
    """SIGABRT first (the CLI runs with PYTHONFAULTHANDLER: it writes every thread's stack to
    its stderr), then SIGKILL the command's process group (su and the CLI under it)."""
    for sig, wait_s in ((signal.SIGABRT, 3), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(wait_s)
            return
        except Exception:
            continue


def where_stuck(err: str) -> str:
    """The innermost gpuflex frames of the main thread's stack in a faulthandler dump."""
    frames = [ln.strip() for ln in err.splitlines() if ln.strip().startswith("File ") and "gpuflex" in ln]
    return " <- ".join(frames[:4])[:600] or err[-300:]


def wait_until(pred, timeout_s: float, every_s: float = 0.5) -> float | None:
    """Seconds until `pred()` held, or None when it did not within `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return time.monotonic() - t0
        time.sleep(every_s)
    return None
