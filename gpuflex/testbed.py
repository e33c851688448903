"""A test bed for mixed GPUs on CPU slots, which are all equally fast (issue 12).

`--device-work-s S`: each worker spends S seconds of simulated device time per sample it
processes, on top of its real compute, so its step grows with its share as on a device.
`--slow-slots SLOT=FACTOR,...`: a worker holding one of those slots (GPUFLEX_SLOTS, or on
a GPU host its own GPUs from CUDA_VISIBLE_DEVICES) spends FACTOR times as long per sample.
The time is spent in the script's step, after its forward and before its backward,
outside the runtime (this module is the example's, never imported by gpuflex.elastic): the
runtime sees the slowness only as the compute time it measures, which runs from the step's
first training forward (work before it, such as rank 0's evaluation, is not the step's). It lives in the package so that a script run through
a wrapper (runpy, as the fault tests do) imports it too.
"""

import argparse
import time

from gpuflex.elastic.protocol.env import WorkerEnv


def add_device_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device-work-s", type=float, default=0.0, help="simulated device seconds per sample")
    ap.add_argument("--slow-slots", type=slow_slots, default={}, help="SLOT=FACTOR,...: slower slots")


def slow_slots(text: str) -> dict[int, float]:
    """"2=3,5=1.5" -> {2: 3.0, 5: 1.5}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        slot, sep, factor = part.partition("=")
        try:
            out[int(slot)] = float(factor)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected SLOT=FACTOR, got {part!r}") from None
        if not sep or out[int(slot)] <= 0:
            raise argparse.ArgumentTypeError(f"expected SLOT=FACTOR with FACTOR > 0, got {part!r}")
    return out


def slowdown(slow: dict[int, float]) -> float:
    """This worker's factor: the largest of its slots' (1 for a slot not listed)."""
    env = WorkerEnv.from_environ()
    mine = env.slots if env.slots is not None else (env.gpus or ())
    return max([slow.get(s, 1.0) for s in mine] or [1.0])


_factor: list[float] = []


def device_work(args: argparse.Namespace, samples: int) -> None:
    """Spend this worker's simulated device time for `samples` samples."""
    if args.device_work_s > 0 and samples > 0:
        if not _factor:
            _factor.append(slowdown(args.slow_slots))
        time.sleep(args.device_work_s * _factor[0] * samples)
