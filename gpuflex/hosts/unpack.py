"""Host side of `submit --sync` (standard library only, like hostops): one code directory.

    python -m gpuflex.hosts.unpack DIR          prints "present DIR" or "absent DIR"
    python -m gpuflex.hosts.unpack DIR TAR      unpacks TAR into DIR, removes TAR

DIR (`~` is this user's home) is `<workdir>/.gpuflex/code/<sha256>`; it is printed
absolute, so the control side can send the tar next to it by SFTP, whose paths know no
`~`. The tar is unpacked into a temporary sibling and renamed into place, so a DIR that
exists is whole: two jobs sending the same tree at once both end with one good copy.
Tar members are checked by tarfile's "data" filter where Python has it (3.12, and 3.11.4
on), else here: no absolute paths, no `..`, no link leaving DIR.
"""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
import tempfile


def _safe(members: list[tarfile.TarInfo], dest: str) -> None:
    root = os.path.realpath(dest)
    for m in members:
        target = os.path.realpath(os.path.join(dest, m.name))
        link = os.path.realpath(os.path.join(os.path.dirname(target), m.linkname)) if m.issym() else root
        for p in (target, link):
            if p != root and not p.startswith(root + os.sep):
                raise ValueError(f"tar member {m.name!r} leaves the directory")
        if not (m.isfile() or m.isdir() or m.issym()):
            raise ValueError(f"tar member {m.name!r} is not a file, directory or link")


def unpack(dest: str, tar_path: str) -> None:
    parent = os.path.dirname(dest)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".unpack-", dir=parent)
    try:
        with tarfile.open(tar_path) as tar:
            members = tar.getmembers()
            _safe(members, tmp)
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, members, filter="data")
            else:  # pragma: no cover - Python before 3.11.4
                tar.extractall(tmp, members)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isdir(dest):   # not "another job put it there first"
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.unlink(tar_path)
        except FileNotFoundError:
            pass


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    dest = os.path.abspath(os.path.expanduser(argv[0]))
    if len(argv) == 1:
        os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)   # where the tar goes
        print(("present " if os.path.isdir(dest) else "absent ") + dest)
        return 0
    try:
        unpack(dest, argv[1])
    except (OSError, ValueError, tarfile.TarError) as e:
        print(f"cannot unpack into {dest}: {e}", file=sys.stderr)
        return 1
    print("present " + dest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
