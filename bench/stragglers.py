"""Straggler detection on real DDP jobs (gloo, CPU) that never import ftrun.

One rank is slowed by a CPU spin before every forward pass, of 10%, 30% and 100% of the balanced step time, in
jobs of 2 and 4 ranks; and the same jobs balanced. Prints, in one run:

  time to name   from the attempt's first step to the straggler event, and whether the rank named is the slow one
  false positives  straggler events in balanced training, per hour (with the seconds trained: a rate seen on
                 minutes is an estimate)
  overhead       the median step time with straggler detection against --no-stragglers, and against torchrun
                 (which has none), alternating runs, as ratios; and the per-step cost of ftrun's two hooks,
                 timed in-process, as a share of the step

    python bench/stragglers.py [--worlds 2,4] [--slow 0.1,0.3,1.0] [--balanced-s 120] [--overhead-s 10] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

JOB = """
import os, sys, time, pathlib, statistics
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
torch.set_num_threads(1)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
slow_rank, slow_s = int(os.environ.get("SLOW_RANK", -1)), float(os.environ.get("SLOW_MS", 0)) / 1000
duration = float(os.environ.get("DURATION", 600))
done = pathlib.Path(sys.argv[1]) / "done"
x = torch.randn(64, 256)
started, step, times, last = time.monotonic(), 0, [], None
while True:
    if step % 20 == 0:
        stop = torch.tensor([float(rank == 0 and (done.exists() or time.monotonic() - started > duration))])
        dist.all_reduce(stop)
        if stop.item():
            break
    if rank == slow_rank:
        end = time.perf_counter() + slow_s
        while time.perf_counter() < end:
            pass
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    now = time.perf_counter()
    if last is not None and step > 20:  # past the warm-up
        times.append(now - last)
    last, step = now, step + 1
if rank == 0:
    print(f"median step {statistics.median(times) * 1000:.4f} ms over {len(times)} steps", flush=True)
dist.destroy_process_group()
"""


Events = list[dict[str, object]]


Events = list[dict[str, object]]


def launch(launcher: str, work: Path, world: int, env: dict[str, str], *flags: str) -> subprocess.Popen[str]:
    if launcher == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    else:
        argv = [sys.executable, "-m", "ftrun", "--log-dir", str(work / "logs"), "--nproc-per-node", str(world), *flags]
    return subprocess.Popen(
        [*argv, str(work / "job.py"), str(work)], cwd=work, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def median_step_ms(out: str) -> float:
    for line in out.splitlines():
        if line.startswith("median step"):
            return float(line.split()[2])
    raise RuntimeError(f"no step time in the job's output: {out[-500:]}")


FAILED: list[str] = []  # runs that failed and were run again


def run_for(launcher: str, world: int, seconds: float, *flags: str, **env: str) -> tuple[float, Events]:
    """A job of ``seconds``: its median step time, and ftrun's events (a failed run is run again, twice at
    most, and counted: torchrun's gloo teardown now and then ends in SIGABRT on this machine)."""
    for _ in range(2):
        try:
            return run_once(launcher, world, seconds, *flags, **env)
        except RuntimeError as e:
            FAILED.append(f"{launcher} world {world}: {str(e).splitlines()[0][:200]}")
    return run_once(launcher, world, seconds, *flags, **env)


def run_once(launcher: str, world: int, seconds: float, *flags: str, **env: str) -> tuple[float, Events]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "job.py").write_text(JOB)
        p = launch(launcher, work, world, {"DURATION": str(seconds), **env}, *flags)
        out, err = p.communicate(timeout=seconds + 120)
        if p.returncode:
            raise RuntimeError(f"{launcher} exited {p.returncode}: {err[-2000:]}")
        return median_step_ms(out), events(work)


def events(work: Path) -> Events:
    found = sorted((work / "logs").glob("*/events.jsonl"))
    return [json.loads(line) for line in found[-1].read_text().splitlines()] if found else []


