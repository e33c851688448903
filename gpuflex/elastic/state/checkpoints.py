"""On-disk checkpoints: tensors plus JSON, a SHA-256 over the file, the previous one kept.

A checkpoint is read after a crash, a lost store or a requeue, possibly from a disk that
filled up or a file someone else could touch, so nothing in it is believed before it is
verified, and nothing in it can run code. The file is our own format, not `torch.save`:

    MAGIC (16 bytes) | header length (8, little-endian) | header (JSON) |
    the tensors' raw bytes, back to back | SHA-256 of everything before it (32)

The header holds the payload's skeleton (`state.flatten`, written by `codec.encode`: JSON
with tagged tuples, int-keyed dicts, bytes, numpy arrays; never pickle) and each tensor's
dtype and shape. Why not `torch.save` + `torch.load(weights_only=True)`: the digest here
covers exactly the bytes on disk and is checked before any of them is parsed (no zip
reader, no restricted unpickler on unverified input), a bad file is told apart by what is
wrong with it (short, not ours, failed its checksum), and each tensor is read straight
into its own buffer while it is hashed, with no second copy. SHA-256 runs at ~1 GB/s on
one core (with SHA instructions), in the order of the write and fsync it follows.

Two files are kept: `checkpoint.pt` and `checkpoint.prev.pt`. A new checkpoint is written
to `checkpoint.pt.tmp.<pid>` and fsynced; then the newest becomes the previous one and the
temp file the newest (two renames, the directory fsynced). A crash between the renames
leaves the previous one. Reading tries the newest, then the previous one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import hashlib
import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import torch

from gpuflex.elastic.state import codec
from gpuflex.elastic.protocol import failpoints
from gpuflex.elastic.state.tree import TensorRef, flatten, unflatten

MAGIC = b"GPUFLEX-CKPT-v1\n"
DIGEST = 32
HEAD = len(MAGIC) + 8
MAX_HEADER = 1 << 30


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def previous_path(path: str) -> str:
    """Where the checkpoint before `path` is kept: checkpoint.pt -> checkpoint.prev.pt."""
    root, ext = os.path.splitext(path)
    return f"{root}.prev{ext}"


def remove_temp_files(path: str) -> list[str]:
    """Remove the temp files of earlier writes of `path` (a write cut short by a full disk
    or a crash); returns the ones removed."""
    gone = []
    for tmp in glob.glob(glob.escape(path) + ".tmp.*"):
        try:
            os.unlink(tmp)
            gone.append(tmp)
        except OSError:   # gone already, or not ours to remove: the write goes on regardless
            pass
    return gone


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _dtype_name(t: torch.Tensor, where: int) -> str:
    if t.layout != torch.strided or t.is_quantized:
        raise codec.CodecError(f"tensor {where}: a {t.layout} tensor cannot be checkpointed; "
                               "register dense tensors")
    return str(t.dtype).removeprefix("torch.")


def _step_of(payload: dict[str, Any]) -> Any:
    state = payload.get("state")
    return state.get("step") if isinstance(state, dict) else None


def save_checkpoint(path: str, payload: dict[str, Any]) -> None:
    """Write `payload` (tensors and what `codec` carries) to `path` atomically, the file
    before it kept as `previous_path(path)`. Raises OSError (a full disk...) with the temp
    file removed and the existing checkpoints intact; CodecError for a value that
    cannot be written safely."""
    d = os.path.dirname(path) or "."
    os.makedirs(d, mode=0o700, exist_ok=True)
    skeleton, tensors = flatten(payload)
    cpu = [t.detach().cpu().resolve_conj().resolve_neg().contiguous() for t in tensors]
    header = json.dumps({"skeleton": codec.encode(skeleton, TensorRef),
                         "tensors": [[_dtype_name(t, i), list(t.shape)] for i, t in enumerate(cpu)]},
                        separators=(",", ":")).encode()
    remove_temp_files(path)   # leftovers of an earlier try
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        # owner-only, and never through a link or into a file someone else made
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with open(fd, "wb") as f, ThreadPoolExecutor(1) as hasher:
            # the digest is computed beside the writes (both release the GIL), in order
            h = hashlib.sha256()
            chunks = [MAGIC, len(header).to_bytes(8, "little"), header] + [_bytes_of(t) for t in cpu if t.numel()]
            hashed = [hasher.submit(h.update, c) for c in chunks]
            for chunk in chunks:
                f.write(chunk)
            for done in hashed:
                done.result()
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
        if failpoints.ARMED: failpoints.hit("checkpoint.write", step=_step_of(payload), path=tmp)
        if os.path.exists(path):
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_into(f: BinaryIO, buf: memoryview, h: Any) -> bool:
    """Fill `buf` from `f`, hashing it; False at an early end of file."""
    got = 0
    while got < len(buf):
        n = f.readinto(buf[got:])
        if not n:
            return False
        got += n
    h.update(buf)
    return True


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r}")
    return dtype


def _shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(type(s) is int and 0 <= s < 1 << 62 for s in shape):
        raise CheckpointError(f"bad shape {shape!r}")
    return tuple(shape)


def load_checkpoint(path: str) -> dict[str, Any] | None:
    """The payload saved at `path`, verified; None if there is no file. Raises
    CheckpointError naming the file and the problem for a file that is short, not ours,
    or fails its checksum: nothing of such a file is used."""
    try:   # O_NONBLOCK: a FIFO in its place must not hang the worker
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e.strerror or e}") from None
    try:
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{path} is not a regular file")
            return _load(f, path, st.st_size)
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e.strerror or e}") from None


def _load(f: BinaryIO, path: str, size: int) -> dict[str, Any]:
    start = f.read(HEAD)
    if len(start) < HEAD or not start.startswith(MAGIC):
        if MAGIC.startswith(start[:len(MAGIC)]) and len(start) < HEAD:
            raise CheckpointError(f"{path} is truncated ({size} bytes)")
        raise CheckpointError(f"{path} is not a gpuflex checkpoint (an unknown format or an older "
                              "gpuflex's pickle, which is never loaded)")
    n = int.from_bytes(start[len(MAGIC):], "little")
    if n > min(size, MAX_HEADER):
        raise CheckpointError(f"{path} is truncated or corrupted ({size} bytes where its header says at least "
                              f"{HEAD + n + DIGEST})")
    h = hashlib.sha256(start)
    raw = f.read(n)
    if len(raw) < n:
        raise CheckpointError(f"{path} is truncated ({size} bytes)")
    h.update(raw)
    try:   # parsed only for the sizes; believed once the digest matches
        layout = [(_dtype(name), _shape(shape)) for name, shape in json.loads(raw)["tensors"]]
    except (ValueError, KeyError, TypeError, CheckpointError) as e:
        raise CheckpointError(f"{path} has a corrupted header ({e})") from None
    sizes = []
    for dtype, shape in layout:
        count = 1
        for s in shape:
            count *= s
        sizes.append(count * torch.empty((), dtype=dtype).element_size())
    expected = HEAD + n + sum(sizes) + DIGEST
    if expected != size:
        raise CheckpointError(f"{path} is truncated or corrupted ({size} bytes where its header "
                              f"says {expected})")
    tensors = []
    for (dtype, shape), nbytes in zip(layout, sizes):
        t = torch.empty(shape, dtype=dtype)
        if nbytes and not _read_into(f, _bytes_of(t), h):
            raise CheckpointError(f"{path} is truncated ({size} bytes)")
        tensors.append(t)
    if f.read(DIGEST + 1) != h.digest():
        raise CheckpointError(f"{path} failed its checksum (the file is corrupted)")
    try:
        return unflatten(codec.decode(json.loads(raw)["skeleton"], TensorRef), tensors)
    except (codec.CodecError, IndexError, TypeError) as e:   # a checksum-valid file we did not write
        raise CheckpointError(f"{path} holds a state this gpuflex does not read ({e})") from None


@dataclasses.dataclass(frozen=True)
class Loaded:
    """The checkpoint resumed from: its payload, its file, and why newer files were refused."""

    payload: dict[str, Any]
    path: str
    refused: tuple[str, ...] = ()


def load_newest_good(path: str) -> Loaded | None:
    """The newest checkpoint that verifies: `path`, else `previous_path(path)`; temp files of
    earlier writes are removed first. None where neither file exists (a first start);
    CheckpointError, naming each file and its problem, where files exist and none is good:
    a job that had checkpoints must not start over from step 0 unnoticed."""
    remove_temp_files(path)
    refused: list[str] = []
    found = False
    for p in (path, previous_path(path)):
        try:
            payload = load_checkpoint(p)
        except CheckpointError as e:
            found = True
            refused.append(str(e))
            continue
        if payload is None:
            refused.append(f"{p} is missing")
            continue
        if p != path and os.path.exists(path):   # kept aside, so the next save keeps `p` as the previous one
            try:
                os.replace(path, path + ".refused")
            except OSError:
                pass
        return Loaded(payload, p, tuple(refused))
    if not found:
        return None
    raise CheckpointError(f"no usable checkpoint: {'; '.join(refused)}")
