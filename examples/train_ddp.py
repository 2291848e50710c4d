"""A real training job for ftrun's demo, tests and benchmarks: torch DDP on CPU (gloo).

Deterministic: the model starts from a fixed seed and the batch of each step
is a pure function of (seed, step, rank), so a run that crashes and resumes
from its last checkpoint ends with exactly the same weights as a run that
never failed. The final checksum proves it.

Faults are injected on the first attempt only (TORCHELASTIC_RESTART_COUNT 0):

    --crash-at STEP   the rank --crash-rank kills itself with SIGKILL at STEP
    --raise-at STEP   the rank --crash-rank raises RuntimeError at STEP
    --hang-at STEP    the rank --crash-rank stops making progress at STEP

It calls ftrun.heartbeat() and ftrun.section("step"), which do nothing (after
one warning) under torchrun or plain python.

Run it with ftrun (or torchrun):

    ftrun --nproc-per-node 2 --max-restarts 3 examples/train_ddp.py --crash-at 60
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ftrun


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--checkpoint-dir", default=None, help="default: <tmp>/ftrun-demo-<run id>")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--raise-at", type=int, default=None)
    p.add_argument("--hang-at", type=int, default=None)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--timeline", default=None, help="append one JSON line per step (for benchmarks)")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


class Timeline:
    """Per-step records with wall-clock times, appended by every rank to one file."""

    def __init__(self, path: str | None, rank: int, attempt: int) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if path else None
        self._rank, self._attempt = rank, attempt

    def note(self, event: str, step: int) -> None:
        if self._fd is not None:
            record = {
                "event": event,
                "rank": self._rank,
                "attempt": self._attempt,
                "step": step,
                "wall": time.time(),
            }
            os.write(self._fd, (json.dumps(record) + "\n").encode())


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(32, 16, generator=g)
    w = torch.linspace(-1.0, 1.0, 16).unsqueeze(1)
    y = torch.sin(x @ w) + 0.01 * torch.randn(32, 1, generator=g)
    return x, y


def save_checkpoint(path: Path, step: int, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """Atomic: write a temp file, then rename it over the old checkpoint."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save({"step": step, "model": model.state_dict(), "optim": optim.state_dict()}, tmp)
    os.replace(tmp, path)


def checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def inject_faults(args: argparse.Namespace, rank: int, attempt: int, step: int, timeline: Timeline) -> None:
    if attempt != 0 or rank != args.crash_rank:
        return
    if step == args.crash_at:
        timeline.note("crash", step)
        print(f"rank {rank}: injected crash (SIGKILL) at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if step == args.raise_at:
        timeline.note("crash", step)
        raise RuntimeError(f"injected failure at step {step} on rank {rank}")
    if step == args.hang_at:
        timeline.note("hang", step)
        print(f"rank {rank}: injected hang at step {step}", flush=True)
        while True:
            time.sleep(3600)


def exact_mean(state, bucket):  # type: ignore[no-untyped-def]  # (see the docstring)
    """Average gradients in float64, where the sum of a few float32 values is exact.

    gloo adds the ranks' values in an order that depends on where a value sits in
    its bucket, and DDP lays buckets out afresh after a restart; with more than two
    ranks a float32 sum then differs in its last bits. Exact sums make a resumed run
    end with the same weights, bit for bit, as one that never failed.
    """
    world = dist.get_world_size()
    wide = bucket.buffer().to(torch.float64)
    pending = dist.all_reduce(wide, async_op=True).get_future()

    def narrow(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return fut.value()[0].div_(world).to(torch.float32)

    return pending.then(narrow)


@ftrun.record
def main() -> None:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    ckpt_dir = Path(args.checkpoint_dir or Path(tempfile.gettempdir()) / f"ftrun-demo-{run_id}")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt_dir / "checkpoint.pt"
    timeline = Timeline(args.timeline, rank, attempt)

    dist.init_process_group("gloo")
    model = make_model(args.seed)
    optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start = state["step"]
        if rank == 0:
            over = " (the whole run: nothing left to train; a new --checkpoint-dir starts afresh)"
            resumed = f"attempt {attempt}: resumed from step {start} of {ckpt}"
            print(resumed + (over if start >= args.steps else ""), flush=True)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, exact_mean)
    loss_fn = nn.MSELoss()
    loss = torch.tensor(0.0)
    for step in range(start, args.steps):
        inject_faults(args, rank, attempt, step, timeline)
        with ftrun.section("step"):  # hang detection: a step has its own timeout (--section-timeout step=S)
            x, y = batch(args.seed, step, rank)
            optim.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optim.step()
        ftrun.heartbeat()  # and progress between steps (--heartbeat-timeout S)
        timeline.note("step", step)
        if args.step_time:
            time.sleep(args.step_time)
        done = step + 1
        if rank == 0 and done % args.checkpoint_every == 0:
            save_checkpoint(ckpt, done, model, optim)
        if rank == 0 and done % args.log_every == 0:
            print(f"step {done} loss {loss.item():.6f}", flush=True)
    dist.barrier()
    if rank == 0 and start < args.steps:
        print(f"final loss {loss.item():.6f} checksum {checksum(model)} world {world}", flush=True)
    dist.destroy_process_group()
    # Everything is saved and printed. torch 2.13's gloo teardown is racy: freeing DDP's reducer
    # joins gloo's threads while holding the GIL, which they may need (a deadlock), and freeing it
    # earlier can abort ("terminate called without an active exception"). So leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
