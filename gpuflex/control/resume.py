"""The checkpoint a job starts from (issue 13, `submit --resume-from PATH`): the checkpoint
directory of an earlier job, which an in-place job's workers are given as
GPUFLEX_RESUME_FROM (gpuflex.elastic.protocol.env) and read whatever world size wrote it.

Checked at submit, before anything is written or probed. The path is made absolute and
normalised (gpuflex.jobspec.resume_path). Where every host of the pool is this machine,
the directory is checked here too, and each refusal names the check that failed: it must
be a directory the caller can read, hold gpuflex's checkpoint (`checkpoint.pt` or
`checkpoint.prev.pt`), and it, those files and everything under a sharded job's `dcp/`
must belong to the caller with no write permission for group or others. A sharded
checkpoint's DCP metadata is a pickle: gpuflex never reads what another user could have
written (the worker checks again before it reads: gpuflex.elastic.sharding.checkpoints). On
SSH hosts the path names a directory over there, which the worker checks when it starts.
"""

from __future__ import annotations

import os
import stat

from gpuflex.config import Config
from gpuflex.elastic.protocol.run_dir import others_may_write
from gpuflex.errors import UsageError
from gpuflex.jobspec import resume_path

CHECKPOINT_FILES = ("checkpoint.pt", "checkpoint.prev.pt")   # gpuflex.elastic.state.checkpoints' pair
DCP_DIR = "dcp"                                              # a sharded job's shards, beside them
WHERE = "gpuflex status JOB --json shows a job's checkpoint_dir"


def checked(config: Config, value: str | None, elastic: str | None) -> str | None:
    """The job's `resume_from` for `--resume-from VALUE` (None when not given): absolute,
    normalised and, on a pool of this machine alone, a checkpoint directory the caller may
    resume from; UsageError naming the failed check otherwise."""
    if value is None:
        return None
    path = resume_path(value, elastic, os.getcwd())
    if all(h.is_local for h in config.hosts):
        check_checkpoint_dir(path)
    return path


def check_checkpoint_dir(path: str) -> None:
    """UsageError unless `path` is a readable checkpoint directory that only the caller
    could have written (see the module's doc)."""
    st = _stat(path, path)
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"--resume-from {path!r} is not a directory: give the checkpoint directory of an "
                         f"earlier job, the one holding checkpoint.pt ({WHERE}).")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UsageError(f"--resume-from {path!r}: you cannot read this directory "
                         f"(mode {stat.S_IMODE(st.st_mode):o}).")
    files = [name for name in CHECKPOINT_FILES if os.path.lexists(os.path.join(path, name))]
    if not files:
        raise UsageError(f"--resume-from {path!r} holds no checkpoint.pt or checkpoint.prev.pt: it is not a "
                         f"job's checkpoint directory ({WHERE}).")
    check_private(path, ".", st)
    for name in files:
        check_file(path, name)
    for name in dcp_entries(path):
        check_private(path, name, _stat(path, os.path.join(path, name)))


def check_file(path: str, name: str) -> None:
    """UsageError unless the checkpoint file `name` in `path` is a regular file the caller
    can read and only the caller could have written."""
    full = os.path.join(path, name)
    st = _stat(path, full)
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"--resume-from {path!r}: {name} is not a regular file.")
    if not os.access(full, os.R_OK):
        raise UsageError(f"--resume-from {path!r}: you cannot read {name} (mode {stat.S_IMODE(st.st_mode):o}).")
    check_private(path, name, st)


def check_private(path: str, name: str, st: os.stat_result) -> None:
    """UsageError unless `name` (relative to `path`; "." the directory itself) belongs to
    the caller and neither group nor others may write it."""
    found = others_may_write(st)
    if found is not None:
        why, remedy = found
        raise UsageError(f"--resume-from {path!r}: {'the directory' if name == '.' else name} {why}; gpuflex "
                         f"reads only checkpoints no other user could have written (a sharded one's DCP "
                         f"metadata is a pickle): {remedy}.")


def dcp_entries(path: str) -> list[str]:
    """Every directory and file under `path`'s `dcp/` (a sharded job's shards), relative to
    `path`; none when it has no `dcp/`. Links are not followed: a link's target is checked
    by `stat` where it is listed."""
    root = os.path.join(path, DCP_DIR)
    if not os.path.isdir(root):
        return []
    out = [DCP_DIR]
    for top, dirs, files in os.walk(root):
        out.extend(os.path.relpath(os.path.join(top, n), path) for n in sorted(dirs + files))
    return out


def _stat(path: str, full: str) -> os.stat_result:
    """`os.stat(full)`, or a UsageError saying why it cannot be read (`path`: the option's)."""
    what = "the directory" if full == path else os.path.relpath(full, path)
    try:
        return os.stat(full)
    except (FileNotFoundError, NotADirectoryError):
        gone = "no such directory" if full == path else f"{what} vanished (or is a broken link)"
        raise UsageError(f"--resume-from {path!r}: {gone}.") from None
    except OSError as e:
        raise UsageError(f"--resume-from {path!r}: cannot read {what} ({e.strerror}).") from None
