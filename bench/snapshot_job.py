"""The job bench/snapshots.py measures (benchmark workload): DDP (gloo; on the CPU, or with --device cuda every
rank's tensors on GPU 0) with --state-mb of state per rank beside a small model, a step of --step-time
(compute, then the rest asleep: as a GPU job's host waits), and, with --snapshots, ftrun.snapshot every step
and ftrun.restore at start (--api dcp: dcp.save through ftrun.SnapshotWriter and dcp.load through
ftrun.SnapshotReader, the whole dcp.save counted as blocking but for the copy ftrun.snapshot makes while the
job goes on). Rank 1 exits at --crash-at on the first attempt. Every rank appends JSON lines to
--timeline: each step (with the time snapshots held it up so far), the crash, the restore (how long it took,
which step)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ftrun
from ftrun.worker import snapshot as snap


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--state-mb", type=int, default=1024)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--step-time", type=float, default=1.0)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--snapshots", action="store_true")
    p.add_argument("--timeline", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--api", choices=("snapshot", "dcp"), default="snapshot")
    a = p.parse_args()
    device = torch.device(a.device)
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def record(event: str, **data: object) -> None:
        with open(a.timeline, "a") as f:
            f.write(json.dumps({"event": event, "wall": time.time(), "rank": rank, "attempt": attempt, **data}) + "\n")

    dist.init_process_group("gloo")
    torch.manual_seed(rank)
    model = DistributedDataParallel(nn.Linear(64, 8).to(device))
    ballast = torch.randn(a.state_mb << 18).to(device)  # 4-byte floats: state_mb MiB, e.g. embeddings
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if a.snapshots:
        began = time.perf_counter()
        restored = ftrun.restore() if a.api == "snapshot" else dcp_restore(model, ballast)
        if restored is not None:
            step, state = restored
            model.module.load_state_dict(state["model"])
            ballast = state["ballast"].to(device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = step + 1
            record("restored", step=step, took_s=time.perf_counter() - began)
    dcp_blocked = 0.0  # dcp.save's time but for what ftrun.snapshot counts itself
    for step in range(start, a.steps):
        if attempt == 0 and rank == 1 and step == a.crash_at:
            record("crash")
            os._exit(3)
        began = time.perf_counter()
        gen = torch.Generator().manual_seed(step * 100 + rank)
        opt.zero_grad()
        model(torch.randn(32, 64, generator=gen).to(device)).sum().backward()
        opt.step()
        if a.snapshots and a.api == "snapshot":
            ftrun.snapshot(step, {"model": model.module.state_dict(), "ballast": ballast})
        elif a.snapshots:
            saving, counted = time.perf_counter(), snap.blocked_s()
            state = {"model": model.module.state_dict(), "ballast": ballast}
            dcp.save(state, storage_writer=ftrun.SnapshotWriter("ckpt", step))
            dcp_blocked += time.perf_counter() - saving - (snap.blocked_s() - counted)
        time.sleep(max(0.0, a.step_time - (time.perf_counter() - began)))
        record("step", step=step, blocked_s=snap.blocked_s() + dcp_blocked)
    snap.wait()
    dist.destroy_process_group()


def dcp_restore(model: nn.Module, ballast: torch.Tensor) -> tuple[int, dict[str, object]] | None:
    """The step the agent names, through ftrun.SnapshotReader (None: no snapshot)."""
    reader = ftrun.SnapshotReader("ckpt")
    if reader.step is None:
        return None
    state = {"model": model.module.state_dict(), "ballast": ballast}  # type: ignore[operator]
    dcp.load(state, storage_reader=reader)
    return reader.step, state


if __name__ == "__main__":
    main()
