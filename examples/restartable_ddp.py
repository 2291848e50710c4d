"""In-process restart: when a rank fails, every rank whose process is sound keeps it (``@ftrun.restartable``).

    ftrun --nproc-per-node 2 --max-restarts 3 examples/restartable_ddp.py --crash-at 30

What is built outside the wrapped function (the model, its compiled code with ``--compile``, the optimizer)
lives as long as the process, in a rank whose exception ended the function (``--crash-by raise``) too; the
function makes the process group, restores the newest snapshot agreed on every rank (or the initial state: a
survivor's memory may hold an optimizer step half-done), and trains.
Deterministic (the batch of each step is a function of the step and the rank): with 2 ranks, a run that crashed
ends with the same weights as one that never failed; with more, as one restarted without the decorator (torch's
DDP on gloo sums the first step after any restart in another order than an uninterrupted run does). Rank 0
prints the checksum. Under plain torchrun (or python) the decorator does nothing: the function runs once.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ftrun


def held() -> str:
    """What this process holds as an attempt starts: nothing may grow from one in-place restart to the next."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    groups = len(dist.distributed_c10d._world.pg_map)  # the process groups torch still knows
    threads = len(os.listdir("/proc/self/task"))  # the process's, torch's and gloo's too (not only Python's)
    held = f"rss {rss} threads {threads} fds {len(os.listdir('/proc/self/fd'))} groups {groups}"
    if torch.cuda.is_initialized():  # the GPU's memory torch's allocator holds, and the host's pinned memory
        pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
        held += f" cuda {torch.cuda.memory_reserved()} pinned {pinned}"
    return held


def note(timeline: str | None, **what: object) -> None:
    if timeline:
        with open(timeline, "a") as f:
            f.write(json.dumps({**what, "t": time.time()}) + "\n")


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--crash-at", type=int, default=None, help="the crashing rank exits at this step")
    p.add_argument("--crashes", type=int, default=1, help="attempts that crash (each a step later)")
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-by", choices=("exit", "raise"), default="exit", help="the process's end, or an exception")
    p.add_argument("--hang-at", type=int, default=None, help="the crashing rank hangs at this step instead")
    p.add_argument("--leaks", action="store_true", help="print what each attempt starts with (RSS, threads...)")
    p.add_argument("--timeline", default=None, help="append one JSON line per step and at the crash (benchmarks)")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds each step also sleeps")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (once per process)")
    p.add_argument("--process-restart", action="store_true", help="no in-place restart: as without the decorator")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="nccl: the model on its GPU")
    return p.parse_args()


def main() -> None:
    a = arguments()
    born = {"rank": int(os.environ["RANK"]), "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    note(a.timeline, **born, started=True)  # a new process (a survivor restarted in place never comes here again)
    torch.manual_seed(0)
    device = torch.device("cpu")
    if a.backend == "nccl":  # this rank's GPU (several ranks may share one: see NCCL_HOSTID)
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
    note(a.timeline, **born, built=True)  # the model on its device (on a GPU: the CUDA context made)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    initial = {"model": copy.deepcopy(net.state_dict()), "opt": copy.deepcopy(opt.state_dict())}
    forward = torch.compile(net) if a.compile else net

    def train() -> None:
        rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        dist.init_process_group(a.backend)
        model = DistributedDataParallel(forward)
        last, state = ftrun.restore() or (-1, initial)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        print(f"rank {rank} attempt {attempt} pid {os.getpid()} from step {last + 1}", flush=True)
        note(a.timeline, rank=rank, attempt=attempt, step=last, restored=True)
        if a.leaks:
            print(f"rank {rank} attempt {attempt} holds {held()}", flush=True)
        for step in range(last + 1, a.steps):
            failing = rank == a.crash_rank and attempt < a.crashes
            if failing and a.crash_at is not None and step == a.crash_at + attempt:
                note(a.timeline, rank=rank, attempt=attempt, step=step, crash=True)
                if a.crash_by == "raise":  # restarted in place too: its process is sound
                    raise RuntimeError(f"rank {rank} failed at step {step}")
                os._exit(3)
            if failing and step == a.hang_at:
                time.sleep(3600)
            gen = torch.Generator().manual_seed(step * 100 + rank)
            x, y = torch.randn(32, 64, generator=gen).to(device), torch.randn(32, 8, generator=gen).to(device)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            ftrun.snapshot(step, {"model": net.state_dict(), "opt": opt.state_dict()})
            note(a.timeline, rank=rank, attempt=attempt, step=step)
            time.sleep(a.step_time)
        digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in net.state_dict().values()))
        if rank == 0:
            print(f"checksum {digest.hexdigest()[:16]}", flush=True)
        # DDP first, while its group is still registered: freed after the group's end, DDP's reducer would end
        # the group itself, joining gloo's threads with the GIL held, which one may need (torch 2.13: a hang).
        del model
        dist.destroy_process_group()

    run = train if a.process_restart else ftrun.restartable(train)  # as @ftrun.restartable on the def
    run()


if __name__ == "__main__":
    main()
