"""A podman bed for the container tests (issue 33, `submit --image`): one small image per
test session and the words this machine's podman needs.

The image is built here with no registry: `podman import` of a tarball holding only the
top directories and the merged-/usr links (bin -> usr/bin, ...). It holds no python of its
own: the host's /usr, this interpreter's installation and the repository (its .venv and
gpuflex, installed editable) are mounted into it read-only through the test host's
`container_args`. Copying a python and torch into an image would take minutes and
gigabytes per session; what the tests check is gpuflex's side (network, mounts,
environment, signals, exit codes, resizes), which is the same for a self-contained image.

Some machines need more than `podman run`: a cgroup v1 host with a cgroup v2 hierarchy
beside it ("hybrid") is refused by crun, and a sandbox without CAP_SYS_RESOURCE cannot
raise the rlimits podman sets by default. The bed tries plain podman first, then runc with
the current limits, and keeps the first that runs a container; without podman (make test
installs it where it can) or with none working, the tests skip saying why.
"""

from __future__ import annotations

import hashlib
import io
import os
import resource
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import REPO

TOP_DIRS = ("usr", "etc", "tmp", "proc", "dev", "sys", "run", "root", "var")
LINKS = {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64", "sbin": "usr/sbin"}


@dataclass(frozen=True)
class PodmanBed:
    image: str
    args: tuple[str, ...]   # the test host's container_args: the machine's needs, then the mounts

    def host_toml(self, home: Path, slots: int = 4) -> str:
        args = ", ".join(f'"{a}"' for a in self.args)
        return (f'[[hosts]]\nname = "local"\naddress = "local"\ngpus = "cpu:{slots}"\nworkdir = "{home}/work"\n'
                f'container = "podman"\ncontainer_args = [{args}]\n')


def rootfs_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in TOP_DIRS:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755, 0
            tar.addfile(info)
        for name, target in LINKS.items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, 0
            tar.addfile(info)
    return buf.getvalue()


def mounts() -> list[str]:
    """What the workers' python needs from this machine, each once, read-only."""
    dirs = []
    for d in sorted({"/usr", os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), str(REPO)}, key=len):
        if not any(d == m or d.startswith(m + "/") for m in dirs):
            dirs.append(d)
    return [w for d in dirs for w in ("-v", f"{d}:{d}:ro")]


def machine_args() -> list[tuple[str, ...]]:
    """The podman words to try, plainest first (see the module's text)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    tries: list[tuple[str, ...]] = [()]
    for nproc in (16384, 4096):
        tries.append(("--runtime", "runc", "--ulimit", f"nofile={nofile}:{nofile}",
                      "--ulimit", f"nproc={nproc}:{nproc}"))
    return tries


def podman(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="session")
def podman_bed(tmp_path_factory) -> PodmanBed:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (make test installs it where it runs as root with apt-get)")
    data = rootfs_tar()
    image = f"localhost/gpuflex-test:{hashlib.sha256(data).hexdigest()[:12]}"
    if podman("image", "exists", image).returncode != 0:   # once per machine: the tag is the content's
        tar = tmp_path_factory.mktemp("podbed") / "rootfs.tar"
        tar.write_bytes(data)
        p = podman("import", str(tar), image)
        if p.returncode != 0:
            pytest.skip(f"podman cannot import an image here: {p.stderr.strip()[-300:]}")
    errors = []
    for args in machine_args():
        p = podman("run", "--rm", "--network", "host", *args, *mounts(), image, sys.executable, "-c", "print('ok')")
        if p.returncode == 0 and p.stdout.strip() == "ok":
            return PodmanBed(image=image, args=(*args, *mounts()))
        errors.append(p.stderr.strip().splitlines()[-1:] or [f"exit {p.returncode}"])
    pytest.skip(f"podman cannot run a container here: {' / '.join(e[0] for e in errors)}")
