"""A DDP job as people write it for torchrun: it never imports ftrun (benchmark workload).

Imports torch and torch._dynamo (as many real jobs do, through torch.compile or a framework), trains a small model
with gloo on CPU (``--backend nccl``: on NCCL, a rank per GPU), checkpoints every 10 steps from rank 0 and resumes
from the last checkpoint, and ends with torch's normal teardown (no os._exit). On the first attempt rank 1 kills
itself with SIGKILL at --crash-at, raises an exception at --raise-at (torch's teardown follows), or stops making
progress at --hang-at (--hang-how: it sleeps, sleeps in C holding the GIL, blocks on a FIFO nobody writes, enters
an all-reduce of another group, or sleeps where every rank's SIGTERM handler only sets a flag, as Lightning's
does; --culprit names the rank). Every rank appends JSON lines to --timeline: when its process started (before any
import), each step, the crash or the hang.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before any import: when this worker began running its own code

import argparse  # noqa: E402 - the stamp above must come first
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402

import torch  # noqa: E402
import torch._dynamo  # noqa: E402 - real jobs import it (torch.compile, frameworks)
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--raise-at", type=int, default=None)
    p.add_argument("--hang-at", type=int, default=None)
    p.add_argument("--hang-how", choices=("sleep", "gil", "fifo", "group", "flagged"), default="sleep")
    p.add_argument("--culprit", type=int, default=1, help="the rank that crashes, raises or hangs")
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--buckets", type=int, default=1, help="gradient all-reduces per step (a layer per bucket)")
    p.add_argument("--timeline", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--checksum", default=None, help="rank 0 writes a digest of the final parameters here")
    p.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    p.add_argument("--cuinit", action="store_true", help="initialise the CUDA driver first, as every GPU job does")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="nccl: the model on its GPU")
    a = p.parse_args()
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def record(event: str, wall: float | None = None, **data: object) -> None:
        line = {"event": event, "wall": wall or time.time(), "rank": rank, "attempt": attempt, **data}
        with open(a.timeline, "a") as f:
            f.write(json.dumps(line) + "\n")

    record("start", STARTED, pid=os.getpid())
    stopping: list[bool] = []
    if a.hang_how == "flagged":  # the loop would stop at its next step: a hung rank never gets there
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    if a.cuinit:  # on a CPU machine, the stand-in driver bench/recovery.py --cuda-standin preloads
        import ctypes

        if ctypes.CDLL("libcuda.so.1").cuInit(0) != 0:
            raise RuntimeError("the CUDA driver could not be initialised (a process forked after cuInit?)")
    device = torch.device("cpu")
    if a.backend == "nccl":  # one rank per GPU
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend)
    # Every rank makes every group (torch requires it); with --hang-how group the culprit enters this one's
    # all-reduce while its partner is in the default group's: each waits for the other.
    partner = a.culprit - 1 if a.culprit % 2 else a.culprit + 1
    pair = dist.new_group(sorted((a.culprit, partner))) if a.hang_how == "group" else None
    torch.manual_seed(0)
    hidden = [m for _ in range(a.buckets - 1) for m in (nn.Linear(128, 128), nn.ReLU())]
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), *hidden, nn.Linear(128, 8))
    # 64 KB buckets: each hidden layer's gradients are all-reduced on their own, as a big model's buckets are
    model = DistributedDataParallel(net.to(device), bucket_cap_mb=0.0625 if a.buckets > 1 else 25)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if os.path.exists(a.checkpoint):
        state = torch.load(a.checkpoint, map_location=device)
        model.module.load_state_dict(state["model"])
        start = state["step"]
    for step in range(start, a.steps):
        faulty = attempt == 0 and rank == a.culprit
        if faulty and step == a.crash_at:
            record("crash")
            os.kill(os.getpid(), signal.SIGKILL)
        if faulty and step == a.raise_at:
            record("crash")
            raise RuntimeError(f"injected failure at step {step}")
        if faulty and step == a.hang_at:
            record("hang", how=a.hang_how)
            hang(a.hang_how, a.checkpoint + ".fifo", pair)
        gen = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(32, 64, generator=gen).to(device), torch.randn(32, 8, generator=gen).to(device)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if device.type == "cuda":  # the step's time is the GPU's too
            torch.cuda.synchronize()
        time.sleep(a.step_time)
        record("step", step=step)
        if rank == 0 and (step + 1) % a.every == 0:
            tmp = a.checkpoint + ".tmp"
            torch.save({"model": model.module.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, a.checkpoint)
    if a.checksum and rank == 0:
        weights = model.module.state_dict().values()
        digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in weights))
        with open(a.checksum, "w") as f:
            f.write(digest.hexdigest()[:16])
    dist.destroy_process_group()


def hang(how: str, fifo: str, pair: object) -> None:
    """Stop making progress, ``how``."""
    if how == "gil":
        import ctypes

        ctypes.PyDLL(None).sleep(3600)  # libc's sleep, the GIL held
    elif how == "fifo":
        if not os.path.exists(fifo):
            os.mkfifo(fifo)
        with open(fifo, "rb") as f:  # nobody writes it: the open blocks in the kernel
            f.read()
    elif how == "group":
        dist.all_reduce(torch.ones(4), group=pair)  # the partner is in the default group's all-reduce
    time.sleep(3600)


if __name__ == "__main__":
    main()
