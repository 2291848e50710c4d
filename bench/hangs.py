"""Hangs with no flag: a rank stops before an all-reduce, and how long until every rank steps again.

The job (bench/plain_ddp.py) is a DDP job as people write it for torchrun: gloo on CPU, never imports ftrun,
checkpoints every 10 steps. Two agents on this machine (2 nodes x 2 ranks, the embedded store), no hang flag.
At step 20 of the first attempt rank 3 (on the second node) stops making progress, one way per case:

  sleep   time.sleep
  gil     libc's sleep called holding the GIL (ftrun's thread in the worker cannot run)
  fifo    blocked opening a FIFO nobody writes
  group   inside an all-reduce of another process group, which waits for rank 2 (in the default group's
          all-reduce, waiting for rank 3): every rank's stack is inside a collective
  flagged time.sleep, where every rank's SIGTERM handler only sets a flag its loop would read at the next
          step (as Lightning's does): the stop's signal leaves the hung rank hung

Figures: the hang -> every rank stepping again (from the job's own timeline), and whether ftrun named rank 3
by the collective ("never entered all_reduce #N"). torchrun runs the same job in the same run, alternating:
it finds nothing until gloo's own timeout (30 minutes), so a run of it ends at --bound.

    python bench/hangs.py [--reps 3] [--ways sleep,gil,fifo,group] [--bound 120] [--launchers ftrun,torchrun]
    python bench/hangs.py --cost [--reps 3] [--steps 400] [--buckets 20 --step-time 0.005] [--job stack|nccl]
    python bench/hangs.py --look-alikes SECONDS

--look-alikes: examples/looks_hung.py, a job whose phases only look hung (a checkpoint while the others wait,
an evaluation, a compile in child processes, a slow read, a sleep, each lasting SECONDS), 3 ranks, no flag:
how many hangs ftrun found (0 is right) and its wall time against torchrun's on the same job.

--cost: the watch's price, one node, 2 ranks, no fault: the median and mean step time (--step-time of simulated
compute, 50 ms, and --buckets all-reduces, 1) with torch's flight recorder off (TORCH_FR_BUFFER_SIZE=0) and
ftrun's watch off, with the recorder on (torch's default) and the watch off (--no-hang-detection), with both on
(ftrun's default), and torchrun, alternating in one run. The mean tells a stall of a step now and then (the
median does not); many buckets and short steps fill the recorder within seconds, as a big model's job does.
--job stack: the real stack instead (examples/pretrain_stack.py: FSDP2, compiled blocks, a datasets loader; no
checkpoint during the run). --job nccl (a GPU node): the DDP job on NCCL, one rank on GPU 0 (NCCL takes no two
ranks on one GPU), each step synchronized: what NCCL's recorder, which ftrun turns on, costs each collective.

Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from recovery import kill_leftovers  # bench/ is this script's sys.path[0]

JOB = Path(__file__).resolve().parent / "plain_ddp.py"
STACK = Path(__file__).resolve().parents[1] / "examples" / "pretrain_stack.py"  # --cost --job stack
FTRUN = [sys.executable, "-m", "ftrun"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
HANG_AT = 20
CULPRIT = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def timeline(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stepping_again(records: list[dict[str, object]], hung_at: float) -> float | None:
    """When every rank had stepped in an attempt after the hang (None: not yet)."""
    later = [r for r in records if r["event"] == "step" and int(str(r["attempt"])) > 0]
    firsts = {}
    for r in later:
        rank = int(str(r["rank"]))
        firsts[rank] = min(firsts.get(rank, float("inf")), float(str(r["wall"])))
    if len(firsts) < 4:
        return None
    return max(firsts.values()) - hung_at


def hang_once(launcher: str, how: str, workdir: Path, bound: float) -> tuple[float | None, str]:
    """(the hang -> every rank stepping again, or None within ``bound``; what ftrun named)."""
    port = free_port()
    tl = workdir / "timeline.jsonl"
    job = [str(JOB), "--steps", str(HANG_AT + 15), "--hang-at", str(HANG_AT), "--hang-how", how]
    job += ["--culprit", str(CULPRIT), "--timeline", str(tl), "--checkpoint", str(workdir / "ckpt.pt")]
    rdzv = ["--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d"]
    rdzv += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"hangs-{port}"]
    procs = []
    for node in ("a", "b"):
        if launcher == "ftrun":
            cmd = [*FTRUN, *rdzv, "--log-dir", str(workdir / f"logs-{node}"), *job]
        else:
            cmd = [*TORCHRUN, *rdzv, "--rdzv-conf", "last_call_timeout=1", *job]
        with (workdir / f"{node}.log").open("wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir))
        time.sleep(0.5)  # node a registers first: ranks 0-1 there, the culprit on b
    try:
        recovered = watch(tl, procs, bound)
        for proc in procs:
            if recovered is None:
                proc.kill()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        kill_leftovers(workdir)
    events = [json.loads(line) for f in workdir.glob("logs-*/*/events.jsonl") for line in f.read_text().splitlines()]
    named = [f"rank {e['rank']} by {e['timeout']}" for e in events if e["kind"] == "hang"]
    return recovered, named[-1] if named else ""


def watch(tl: Path, procs: list[subprocess.Popen[bytes]], bound: float) -> float | None:
    """The hang -> every rank stepping again, read from the job's timeline (None: not within ``bound``)."""
    deadline = None
    while all(p.poll() is None for p in procs) and (deadline is None or time.time() < deadline):
        records = timeline(tl)
        hung = [float(str(r["wall"])) for r in records if r["event"] == "hang"]
        if hung:
            deadline = deadline or hung[0] + bound
            recovered = stepping_again(records, hung[0])
            if recovered is not None:
                return recovered
        time.sleep(0.2)
    return None


