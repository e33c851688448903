"""Host side of `gpuflex fetch` (standard library only, like unpack): what to copy back.

    python -m gpuflex.hosts.gather ROOT PATH

ROOT is the directory a job's workers ran in (`~` is this user's home), PATH a path
relative to it. Prints one JSON line, {"ok": {...}} or {"error": WHY, "missing": bool}:

    kind     "file" or "dir"
    files    [[rel, real], ...]: each file to copy, `rel` under PATH ("" for PATH itself),
             `real` its absolute path with no link in it (what the control side reads)
    dirs     [rel, ...]: the directories, so that empty ones are made too
    skipped  [[rel, why], ...]: what is not copied, and why

Links are resolved here, where they point, and never followed out of ROOT: a link (or
PATH itself) whose target is outside the job's directory would hand the fetcher a file the
job did not write, such as another job's on a host reached through one shared account.
A link to a file inside ROOT is copied as that file; a link to a directory is left out
(a loop cannot make the copy endless). The files are read by their resolved paths in a
second step (SFTP, or a copy), so a link the job swaps in between is not checked again:
the job's own processes can race that, no other user's.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def gather(root: str, path: str) -> dict[str, Any]:
    real_root = os.path.realpath(os.path.expanduser(root))
    if not os.path.isdir(real_root):
        return {"error": f"the job's directory {root} is not there", "missing": True}
    target = os.path.join(real_root, path)
    real = os.path.realpath(target)
    if not _inside(real, real_root):
        return {"error": f"{path} leads to {real}, outside the job's directory {real_root}", "missing": False}
    if not os.path.lexists(target) or not os.path.exists(real):
        return {"error": f"{path} is not in {real_root}", "missing": True}
    if os.path.isfile(real):
        return {"ok": {"kind": "file", "files": [["", real]], "dirs": [], "skipped": []}}
    if not os.path.isdir(real):
        return {"error": f"{path} in {real_root} is not a file or a directory", "missing": False}
    files: list[list[str]] = []
    dirs: list[str] = []
    skipped: list[list[str]] = []

    def unreadable(e: OSError) -> None:
        skipped.append([os.path.relpath(e.filename or real, real), e.strerror or str(e)])

    for top, subdirs, names in os.walk(real, onerror=unreadable):   # links to directories: not entered
        for name in sorted(subdirs) + sorted(names):
            full = os.path.join(top, name)
            rel = os.path.relpath(full, real)
            if os.path.islink(full):
                to = os.path.realpath(full)
                if not _inside(to, real_root):
                    skipped.append([rel, "a link leaving the job's directory"])
                elif os.path.isfile(to):
                    files.append([rel, to])
                else:
                    skipped.append([rel, "a link to a directory" if os.path.isdir(to) else "a broken link"])
            elif os.path.isdir(full):
                dirs.append(rel)
            elif os.path.isfile(full):
                files.append([rel, full])
            else:
                skipped.append([rel, "not a regular file"])
    return {"ok": {"kind": "dir", "files": files, "dirs": dirs, "skipped": skipped}}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(gather(argv[0], argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
