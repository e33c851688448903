"""`submit --sync`: the submit directory packed into one deterministic tar.

The pack is content-addressed: its sha256 names the directory it is unpacked into on each
host (`<workdir>/.gpuflex/code/<sha256>/`), so a second job of the same tree finds the
directory there and sends nothing. For that the tar must depend on the tree's contents
only: entries sorted by path, mtime 0, uid/gid 0 and no owner names, modes reduced to
0755/0644 (the executable bit is all a job needs from them).

Which files: every file under the directory except `.git/` and what `.gitignore` files
exclude. The `.gitignore` rules are read here, not by running `git`, so a tree that is not
a repository (or a host without git) packs the same way; the subset is the one people
write: `#` comments, blank lines, `!` negation, a trailing `/` for directories only, a `/`
at the start or inside anchoring to the `.gitignore`'s own directory, `*`, `?`, `[...]` and
`**`. As in git, the last matching line wins, a `.gitignore` in a subdirectory applies
below it, and a file in an excluded directory cannot be brought back by `!`.

A symlink is kept as a link when it resolves inside the tree (an absolute one is rewritten
relative) and refused when it leaves it: the host would not have its target, and following
it could pack files the submitter did not mean to send.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from gpuflex.errors import TransportError, UsageError
from gpuflex.hosts.private import private_dir

if TYPE_CHECKING:
    from gpuflex.hosts.transport import Transport

DEFAULT_CAP = 100 * 1024 * 1024
CODE_DIR = ".gpuflex/code"      # under a host's workdir; one directory per pack's sha256


@dataclass(frozen=True)
class Rule:
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool


@dataclass(frozen=True)
class Pack:
    sha256: str
    files: int
    size: int          # the files' bytes (not the tar's)


def _glob_regex(glob: str) -> str:
    """A gitignore glob (no leading/trailing slash) as a regex over '/'-joined paths."""
    out, i = [], 0
    while i < len(glob):
        c = glob[i]
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("/**", i) and i + 3 == len(glob):
            out.append("/.*")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            end = glob.find("]", i + 2)
            if end < 0:
                out.append(re.escape(c))
                i += 1
            else:
                body = glob[i + 1:end].replace("\\", "\\\\")
                out.append("[^" + body[1:] + "]" if body[:1] == "!" else "[" + body + "]")
                i = end + 1
        elif c == "\\" and i + 1 < len(glob):
            out.append(re.escape(glob[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def parse_gitignore(text: str) -> list[Rule]:
    rules = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        body = _glob_regex(line.lstrip("/"))
        rules.append(Rule(re.compile(("" if anchored else "(?:.*/)?") + body + r"\Z"), negate, dir_only))
    return rules


def ignored(rel: str, is_dir: bool, layers: list[tuple[str, list[Rule]]]) -> bool:
    """Whether `rel` (relative to the tree, '/'-joined) is excluded: each layer is a
    `.gitignore`'s directory (relative, '' for the top) and its rules; the last match wins."""
    verdict = False
    for base, rules in layers:
        if base and not rel.startswith(base + "/"):
            continue
        sub = rel[len(base) + 1:] if base else rel
        for rule in rules:
            if rule.dir_only and not is_dir:
                continue
            if rule.regex.match(sub):
                verdict = not rule.negate
    return verdict


def _walk(root: Path) -> list[tuple[str, Path]]:
    """The tree's entries to pack, as (relative path, path), sorted; refuses links leaving it."""
    real_root = root.resolve()
    found: list[tuple[str, Path]] = []

    def visit(d: Path, rel_dir: str, layers: list[tuple[str, list[Rule]]]) -> None:
        gi = d / ".gitignore"
        if gi.is_file() and not gi.is_symlink():
            layers = layers + [(rel_dir, parse_gitignore(gi.read_text(errors="replace")))]
        for entry in sorted(os.scandir(d), key=lambda e: e.name):
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if entry.name == ".git" and not rel_dir:
                continue
            is_link = entry.is_symlink()
            is_dir = entry.is_dir(follow_symlinks=False)
            if ignored(rel, is_dir, layers):
                continue
            path = Path(entry.path)
            if is_link:
                target = path.resolve()
                if target != real_root and real_root not in target.parents:
                    raise UsageError(f"--sync: {path} is a link to {os.readlink(path)}, outside {root}.",
                                     hint="Copy the file into the tree, or list the link in .gitignore.")
                found.append((rel, path))
            elif is_dir:
                found.append((rel, path))
                visit(path, rel, layers)
            elif entry.is_file(follow_symlinks=False):
                found.append((rel, path))
            # sockets, fifos and devices are not code: left out

    visit(root, "", [])
    return found


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"


