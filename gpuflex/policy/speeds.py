"""A first guess of a GPU's speed from its model name, before the runtime measures it (pure).

A job on mixed GPUs splits its global batch by each worker's measured speed (issue 12);
until the first measurements arrive, each worker starts from this guess, so the first
steps are not all run at the slowest worker's pace. Only the ratios matter, and only
until they are measured, so the numbers are rough on purpose and were not measured here:
training throughput (samples/s, FP32/TF32) relative to a V100 = 1.0, rounded from the
relative PyTorch training throughputs Lambda publishes (https://lambdalabs.com/gpu-benchmarks)
and, for GPUs not listed there, from the dense TF32 (FP32 before Ampere) TFLOPS of
NVIDIA's data sheets against a listed GPU of the same generation. A host's `speed` key
overrides the table for every GPU of that host (a lab that measured its own, or a model
missing here).

Names are matched as nvidia-smi prints them ("NVIDIA A100-SXM4-80GB", "Tesla V100-PCIE-32GB",
"NVIDIA GeForce RTX 2080 Ti"): upper-cased, split into words at anything not a letter or
digit, and an entry matches when its words appear in the name whole and in order ("A100
PCIE" in "NVIDIA A100 80GB PCIe"; "A10" is not "A100"). The most specific entries come first.
"""

from __future__ import annotations

import re

DEFAULT_SPEED = 1.0

# (words of the model name, speed relative to a V100), most specific first
TABLE: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 5.5),
    (("H100", "PCIE"), 3.8),
    (("H100", "NVL"), 4.5),
    (("H100",), 5.0),            # SXM5: "NVIDIA H100 80GB HBM3"
    (("GH200",), 5.5),
    (("A100", "PCIE"), 2.4),
    (("A100",), 2.6),            # SXM4, 40 or 80 GB
    (("A800",), 2.5),
    (("V100",), 1.0),
    (("P100",), 0.5),
    (("T4",), 0.3),
    (("L40S",), 2.5),
    (("L40",), 2.0),
    (("L4",), 0.7),
    (("A40",), 1.4),
    (("A30",), 1.4),
    (("A10",), 0.9),
    (("6000", "ADA"), 2.3),      # "NVIDIA RTX 6000 Ada Generation"
    (("A6000",), 1.5),
    (("A5000",), 1.2),
    (("A4000",), 0.8),
    (("TITAN", "RTX"), 0.85),
    (("RTX", "8000"), 0.85),     # Quadro RTX 8000 / 6000: the Titan RTX's chip
    (("RTX", "6000"), 0.85),
    (("4090",), 2.0),
    (("4080",), 1.5),
    (("3090", "TI"), 1.5),
    (("3090",), 1.4),
    (("3080", "TI"), 1.3),
    (("3080",), 1.2),
    (("3070",), 0.8),
    (("3060",), 0.55),
    (("2080", "TI"), 0.75),
    (("2080",), 0.6),
    (("1080", "TI"), 0.5),
)

_WORD = re.compile(r"[A-Z0-9]+")


def words(model: str) -> tuple[str, ...]:
    """A model name as its upper-case words: "NVIDIA A100-SXM4-80GB" -> (NVIDIA, A100, SXM4, 80GB)."""
    return tuple(_WORD.findall(model.upper()))


def table_speed(model: str | None) -> float | None:
    """The table's speed for a model name as nvidia-smi prints it; None when not listed."""
    if not model:
        return None
    name = words(model)
    for key, speed in TABLE:
        rest = iter(name)
        if all(w in rest for w in key):   # each word found after the one before it
            return speed
    return None


def speed_hint(model: str | None, host_speed: float | None) -> float:
    """A worker's first guess of its relative speed: its host's `speed` when set, else its
    GPU model's entry, else DEFAULT_SPEED (a CPU slot, an unknown or unprobed GPU)."""
    if host_speed is not None:
        return float(host_speed)
    found = table_speed(model)
    return DEFAULT_SPEED if found is None else found


def same_model(a: str | None, b: str | None) -> bool:
    """Whether two GPUs are of one model: the same words (unknown models are of none)."""
    return a is not None and b is not None and words(a) == words(b)
