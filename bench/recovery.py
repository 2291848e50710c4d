"""Recovery after a worker crash, at every moment a crash can come: ftrun (warm, cold, a rerun) against torchrun.

The job (bench/plain_ddp.py) is a DDP job as people write it for torchrun: it never imports ftrun, imports
torch and torch._dynamo, trains on 2 workers (gloo, CPU, 50 ms of simulated compute per step), checkpoints
every 10 steps and ends with torch's normal teardown. Rank 1 kills itself (SIGKILL) at a given step of the
first attempt: at the first step, about 0.5 s and 2 s after it, and late. Launchers, alternating in one run:

  ftrun-warm        ftrun as it comes, with an empty cache: the job's first run on this machine
  ftrun-rerun       ftrun again on the same job, with the cache the ftrun-warm run left
  ftrun-cold        ftrun --no-warm
  ftrun-in-place    ftrun, --job stack under @ftrun.restartable (its --restartable): rank 0 keeps its process and
                    trains again, rank 1 is a new one (not in the default list)
  torchrun          torchrun as it comes (static rendezvous, the agent's store shared with the workers)
  torchrun-noshare  torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

Figures, from the job's own timeline (wall-clock lines written by every rank): recovery = the crash to
every rank having finished its first step after the restart; how many recovered on the first restart;
and, for ftrun, its own part: the failed worker's exit seen -> every new worker running its own code.

    python bench/recovery.py [--reps 3] [--crash-at 0,10,40,300] [--fault crash|raise] [--cuda-standin]
                             [--nproc 2] [--job ddp|stack] [--busy] [--top-env literal|computed]

--busy: one busy loop per core for the whole run, at normal priority (a node whose cores are all taken).

--job stack: the real-stack job instead (examples/pretrain_stack.py: FSDP2 on a 2-D mesh, torch.compile with
inductor, DCP every 5 steps, a StatefulDataLoader over a datasets table); rank 1 exits (os._exit) at the step
(--fault raise: raises).

--top-env literal|computed: the ddp job with a variable set at its top, before `import torch` (a copy of it in the
run's directory): `os.environ["HF_HUB_OFFLINE"] = "1"` (the pool replays it and preloads all it would), or
`os.environ["RUN_TAG"] = str(os.getpid())` (a computed value stops the pool's preload of what follows: torch is
preloaded only once the workers reported it, each import checked).

--cuda-standin: a GPU node's driver on this machine: the stand-in CUDA driver (ftrun.testing.cuda_driver)
preloaded into every launcher and worker, and every worker initialises it first (cuInit), as GPU jobs do.

Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

JOB = Path(__file__).resolve().parent / "plain_ddp.py"
STACK = Path(__file__).resolve().parents[1] / "examples" / "pretrain_stack.py"  # --job stack
FTRUN = [sys.executable, "-m", "ftrun"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
LAUNCHERS = {
    "ftrun-warm": FTRUN,
    "ftrun-rerun": FTRUN,
    "ftrun-cold": [*FTRUN, "--no-warm"],
    "ftrun-in-place": FTRUN,
    "torchrun": TORCHRUN,
    "torchrun-noshare": TORCHRUN,
}


@dataclass
class Trial:
    launcher: str
    crash_at: int
    recovery_s: float | None  # crash -> every rank stepped again; None: never trained again
    first_restart: bool
    own_s: float | None  # ftrun only: failed exit seen -> every new worker running its own code
    stop_s: float | None  # ftrun only: of which stopping the other worker (SIGTERM -> released while exiting, or gone)
    released: bool | None  # ftrun only: the stopped worker was released while the kernel freed it
    warm: bool | None  # ftrun only: the restart's workers came from the pool
    start_s: float | None  # launcher started -> every rank finished its first step (the first attempt)


def run_once(
    launcher: str,
    crash_at: int,
    workdir: Path,
    cache: Path,
    timeout: float,
    fault: str,
    driver: str | None,
    nproc: int = 2,
    stack: bool = False,
    top_env: str = "",
) -> Trial:
    timeline, events = workdir / "timeline.jsonl", workdir / "events.jsonl"
    flags = ["--nproc-per-node", str(nproc), "--max-restarts", "3"]
    env = {**os.environ, "FTRUN_CACHE_DIR": str(cache)}
    if driver:
        env["LD_PRELOAD"] = driver
    if launcher.startswith("ftrun"):
        flags += ["--log-dir", str(workdir / "logs"), "--event-log", str(events)]
    if launcher == "torchrun-noshare":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    job = job_command(launcher, crash_at, workdir, fault, bool(driver), stack, top_env)
    launched = time.time()
    with (workdir / "launcher.log").open("w") as log:
        proc = subprocess.Popen(
            [*LAUNCHERS[launcher], *flags, *job], stdout=log, stderr=log, env=env, start_new_session=True
        )
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    kill_leftovers(workdir)  # a launcher killed on its timeout may leave workers behind (torchrun does)
    records = [json.loads(line) for line in timeline.read_text().splitlines()] if timeline.exists() else []
    crash = next((r["wall"] for r in records if r["event"] == "crash"), None)
    if crash is None:
        raise SystemExit(f"{launcher}: the job never reached the crash step; see {workdir / 'launcher.log'}")
    resumed: dict[int, dict[int, float]] = {}  # attempt -> rank -> wall of its first step
    started: dict[int, dict[int, float]] = {}  # attempt -> rank -> wall its process began running
    for r in records:
        if r["event"] == "step" and r["attempt"] > 0:
            resumed.setdefault(r["attempt"], {}).setdefault(r["rank"], r["wall"])
        elif r["event"] == "start":
            started.setdefault(r["attempt"], {})[r["rank"]] = r["wall"]
    complete = sorted(a for a, ranks in resumed.items() if len(ranks) == nproc)
    recovery = max(resumed[complete[0]].values()) - crash if complete else None
    own = warm = stop = released = None
    if launcher.startswith("ftrun") and events.exists():
        ev = [json.loads(line) for line in events.read_text().splitlines()]
        failed = next((e for e in ev if e["kind"] == "worker_exited" and e["state"] == "failed"), None)
        if failed is not None:  # none where every rank restarted in place (an exception under --restartable)
            if len(started.get(1, {})) == nproc:
                own = max(started[1].values()) - failed["wall"]
            exits = [e for e in ev if e["kind"] == "worker_exited" and e["attempt"] == failed["attempt"]]
            stop = max(e["wall"] for e in exits) - failed["wall"]
            released = all(e.get("released") for e in exits if e["state"] == "stopped")
        respawned = [e for e in ev if e["kind"] == "worker_spawned" and e["attempt"] == 1]
        warm = bool(respawned) and all(e["warm"] for e in respawned)
    firsts = [min((r["wall"] for r in records if r["event"] == "step" and r["attempt"] == 0 and r["rank"] == k),
                  default=None) for k in range(nproc)]  # fmt: skip
    start = max(firsts) - launched if None not in firsts else None  # type: ignore[type-var, operator]
    return Trial(launcher, crash_at, recovery, bool(complete) and complete[0] == 1, own, stop, released, warm, start)


TOP_ENV = {
    "literal": 'import os\nos.environ["HF_HUB_OFFLINE"] = "1"\n',
    "computed": 'import os\nos.environ["RUN_TAG"] = str(os.getpid())\n',
}


def job_command(
    launcher: str, crash_at: int, workdir: Path, fault: str, cuinit: bool, stack: bool, top_env: str = ""
) -> list[str]:
    timeline, steps = workdir / "timeline.jsonl", crash_at + 5
    script = JOB
    if top_env:  # the job with a variable set before its imports (after its start stamp)
        source = JOB.read_text()
        stamp = "STARTED = time.time()  # before any import: when this worker began running its own code\n"
        script = workdir.parent / f"plain_ddp_{top_env}.py"  # the same file for every run: the cache's key
        script.write_text(source.replace(stamp, stamp + TOP_ENV[top_env]))
    if stack:
        job = [str(STACK), "--workdir", str(workdir), "--crash-at", str(crash_at), "--timeline", str(timeline)]
        job += ["--steps", str(steps), "--crash-by", "raise" if fault == "raise" else "exit"]
        job += ["--restartable"] if launcher == "ftrun-in-place" else []
    else:
        job = [str(script), "--steps", str(steps), f"--{fault}-at", str(crash_at), "--timeline", str(timeline)]
        job += ["--checkpoint", str(workdir / "ckpt.pt")] + (["--cuinit"] if cuinit else [])
    return job


def kill_leftovers(workdir: Path) -> None:
    """SIGKILL every process whose command line names this run's directory: nothing may skew the next run."""
    mark = str(workdir).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if mark in f.read():
                    os.kill(int(entry), signal.SIGKILL)
        except OSError:
            continue


