"""A sharded run's on-disk checkpoints (issue 13): the shards in a distributed checkpoint
(torch.distributed.checkpoint, DCP), the light state in the data-parallel run's file.

Under the job's checkpoint directory:

    dcp/step-<N>/        DCP's files of step N: one per rank that wrote it, and .metadata
    checkpoint.pt        the light state (step, logs, RNG, sampler, split, param groups,
                         scheduler: checkpoints.py's format) and "dcp": "step-<N>";
                         checkpoint.prev.pt the one before, naming its own DCP directory

Every member writes its own shards (`sharded.save`: into step-<N>.tmp, renamed into place
by rank 0 once all are written); then rank 0 writes checkpoint.pt, then removes the DCP
directories neither light file names. A crash or a full disk anywhere leaves the previous
pair whole. DCP reads back at any world size: each member reads the rows of its new
shards, whoever wrote them. So a job whose shards are lost (a member killed, the store
lost) restarts from here at whatever size it gets, and replays the steps since exactly
(the light state holds the sampler's place and the RNG). Every host of a sharded job must
see the same checkpoint directory (a shared file system) for the shards written on one
host to be read on another.

No pickle travels between the members: DCP's collective save and load would gather plans
and broadcast its metadata as pickles over the process group. So each member saves alone
(`no_dist`) into `step-N/rank-K/`, with its own .metadata (its chunks, at their global
offsets); the members agree over the group, with a plain all-reduce, that all of them
wrote; and a load reads every rank's .metadata from disk and merges them into one
(`SafeReader`): each member then reads the rows of its new shards from whichever files hold
them, at any world size. DCP writes its .metadata with pickle: it is read here with an
unpickler that builds only DCP's metadata classes, torch.Size, dtypes and paths, and only
from directories and files that this user owns and nobody else may write: never what
another user could have put there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import io
import logging
import os
import pickle
import re
import shutil
import warnings
from typing import Any, Iterator

import torch

from gpuflex.elastic.protocol.run_dir import others_may_write

# torch.distributed.checkpoint is imported where it is used, not here: importing it costs
# ~0.9 s of CPU (it loads DTensor), and every worker imports this module (a data-parallel
# job's resume checks the names below) though only a sharded job reads or writes DCP.

log = logging.getLogger(__name__)

DCP_DIR = "dcp"
_NAME = re.compile(r"step-(\d+)")
_RANK = re.compile(r"rank-(\d+)")
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta",
        "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}


class UnsafeCheckpoint(Exception):
    """A distributed checkpoint this process will not read; the message says why."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                  torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"its .metadata refers to {module}.{name}, which a DCP checkpoint never holds")


def check_private(path: str) -> None:
    """`path` (a file or directory) is this user's and nobody else may write it."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise UnsafeCheckpoint(f"{path}: {e.strerror}") from None
    found = others_may_write(st)
    if found is not None:
        raise UnsafeCheckpoint(f"{path} {found[0]}")


def write_rank(state: dict[str, Any], directory: str, rank: int) -> None:
    """This member's shards (and its copy of what is replicated) into `directory`/rank-K,
    by DCP without any collective."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with alone():
        dcp.save(state, storage_writer=FileSystemWriter(os.path.join(directory, f"rank-{rank}")), no_dist=True)


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """DCP without collectives, on purpose: its warning that it assumes one process is not
    for the worker's log."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_metadata(path: str) -> Any:
    """One .metadata file, private, through the allow-list unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    check_private(os.path.dirname(path))
    check_private(path)
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def merged_metadata(directory: str) -> Any:
    """The metadata of a checkpoint written rank by rank: every rank's chunks of each tensor
    (a replicated value, and anything not a tensor, from the lowest rank), each file named
    by its path under `directory`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ranks = sorted(int(m.group(1)) for d in os.listdir(directory) if (m := _RANK.fullmatch(d)))
    if not ranks:
        raise UnsafeCheckpoint(f"{directory} holds no rank-N directory: not a gpuflex distributed checkpoint")
    merged = None
    for r in ranks:
        md = read_metadata(os.path.join(directory, f"rank-{r}", ".metadata"))
        files = {k: dataclasses.replace(v, relative_path=f"rank-{r}/{v.relative_path}")
                 for k, v in md.storage_data.items()}
        if merged is None:
            merged, md.storage_data = md, files
            continue
        for fqn, meta in md.state_dict_metadata.items():
            have = merged.state_dict_metadata.setdefault(fqn, meta)
            if have is not meta and isinstance(have, TensorStorageMetadata):
                seen = {tuple(c.offsets) for c in have.chunks}
                have.chunks.extend(c for c in meta.chunks if tuple(c.offsets) not in seen)
        for k, v in files.items():
            merged.storage_data.setdefault(k, v)
    return merged


def _safe_reader() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's file reader over a checkpoint written rank by rank: the ranks' metadata
        merged, each read by the restricted unpickler from a private file (no collective)."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = merged_metadata(str(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    SafeReader.__qualname__ = "SafeReader"
    return SafeReader


def __getattr__(name: str) -> Any:
    """`SafeReader`, a subclass of DCP's reader, made on first use (DCP imported then)."""
    if name == "SafeReader":
        globals()[name] = cls = _safe_reader()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def step_name(step: int) -> str:
    return f"step-{step}"


def path_of(checkpoint_dir: str, name: str) -> str:
    """The DCP directory a light checkpoint names (a name, never a path: checked)."""
    if not _NAME.fullmatch(name):
        raise UnsafeCheckpoint(f"a checkpoint names the distributed checkpoint {name!r}, not step-<N>")
    return os.path.join(checkpoint_dir, DCP_DIR, name)


def prune(checkpoint_dir: str, keep: set[str]) -> list[str]:
    """Remove the DCP directories (and left-over .tmp ones) of `checkpoint_dir` not in
    `keep`; returns the names removed."""
    gone = []
    for d in glob.glob(os.path.join(glob.escape(checkpoint_dir), DCP_DIR, "step-*")):
        name = os.path.basename(d)
        if name not in keep:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(name)
    return gone
