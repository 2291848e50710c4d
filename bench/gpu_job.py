"""A DDP job on a GPU as people write it for torchrun (it never imports ftrun): the workload of bench/gpu.py.

Every rank uses the one GPU (``cuda:0``; on a machine without one, the CPU): two ranks share it over gloo with
CUDA tensors (NCCL refuses two ranks per GPU), one rank may use NCCL (``--backend nccl``). It checkpoints every
step from rank 0 and resumes from the last checkpoint. Every rank appends JSON lines to --timeline, with the
wall clock: its process start (before any import), then each phase of its start (imports, CUDA context, process
group, DDP), each step, and the fault. On the first attempt rank --fault-rank, at --fault-at:

    exit       os._exit(1)               sigkill   SIGKILL to itself       raise     an uncaught exception
    hang       sleeps in Python          gpu-hang  a GPU kernel that spins while the host waits in synchronize()
    gpu-hang-collective  the spinning kernel, then an all-reduce queued behind it (the process group's
               watchdog times that collective out)
    spin       loops in Python for ever  slow-ckpt  writes a "checkpoint" slowly for 40 s, then goes on
    assert     a device-side assert      illegal   an illegal memory access (a kernel writes to address 8)
    oom        asks for more memory than the GPU has                remote    enqueues an all-reduce, then SIGKILL

On NCCL, ranks that share one GPU each get their own NCCL_HOSTID: NCCL refuses two ranks on one device of one
host, and with a host each they talk over its socket transport, as two nodes would.

--imports adds modules the job imports (transformers, accelerate); --helper imports ``gpuhelper``, a module
next to this one that initialises CUDA at import (``cuInit``), as some libraries do.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before any import

import argparse  # noqa: E402 - the stamp above must come first
import hashlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    faults = ["none", "exit", "sigkill", "raise", "hang", "gpu-hang", "gpu-hang-collective", "spin", "slow-ckpt"]
    faults += ["assert", "illegal", "oom", "remote"]
    p.add_argument("--fault", choices=faults, default="none")
    p.add_argument("--fault-at", type=int, default=20)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--pg-timeout", type=float, default=30.0, help="the process group's timeout (torchrun's hang exit)")
    p.add_argument("--imports", default="", help="comma-separated modules the job also imports")
    p.add_argument("--helper", action="store_true", help="import gpuhelper (initialises CUDA at import)")
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--timeline", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--checksum", default=None, help="rank 0 writes a digest of the final parameters here")
    a = p.parse_args()
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def record(event: str, wall: float | None = None, **data: object) -> None:
        line = {"event": event, "wall": wall or time.time(), "rank": rank, "attempt": attempt, **data}
        with open(a.timeline, "a") as f:
            f.write(json.dumps(line) + "\n")

    record("start", STARTED, pid=os.getpid())
    for name in filter(None, a.imports.split(",")):
        importlib.import_module(name)
    if a.helper:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        importlib.import_module("gpuhelper")
    record("imported")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # the CUDA context
    record("cuda")
    timeout = timedelta(seconds=a.pg_timeout)
    if a.backend == "nccl":
        if cuda and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count():
            os.environ["NCCL_HOSTID"] = f"{os.uname().nodename}-{os.environ.get('LOCAL_RANK', '0')}"
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # the "hosts" meet on this one
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group(a.backend, timeout=timeout)
    record("pg")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 16)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    record("ddp")
    start = 0
    if os.path.exists(a.checkpoint):
        state = torch.load(a.checkpoint, map_location=device)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    for step in range(start, a.steps):
        if attempt == 0 and rank == a.fault_rank and step == a.fault_at and a.fault != "none":
            inject(a.fault, step, record, cuda, a.checkpoint)
        gen = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(64, 256, generator=gen).to(device), torch.randn(64, 16, generator=gen).to(device)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        time.sleep(a.step_time)
        record("step", step=step)
        if rank == 0:
            tmp = a.checkpoint + ".tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, a.checkpoint)
    if a.checksum and rank == 0:
        values = model.module.state_dict().values()
        digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in values))
        with open(a.checksum, "w") as f:
            f.write(digest.hexdigest()[:16])
    dist.destroy_process_group()


def inject(fault: str, step: int, record: object, cuda: bool, checkpoint: str) -> None:
    record("fault", fault=fault)  # type: ignore[operator]
    if fault == "slow-ckpt":  # looks hung to the other ranks, waiting in the next all-reduce: it is not
        with open(checkpoint + ".slow", "wb") as f:
            end = time.time() + 40
            while time.time() < end:
                f.write(os.urandom(64 << 10))
                f.flush()
                time.sleep(0.2)
        return
    if fault == "spin":
        while True:
            sum(i * i for i in range(10_000))
    if cuda and fault in ("assert", "illegal", "oom"):
        cuda_error(fault)
    if fault == "remote":
        dist.all_reduce(torch.ones(1, device="cuda:0" if cuda else "cpu"))
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "exit":
        os._exit(1)
    if fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "raise":
        raise RuntimeError(f"injected failure at step {step}")
    if fault == "gpu-hang" and cuda:
        torch.cuda._sleep(1 << 40)  # type: ignore[attr-defined]  # a kernel that spins for minutes
        torch.cuda.synchronize()  # the host waits here, its CPU idle
    if fault == "gpu-hang-collective" and cuda:
        torch.cuda._sleep(1 << 40)  # type: ignore[attr-defined]
        dist.all_reduce(torch.ones(1, device="cuda:0"))  # queued behind the kernel: never completes
        torch.cuda.synchronize()
    time.sleep(3600)


def cuda_error(fault: str) -> None:
    """A CUDA error as jobs meet them: the process raises it at its next synchronisation."""
    if fault == "assert":
        x = torch.zeros(4, device="cuda:0")
        x[torch.tensor([10], device="cuda:0")] = 1.0
        torch.cuda.synchronize()
    if fault == "illegal":
        import cupy  # type: ignore[import-not-found]

        poke = cupy.RawKernel(r'extern "C" __global__ void poke(int* p) { *p = 1; }', "poke")
        poke((1,), (1,), (cupy.uint64(8),))  # address 8: never mapped
        torch.cuda.synchronize()
    if fault == "oom":
        _free, total = torch.cuda.mem_get_info()
        torch.empty(total + (8 << 30), dtype=torch.uint8, device="cuda:0")


if __name__ == "__main__":
    main()