def describe(values: list[float], scale: float = 1.0, unit: str = "s") -> str:
    if not values:
        return "n/a"
    v = [x * scale for x in values]
    return f"median {statistics.median(v):7.3f} {unit}  min {min(v):7.3f}  max {max(v):7.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--crash-at", default="0,10,40,300", help="steps (50 ms each) at which rank 1 dies")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a run that hangs is killed")
    p.add_argument("--launchers", default=",".join(n for n in LAUNCHERS if n != "ftrun-in-place"))
    p.add_argument("--fault", choices=["crash", "raise"], default="crash", help="SIGKILL, or an uncaught exception")
    p.add_argument("--cuda-standin", action="store_true", help="a GPU node's CUDA driver, stood in for (see above)")
    p.add_argument("--nproc", type=int, default=2, help="workers (ranks) on this node")
    p.add_argument("--job", choices=["ddp", "stack"], default="ddp",
                   help="ddp: bench/plain_ddp.py; stack: examples/pretrain_stack.py (FSDP2, DCP, torch.compile, "
                   "a datasets loader; steps of its own length, a SIGKILL-free exit at the step)")  # fmt: skip
    p.add_argument("--busy", action="store_true", help="every core taken by a busy loop (see above)")
    p.add_argument("--top-env", choices=["literal", "computed"], default="", help="a variable set before the imports")
    args = p.parse_args()
    cores = (os.cpu_count() or 1) if args.busy else 0
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        run_all(args)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def run_all(args: argparse.Namespace) -> None:
    launchers = args.launchers.split(",")
    crash_points = [int(c) for c in args.crash_at.split(",")]
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-") as tmp:
        driver = None
        if args.cuda_standin:
            from ftrun.testing import cuda_driver

            driver = str(cuda_driver.build(Path(tmp) / "driver"))
            print(f"the stand-in CUDA driver preloaded: {driver}", flush=True)
        for rep in range(args.reps):
            for crash_at in crash_points:
                cache = Path(tmp) / f"cache-{rep}-{crash_at}"  # ftrun-warm starts it empty, ftrun-rerun reuses it
                order = launchers if rep % 2 == 0 else list(reversed(launchers))  # alternate the order
                if "ftrun-rerun" in order and "ftrun-warm" in order:  # the rerun follows the first run
                    order = [n for n in order if n != "ftrun-rerun"]
                    order.insert(order.index("ftrun-warm") + 1, "ftrun-rerun")
                for launcher in order:
                    workdir = Path(tmp) / f"{launcher}-{rep}-{crash_at}"
                    workdir.mkdir()
                    t = run_once(launcher, crash_at, workdir, cache, args.timeout, args.fault, driver, args.nproc,
                                 args.job == "stack", args.top_env)  # fmt: skip
                    trials.append(t)
                    rec = f"{t.recovery_s:.3f} s" if t.recovery_s is not None else "never"
                    how = "" if t.warm is None else (" (warm)" if t.warm else " (cold)")
                    print(f"rep {rep} step {crash_at:3d} {launcher:16s} recovery {rec}{how}", flush=True)
    print()
    what = "crash (SIGKILL)" if args.fault == "crash" else "exception"
    print(f"{what} of rank 1 -> every rank stepping again ({args.reps} reps, alternating; medians over recovered runs)")
    for crash_at in crash_points:
        print(f"crash at step {crash_at} ({crash_at * 0.05:.1f} s of steps after the first):")
        medians = {}
        for launcher in launchers:
            mine = [t for t in trials if t.launcher == launcher and t.crash_at == crash_at]
            rec = [t.recovery_s for t in mine if t.recovery_s is not None]
            firsts = sum(t.first_restart for t in mine)
            warm = sum(bool(t.warm) for t in mine)
            extra = f", warm {warm}/{len(mine)}" if launcher.startswith("ftrun") else ""
            print(f"  {launcher:16s} {describe(rec)}  first restart {firsts}/{len(mine)}{extra}")
            if rec:
                medians[launcher] = statistics.median(rec)
        for ours in [n for n in medians if n.startswith("ftrun")]:
            ratios = [f"/{peer} {medians[ours] / medians[peer]:.2f}" for peer in medians if peer.startswith("torch")]
            cold = f"  /ftrun-cold {medians[ours] / medians['ftrun-cold']:.2f}" if "ftrun-cold" in medians else ""
            print(f"    ratio {ours}{'  '.join(ratios)}{cold}")
    print("start: launcher started -> every rank finished its first step (all crash points):")
    for launcher in launchers:
        starts = [t.start_s for t in trials if t.launcher == launcher and t.start_s is not None]
        print(f"  {launcher:16s} {describe(starts)}")
    for ours in [n for n in launchers if n.startswith("ftrun")]:
        own = [t.own_s for t in trials if t.launcher == ours and t.own_s is not None]
        by = {c: [t.own_s for t in trials if t.launcher == ours and t.crash_at == c and t.own_s] for c in crash_points}
        print(f"{ours}: its own part, failed exit seen -> every new worker running its own code: "
              f"{describe(own, 1000, 'ms')}")  # fmt: skip
        print("  median by crash point: " + ", ".join(
            f"step {c} {statistics.median(o) * 1000:.1f} ms" for c, o in by.items() if o))  # fmt: skip
        mine = [t for t in trials if t.launcher == ours and t.own_s and t.stop_s]
        released = sum(bool(t.released) for t in mine)
        print(f"  of which stopping the other worker (SIGTERM -> released while exiting, or gone): "
              f"{describe([t.stop_s for t in mine], 1000, 'ms')}, released {released}/{len(mine)}"
              f"\n  and ftrun's restart (the others stopped -> every new one running its code): "
              f"{describe([t.own_s - t.stop_s for t in mine], 1000, 'ms')}")  # fmt: skip


if __name__ == "__main__":
    main()
