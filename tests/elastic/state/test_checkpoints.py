"""On-disk checkpoints under corruption, a full disk and a planted pickle: a bad file is
detected and never resumed from, the previous good one is used, and a failed write leaves
training going on. No processes: the training state is driven directly."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from gpuflex.elastic.state import checkpoints
from gpuflex.elastic.state.checkpoints import (HEAD, CheckpointError, load_checkpoint, load_newest_good,
                                         previous_path, save_checkpoint)
from gpuflex.elastic.state.training import CHECKPOINT_FILE, NO_CHECKPOINT_EXIT, TrainingState
from gpuflex.elastic.data.sampler import ElasticSampler
from gpuflex.elastic.state.tree import Registry
from tests import REPO
from tests.conftest import tmpfs


class Job:
    """What an ElasticRun registers: a model with buffers, Adam (int-keyed state), a
    scheduler, user counters; the runtime's own step, logs and RNG states ride along."""

    def __init__(self, ckdir, width: int = 8, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width),
                                         torch.nn.Linear(width, 2))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.extra = {"seen": 0, "by_class": {0: 1.5, 1: (2, 3)}, "tag": b"\x00\xff"}
        self.registry = Registry()
        for name, obj in (("model", self.model), ("optimizer", self.opt), ("scheduler", self.sched),
                          ("extra.counters", self.extra)):
            self.registry.add(name, obj)
        self.state = TrainingState(registry=self.registry, model=self.model,
                                   sampler=ElasticSampler(64, 8, epochs=2), distributed=False,
                                   checkpoint_dir=str(ckdir))
        self.width = width

    def train(self, steps: int = 1) -> None:
        for _ in range(steps):
            x = torch.randn(8, self.width) + random.random() + float(np.random.rand())
            self.opt.zero_grad()
            self.model(x).square().mean().backward()
            self.opt.step()
            self.sched.step()
            self.extra["seen"] += 8
            self.state.confirm_step(list(range(8)), 1.0, 1)

    def save(self) -> bool:
        return self.state.checkpoint(0, 1)

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.state_dict().values()]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.reshape(-1).view(torch.uint8).equal(
        b.reshape(-1).view(torch.uint8))


def data_start(path) -> int:
    with open(path, "rb") as f:
        head = f.read(HEAD)
    return HEAD + int.from_bytes(head[-8:], "little")


def flip_floats(path, count: int = 8) -> None:
    """Flip the top exponent bit of `count` float32s in the tensor data (values off by up
    to ~1e38, as seen in the field)."""
    raw = bytearray(open(path, "rb").read())
    start, end = data_start(path), len(raw) - checkpoints.DIGEST
    for k in range(count):
        pos = start + (k * 4 * 7) % ((end - start) // 4 * 4)
        raw[pos + 3] ^= 0x40
    open(path, "wb").write(bytes(raw))


@pytest.fixture
def job(tmp_path):
    return Job(tmp_path / "ck")


def two_checkpoints(job):
    """A checkpoint at step 3 (now the previous one) and one at step 5 (the newest)."""
    job.train(3)
    assert job.save()
    at3 = job.params()
    job.train(2)
    assert job.save()
    return at3


def resume(tmp_path):
    fresh = Job(tmp_path / "ck", seed=99)
    assert fresh.state.load_disk_checkpoint() is True
    return fresh


def test_bit_flipped_floats_are_detected_and_the_previous_checkpoint_is_used(job, tmp_path, caplog):
    at3 = two_checkpoints(job)
    newest = tmp_path / "ck" / CHECKPOINT_FILE
    flip_floats(newest)
    with pytest.raises(CheckpointError, match="failed its checksum"):
        load_checkpoint(str(newest))
    with caplog.at_level(logging.INFO, logger="gpuflex"):
        fresh = resume(tmp_path)
    assert fresh.state.step == 3
    assert all(bits_equal(a, b) for a, b in zip(fresh.params(), at3))
    assert f"{newest} failed its checksum (the file is corrupted); resuming from the previous one " \
           f"({previous_path(str(newest))}) at step 3" in caplog.text
    assert "resumed from checkpoint at step 3" in caplog.text
    # the refused file is set aside: the next save keeps the good one as the previous one
    assert sorted(os.listdir(tmp_path / "ck")) == ["checkpoint.prev.pt", "checkpoint.pt.refused"]
    fresh.train(1)
    assert fresh.save()
    assert load_checkpoint(previous_path(str(newest)))["state"]["step"] == 3


def test_a_truncated_checkpoint_is_detected_and_the_previous_one_is_used(job, tmp_path):
    at3 = two_checkpoints(job)
    newest = tmp_path / "ck" / CHECKPOINT_FILE
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) * 2 // 3)
    with pytest.raises(CheckpointError, match="is truncated"):
        load_checkpoint(str(newest))
    fresh = resume(tmp_path)
    assert fresh.state.step == 3 and all(bits_equal(a, b) for a, b in zip(fresh.params(), at3))


