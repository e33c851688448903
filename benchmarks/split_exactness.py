"""How close a run split over ranks stays to the unsplit run, for the two cases
docs/converting.md quotes: bf16 autocast, and AdamW on a parameter whose true gradient is
zero (an attention key bias).

    python benchmarks/split_exactness.py

A split is simulated in one process, as the runtime computes it: each rank's mean loss over
its share, weighted by the share's part of the global batch, backward, and the ranks'
gradients summed in rank order (what the all-reduce adds up). The unsplit run is one
rank holding the whole batch. No process group is involved: only the order and grouping of
the float additions differ, which is all a resize changes.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import elastic_fsdp  # noqa: E402  (the LM block, its data)
import elastic_mlp  # noqa: E402


def shares(n: int, world: int) -> list[slice]:
    """Even shares of n samples over `world` ranks, the first ranks one larger."""
    base, extra = divmod(n, world)
    out, start = [], 0
    for r in range(world):
        size = base + (r < extra)
        out.append(slice(start, start + size))
        start += size
    return out


def split_grads(model: nn.Module, loss_of, x, y, world: int, bf16: bool) -> None:
    """model's .grad: the sum over `world` ranks of each share's weighted mean-loss gradient."""
    total = None
    for s in shares(len(x), world):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of(model, x[s], y[s])
        (loss.float() * ((s.stop - s.start) / len(x))).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    for p, g in zip(model.parameters(), total):
        p.grad = g


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def mlp_loss(model, x, y):
    return F.mse_loss(model(x), y)


def bf16_figures() -> None:
    x, y = elastic_mlp.make_data()
    torch.manual_seed(0)
    model = elastic_mlp.make_model(64)
    batch = 64
    print("bf16 autocast, the example's MLP (hidden 64), global batch 64")
    print("  one step's gradient against the unsplit batch (relative norm of the difference):")
    for bf16 in (False, True):
        split_grads(model, mlp_loss, x[:batch], y[:batch], 1, bf16)
        full = flat(p.grad for p in model.parameters())
        row = []
        for w in (2, 3, 4):
            split_grads(model, mlp_loss, x[:batch], y[:batch], w, bf16)
            row.append(f"{rel(flat(p.grad for p in model.parameters()), full):.2e}")
        print(f"    {'bf16' if bf16 else 'fp32'}: 2 ranks {row[0]}, 3 ranks {row[1]}, 4 ranks {row[2]}")
    print("  after 96 SGD steps (lr 0.05, momentum 0.9), 1 rank against 1 -> 3 -> 2 ranks (32 steps each):")
    for bf16 in (False, True):
        ends = []
        for schedule in ([1] * 96, [1] * 32 + [3] * 32 + [2] * 32):
            torch.manual_seed(0)
            m = elastic_mlp.make_model(64)
            opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
            g = torch.Generator().manual_seed(3)
            for world in schedule:
                idx = torch.randint(0, len(x), (batch,), generator=g)
                split_grads(m, mlp_loss, x[idx], y[idx], world, bf16)
                opt.step()
            ends.append(flat(m.parameters()))
        print(f"    {'bf16' if bf16 else 'fp32'}: relative difference {rel(ends[1], ends[0]):.2e}, "
              f"max abs {float((ends[1] - ends[0]).abs().max()):.2e}, "
              f"allclose(rtol=1e-5, atol=1e-6): {torch.allclose(ends[1], ends[0], rtol=1e-5, atol=1e-6)}")


class BiasedBlock(elastic_fsdp.Block):
    """The example's block with a bias on q, k and v (the example leaves it out: see its comment)."""

    def __init__(self, d, heads):
        super().__init__(d, heads)
        self.qkv = nn.Linear(d, 3 * d, bias=True)


def lm_loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, elastic_fsdp.VOCAB), y.reshape(-1))


def adam_figures() -> None:
    x, y = elastic_fsdp.make_data()
    torch.manual_seed(0)
    base = elastic_fsdp.LM(32, layers=2)
    for i in range(len(base.blocks)):
        b = BiasedBlock(32, 2)
        b.load_state_dict(base.blocks[i].state_dict(), strict=False)
        base.blocks[i] = b
    d = 32
    print("AdamW (lr 3e-3) on the example LM with a bias on q, k, v; global batch 24; 1 rank against 2 ranks, 40 steps")
    ends = []
    for world in (1, 2):
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
        g = torch.Generator().manual_seed(3)
        for _ in range(40):
            idx = torch.randint(0, len(x), (24,), generator=g)
            split_grads(m, lm_loss, x[idx], y[idx], world, False)
            opt.step()
        ends.append(dict(m.named_parameters()))
    key_bias, others = [], []
    for name, p in ends[0].items():
        q = ends[1][name]
        if name.endswith("qkv.bias"):
            k_ref, k_got = p[d:2 * d], q[d:2 * d]
            key_bias.append((float((k_got - k_ref).detach().abs().max()), float(k_ref.detach().abs().max())))
            others.append((p[:d], q[:d]))
            others.append((p[2 * d:], q[2 * d:]))
        else:
            others.append((p, q))
    ref = torch.cat([a.detach().reshape(-1) for a, _ in others])
    got = torch.cat([b.detach().reshape(-1) for _, b in others])
    worst = max(key_bias)
    print(f"  key bias: max abs difference {worst[0]:.2e} (its values reach {worst[1]:.2e}; lr 3e-3); "
          f"allclose(rtol=1e-5, atol=1e-6): "
          f"{all(torch.allclose(ends[1][n][d:2 * d], ends[0][n][d:2 * d], rtol=1e-5, atol=1e-6) for n in ends[0] if n.endswith('qkv.bias'))}")
    print(f"  every other parameter: max abs difference {float((got - ref).abs().max()):.2e}, "
          f"relative {rel(got, ref):.2e}, allclose(rtol=1e-5, atol=1e-6): "
          f"{torch.allclose(got, ref, rtol=1e-5, atol=1e-6)}")


def main() -> None:
    torch.set_num_threads(1)   # a fixed summation order inside each kernel: only the split differs
    bf16_figures()
    adam_figures()


if __name__ == "__main__":
    main()
