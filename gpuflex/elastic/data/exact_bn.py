"""BatchNorm in `exact="bitwise"` mode: running statistics whose bits do not depend on the
world size, the split or the order the members ran their units in.

In training mode a BatchNorm normalises each forward with that forward's own batch
statistics, so a unit's forward and backward (one forward per unit, data/exact.py) are the
same whichever member runs it. Only the running statistics (running_mean, running_var,
num_batches_tracked) depend on the order the units were seen and on which member saw them.
So, around each unit's training forward of each BatchNorm layer, `BatchNormUnits`:

- takes the unit's statistics from BatchNorm's own kernel: for the forward its running
  buffers are zeros and its momentum 1, so its update writes 1 x s + 0 x 0 = s, the
  batch mean and unbiased variance exactly as BatchNorm would fold them in (any dimension,
  CPU or cuDNN, no second pass over the activations);
- puts the running buffers, num_batches_tracked and momentum back: BatchNorm updated scratch
  tensors swapped in for the forward (autograd keeps the running buffers for backward, so
  they are not written in place), and the buffers do not move during the step.

At the end of the step every unit's statistics of every layer travel with the integer
gradient sum: a zero int64 matrix of [the step's global units, width], each member filling
its own units' rows with float64 bits viewed as int64; summing x and zeros as integers is
exact, so every member gets every unit's statistics bit for bit. Then every member applies
BatchNorm's running update unit by unit in global unit order (momentum, or the cumulative
average where momentum is None), in float64 and rounded to the buffer's dtype once per unit:
the same arithmetic on the same values on every member, and a member alone (the standalone
run) goes through the same code. Evaluation forwards (eval mode, or gradients off) are not
touched: they neither record nor update.
"""

from __future__ import annotations

import torch
from torch import nn

from gpuflex.elastic import torch_compat


def has_batch_norm(model: nn.Module) -> bool:
    """Whether `model` normalizes with its batch's statistics in train mode (BatchNorm of any
    dimension, SyncBatchNorm): such a model cannot train on a single sample."""
    return any(torch_compat.is_batch_norm(m) for m in model.modules())


def refuse(model: nn.Module, unit: int, num_samples: int, global_batch_size: int) -> None:
    """What bitwise mode cannot make exact with BatchNorm, refused at start with one line."""
    for m in model.modules():
        if isinstance(m, nn.SyncBatchNorm):
            raise ValueError("exact='bitwise' with SyncBatchNorm is not supported: it normalises with statistics "
                             "all-reduced in floats over the members, so a unit's forward depends on the split; "
                             "use BatchNorm (each unit then normalises with its own statistics)")
        if torch_compat.is_batch_norm(m) and m.track_running_stats and nn.parameter.is_lazy(m.running_mean):
            raise ValueError("exact='bitwise' with a lazy BatchNorm is not supported before its first forward: "
                             "run one forward (or give num_features) before ElasticRun")
    last = num_samples % global_batch_size % unit   # an epoch's last batch may end in a short unit
    if unit < 2 or last == 1:
        raise ValueError(f"exact='bitwise' with BatchNorm needs units of at least 2 samples (unit {unit}, an "
                         f"epoch's last unit {last or unit}): the unbiased variance of one sample is undefined")


