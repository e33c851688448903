"""A gpuflex.elastic script that dies by SIGSEGV in its last step, every time: the crash at
the same place that a restart from the checkpoint cannot get past (seen on a GPU, in a
sharded job's gather for its report). tests/e2e/test_repeated_fault.py."""

import os
import signal
import sys
import time

import torch
from torch.utils.data import TensorDataset

from gpuflex.elastic import ElasticRun

N, EPOCHS, BATCH = 64, 5, 8   # 40 steps
step_sleep = float(sys.argv[1]) if len(sys.argv) > 1 else 0.2
torch.manual_seed(0)
x, y = torch.randn(N, 4), torch.randn(N, 1)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
run = ElasticRun(model=model, optimizer=opt, num_samples=N, seed=0, epochs=EPOCHS, global_batch_size=BATCH)
total = EPOCHS * run.sampler.steps_per_epoch
loader = run.loader(TensorDataset(x, y))
for epoch in run.epochs():
    for xb, yb in loader:
        if run.step == total - 1:
            print(f"crash_in_last_step: SIGSEGV at step {run.step}", flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        run.backward(loss)
        opt.step()
        time.sleep(step_sleep)
