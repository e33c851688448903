"""Owner-only files and directories: what gpuflex creates for itself is its user's alone.

The database, a job's directory (logs, exit records, checkpoints) and its control-socket
directory hold secrets or steer the job, so they are created 0700 (directories) and
0600 (files) with explicit modes, whatever the umask; the user's own files (a training
script's outputs) keep the umask they chose. A directory or file that already exists
must be ours and not a symlink: one another user made is never used.

Standard library only (hostops runs it on remote hosts), and below everything else: the
database (gpuflex.db.engine) uses it too.
"""

from __future__ import annotations

import os
import shutil
import stat

DIR_MODE = 0o700
FILE_MODE = 0o600


class NotPrivate(PermissionError):
    """A path gpuflex would use exists but is not ours alone (another user's, a symlink,
    not a directory); the message says which and what to do."""


def check_own(path: str, st: os.stat_result, *, directory: bool) -> None:
    """Raise NotPrivate unless the lstat result `st` of `path` is ours and of the kind asked."""
    if stat.S_ISLNK(st.st_mode):
        raise NotPrivate(f"{path} is a symlink; gpuflex does not follow it. Remove it.")
    if directory and not stat.S_ISDIR(st.st_mode):
        raise NotPrivate(f"{path} exists and is not a directory. Remove it.")
    if st.st_uid != os.getuid():
        raise NotPrivate(f"{path} belongs to uid {st.st_uid}, not to us (uid {os.getuid()}); "
                         f"gpuflex never uses another user's directory or file. Remove it or choose another path.")


def private_dir(path: str, *, claim: bool = True) -> None:
    """Make `path` a directory: each missing component (parents included) is created with
    mode 0700. With `claim`, an existing `path` must be our directory, not a symlink
    (NotPrivate otherwise), and loses its group and other bits; without, a `path` that
    was there already is left as it is (a directory the user chose for the database).

    Existing parents are left as they are (a home directory, /tmp).
    """
    path = os.path.abspath(os.path.expanduser(path))
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for p in reversed(missing):
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:   # made meanwhile (by us or someone else): checked below
            pass
    if not claim and path not in missing:
        if not os.path.isdir(path):
            raise NotADirectoryError(f"{path} is not a directory")
        return
    st = os.lstat(path)
    check_own(path, st, directory=True)
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, stat.S_IMODE(st.st_mode) & DIR_MODE)


def exclusive_dir(path: str) -> None:
    """A directory only we can use at `path`, which the caller named with enough random
    bits that nobody else can guess it: created 0700 in an existing parent, or accepted
    if it is already ours, a real directory and exactly 0700 (made by an earlier spawn of
    the same job). Anything else raises NotPrivate: never use what another user made.
    """
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    check_own(path, st, directory=True)
    mode = stat.S_IMODE(st.st_mode)
    if mode & ~DIR_MODE:   # wider than 0700 at some time: others may have put things in it
        raise NotPrivate(f"{path} is mode {mode:04o}, not 0700; gpuflex does not use it. Remove it.")
    if mode != DIR_MODE:   # narrower (a umask like 0277): ours, made usable
        os.chmod(path, DIR_MODE)


def open_private(path: str, flags: int) -> int:
    """os.open(path, flags | O_CREAT | O_NOFOLLOW) with mode 0600; a file that already
    exists must be ours (NotPrivate otherwise) and loses its group and other bits."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    try:
        st = os.fstat(fd)
        check_own(path, st, directory=False)
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def tighten_file(path: str) -> None:
    """Drop the group and other bits of an existing file of ours (a database made before
    gpuflex made its files private); nothing when it is absent or not ours."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
        try:
            os.chmod(path, stat.S_IMODE(st.st_mode) & FILE_MODE)
        except FileNotFoundError:   # removed meanwhile (SQLite's -wal at its last close)
            return


def remove_own_dir(path: str) -> bool:
    """Remove the directory `path` and what it holds if it is ours (not a symlink);
    True when it is gone, False when it was left (absent counts as gone)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    try:
        check_own(path, st, directory=True)
    except NotPrivate:
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)
