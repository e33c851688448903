"""An unmodified torch.distributed script, in the style of the PyTorch DDP tutorial.

Nothing here knows gpuflex: `init_process_group("gloo")` reads the env:// contract
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) that torchrun sets, and that gpuflex sets for
each worker of a gang (`gpuflex submit --workers 3 -- python ddp_tutorial.py`) or for the
processes of a torchrun it runs (`gpuflex submit --workers 2 --gpus-per-worker 2 --
torchrun --nproc-per-node 2 ddp_tutorial.py`). A few steps on deterministic data, each
rank its own; then every rank writes a hash of its parameters (DDP keeps them equal) and
what it was told, and rank 0 writes the parameters, under --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

TOLD = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RESTART_COUNT", "GPUFLEX_RESTART_COUNT")


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="directory for the ranks' files")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                        # the same initial model on every rank
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1000 + rank)   # each rank its own batches
    for _ in range(args.steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=data))
        loss_fn(outputs, torch.randn(20, 5, generator=data)).backward()
        optimizer.step()
    params = [p.detach().clone() for p in model.parameters()]
    digest = hashlib.sha256(b"".join(bytes(p.contiguous().view(torch.uint8).reshape(-1).tolist()) for p in params)).hexdigest()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world_size": world, "hash": digest,
                   "env": {k: os.environ.get(k) for k in TOLD}}, f)
    if rank == 0:
        with open(os.path.join(args.out, "params.json"), "w") as f:
            json.dump([p.flatten().tolist() for p in params], f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13 on CPU: DDP keeps gloo's worker threads alive past destroy_process_group,
    # and one of them may still be freeing the last all-reduce of backward(), which holds a
    # Python object, when the interpreter finalizes; the thread cannot take the GIL then and
    # the process aborts ("terminate called without an active exception", SIGABRT; 8 runs
    # in 60 under plain torchrun). Everything is written and the group torn down: leave
    # without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
