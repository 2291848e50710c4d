"""A job that only looks hung, phase after phase, each lasting SECONDS: no launcher should call it hung.

    ftrun --nproc-per-node 3 examples/looks_hung.py SECONDS

1. rank 0 saves a checkpoint, slowly, while the others wait in a barrier;
2. an evaluation on every rank: no collective until it ends;
3. rank 1 compiles: the work happens in child processes while its main thread waits;
4. rank 2 reads slowly from a slow source (a pipe that trickles);
5. rank 0 loads a batch slowly through torch's DataLoader, its dataset computing in Python (no workers);
6. a long sleep between epochs, on every rank.
Every rank meets the others in an all-reduce after each phase and prints "rank N after PHASE".
"""

import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

LONG_S = float(sys.argv[1])
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
t = torch.ones(16)


def meet(phase):
    dist.all_reduce(t)
    print(f"rank {rank} after {phase}", flush=True)


meet("start")
if rank == 0:  # saving a checkpoint, slowly, while the others wait in a barrier
    with open(f"ckpt-{attempt}.bin", "wb") as f:
        end = time.time() + LONG_S
        while time.time() < end:
            f.write(os.urandom(64 << 10))
            f.flush()
            time.sleep(0.2)
dist.barrier()
print(f"rank {rank} after checkpoint", flush=True)

end = time.time() + LONG_S  # an evaluation on every rank: no collective until it ends
while time.time() < end:
    sum(i * i for i in range(10_000))
meet("evaluation")

if rank == 1:  # a compile: the work happens in child processes while the main thread waits
    busy = f"import time\nend = time.time() + {LONG_S}\nwhile time.time() < end: pass"
    subprocess.run([sys.executable, "-c", busy], check=True)
meet("compile")

if rank == 2:  # reading slowly from a slow disk (a pipe that trickles)
    feeder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, time\nfor _ in range(int({LONG_S} * 5)):\n    os.write(1, b'x' * 4096); time.sleep(0.2)",
        ],
        stdout=subprocess.PIPE,
    )
    while feeder.stdout.read(4096):
        pass
    feeder.wait()
meet("slow read")


class Slow(torch.utils.data.Dataset):  # each item computed in Python, the whole batch taking LONG_S
    def __len__(self):
        return 4

    def __getitem__(self, i):
        end = time.time() + LONG_S / 4
        while time.time() < end:
            sum(j * j for j in range(1000))
        return torch.ones(2)


if rank == 0:
    next(iter(torch.utils.data.DataLoader(Slow(), batch_size=4, num_workers=0)))
meet("slow batch")

time.sleep(LONG_S)  # a long sleep between epochs, on every rank
meet("sleep")
dist.destroy_process_group()