class BatchNormUnits:
    """The BatchNorm layers of `model` (with running statistics) under bitwise mode."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules()
                       if torch_compat.is_batch_norm(m) and m.track_running_stats and m.running_mean is not None]
        # a unit's row: per layer a flag (1: it ran in the unit), its C means, its C variances
        self.offsets, off = [], 0
        for m in self.layers:
            self.offsets.append(off)
            off += 1 + 2 * m.running_mean.numel()
        self.width = off
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # layer -> the unit's (mean, var)
        self.saved: dict[int, tuple] = {}     # layer -> its buffers and momentum, during its forward
        self.rows: dict[int, torch.Tensor] = {}   # the step's global unit index -> its float64 row
        self.step: tuple[int, int] | None = None     # (generation, step) of the rows
        for i, m in enumerate(self.layers):
            m.register_forward_pre_hook(lambda mod, args, i=i: self._before(i, mod))
            m.register_forward_hook(lambda mod, args, out, i=i: self._after(i, mod, out), always_call=True)

    def _before(self, i: int, m: nn.Module) -> None:
        if not (m.training and torch.is_grad_enabled()):
            return   # an evaluation: BatchNorm uses (and, under no_grad in train mode, updates) as usual
        if i in self.pending:
            raise ValueError(f"exact='bitwise': BatchNorm layer {i} ran twice in one unit; call the model once per "
                             "unit (for xb, yb in run.accumulate(x, y): run.backward(loss_fn(model(xb), yb)))")
        nbt = m.num_batches_tracked
        self.saved[i] = (m.running_mean, m.running_var, nbt, m.momentum)
        # scratch buffers in their place (the running ones are saved for backward, so they are
        # swapped, not written): BatchNorm's update with momentum 1 writes the unit's statistics
        m.running_mean, m.running_var = torch.zeros_like(m.running_mean), torch.zeros_like(m.running_var)
        if nbt is not None:
            m.num_batches_tracked = nbt.clone()
        m.momentum = 1.0

    def _after(self, i: int, m: nn.Module, out: object) -> None:
        saved = self.saved.pop(i, None)
        if saved is None:
            return
        if out is not None:   # None: the forward raised, nothing to record
            self.pending[i] = (m.running_mean.detach().to(torch.float64, copy=True),
                               m.running_var.detach().to(torch.float64, copy=True))
        m.running_mean, m.running_var, nbt, m.momentum = saved   # the very tensors, untouched
        if nbt is not None:
            m.num_batches_tracked = nbt

    def take(self, unit: int, step: tuple[int, int]) -> None:
        """After unit `unit`'s backward (its index in the step's global batch): its
        statistics, recorded by its forward, become its row. `step`: (generation, step); rows
        of another one were left by a step abandoned before its end, and are dropped."""
        if step != self.step:
            self.step, self.rows = step, {}
        row = torch.zeros(self.width, dtype=torch.float64)
        for i, (mean, var) in self.pending.items():
            o, c = self.offsets[i], mean.numel()
            row[o] = 1.0
            row[o + 1:o + 1 + c] = mean.cpu()
            row[o + 1 + c:o + 1 + 2 * c] = var.cpu()
        self.pending = {}
        self.rows[unit] = row

    def drop(self) -> None:
        """The step failed or was a warm-up: nothing of it is kept."""
        self.pending, self.rows = {}, {}

    def pack(self, units: int) -> torch.Tensor:
        """This member's rows in the step's [units, width] matrix, the rest zeros, as int64
        bits (summed over the members as integers: each row arrives exactly)."""
        table = torch.zeros(units, self.width, dtype=torch.float64)
        for u, row in self.rows.items():
            table[u] = row
        self.rows = {}
        return table.view(torch.int64).reshape(-1)

    def apply(self, summed: torch.Tensor, units: int) -> None:
        """Every unit's statistics (the summed int64 bits), folded into the running buffers
        unit by unit in global order, as BatchNorm's own update would fold them."""
        table = summed.cpu().reshape(units, self.width).contiguous().view(torch.float64)
        with torch.no_grad():
            for m, o in zip(self.layers, self.offsets):
                c = m.running_mean.numel()
                mean, var = (b.detach().cpu().to(torch.float64).reshape(-1) for b in (m.running_mean, m.running_var))
                for u in range(units):
                    if float(table[u, o]) != 1.0:
                        continue   # the layer did not run in this unit
                    f = m.momentum
                    if m.num_batches_tracked is not None:
                        m.num_batches_tracked.add_(1)
                        if f is None:
                            f = 1.0 / float(m.num_batches_tracked)
                    f = 0.0 if f is None else f
                    mean = ((1 - f) * mean + f * table[u, o + 1:o + 1 + c]).to(m.running_mean.dtype).to(torch.float64)
                    var = ((1 - f) * var + f * table[u, o + 1 + c:o + 1 + 2 * c]).to(m.running_var.dtype) \
                        .to(torch.float64)
                m.running_mean.copy_(mean.view_as(m.running_mean))
                m.running_var.copy_(var.view_as(m.running_var))
