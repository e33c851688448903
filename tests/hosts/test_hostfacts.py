"""gpuflex.hosts.hostfacts in this process: what the doctor's host-side program reports of
this python, gpuflex, torch and a workdir (tests/e2e/test_doctor_host_programs.py runs it as the
doctor does, as a process fed its own source)."""

from __future__ import annotations

import json
import os
import stat
import sys

from gpuflex.hosts import hostfacts


def test_python_gpuflex_and_torch_are_described():
    assert hostfacts.python_facts() == {"version": sys.version.split()[0], "executable": sys.executable}
    assert hostfacts.gpuflex_facts()["path"].endswith("gpuflex")
    import torch

    facts = hostfacts.torch_facts()
    assert (facts["version"], facts["gloo"]) == (torch.__version__, True)
    assert facts["device_count"] == (torch.cuda.device_count() if facts["cuda_available"] else 0)


def test_a_missing_workdir_is_tried_and_left_missing(tmp_path):
    path = tmp_path / "a" / "b"
    facts = hostfacts.workdir_facts(str(path))
    assert (facts["existed"], facts["is_dir"], facts["owned"], facts["mode"]) == (False, True, True, 0o700)
    assert facts["modes_kept"] and facts["error"] is None and facts["free_bytes"] > 0
    assert not (tmp_path / "a").exists()


def test_an_existing_workdir_is_left_as_it_was(tmp_path):
    os.chmod(tmp_path, 0o755)
    before = sorted(os.listdir(tmp_path))
    facts = hostfacts.workdir_facts(str(tmp_path))
    assert (facts["existed"], facts["mode"], facts["modes_kept"]) == (True, 0o755, True)
    assert sorted(os.listdir(tmp_path)) == before and stat.S_IMODE(tmp_path.stat().st_mode) == 0o755


def test_a_file_in_place_of_the_workdir_is_an_error(tmp_path):
    (tmp_path / "f").write_text("")
    facts = hostfacts.workdir_facts(str(tmp_path / "f"))
    assert facts["error"] == f"not a directory: {tmp_path / 'f'}" and not facts["modes_kept"]
    under = hostfacts.workdir_facts(str(tmp_path / "f" / "sub"))
    assert under["error"] is not None and "Not a directory" in under["error"]


def test_main_prints_one_json_line(tmp_path, capsys):
    assert hostfacts.main([str(tmp_path)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert set(json.loads(line)) == {"python", "gpuflex", "torch", "workdir"}
