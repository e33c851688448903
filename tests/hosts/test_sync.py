"""The `--sync` packer: which files, a deterministic tar, the size cap, links."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from gpuflex.config import HostConfig
from gpuflex.errors import TransportError, UsageError
from gpuflex.hosts import unpack
from gpuflex.hosts.sync import ignored, pack, pack_bytes, parse_gitignore, send_code
from gpuflex.hosts.transport import CommandResult


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def names(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [m.name for m in tar.getmembers()]


def matches(text: str, rel: str, is_dir: bool = False) -> bool:
    return ignored(rel, is_dir, [("", parse_gitignore(text))])


@pytest.mark.parametrize("text, rel, is_dir, expected", [
    ("*.pyc", "a/b/c.pyc", False, True),
    ("*.pyc", "a/b/c.py", False, False),
    ("/build", "build", True, True),
    ("/build", "src/build", True, False),        # anchored: the top only
    ("build", "src/build", True, True),          # unanchored: at any depth
    ("out/", "out", False, False),               # dir/ matches directories only
    ("out/", "x/out", True, True),
    ("docs/*.md", "docs/a.md", False, True),
    ("docs/*.md", "x/docs/a.md", False, False),  # a '/' inside anchors too
    ("**/logs", "a/b/logs", True, True),
    ("data/**", "data/x/y.bin", False, True),
    ("a/**/z", "a/z", False, True),
    ("a/**/z", "a/b/c/z", False, True),
    ("file?.txt", "file1.txt", False, True),
    ("file[0-9].txt", "filex.txt", False, False),
    ("file[!0-9].txt", "filex.txt", False, True),
    ("*.log\n!keep.log", "keep.log", False, False),   # the last match wins
    ("!keep.log\n*.log", "keep.log", False, True),
    ("# *.py\n\n", "a.py", False, False),             # comments and blank lines
    (r"\#x", "#x", False, True),
])
def test_gitignore_subset(text, rel, is_dir, expected):
    assert matches(text, rel, is_dir) is expected


def test_packs_files_sorted_skipping_git_and_ignored(tmp_path):
    root = tree(tmp_path / "src", {
        "train.py": "print(1)\n", "b/z.py": "", "a.txt": "", ".gitignore": "*.ckpt\nrunsdir/\n!keep.ckpt\n",
        "model.ckpt": "x", "keep.ckpt": "k", "runsdir/log.txt": "", ".git/HEAD": "ref",
        "sub/.gitignore": "local.txt\n", "sub/local.txt": "", "local.txt": "top", "sub/ok.py": "",
    })
    data, result = pack_bytes(root)
    assert names(data) == [".gitignore", "a.txt", "b", "b/z.py", "keep.ckpt", "local.txt", "sub",
                           "sub/.gitignore", "sub/ok.py", "train.py"]
    assert result.files == 8 and len(result.sha256) == 64


def test_excluded_directory_cannot_be_reopened_by_negation(tmp_path):
    root = tree(tmp_path / "src", {".gitignore": "cache/\n!cache/x.py\n", "cache/x.py": "", "a.py": ""})
    assert names(pack_bytes(root)[0]) == [".gitignore", "a.py"]


def test_tar_depends_on_contents_only(tmp_path):
    files = {"run.sh": "echo hi\n", "lib/m.py": "x = 1\n"}
    one, two = tree(tmp_path / "one", files), tree(tmp_path / "two", files)
    os.chmod(one / "run.sh", 0o755)
    os.chmod(two / "run.sh", 0o700)        # still executable: the same mode in the tar
    os.utime(two / "lib/m.py", (1, 1))
    a, pa = pack_bytes(one)
    b, pb = pack_bytes(two)
    assert a == b and pa.sha256 == pb.sha256
    with tarfile.open(fileobj=io.BytesIO(a)) as tar:
        for m in tar.getmembers():
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (0, 0, 0, "", "")
        assert tar.getmember("run.sh").mode == 0o755 and tar.getmember("lib/m.py").mode == 0o644
    (two / "lib/m.py").write_text("x = 2\n")
    assert pack_bytes(two)[1].sha256 != pa.sha256


def test_over_the_cap_names_cap_size_and_biggest_files(tmp_path):
    root = tree(tmp_path / "src", {"big.bin": "x" * 3000, "mid.bin": "x" * 2000, "small.py": "x"})
    with pytest.raises(UsageError) as err:
        pack_bytes(root, cap=4096)
    text = str(err.value)
    assert err.value.exit_code == 2
    assert "over the cap of 0.0 MiB" in text and "big.bin" in text and "mid.bin" in text
    assert text.index("big.bin") < text.index("mid.bin")
    assert "sync_cap_mib" in text


def test_cap_counts_only_what_is_sent(tmp_path):
    root = tree(tmp_path / "src", {".gitignore": "*.bin\n", "big.bin": "x" * 5000, "a.py": "x"})
    assert pack_bytes(root, cap=4096)[1].size == len("*.bin\n") + len("x")   # .gitignore and a.py


def test_link_inside_the_tree_is_kept_relative(tmp_path):
    root = tree(tmp_path / "src", {"data/real.txt": "r"})
    (root / "rel").symlink_to("data/real.txt")
    (root / "abs").symlink_to(root / "data" / "real.txt")
    with tarfile.open(fileobj=io.BytesIO(pack_bytes(root)[0])) as tar:
        assert tar.getmember("rel").issym() and tar.getmember("rel").linkname == "data/real.txt"
        assert tar.getmember("abs").linkname == "data/real.txt"


def test_link_leaving_the_tree_is_refused(tmp_path):
    root = tree(tmp_path / "src", {"a.py": ""})
    (tmp_path / "secret").write_text("s")
    (root / "leak").symlink_to(tmp_path / "secret")
    with pytest.raises(UsageError, match="leak is a link to .*secret, outside"):
        pack_bytes(root)


def test_ignored_link_leaving_the_tree_is_not_refused(tmp_path):
    root = tree(tmp_path / "src", {".gitignore": "leak\n"})
    (root / "leak").symlink_to("/etc")
    assert names(pack_bytes(root)[0]) == [".gitignore"]


# ---- sending: the host-side unpacker run in-process by a fake transport -----------------
class InProcess:
    """A transport whose `run` is `python -m gpuflex.hosts.unpack` called in this process."""

    def __init__(self, workdir: Path) -> None:
        self.host = HostConfig(name="h", workdir=str(workdir))
        self.puts: list[str] = []

    def run(self, argv, *, input=None, timeout=None):
        assert argv[1:3] == ["-m", "gpuflex.hosts.unpack"]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = unpack.main(argv[3:])
        return CommandResult(rc, out.getvalue(), err.getvalue())

    def put(self, local_path, remote_path):
        self.puts.append(remote_path)
        shutil.copyfile(local_path, remote_path)


def test_code_is_sent_once_and_unpacked_whole(tmp_path):
    root = tree(tmp_path / "src", {"run.sh": "#!/bin/sh\necho hi\n", "lib/m.py": "x = 1\n"})
    os.chmod(root / "run.sh", 0o755)
    tar = tmp_path / "code.tar"
    with tar.open("wb") as f:
        sha = pack(root, f).sha256
    t = InProcess(tmp_path / "work")
    where, sent = send_code(t, sha, str(tar))
    assert where == str(tmp_path / "work" / ".gpuflex" / "code" / sha) and sent
    assert (Path(where) / "lib/m.py").read_text() == "x = 1\n"
    assert os.access(Path(where) / "run.sh", os.X_OK)
    assert sorted(p.name for p in Path(where).parent.iterdir()) == [sha]   # no tar, no temporary left
    assert send_code(t, sha, str(tar)) == (where, False) and len(t.puts) == 1


def test_unpack_refuses_a_member_leaving_the_directory(tmp_path):
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert unpack.main([str(tmp_path / "code" / "abc"), str(evil)]) == 1
    assert "leaves the directory" in err.getvalue()
    assert not (tmp_path / "code" / "escaped").exists() and not (tmp_path / "code" / "abc").exists()


def test_unpack_failure_is_a_transport_error_naming_the_host(tmp_path):
    t = InProcess(tmp_path / "work")
    (tmp_path / "bad.tar").write_bytes(b"not a tar")
    with pytest.raises(TransportError, match="cannot unpack"):
        send_code(t, "f" * 64, str(tmp_path / "bad.tar"))


def test_a_pack_missing_here_fails_the_launch_at_once(tmp_path):
    t = InProcess(tmp_path / "work")
    with pytest.raises(TransportError, match="cannot start the job: .* is missing and the pack .* is not here"):
        send_code(t, "e" * 64, str(tmp_path / "gone.tar"))
    assert t.puts == []
