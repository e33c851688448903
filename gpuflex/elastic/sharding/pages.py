"""Memory a newcomer's shards will fill, made ready before a resize's stall (CPU, glibc).

A newcomer to a sharded job receives its shards into memory it never touched: torch asks
malloc for each new shard and the move writes every 4 KB page of it for the first time,
one page fault each, inside the survivors' stall. For a 1 GB model grown from 2 to 3 workers
that is ~330 MB a newcomer, and it made that stall 0.6-1.2 s instead of ~0.4 s on this
project's CPU machines (benchmarks/fsdp_resize.py; docs/benchmarks.md).

`reserve(n)` touches n bytes of malloc's heap and frees them back into it, where the
newcomer's next allocations find them mapped already. It runs when the newcomer learns the
generation it joins, while the survivors still finish their step (sharding.py's
`prepare`). Two glibc settings make the heap keep and hand out that memory:
- M_MMAP_THRESHOLD 32 MB: blocks up to 32 MB come from the heap instead of fresh mmaps of
  their own. It is the value glibc's dynamic threshold climbs to in any process that frees
  large blocks (a training loop does), fixed here from the start.
- M_TRIM_THRESHOLD above the reservation while it is being used, so a free does not hand
  it back to the kernel; `settle()` puts it back to twice the mmap threshold (glibc's own
  rule) once the shards are in place.
Not glibc (another libc, another OS) or nothing to reserve: nothing is done. GPU shards are
device memory, so only CPU pools use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

import torch

BLOCK = 4 << 20                 # the reservation's blocks (freed, they coalesce in the heap)
MIN_BYTES = 16 << 20            # a smaller share faults too little to be worth a reservation
MARGIN = 8                      # blocks reserved beyond the need: up to ~16 MB of a reservation
                                # was not reused by the next allocations (heap placement; 64 MB
                                # filled after reserving 80 MB: 0-4 of 16 blocks faulted, 96 MB: none)
MMAP_THRESHOLD = 32 << 20       # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # malloc.h
_libc: Any = None


def _glibc() -> Any:
    """glibc's handle with mallopt, or None (another libc or OS)."""
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                libc.gnu_get_libc_version   # glibc's own symbol: musl and others lack it
                libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                _libc = libc
            except (OSError, AttributeError):
                pass
    return _libc or None


def reserve(nbytes: int) -> int:
    """Touch `nbytes` of heap memory (in whole blocks, MARGIN more) and free it into the
    heap for the allocations to come; the bytes reserved (0: not done, or under MIN_BYTES)."""
    libc = _glibc()
    count = -(-nbytes // BLOCK) + MARGIN if nbytes >= MIN_BYTES else 0
    if libc is None or count == 0:
        return 0
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and libc.mallopt(M_TRIM_THRESHOLD, min(count * BLOCK + 2 * MMAP_THRESHOLD, 2**31 - 1))):
        return 0
    blocks = [torch.ones(BLOCK // 4) for _ in range(count)]   # ones: every page written
    del blocks
    return count * BLOCK


def settle() -> None:
    """After the reserved memory was used: frees hand memory back as glibc does by itself
    (trim threshold twice the mmap threshold)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD)
