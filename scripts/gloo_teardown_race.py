"""Count how often a 2-rank DDP job (gloo) never exits, by how its workers were started; no ftrun involved.

torch 2.13 can deadlock when DDP's reducer is freed at the end of a script: freeing it destroys the
gloo process group while holding the GIL and joins gloo's worker thread, and that thread may still
hold the last reference to a finished work item whose thread-local state keeps a Python object (the
contextvars.Context that autograd stashes during backward), so it waits for the GIL forever. Whether
it happens is a matter of timing, and forking the workers from a process that has already imported
torch._dynamo (what a warm pool does) makes it much more likely. Run it under load (two at once on
two cores) to see it:

    python scripts/gloo_teardown_race.py --trials 40 & python scripts/gloo_teardown_race.py --trials 40
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import subprocess
import sys
import time

WAYS = ["fresh", "fork-torch", "fork-dynamo"]  # how the two ranks start: python -c, or a fork after an import
STUCK_AFTER_S = 30.0  # a trial takes about a second; one still alive after this is deadlocked

WORKER = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

def main():
    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)))
    for _ in range(20):
        ddp(torch.randn(16, 32)).sum().backward()
    dist.barrier()
    dist.destroy_process_group()

main()  # the reducer is freed as main() returns
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_rank(how: str, rank: int, port: int) -> int:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank)}
    if how == "fresh":
        return subprocess.Popen([sys.executable, "-c", WORKER], env={**os.environ, **env}).pid
    pid = os.fork()
    if pid == 0:
        os.environ.update(env)
        try:
            exec(compile(WORKER, "<worker>", "exec"), {"__name__": "__main__"})  # noqa: S102 - our own text
            code = 0
        except BaseException:  # an error still ends the trial: only a worker that never exits counts
            code = 1
        os._exit(code)
    return pid


def stuck_trials(how: str, trials: int) -> int:
    stuck = 0
    for _ in range(trials):
        port = free_port()
        left = {start_rank(how, rank, port) for rank in (0, 1)}
        deadline = time.monotonic() + STUCK_AFTER_S
        while left and time.monotonic() < deadline:
            left = {pid for pid in left if os.waitpid(pid, os.WNOHANG)[0] == 0}
            time.sleep(0.01)
        stuck += bool(left)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return stuck


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--how", choices=WAYS, nargs="+", default=WAYS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as ftrun and torchrun set it for several workers
    # Fork-based ways import here, before forking, and imports only add up: so run them in this order.
    for how in [way for way in WAYS if way in args.how]:
        if how.startswith("fork"):
            importlib.import_module("torch._dynamo" if how == "fork-dynamo" else "torch")
        print(f"{how}: {stuck_trials(how, args.trials)} of {args.trials} trials never exited", flush=True)


if __name__ == "__main__":
    main()
