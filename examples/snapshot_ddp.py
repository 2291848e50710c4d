"""Lose at most one step: a DDP job that snapshots its state every step with ftrun.snapshot and, after a
failure, restores it with ftrun.restore (falling back to its own checkpoint when there is none).

    ftrun --nproc-per-node 2 --max-restarts 3 examples/snapshot_ddp.py --crash-at 30

Deterministic (the batch of each step is a function of the step and the rank): a run that crashed and
restored ends with the same weights as one that never failed; rank 0 prints the checksum. Outside ftrun (plain
torchrun) ftrun.snapshot does nothing and ftrun.restore returns None: the job runs from its checkpoint as before.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ftrun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--crash-at", type=int, default=None, help="rank 1 exits at this step of the first attempt")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds each step also sleeps")
    a = p.parse_args()
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start = 0
    restored = ftrun.restore()  # the newest snapshot whole on every rank, verified; None: there is none
    if restored is not None:
        step, state = restored
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = step + 1
        print(f"rank {rank} restored step {step} (attempt {attempt})", flush=True)
    for step in range(start, a.steps):
        if attempt == 0 and rank == 1 and step == a.crash_at:
            os._exit(3)
        gen = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 8, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ftrun.snapshot(step, {"model": model.module.state_dict(), "opt": opt.state_dict()})
        time.sleep(a.step_time)
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.module.state_dict().values()))
    if rank == 0:
        print(f"checksum {digest.hexdigest()[:16]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
