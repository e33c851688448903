"""gpuflex.elastic.sharding.checkpoints: each member's shards saved alone, read back through
the merged metadata of every rank, and a .metadata that is not ours or not DCP's refused
(in this process, without a process group; tests/e2e/test_fsdp_reshard_processes.py runs real members)."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed import checkpoint as dcp

from gpuflex.elastic.sharding import checkpoints as sc


def test_ranks_written_alone_are_read_back_as_one_checkpoint(tmp_path):
    step = tmp_path / sc.DCP_DIR / sc.step_name(3)
    sc.write_rank({"w": torch.arange(6.0), "step": 3}, str(step), 0)
    sc.write_rank({"w": torch.arange(6.0), "step": 3}, str(step), 1)
    assert sorted(os.listdir(step)) == ["rank-0", "rank-1"]
    merged = sc.merged_metadata(str(step))
    assert {k.split("/")[0] for k in {v.relative_path for v in merged.storage_data.values()}} == {"rank-0"}
    into = {"w": torch.zeros(6), "step": 0}
    with sc.alone():
        dcp.load(into, storage_reader=sc.SafeReader(str(step)), no_dist=True)
    assert torch.equal(into["w"], torch.arange(6.0)) and into["step"] == 3


def test_a_directory_without_ranks_is_no_checkpoint(tmp_path):
    with pytest.raises(sc.UnsafeCheckpoint, match="holds no rank-N directory"):
        sc.merged_metadata(str(tmp_path))


def test_metadata_others_may_write_is_never_read(tmp_path):
    sc.write_rank({"w": torch.ones(2)}, str(tmp_path / "step-1"), 0)
    meta = tmp_path / "step-1" / "rank-0" / ".metadata"
    assert sc.read_metadata(str(meta)) is not None
    os.chmod(meta, 0o664)
    with pytest.raises(sc.UnsafeCheckpoint, match="writable by group or others"):
        sc.read_metadata(str(meta))


def test_a_pickle_of_anything_but_dcps_metadata_is_refused(tmp_path):
    evil = tmp_path / "rank-0"
    evil.mkdir(mode=0o700)
    (evil / ".metadata").write_bytes(pickle.dumps(shutil.rmtree))
    with pytest.raises(sc.UnsafeCheckpoint, match="refers to shutil.rmtree"):
        sc.read_metadata(str(evil / ".metadata"))
    (evil / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(sc.UnsafeCheckpoint, match="holds a dict, not DCP metadata"):
        sc.read_metadata(str(evil / ".metadata"))


def test_a_light_checkpoint_names_a_step_never_a_path(tmp_path):
    assert sc.path_of(str(tmp_path), "step-12") == str(tmp_path / "dcp" / "step-12")
    for name in ("../x", "step-1/../../etc", "/abs", "step-"):
        with pytest.raises(sc.UnsafeCheckpoint, match="not step-<N>"):
            sc.path_of(str(tmp_path), name)


def test_prune_keeps_what_the_light_files_name(tmp_path):
    for name in ("step-1", "step-2", "step-3", "step-4.tmp"):
        (tmp_path / "dcp" / name).mkdir(parents=True)
    assert sorted(sc.prune(str(tmp_path), {"step-2", "step-3"})) == ["step-1", "step-4.tmp"]
    assert sorted(os.listdir(tmp_path / "dcp")) == ["step-2", "step-3"]


def test_a_worker_imports_no_distributed_checkpoint_until_a_sharded_job_needs_it():
    """DCP's import (~0.9 s of CPU: it loads DTensor) is paid by a sharded job only, not by
    every worker of a data-parallel one; `SafeReader` still comes from this module."""
    code = ("import sys, gpuflex.elastic, gpuflex.elastic.run.runtime\n"
            "assert 'torch.distributed.checkpoint' not in sys.modules, 'imported at start'\n"
            "from gpuflex.elastic.sharding import checkpoints as sc\n"
            "from torch.distributed.checkpoint import FileSystemReader\n"
            "assert issubclass(sc.SafeReader, FileSystemReader) and sc.SafeReader.__name__ == 'SafeReader'\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
