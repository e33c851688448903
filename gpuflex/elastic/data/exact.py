"""`exact="bitwise"`: gradients whose bits do not depend on the world size, the split or
the order the members' parts arrive in.

The global batch is cut into units of `unit` samples; every member's share is a whole
number of units, and each unit's forward and backward is its own (`run.accumulate` yields
the units), so a unit's gradient has the same bits whichever member computes it. The sum
over the units is then made exact (data/exact_sum.py). This module: the mode, the unit,
what the mode refuses, the threads and each unit's RNG seed.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from gpuflex.elastic.data import exact_bn
from gpuflex.elastic.protocol.env import EXACT, EXACT_THREADS, UNIT
from gpuflex.elastic.data.exact_sum import INT_BITS, UnitGrads, dequantize, quantize, scale_exponent  # noqa: F401 (exact's importers)

MODES = ("allclose", "bitwise")
DEFAULT_UNITS = 8      # unit= defaults to the global batch / 8 (so up to 8 members get work)
DEFAULT_THREADS = 1    # intra-op threads in bitwise mode (GPUFLEX_EXACT_THREADS): a reduction
# split over threads adds in an order that depends on their count, so it is fixed per run


def exact_mode(exact: str | None, environ: Mapping[str, str] | None = None) -> str:
    """`ElasticRun(exact=...)`: as given, else GPUFLEX_EXACT, else "allclose"."""
    env = os.environ if environ is None else environ
    mode = exact if exact is not None else (env.get(EXACT) or "allclose")
    if mode not in MODES:
        where = "exact" if exact is not None else EXACT
        raise ValueError(f"{where} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def unit_size(global_batch_size: int, num_samples: int, unit: int | None,
              environ: Mapping[str, str] | None = None) -> int:
    """The samples of one unit in bitwise mode: `unit=`, else GPUFLEX_UNIT, else the global
    batch / DEFAULT_UNITS. Refused (ValueError, one line) where the global batch does not
    divide into units."""
    env = os.environ if environ is None else environ
    if unit is None and env.get(UNIT):
        try:
            unit = int(env[UNIT])
        except ValueError:
            raise ValueError(f"{UNIT} must be a whole number of samples, got {env[UNIT]!r}") from None
    if unit is None:
        if global_batch_size % DEFAULT_UNITS:
            raise ValueError(f"exact='bitwise': global_batch_size {global_batch_size} is not a multiple of "
                             f"{DEFAULT_UNITS}; give unit= (samples per unit) dividing it")
        unit = global_batch_size // DEFAULT_UNITS
    if unit < 1 or global_batch_size % unit:
        raise ValueError(f"exact='bitwise': global_batch_size {global_batch_size} does not divide into units "
                         f"of {unit} samples")
    return unit   # an epoch's last, partial batch ends in a short unit where `unit` does not divide it


def refuse(*, shard: object, scaler: object, buffers: str) -> None:
    """What bitwise mode does not cover yet, refused at construction with one line."""
    if shard is not None:
        raise ValueError("exact='bitwise' with shard= is not supported: FSDP's reduce-scatter sums in "
                         "floats in an order set by the world size")
    if scaler is not None:
        raise ValueError("exact='bitwise' with a loss scaler (scaler=) is not supported: drop the scaler "
                         "(float32 or bfloat16 autocast need none)")
    if buffers != "broadcast":
        raise ValueError(f"exact='bitwise' with buffers={buffers!r} is not supported: averaged buffers "
                         "depend on the split; use buffers='broadcast'")


def bitwise_units(model: torch.nn.Module, num_samples: int, global_batch_size: int, exact: str | None,
                  unit: int | None, *, shard: object, scaler: object, buffers: str) -> int:
    """ElasticRun's exact= and unit=: 0 in the default mode; in bitwise mode the unit's
    samples, once what it does not cover is refused and the threads are pinned (a model
    with BatchNorm: its running statistics are merged exactly, data/exact_bn.py)."""
    if exact_mode(exact) != "bitwise":
        if unit is not None:
            raise ValueError("unit= is for exact='bitwise' (the default mode has no units)")
        return 0
    refuse(shard=shard, scaler=scaler, buffers=buffers)
    units = unit_size(global_batch_size, num_samples, unit)
    if exact_bn.has_batch_norm(model):
        exact_bn.refuse(model, units, num_samples, global_batch_size)
    pin_threads()
    return units


def pin_threads(environ: Mapping[str, str] | None = None) -> int:
    """Fix the intra-op threads for the run (a float reduction's order depends on their
    count) and ask torch for deterministic kernels; returns the thread count."""
    env = os.environ if environ is None else environ
    raw = env.get(EXACT_THREADS)
    try:
        threads = int(raw) if raw else DEFAULT_THREADS
    except ValueError:
        raise ValueError(f"{EXACT_THREADS} must be a whole number of threads, got {raw!r}") from None
    if threads < 1:
        raise ValueError(f"{EXACT_THREADS} must be at least 1, got {threads}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # cuBLAS' deterministic mode
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    # which torch follows by filling every new tensor (NaN, or an integer's largest value) so
    # that a read of memory nothing wrote is reproducible: a kernel launch per allocation, ~450
    # a step of the MLP's 8 units on an H200, where they and the other small launches held
    # bitwise mode to 0.22 of the default's steps/s. No op of torch's or ours reads what it did
    # not write; a script that wants the fill back sets it after ElasticRun is made.
    torch.utils.deterministic.fill_uninitialized_memory = False
    return threads


def unit_seed(seed: int, step: int, unit: int) -> int:
    """The seed of a unit's own RNG stream (dropout and the like): a function of the step
    and the unit's place in the global batch only, never of the member that runs it."""
    return (seed * 1_000_003 + step) * 65_537 + unit