def pack(root: Path, out: BinaryIO, *, cap: int = DEFAULT_CAP) -> Pack:
    """Write the tar of `root` to `out`; UsageError (exit 2) before writing when the files
    pass `cap` bytes, naming the cap, the size found and the biggest files."""
    root = Path(root)
    entries = _walk(root)
    sizes = [(p.stat().st_size, rel) for rel, p in entries if p.is_file() and not p.is_symlink()]
    total = sum(s for s, _ in sizes)
    if total > cap:
        biggest = ", ".join(f"{rel} ({_mib(s)})" for s, rel in sorted(sizes, key=lambda x: (-x[0], x[1]))[:5])
        raise UsageError(f"--sync: {root} holds {_mib(total)} to send, over the cap of {_mib(cap)}; "
                         f"biggest: {biggest}.",
                         hint="List what the job does not need in .gitignore, or raise [jobs] sync_cap_mib.")
    digest = hashlib.sha256()
    tee = _Tee(out, digest)
    with tarfile.open(fileobj=tee, mode="w|", format=tarfile.PAX_FORMAT) as tar:   # a stream: no seeks
        for rel, path in entries:
            info = tarfile.TarInfo(rel)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_symlink():
                info.type, info.mode = tarfile.SYMTYPE, 0o777
                info.linkname = os.path.relpath(path.resolve(), path.parent.resolve())
                tar.addfile(info)
            elif path.is_dir():
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
                info.size = path.stat().st_size
                with path.open("rb") as f:
                    tar.addfile(info, f)
    return Pack(sha256=digest.hexdigest(), files=len(sizes), size=total)


def pack_bytes(root: Path, *, cap: int = DEFAULT_CAP) -> tuple[bytes, Pack]:
    buf = io.BytesIO()
    result = pack(root, buf, cap=cap)
    return buf.getvalue(), result


class _Tee(io.RawIOBase):
    """A write-only file that hashes what passes through it."""

    def __init__(self, out: BinaryIO, digest: Any) -> None:   # a hashlib object
        self.out, self.digest = out, digest

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        self.digest.update(b)
        self.out.write(b)
        return len(b)


def code_dir(workdir: str, sha256: str) -> str:
    """Where a pack is unpacked on a host (`~` left for the host to expand)."""
    return f"{workdir.rstrip('/')}/{CODE_DIR}/{sha256}"


def send_code(transport: "Transport", sha256: str, tar_path: str) -> tuple[str, bool]:
    """Make sure the host holds the pack `sha256` unpacked; returns its absolute directory
    there and whether the tar had to be sent (False: a job before this one sent it).

    The same steps on every kind of host (the local one copies instead of SFTP), through
    the host-side `python -m gpuflex.hosts.unpack`."""
    host = transport.host
    word, where = _unpack(transport, [code_dir(host.workdir, sha256)])
    if word == "present":
        return where, False
    if not os.path.isfile(tar_path):   # packed by another user's gpuflex, or the cache was cleared
        # "cannot start": the launch fails at once (lifecycle), since retrying cannot help
        raise TransportError(host.name, f"--sync: cannot start the job: {where} is missing and the pack "
                                        f"{tar_path} is not here to send; submit it again from its directory.")
    remote_tar = f"{where}.tar.{os.getpid()}"
    transport.put(tar_path, remote_tar)
    word, where = _unpack(transport, [where, remote_tar], timeout=host.command_timeout_s + 300)
    return where, True


def _unpack(transport: "Transport", args: list[str], timeout: float | None = None) -> tuple[str, str]:
    res = transport.run([transport.host.python, "-m", "gpuflex.hosts.unpack", *args], timeout=timeout)
    words = res.stdout.strip().split(" ", 1)
    if res.returncode != 0 or len(words) != 2 or words[0] not in ("present", "absent"):
        said = ((res.stderr + res.stdout).strip() or f"exit {res.returncode}").splitlines()[0][:300]
        raise TransportError(transport.host.name, f"--sync: {said}")
    return words[0], words[1]


CACHE = "~/.local/state/gpuflex/code"   # the submitter's packs, until the hosts hold them


def cached_tar(sha256: str, cache: str = CACHE) -> str:
    return os.path.join(os.path.expanduser(cache), f"{sha256}.tar")


def pack_to_cache(root: Path, *, cap: int = DEFAULT_CAP, cache: str = CACHE) -> Pack:
    """Pack `root` into `<cache>/<sha256>.tar` (0600 in a 0700 directory: the code may be
    private); an identical pack already there is kept."""
    private_dir(cache)
    fd, tmp = tempfile.mkstemp(prefix=".pack-", dir=os.path.expanduser(cache))
    try:
        with os.fdopen(fd, "wb") as f:
            result = pack(root, f, cap=cap)
        os.replace(tmp, cached_tar(result.sha256, cache))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return result
