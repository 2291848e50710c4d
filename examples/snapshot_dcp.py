"""Lose at most one step, for a job that checkpoints with torch.distributed.checkpoint: the one argument that
changes is the storage, ``ftrun.SnapshotWriter`` / ``ftrun.SnapshotReader``.

    ftrun --nproc-per-node 2 --max-restarts 3 examples/snapshot_dcp.py --checkpoint ckpt --crash-at 30

Every step it saves its model and optimizer (DCP's state-dict API) through ftrun.SnapshotWriter: under ftrun
into shared memory the agent keeps, each rank's whole state checksummed and copied to the next node; after a
failure ftrun.SnapshotReader reads the step the agent names, verified. Outside ftrun (plain torchrun) the same
calls save to and load from --checkpoint, as torch's FileSystemWriter and FileSystemReader do. Deterministic: a
run that crashed and restored ends with the same weights as one that never failed; rank 0 prints the checksum.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

import ftrun


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--checkpoint", required=True, help="where the checkpoint is outside ftrun")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds each step also sleeps")
    p.add_argument("--crash-at", type=int, default=None, help="rank 1 exits at this step of the first attempt")
    a = p.parse_args()
    dist.init_process_group("gloo")
    digest = train(a)
    if dist.get_rank() == 0:
        print(f"checksum {digest}", flush=True)
    # DDP is gone before the group: the other way round, the gloo group's last owner would be DDP's reducer,
    # whose destructor joins gloo's threads holding the GIL while one of them waits for it to free a DCP
    # broadcast's tensor (torch issue 56297: the run hung at exit about one time in five).
    dist.destroy_process_group()


def train(a: argparse.Namespace) -> str:
    """The training loop; the weights' checksum."""
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def state(step: int) -> dict[str, object]:
        model_state, opt_state = get_state_dict(model, opt)
        return {"model": model_state, "opt": opt_state, "step": torch.tensor(step)}

    start = 0
    reader = ftrun.SnapshotReader(a.checkpoint)  # the snapshot ftrun names, verified; else --checkpoint
    if reader.step is not None or os.path.exists(os.path.join(a.checkpoint, ".metadata")):
        loaded = state(-1)
        dcp.load(loaded, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["opt"])
        start = int(loaded["step"]) + 1  # type: ignore[call-overload]
        print(f"rank {rank} restored step {start - 1} (attempt {attempt})", flush=True)
    for step in range(start, a.steps):
        if attempt == 0 and rank == 1 and step == a.crash_at:
            os._exit(3)
        gen = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 8, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        time.sleep(a.step_time)
        dcp.save(state(step), storage_writer=ftrun.SnapshotWriter(a.checkpoint, step))
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.module.state_dict().values()))
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    main()
