"""Recovery after a worker crash: ftrun (warm and cold) against torchrun, same job, same flags, same run.

The demo DDP job (2 workers, gloo on CPU) runs under each launcher in turn; rank 1
kills itself with SIGKILL at the same step on the first attempt. ftrun-warm is
ftrun as it comes (a warm pool that learns what the workers import: it must have
finished preloading before the crash: the default crash comes ~8 s into the job,
300 steps of 20 ms simulated compute);
ftrun-cold is ftrun --no-warm. From the job's
own timeline (wall-clock records written by every rank) we take the time from
the crash to the moment every rank has finished its first step after the
restart. From ftrun's event log we also take ftrun's own overhead: from the
failed worker's exit to the new workers' exec.

    python bench/recovery.py [--reps 5] [--crash-at 300] [--step-time 0.02]

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

DEMO = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"
LAUNCHERS = {
    "ftrun-warm": [sys.executable, "-m", "ftrun"],
    "ftrun-cold": [sys.executable, "-m", "ftrun", "--no-warm"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    # torchrun's other common form: c10d rendezvous on localhost instead of its static default
    "torchrun-standalone": [sys.executable, "-m", "torch.distributed.run", "--standalone"],
}


@dataclass
class Trial:
    launcher: str
    recovery_s: float | None  # crash -> every rank stepped again; None: never trained again
    first_restart: bool  # training resumed on the first restart (attempt 1)
    overhead_s: float | None  # ftrun only: failed worker exit -> last new worker exec'd
    detect_s: float | None  # ftrun only: crash -> exit seen by ftrun
    start_s: float | None  # launcher started -> every rank finished its first step (a cold start)


def run_once(launcher: str, args: argparse.Namespace, workdir: Path) -> Trial:
    timeline, events = workdir / "timeline.jsonl", workdir / "events.jsonl"
    flags = ["--nproc-per-node", "2", "--max-restarts", "3"]
    if launcher.startswith("ftrun"):
        flags += ["--log-dir", str(workdir / "logs"), "--event-log", str(events)]
    job = [str(DEMO), "--steps", str(args.steps), "--checkpoint-every", "10", "--crash-at", str(args.crash_at)]
    job += ["--step-time", str(args.step_time)]
    job += ["--checkpoint-dir", str(workdir / "ckpt"), "--timeline", str(timeline), "--log-every", "1000000"]
    started = time.time()
    with (workdir / "launcher.log").open("w") as log:
        proc = subprocess.Popen([*LAUNCHERS[launcher], *flags, *job], stdout=log, stderr=log, start_new_session=True)
        try:
            proc.wait(args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    records = [json.loads(line) for line in timeline.read_text().splitlines()] if timeline.exists() else []
    crash = next((r["wall"] for r in records if r["event"] == "crash"), None)
    if crash is None:
        raise SystemExit(f"{launcher}: the job never reached the crash step; see {workdir / 'launcher.log'}")
    resumed: dict[int, dict[int, float]] = {}  # attempt -> rank -> wall of its first step
    for r in records:
        if r["event"] == "step" and r["attempt"] > 0:
            resumed.setdefault(r["attempt"], {}).setdefault(r["rank"], r["wall"])
    complete = sorted(a for a, ranks in resumed.items() if len(ranks) == 2)
    recovery = max(resumed[complete[0]].values()) - crash if complete else None
    overhead = detect = None
    if launcher.startswith("ftrun") and events.exists():
        ev = [json.loads(line) for line in events.read_text().splitlines()]
        failed = next(e for e in ev if e["kind"] == "worker_exited" and e["state"] == "failed")
        respawned = [e for e in ev if e["kind"] == "worker_spawned" and e["attempt"] == 1]
        overhead = max(e["mono"] for e in respawned) - failed["mono"] if respawned else None
        detect = failed["wall"] - crash
    firsts = [
        min((r["wall"] for r in records if r["event"] == "step" and r["attempt"] == 0 and r["rank"] == k), default=None)
        for k in (0, 1)
    ]
    start = max(firsts) - started if None not in firsts else None  # type: ignore[type-var, operator]
    return Trial(launcher, recovery, bool(complete) and complete[0] == 1, overhead, detect, start)


def describe(values: list[float], scale: float = 1.0, unit: str = "s") -> str:
    if not values:
        return "n/a"
    v = [x * scale for x in values]
    return f"median {statistics.median(v):7.3f} {unit}  min {min(v):7.3f}  max {max(v):7.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=330)
    p.add_argument("--crash-at", type=int, default=300)
    p.add_argument("--step-time", type=float, default=0.02, help="simulated compute per step (s), as the demo's flag")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a run that hangs is killed")
    p.add_argument("--launchers", default="ftrun-warm,ftrun-cold,torchrun,torchrun-standalone")
    args = p.parse_args()
    launchers = args.launchers.split(",")
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-") as tmp:
        for rep in range(args.reps):
            for launcher in launchers if rep % 2 == 0 else reversed(launchers):  # alternate the order
                workdir = Path(tmp) / f"{launcher}-{rep}"
                workdir.mkdir()
                t = run_once(launcher, args, workdir)
                trials.append(t)
                rec = f"{t.recovery_s:.3f} s" if t.recovery_s is not None else "never"
                print(f"rep {rep} {launcher:19s} recovery {rec}  first restart: {'yes' if t.first_restart else 'NO'}")
    print()
    print(f"crash of rank 1 at step {args.crash_at} -> every rank stepping again ({args.reps} reps, alternating)")
    print("  (times over the runs that trained again, on any restart)")
    medians = {}
    for launcher in launchers:
        mine = [t for t in trials if t.launcher == launcher]
        rec = [t.recovery_s for t in mine if t.recovery_s is not None]
        firsts = sum(t.first_restart for t in mine)
        never = len(mine) - len(rec)
        print(
            f"  {launcher:19s} {describe(rec)}  recovered on first restart {firsts}/{len(mine)}, "
            f"never within {args.timeout:.0f} s {never}/{len(mine)}"
        )
        if rec:
            medians[launcher] = statistics.median(rec)
    for ours in [name for name in medians if name.startswith("ftrun")]:
        for peer in [name for name in medians if name != ours and not name.startswith("ftrun-warm")]:
            print(f"  ratio {ours}/{peer} (medians): {medians[ours] / medians[peer]:.2f}")
    print("start: launcher started -> every rank finished its first step (the first attempt):")
    for launcher in launchers:
        starts = [t.start_s for t in trials if t.launcher == launcher and t.start_s is not None]
        print(f"  {launcher:19s} {describe(starts)}")
    for ours in [name for name in launchers if name.startswith("ftrun")]:
        ft = [t for t in trials if t.launcher == ours]
        print(f"{ours}: its own overhead, failed worker exit -> new workers spawned:")
        print(f"  {describe([t.overhead_s for t in ft if t.overhead_s is not None], 1000, 'ms')}")
        print(f"{ours}: crash -> exit seen:")
        print(f"  {describe([t.detect_s for t in ft if t.detect_s is not None], 1000, 'ms')}")


if __name__ == "__main__":
    main()
