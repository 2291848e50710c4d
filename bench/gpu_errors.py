"""Record what a GPU job's ranks print when CUDA or NCCL fails, with no launcher in the way: test fixtures.

    python bench/gpu_errors.py --out DIR [--cases device-assert,...] [--bound-s 45] [--ftrun]

Each case starts bench/gpu_job.py as 2 ranks on NCCL sharing GPU 0 (each its own NCCL_HOSTID), with the
environment ftrun gives workers (flight recorder, its dump on timeout), and lets rank 1 fail at step 5:

    device-assert    an index out of bounds in a CUDA kernel      illegal-address  a kernel writes to address 8
    out-of-memory    asks for more than the GPU holds             nccl-timeout     rank 1 sleeps; NCCL's timeout 10 s
    nccl-remote      rank 1 enqueues an all-reduce, then SIGKILL: rank 0 meets its closed connection

Nothing stops the other rank when one fails (a launcher would): each rank's stderr, stdout, exit status and the
moment it ended, and any flight recorder dump, land in DIR/CASE/ (meta.json says who ended first). Every process
is ended at --bound-s. The cases run side by side. Without a GPU it says so and records nothing. With --ftrun,
each case runs under ftrun (no restart) instead: its console and log directory, root cause included, in DIR/CASE/.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = {  # name: (fault, the process group's timeout)
    "device-assert": ("assert", 60),
    "illegal-address": ("illegal", 60),
    "out-of-memory": ("oom", 60),
    "nccl-timeout": ("hang", 10),
    "nccl-remote": ("remote", 60),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job(fault: str, pg_timeout: int, case: Path) -> list[str]:
    args = [str(HERE / "gpu_job.py"), "--backend", "nccl", "--fault", fault, "--fault-rank", "1"]
    args += ["--fault-at", "5", "--steps", "30", "--pg-timeout", str(pg_timeout)]
    return [*args, "--timeline", str(case / "timeline.jsonl"), "--checkpoint", str(case / "ckpt.pt")]


def under_ftrun(name: str, out: Path, bound_s: float) -> None:
    fault, pg_timeout = CASES[name]
    case = out / name
    case.mkdir(parents=True)
    cmd = [sys.executable, "-m", "ftrun", "--nproc-per-node", "2", "--max-restarts", "0"]
    cmd += ["--log-dir", str(case / "logs"), "--event-log", str(case / "events.jsonl"), *job(fault, pg_timeout, case)]
    began = time.monotonic()
    with (case / "console.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(bound_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    (case / "ckpt.pt").unlink(missing_ok=True)
    print(f"{name} under ftrun: exit {proc.returncode} after {time.monotonic() - began:.1f} s", flush=True)


def record(name: str, out: Path, bound_s: float) -> None:
    fault, pg_timeout = CASES[name]
    case = out / name
    (case / "fr").mkdir(parents=True)
    port, began = free_port(), time.monotonic()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        env |= {"LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env |= {"TORCHELASTIC_RESTART_COUNT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
        env |= {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
        env |= {"TORCH_FR_DUMP_TEMP_FILE": str(case / "fr" / "rank_"), "PYTHONFAULTHANDLER": "1"}
        args = [sys.executable, *job(fault, pg_timeout, case)]
        with (case / f"rank{rank}.stdout").open("w") as o, (case / f"rank{rank}.stderr").open("w") as e:
            procs.append(subprocess.Popen(args, stdout=o, stderr=e, env=env, start_new_session=True))
    ended: dict[int, tuple[float, int | None]] = {}
    while len(ended) < 2 and time.monotonic() - began < bound_s:
        for rank, p in enumerate(procs):
            if rank not in ended and p.poll() is not None:
                ended[rank] = (time.monotonic() - began, p.returncode)
        time.sleep(0.05)
    for rank, p in enumerate(procs):
        if rank not in ended:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    meta = {
        "case": name,
        "fault": fault,
        "pg_timeout_s": pg_timeout,
        "bound_s": bound_s,
        "ranks": {r: {"ended_s": round(t, 3), "returncode": rc} for r, (t, rc) in ended.items()},
        "killed_at_bound": [r for r in range(2) if r not in ended],
    }
    (case / "meta.json").write_text(json.dumps(meta, indent=1))
    (case / "ckpt.pt").unlink(missing_ok=True)
    print(f"{name}: {json.dumps(meta['ranks'])} killed at the bound: {meta['killed_at_bound']}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--bound-s", type=float, default=45.0)
    p.add_argument("--ftrun", action="store_true", help="run each case under ftrun, not bare")
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no GPU here: nothing recorded")
        return
    print(f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, {torch.cuda.get_device_name(0)}")
    out = Path(a.out)
    how = under_ftrun if a.ftrun else record
    threads = [threading.Thread(target=how, args=(n, out, a.bound_s)) for n in a.cases.split(",") if n]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