def time_to_name(world: int, slow_ms: float, bound_s: float) -> tuple[float | None, object]:
    """Seconds from the first step to the straggler event (None: not named within ``bound_s``), and its rank."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "job.py").write_text(JOB)
        p = launch("ftrun", work, world, {"SLOW_RANK": str(world - 1), "SLOW_MS": str(slow_ms)})
        deadline = time.monotonic() + bound_s
        named: dict[str, object] | None = None
        first: float | None = None
        try:
            while time.monotonic() < deadline and named is None:
                time.sleep(0.2)  # polling the event log: the benchmark's own pace, not ftrun's
                found = events(work)
                first = next((float(e["mono"]) for e in found if e["kind"] == "first_step"), first)  # type: ignore[arg-type]
                named = next((e for e in found if e["kind"] == "straggler"), None)
        finally:
            (work / "done").touch()
            p.communicate(timeout=120)
        if named is None or first is None:
            return None, None
        return float(named["mono"]) - first, named["rank"]  # type: ignore[arg-type]


def hook_cost_us() -> float:
    """ftrun's two hooks per step (the backward wrapper's mark and the step's end), with the slot write, timed
    in-process against a scratch table."""
    import mmap

    from ftrun.worker import client, layout, pace

    table = mmap.mmap(-1, layout.HEADER_SIZE + layout.SLOT_SIZE)
    layout.HEADER.pack_into(table, 0, layout.MAGIC, layout.VERSION, 1, layout.SLOT_SIZE)
    client._client = client._Attached(table, 0, {})  # type: ignore[attr-defined]
    n = 200_000
    started = time.perf_counter()
    for _ in range(n):
        pace.backward_starts()
        pace.step_ends()
    return (time.perf_counter() - started) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--slow", default="0.1,0.3,1.0", help="the slow rank's extra time, as shares of a step")
    ap.add_argument("--balanced-s", type=float, default=120.0, help="seconds of balanced training per world size")
    ap.add_argument("--overhead-s", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bound", type=float, default=60.0, help="seconds allowed to name the straggler")
    ap.add_argument("--parts", default="name,balanced,overhead", help="which measurements to make")
    a = ap.parse_args()
    worlds = [int(w) for w in a.worlds.split(",")]
    shares = [float(s) for s in a.slow.split(",")]
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; job: DDP gloo MLP 256-1024-256, batch 64")

    parts = set(a.parts.split(","))
    step_ms = 0.0
    print("\n# time to name the slow rank (from the first step)")
    for world in worlds if "name" in parts else []:
        step_ms, _ = run_for("ftrun", world, 8.0, "--no-stragglers")
        for share in shares:
            took, rank = time_to_name(world, share * step_ms, a.bound)
            said = (
                "not named"
                if took is None
                else f"{took:5.1f} s, rank {rank} named ({'right' if rank == world - 1 else 'WRONG'})"
            )
            print(f"world {world}  slow rank {world - 1} +{share:.0%} of a {step_ms:.2f} ms step: {said}")

    print("\n# false positives in balanced training")
    for world in worlds if "balanced" in parts else []:
        _, found = run_for("ftrun", world, a.balanced_s)
        named = [e for e in found if e["kind"] == "straggler"]
        rate = len(named) * 3600 / a.balanced_s
        print(f"world {world}: {len(named)} straggler event(s) in {a.balanced_s:.0f} s = {rate:.1f} per hour")

    print("\n# overhead per step (median step time; alternating runs)")
    for world in worlds if "overhead" in parts else []:
        runs: dict[str, list[float]] = {"ftrun": [], "ftrun --no-stragglers": [], "torchrun": []}
        for _ in range(a.reps):
            runs["ftrun"].append(run_for("ftrun", world, a.overhead_s)[0])
            runs["ftrun --no-stragglers"].append(run_for("ftrun", world, a.overhead_s, "--no-stragglers")[0])
            runs["torchrun"].append(run_for("torchrun", world, a.overhead_s)[0])
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(
            f"world {world}: ftrun {med['ftrun']:.3f} ms, --no-stragglers {med['ftrun --no-stragglers']:.3f} ms "
            f"(ratio {med['ftrun'] / med['ftrun --no-stragglers']:.3f}), torchrun {med['torchrun']:.3f} ms "
            f"(ratio {med['ftrun'] / med['torchrun']:.3f})"
        )
        step_ms = med["ftrun --no-stragglers"]
    cost = hook_cost_us()
    share = f" = {cost / 1000 / step_ms:.3%} of a {step_ms:.2f} ms step" if step_ms else ""
    print(f"ftrun's hooks: {cost:.2f} us per step{share}")
    for failed in FAILED:
        print(f"run again after a failure: {failed}")


if __name__ == "__main__":
    main()