def test_every_single_bit_flip_anywhere_in_the_file_is_refused(tmp_path):
    path = str(tmp_path / "c.pt")
    save_checkpoint(path, {"w": torch.arange(5, dtype=torch.float32), "step": 3, "t": (1, b"x")})
    raw = open(path, "rb").read()
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 1 << (i % 8)
        open(path, "wb").write(bytes(bad))
        with pytest.raises(CheckpointError):
            load_checkpoint(path)


def test_when_every_checkpoint_is_bad_the_worker_ends_with_one_clear_line(job, tmp_path, caplog):
    two_checkpoints(job)
    newest = str(tmp_path / "ck" / CHECKPOINT_FILE)
    flip_floats(newest)
    with open(previous_path(newest), "r+b") as f:
        f.truncate(100)
    fresh = Job(tmp_path / "ck", seed=99)
    with pytest.raises(SystemExit) as ex:
        fresh.state.load_disk_checkpoint()
    assert ex.value.code == NO_CHECKPOINT_EXIT
    (rec,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert re.fullmatch(re.escape(
        f"gpuflex: no usable checkpoint: {newest} failed its checksum (the file is corrupted); "
        f"{previous_path(newest)} is truncated or corrupted (100 bytes where its header says at least "
        ) + "[0-9]+" + re.escape("); the job cannot resume and does not start over"), rec.getMessage())
    assert rec.exc_info is None and "Traceback" not in caplog.text
    assert fresh.state.step == 0


def test_no_checkpoint_at_all_is_a_fresh_start_and_temp_leftovers_are_removed(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "checkpoint.pt.tmp.4242").write_bytes(b"")            # a write cut short
    (ck / "checkpoint.pt.tmp.4243").write_bytes(b"half a file")
    fresh = Job(ck)
    assert fresh.state.load_disk_checkpoint() is False and fresh.state.step == 0
    assert os.listdir(ck) == []


class Marker:
    """A pickle that would run code on load: it writes a file."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (subprocess.call, (["touch", self.path],))


@pytest.mark.parametrize("content", ["pickle", "garbage", "empty"])
def test_a_planted_pickle_or_garbage_is_refused_and_never_run(job, tmp_path, content, caplog):
    marker = tmp_path / "pwned"
    at3 = two_checkpoints(job)
    newest = tmp_path / "ck" / CHECKPOINT_FILE
    if content == "pickle":
        torch.save({"state": Marker(marker), "logs": Marker(marker)}, newest)
    else:
        newest.write_bytes(os.urandom(5000) if content == "garbage" else b"")
    with caplog.at_level(logging.INFO, logger="gpuflex"):
        fresh = resume(tmp_path)
    assert fresh.state.step == 3 and all(bits_equal(a, b) for a, b in zip(fresh.params(), at3))
    assert ("is truncated (0 bytes)" if content == "empty" else "is not a gpuflex checkpoint") in caplog.text
    # both planted: refused, the worker ends; the pickle never ran
    for p in (newest, tmp_path / "ck" / "checkpoint.prev.pt"):
        torch.save({"state": Marker(marker)}, p)
    with pytest.raises(SystemExit):
        Job(tmp_path / "ck").state.load_disk_checkpoint()
    assert not marker.exists()


def test_a_failed_write_leaves_training_going_with_the_old_checkpoint(job, tmp_path, monkeypatch, caplog):
    """ENOSPC reported at fsync (as NFS and quota'd disks do): no exception out of the
    checkpoint call, no temp file, the error recorded, the next checkpoint works."""
    job.train(2)
    assert job.save()
    job.train(1)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoints.os, "fsync", full)
    before = job.state.last_checkpoint
    assert job.save() is False
    assert job.state.last_checkpoint > before   # retried an interval later, not at every step
    assert "No space left on device" in job.state.last_checkpoint_error
    assert job.state.checkpoint_failures == 1
    assert "checkpoint at step 3 failed: No space left on device" in caplog.text
    assert os.listdir(tmp_path / "ck") == [CHECKPOINT_FILE]
    assert load_checkpoint(str(tmp_path / "ck" / CHECKPOINT_FILE))["state"]["step"] == 2
    monkeypatch.undo()
    job.train(1)
    assert job.save() and job.state.last_checkpoint_error is None
    assert load_checkpoint(str(tmp_path / "ck" / CHECKPOINT_FILE))["state"]["step"] == 4


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs (needs root)."""
    with tmpfs(tmp_path / "disk", "256k") as d:
        yield d


def test_a_full_disk_is_a_failed_checkpoint_not_a_failed_job(tiny_disk, caplog):
    job = Job(tiny_disk / "ck", width=64)   # ~50 KB a checkpoint
    job.train(1)
    assert job.save()
    (tiny_disk / "ck" / "checkpoint.pt.tmp.1").write_bytes(b"")   # an earlier try's leftover
    filler = tiny_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:   # fill the disk
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    job.train(1)
    assert job.save() is False                           # no exception out of it
    assert "No space left on device" in job.state.last_checkpoint_error
    assert os.listdir(tiny_disk / "ck") == [CHECKPOINT_FILE]   # temp files gone, the old one intact
    assert load_checkpoint(str(tiny_disk / "ck" / CHECKPOINT_FILE))["state"]["step"] == 1
    filler.unlink()
    job.train(1)
    assert job.save() and job.state.last_checkpoint_error is None
    assert sorted(os.listdir(tiny_disk / "ck")) == ["checkpoint.prev.pt", CHECKPOINT_FILE]
    assert Job(tiny_disk / "ck", width=64, seed=5).state.load_disk_checkpoint()


def test_a_training_state_round_trips_bit_exact(job, tmp_path):
    job.train(3)
    job.state.samples[7] = [1, 2]
    assert job.save()
    saved = job.registry.capture()
    expect_rng = (torch.rand(4), random.random(), np.random.rand(3))
    logs = job.state.logs_payload()
    fresh = resume(tmp_path)
    assert fresh.state.step == 3 and fresh.state.logs_payload() == logs
    got = fresh.registry.capture()
    assert all(bits_equal(a, b) for a, b in zip(got["model"].values(), saved["model"].values()))
    for i, s in saved["optimizer"]["state"].items():   # Adam's state, keyed by int
        assert got["optimizer"]["state"][i].keys() == s.keys()
        assert all(bits_equal(got["optimizer"]["state"][i][k], v) for k, v in s.items())
    assert got["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]
    assert got["scheduler"] == saved["scheduler"]
    assert got["extra.counters"] == saved["extra.counters"] == {"seen": 24, "by_class": {0: 1.5, 1: (2, 3)},
                                                                "tag": b"\x00\xff"}
    rng = (torch.rand(4), random.random(), np.random.rand(3))
    assert bits_equal(rng[0], expect_rng[0]) and rng[1] == expect_rng[1] and (rng[2] == expect_rng[2]).all()


def test_checkpoints_are_owner_only_and_the_previous_one_is_kept(job, tmp_path):
    for _ in range(3):
        job.train(1)
        assert job.save()
    ck = tmp_path / "ck"
    assert sorted(os.listdir(ck)) == ["checkpoint.prev.pt", CHECKPOINT_FILE]
    assert stat.S_IMODE(os.stat(ck).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(ck / f).st_mode) == 0o600 for f in os.listdir(ck))
    found = load_newest_good(str(ck / CHECKPOINT_FILE))
    assert found.payload["state"]["step"] == 3 and found.refused == ()
    assert load_checkpoint(str(ck / "checkpoint.prev.pt"))["state"]["step"] == 2


EXAMPLE = str(REPO / "examples" / "elastic_mlp.py")


def run_example(tmp_path, name: str, epochs: int, ckdir=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEX_")}
    if ckdir is not None:   # a checkpoint at every step
        env.update(GPUFLEX_CHECKPOINT_DIR=str(ckdir), GPUFLEX_CHECKPOINT_INTERVAL_S="1e-9")
    return subprocess.run([sys.executable, EXAMPLE, "--hidden", "16", "--seed", "3", "--epochs", str(epochs),
                           "--report", str(tmp_path / f"{name}.json")],
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_script_resumes_from_the_previous_checkpoint_and_ends_exact_or_fails_with_one_line(tmp_path):
    """The example script, standalone (one process, no services): its newest checkpoint
    bit-flipped, it resumes from the previous one and ends with the parameters of an
    uninterrupted run; with both bad it exits NO_CHECKPOINT_EXIT with one line, no traceback."""
    ck = tmp_path / "ck"
    assert run_example(tmp_path, "ref", 2).returncode == 0
    assert run_example(tmp_path, "first", 1, ck).returncode == 0          # checkpoints at steps 31, 32
    flip_floats(ck / CHECKPOINT_FILE)
    p = run_example(tmp_path, "resumed", 2, ck)
    assert p.returncode == 0, p.stderr
    assert "failed its checksum" in p.stderr and "resumed from checkpoint at step 31" in p.stderr
    ref, got = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("ref", "resumed"))
    assert got["steps"] == ref["steps"] == 64 and got["params"] == ref["params"]
    assert got["step_log"][-1][0] == 63 and got["samples"] == ref["samples"]
    for f in (CHECKPOINT_FILE, "checkpoint.prev.pt"):
        flip_floats(ck / f)
    p = run_example(tmp_path, "failed", 2, ck)
    assert p.returncode == NO_CHECKPOINT_EXIT
    assert p.stderr.strip().splitlines() == [
        f"gpuflex: no usable checkpoint: {ck / CHECKPOINT_FILE} failed its checksum (the file is corrupted); "
        f"{ck / 'checkpoint.prev.pt'} failed its checksum (the file is corrupted); the job cannot resume "
        "and does not start over"]


def test_a_fifo_or_a_device_in_place_of_the_checkpoint_is_refused_without_hanging(tmp_path):
    fifo, dev = tmp_path / "fifo.pt", tmp_path / "dev.pt"
    os.mkfifo(fifo)
    dev.symlink_to("/dev/zero")
    for p in (fifo, dev):
        with pytest.raises(CheckpointError, match="is not a regular file"):
            load_checkpoint(str(p))


def test_a_planted_temp_file_or_link_is_never_written_through(tmp_path, monkeypatch):
    """Someone who could write in the directory plants a link where the next temp file goes."""
    ck = tmp_path / "ck"
    ck.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    monkeypatch.setattr(checkpoints, "remove_temp_files", lambda path: [])   # planted after the cleanup
    (ck / f"checkpoint.pt.tmp.{os.getpid()}").symlink_to(victim)
    with pytest.raises(FileExistsError):
        save_checkpoint(str(ck / CHECKPOINT_FILE), {"w": torch.ones(2)})
    assert victim.read_text() == "keep"
