"""`submit --sync` on the local host (issue 33): the same layout as over SSH, through a
local copy; the workers run in `<workdir>/.gpuflex/code/<sha256>`, not where submit ran, and `gpuflex fetch` copies back
what they wrote there."""

from __future__ import annotations

import os

SCRIPT = "#!/bin/sh\necho \"ran in $(pwd)\"\ncat data.txt\necho result > result.txt\n"


def test_local_sync_runs_in_the_code_directory(gf, home):
    src = home / "src"
    src.mkdir()
    (src / "mine.sh").write_text(SCRIPT)
    os.chmod(src / "mine.sh", 0o755)
    (src / "data.txt").write_text("local data\n")
    job = gf.submit(["./mine.sh"], "--sync", "--workdir", str(src))
    done = gf.wait_final(job["id"])
    assert done["state"] == "succeeded", done
    code = home / "work" / ".gpuflex" / "code" / job["code_sha256"]
    out = gf.ok("logs", str(job["id"])).stdout
    assert f"ran in {code}" in out and "local data" in out
    assert [e["kind"] for e in gf.json("events", str(job["id"])) if e["kind"] == "code"] == ["code"]
    gf.ok("fetch", str(job["id"]), "result.txt", "--to", str(home / "back"))
    assert (home / "back" / "result.txt").read_text() == "result\n"
    assert not (src / "result.txt").exists()   # written in the sent copy, not the submit directory
