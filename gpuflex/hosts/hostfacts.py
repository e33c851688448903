"""What `gpuflex doctor` asks a host's configured python, in one run.

The doctor sends this file's source on stdin to `PYTHON - WORKDIR` on the host (through
its transport), so it runs even where gpuflex itself is not importable: saying so is
part of its answer. It prints one JSON line:

    {"python": {"version", "executable"},
     "gpuflex": {"version", "path"} or {"error"},
     "torch": {"version", "cuda", "cuda_available", "device_count", "gloo", "nccl"} or {"error"},
     "workdir": {"path", "existed", "is_dir", "owned", "mode", "modes_kept", "free_bytes", "error"}}

The workdir is tried as a job's launch uses it (gpuflex.hosts.private): missing
components are created 0700, then a 0700 directory and a 0600 file are made in it and
their modes read back (a filesystem that ignores modes, or one mounted read-only, fails
here rather than at a job's first spawn); what the check created is removed again, so
the host is left as it was. Standard library only (torch is imported, not required).
"""

from __future__ import annotations

import json
import os
import stat
import sys

PROBE_NAME = ".gpuflex-doctor-"


def python_facts() -> dict:
    return {"version": sys.version.split()[0], "executable": sys.executable}


def gpuflex_facts() -> dict:
    try:
        import gpuflex
    except Exception as e:  # noqa: BLE001 - whatever stops the import is the answer
        return {"error": f"{type(e).__name__}: {e}"}
    return {"version": getattr(gpuflex, "__version__", None), "path": os.path.dirname(gpuflex.__file__ or "")}


def torch_facts() -> dict:
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - as above
        return {"error": f"{type(e).__name__}: {e}"}
    out = {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": False, "device_count": 0,
           "gloo": bool(dist.is_available() and dist.is_gloo_available()),
           "nccl": bool(dist.is_available() and dist.is_nccl_available())}
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
        out["device_count"] = int(torch.cuda.device_count()) if out["cuda_available"] else 0
    except Exception as e:  # noqa: BLE001 - a driver that refuses is a fact too
        out["cuda_error"] = f"{type(e).__name__}: {e}"
    return out


def _error(e: OSError) -> str:
    where = f": {e.filename}" if e.filename else ""
    return f"{e.strerror or e}{where}"


def workdir_facts(path: str) -> dict:
    p = os.path.abspath(os.path.expanduser(path))
    out: dict = {"path": p, "existed": os.path.lexists(p), "is_dir": False, "owned": False, "mode": None,
                 "modes_kept": False, "free_bytes": None, "error": None}
    missing, q = [], p
    while not os.path.lexists(q):
        missing.append(q)
        parent = os.path.dirname(q)
        if parent == q:
            break
        q = parent
    out["free_bytes"] = _free_bytes(q)
    made: list[str] = []
    try:
        for d in reversed(missing):
            os.mkdir(d, 0o700)
            made.append(d)
        st = os.stat(p)
        out["is_dir"] = stat.S_ISDIR(st.st_mode)
        out["owned"] = st.st_uid == os.getuid()
        out["mode"] = stat.S_IMODE(st.st_mode)
        if not out["is_dir"]:
            out["error"] = f"not a directory: {p}"
            return out
        out["modes_kept"] = _try_private(p)
        out["free_bytes"] = _free_bytes(p)
    except OSError as e:
        out["error"] = _error(e)
    finally:
        for d in reversed(made):
            try:
                os.rmdir(d)
            except OSError:
                pass
    return out


def _try_private(p: str) -> bool:
    """A 0700 directory and a 0600 file made in `p` as gpuflex makes its own (explicit
    modes, whatever the umask); True when both modes read back as set. Raises OSError
    when `p` is not writable."""
    name = os.path.join(p, f"{PROBE_NAME}{os.getpid()}")
    os.mkdir(name, 0o700)
    try:
        os.chmod(name, 0o700)
        dir_mode = stat.S_IMODE(os.stat(name).st_mode)
        f = os.path.join(name, "file")
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, b"gpuflex doctor\n")
            file_mode = stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
            os.unlink(f)
    finally:
        os.rmdir(name)
    return dir_mode == 0o700 and file_mode == 0o600


def _free_bytes(p: str) -> int | None:
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def main(argv: list[str]) -> int:
    workdir = argv[0] if argv else "~"
    print(json.dumps({"python": python_facts(), "gpuflex": gpuflex_facts(), "torch": torch_facts(),
                      "workdir": workdir_facts(workdir)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
