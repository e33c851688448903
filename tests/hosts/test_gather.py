"""The host side of `gpuflex fetch` (gpuflex.hosts.gather): links resolved and never
followed out of the job's directory."""

from __future__ import annotations

import json

from gpuflex.hosts import gather


def test_links_inside_are_copied_as_files_links_out_and_to_directories_left_out(tmp_path, capsys):
    root = tmp_path / "job"
    (root / "out" / "d").mkdir(parents=True)
    (root / "out" / "a.txt").write_text("a")
    (root / "b.txt").write_text("b")
    (tmp_path / "outside").write_text("no")
    (root / "out" / "in").symlink_to(root / "b.txt")
    (root / "out" / "away").symlink_to(tmp_path / "outside")
    (root / "out" / "loop").symlink_to(root)
    got = gather.gather(str(root), "out")["ok"]
    assert got["kind"] == "dir" and got["dirs"] == ["d"]
    assert sorted(got["files"]) == [["a.txt", str(root / "out" / "a.txt")], ["in", str(root / "b.txt")]]
    assert sorted(got["skipped"]) == [["away", "a link leaving the job's directory"],
                                      ["loop", "a link to a directory"]]
    assert gather.gather(str(root), "out/away") == {
        "error": f"out/away leads to {tmp_path / 'outside'}, outside the job's directory {root}", "missing": False}
    assert gather.gather(str(root), "nope")["missing"] is True
    assert gather.gather(str(tmp_path / "gone"), "x")["missing"] is True
    assert gather.main([str(root), "b.txt"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]["files"] == [["", str(root / "b.txt")]]