def step_times(records: list[dict[str, object]]) -> list[float]:
    by_rank: dict[int, list[float]] = {}
    for r in records:
        if r["event"] == "step":
            by_rank.setdefault(int(str(r["rank"])), []).append(float(str(r["wall"])))
    gaps = []
    for walls in by_rank.values():
        walls.sort()
        gaps += [b - a for a, b in itertools.pairwise(walls[10:])]  # past the first steps' warm-up
    return gaps


def cost_job(which: str, workdir: Path, steps: int, buckets: int, step_time: float) -> list[str]:
    """--cost's job (``which``: ddp, nccl or stack), but for its --steps and --timeline."""
    if which == "stack":  # no checkpoint in the run: its steps alone
        return [str(STACK), "--workdir", str(workdir), "--ckpt-every", str(steps + 1)]
    flags = ["--buckets", str(buckets), "--step-time", str(step_time)]
    flags += ["--backend", "nccl", "--every", str(steps + 1)] if which == "nccl" else []  # no checkpoint: the GPU's
    return [str(JOB), "--checkpoint", str(workdir / "ckpt.pt"), *flags]


def cost_once(config: str, workdir: Path, steps: int, job: list[str], nproc: int) -> list[float]:
    """The step times of one run of ``job`` on ``nproc`` ranks under ``config``."""
    tl = workdir / "timeline.jsonl"
    env = dict(os.environ)
    launcher = [*(TORCHRUN if config == "torchrun" else FTRUN), "--nproc-per-node", str(nproc)]
    flags = [] if config == "torchrun" else ["--log-dir", str(workdir / "logs")]
    if config == "nothing":
        env["TORCH_FR_BUFFER_SIZE"] = "0"
    if config in ("nothing", "recorder"):
        flags.append("--no-hang-detection")
    job = [*job, "--steps", str(steps), "--timeline", str(tl)]
    subprocess.run([*launcher, *flags, *job], env=env, cwd=workdir, capture_output=True, check=True, timeout=900)
    return step_times(timeline(tl))


