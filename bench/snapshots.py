"""Snapshots every step against none, in one run: what they cost the step and what they save at a crash.

The job (bench/snapshot_job.py): DDP, gloo, CPU, 2 ranks on one node, --state-mb of state per rank (1 GiB by
default), a 1 s step; rank 1 exits at step 15 of the first attempt. Alternating in one run:

  snapshots   ftrun.snapshot every step, ftrun.restore at start
  none        no snapshots: the job starts again from step 0 (its own checkpoint would be older still)

Figures: the time snapshots held the job up per step (the copies at the call and the next optimizer step's
wait for the copy in flight), as a share of the step; ftrun.restore's own time; the crash -> every rank
stepping again; the steps done again (lost work).

    python bench/snapshots.py [--reps 2] [--state-mb 1024] [--device cuda] [--nodes 2]

Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = Path(__file__).resolve().parent / "snapshot_job.py"
CRASH_AT = 15
STEPS = 19


def run_once(snapshots: bool, state_mb: int, device: str, nodes: int, workdir: Path) -> dict[str, float]:
    tl = workdir / "timeline.jsonl"
    job = [str(JOB), "--state-mb", str(state_mb), "--steps", str(STEPS), "--crash-at", str(CRASH_AT)]
    job += ["--device", device]
    job += ["--timeline", str(tl)] + (["--snapshots"] if snapshots else [])
    cmd = [sys.executable, "-m", "ftrun", "--nproc-per-node", str(2 // nodes), "--max-restarts", "1"]
    if nodes > 1:  # agents as separate processes on this machine, the first hosting the embedded store
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd += ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        cmd += ["--rdzv-id", "bench", "--local-addr", "127.0.0.1"]
    agents = [
        subprocess.Popen(
            [*cmd, "--log-dir", str(workdir / f"logs-{n}"), "--event-log", str(workdir / f"events-{n}.jsonl"), *job],
            cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for n in range(nodes)
    ]  # fmt: skip
    for agent in agents:
        if agent.wait(timeout=900) != 0:
            raise SystemExit(f"an agent exited {agent.returncode}; its logs are in {workdir}")
    records = [json.loads(line) for line in tl.read_text().splitlines()]
    crash = next(r["wall"] for r in records if r["event"] == "crash")
    events = [json.loads(line) for n in range(nodes) for line in (workdir / f"events-{n}.jsonl").open()]

    def first(kind: str) -> float:
        after = [e["wall"] - crash for e in events if e["kind"] == kind and e["wall"] > crash]
        return min(after, default=float("nan"))

    restored = [r["wall"] - crash for r in records if r["event"] == "restored"]
    print(f"  {'snapshots' if snapshots else 'none'}: after the crash, s: failure {first('failure'):.2f}, "
          f"workers stopped {first('group_stopped'):.2f}, attempt 1 {first('attempt_started'):.2f}, "
          f"restored {max(restored, default=float('nan')):.2f}", flush=True)  # fmt: skip
    again = {r["rank"]: r["wall"] for r in reversed(records) if r["event"] == "step" and r["attempt"] == 1}
    first_again = min((r["step"] for r in records if r["event"] == "step" and r["attempt"] == 1), default=0)
    steps = [r["blocked_s"] for r in records if r["event"] == "step" and r["attempt"] == 0 and r["rank"] == 0]
    # per step: the first few share two cores with ftrun's warm pool being made, so the median, not the mean
    each = [b - a for a, b in zip([0.0, *steps], steps, strict=False)]
    blocked, worst = (statistics.median(each), max(each)) if steps else (0.0, 0.0)
    restore = [r["took_s"] for r in records if r["event"] == "restored"]
    return {"recovery_s": max(again.values()) - crash, "blocked_s": blocked, "worst_s": worst,
            "lost_steps": CRASH_AT - first_again,
            "restore_s": max(restore) if restore else 0.0}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--state-mb", type=int, default=1024)
    p.add_argument("--device", default="cpu", help="cuda: every rank's tensors on GPU 0")
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="2: two agents of one rank each")
    a = p.parse_args()
    print(f"{a.reps} runs each, 2 ranks on {a.nodes} node(s), {a.state_mb} MiB of state per rank on {a.device}, "
          f"rank 1 exits at step {CRASH_AT}")  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {"snapshots": [], "none": []}
    for _ in range(a.reps):
        for name, trials in runs.items():
            with tempfile.TemporaryDirectory(prefix="ftrun-bench-") as d:
                trials.append(run_once(name == "snapshots", a.state_mb, a.device, a.nodes, Path(d)))
    for name, trials in runs.items():
        med = {k: statistics.median(t[k] for t in trials) for k in trials[0]}
        each = ", ".join(f"{t['recovery_s']:.2f}" for t in trials)
        print(f"{name:9s} blocked per step {med['blocked_s'] * 1000:7.1f} ms ({med['blocked_s']:.2%} of a 1 s step, "
              f"the worst {med['worst_s']:.2f} s); "
              f"restore {med['restore_s']:.2f} s; crash -> stepping again {med['recovery_s']:.2f} s ({each}); "
              f"steps done again {med['lost_steps']:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
