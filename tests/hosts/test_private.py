"""gpuflex.hosts.private: what gpuflex creates for itself is its user's alone, and what it
finds must be ours (tests/e2e/test_file_security.py runs the same rules through the CLI)."""

from __future__ import annotations

import os
import stat

import pytest

from gpuflex.hosts.private import (NotPrivate, exclusive_dir, open_private, private_dir, remove_own_dir,
                                   tighten_file)


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_missing_directories_are_made_0700_and_an_existing_one_is_narrowed(tmp_path):
    target = tmp_path / "a" / "b"
    private_dir(str(target))
    assert mode(tmp_path / "a") == mode(target) == 0o700
    os.chmod(target, 0o755)
    private_dir(str(target))
    assert mode(target) == 0o700


def test_a_directory_the_user_chose_is_left_as_it_is_without_claim(tmp_path):
    os.chmod(tmp_path, 0o755)
    private_dir(str(tmp_path), claim=False)
    assert mode(tmp_path) == 0o755
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        private_dir(str(tmp_path / "file"), claim=False)


def test_a_symlink_or_a_file_is_never_used_as_a_directory(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(NotPrivate, match="symlink"):
        private_dir(str(tmp_path / "link"))
    (tmp_path / "file").write_text("")
    with pytest.raises(NotPrivate, match="not a directory"):
        exclusive_dir(str(tmp_path / "file"))


def test_an_exclusive_directory_once_wider_than_0700_is_refused(tmp_path):
    path = tmp_path / "sock-1f3a"
    exclusive_dir(str(path))
    exclusive_dir(str(path))   # an earlier spawn of the same job made it: accepted
    assert mode(path) == 0o700
    os.chmod(path, 0o770)
    with pytest.raises(NotPrivate, match="mode 0770"):
        exclusive_dir(str(path))
    os.chmod(path, 0o500)
    exclusive_dir(str(path))
    assert mode(path) == 0o700


def test_a_private_file_is_0600_and_never_followed(tmp_path):
    path = tmp_path / "exit"
    os.close(open_private(str(path), os.O_WRONLY))
    assert mode(path) == 0o600
    os.chmod(path, 0o644)
    os.close(open_private(str(path), os.O_WRONLY))
    assert mode(path) == 0o600
    os.symlink(path, tmp_path / "link")
    with pytest.raises(OSError):
        open_private(str(tmp_path / "link"), os.O_WRONLY)


def test_tighten_drops_group_and_other_bits_of_an_existing_file(tmp_path):
    path = tmp_path / "g.db"
    path.write_text("")
    os.chmod(path, 0o664)
    tighten_file(str(path))
    assert mode(path) == 0o600
    tighten_file(str(tmp_path / "absent"))


def test_only_our_own_real_directory_is_removed(tmp_path):
    (tmp_path / "job" / "logs").mkdir(parents=True)
    assert remove_own_dir(str(tmp_path / "job")) and not (tmp_path / "job").exists()
    assert remove_own_dir(str(tmp_path / "absent"))
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert not remove_own_dir(str(tmp_path / "link"))
    assert (tmp_path / "real").is_dir()