def cost(reps: int, steps: int, job: Callable[[Path], list[str]], nproc: int) -> None:
    configs = ("nothing", "recorder", "ftrun", "torchrun")
    medians: dict[str, list[float]] = {c: [] for c in configs}
    means: dict[str, list[float]] = {c: [] for c in configs}
    for rep in range(reps):
        for c in configs if rep % 2 == 0 else reversed(configs):
            with tempfile.TemporaryDirectory(prefix="ftrun-bench-") as d:
                times = cost_once(c, Path(d), steps, job(Path(d)), nproc)
                medians[c].append(statistics.median(times))
                means[c].append(statistics.fmean(times))
    base_median, base_mean = statistics.median(medians["nothing"]), statistics.median(means["nothing"])
    for c in configs:
        m, mean = statistics.median(medians[c]), statistics.median(means[c])
        runs = ", ".join(f"{x * 1000:.2f}" for x in means[c])
        print(f"{c:9s} median step {m * 1000:8.3f} ms ({m / base_median:.3f} of nothing), "
              f"mean {mean * 1000:8.3f} ms ({mean / base_mean:.3f}); means of the runs: {runs}")  # fmt: skip


def look_alikes(seconds: float) -> None:
    job = [str(Path(__file__).resolve().parents[1] / "examples" / "looks_hung.py"), f"{seconds:g}"]
    walls = {}
    for launcher in ("ftrun", "torchrun"):
        with tempfile.TemporaryDirectory(prefix="ftrun-bench-") as d:
            cmd = [*(FTRUN if launcher == "ftrun" else TORCHRUN), "--nproc-per-node", "3"]
            cmd += ["--log-dir", str(Path(d) / "logs")] if launcher == "ftrun" else []
            t0 = time.monotonic()
            bound = 10 * seconds + 300
            r = subprocess.run([*cmd, *job], check=False, cwd=d, capture_output=True, text=True, timeout=bound)
            walls[launcher] = time.monotonic() - t0
            events = [json.loads(line) for f in Path(d).glob("logs/*/events.jsonl") for line in f.open()]
            hangs = sum(1 for e in events if e["kind"] == "hang")
            phases = r.stdout.count(" after ")
            found = f", hangs found: {hangs}" if launcher == "ftrun" else ""
            print(f"{launcher:9s} exit {r.returncode}, {phases}/18 phase ends printed{found}, {walls[launcher]:.1f} s")
    print(f"ftrun / torchrun wall time: {walls['ftrun'] / walls['torchrun']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ways", default="sleep,gil,fifo,group")
    p.add_argument("--bound", type=float, default=120.0, help="seconds after the hang before a run is given up")
    p.add_argument("--launchers", default="ftrun,torchrun")
    p.add_argument("--cost", action="store_true")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--buckets", type=int, default=1, help="--cost: the job's all-reduces per step")
    p.add_argument("--step-time", type=float, default=0.05, help="--cost: the job's simulated compute per step")
    p.add_argument("--job", choices=("ddp", "nccl", "stack"), default="ddp",
                   help="--cost: the DDP job (on gloo, or NCCL on one GPU) or the real stack")  # fmt: skip
    p.add_argument("--look-alikes", type=float, metavar="SECONDS")
    a = p.parse_args()
    if a.look_alikes:
        look_alikes(a.look_alikes)
        return
    if a.cost:
        job = partial(cost_job, a.job, steps=a.steps, buckets=a.buckets, step_time=a.step_time)  # of its workdir
        cost(a.reps, a.steps, job, 1 if a.job == "nccl" else 2)
        return
    for how in a.ways.split(","):
        results: dict[str, list[tuple[float | None, str]]] = {name: [] for name in a.launchers.split(",")}
        for _ in range(a.reps):
            for launcher, runs in results.items():
                with tempfile.TemporaryDirectory(prefix="ftrun-bench-") as d:
                    runs.append(hang_once(launcher, how, Path(d), a.bound))
        for launcher, runs in results.items():
            times = [t for t, _ in runs if t is not None]
            right = sum(1 for _, named in runs if named == f"rank {CULPRIT} by collective")
            shown = ", ".join(f"{t:.1f}" if t is not None else f">{a.bound:.0f}" for t, _ in runs)
            named = f"  named rank {CULPRIT} by the collective {right}/{len(runs)}" if launcher == "ftrun" else ""
            median = f"median {statistics.median(times):6.1f} s" if times else "never"
            print(f"{how:6s} {launcher:9s} stepping again: {median} ({shown}){named}")


if __name__ == "__main__":
    main()
