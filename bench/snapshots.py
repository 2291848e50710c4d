"""Snapshots every step against none, in one run: what they cost the step and what they save at a crash.

The job (bench/snapshot_job.py): DDP, gloo, CPU, 2 ranks on one node, --state-mb of state per rank (1 GiB by
default), a 1 s step; rank 1 exits at step 15 of the first attempt. With --nodes 2 two agents of one rank each
share a standalone store (`ftrun store`); with --fault node a third waits as a hot spare, and at rank 1's step
15 its node (agent and worker) is SIGKILLed: the spare takes rank 1 and fetches its snapshot from the copy on
rank 0's node. Alternating in one run:

  snapshots   ftrun.snapshot every step, ftrun.restore at start
  none        no snapshots: the job starts again from step 0 (its own checkpoint would be older still)

Figures: the time snapshots held the job up per step (the copies at the call and the next optimizer step's
wait for the copy in flight), as a share of the step; ftrun.restore's own time; the fault -> every rank
stepping again; the steps done again (lost work).

    python bench/snapshots.py [--reps 2] [--state-mb 1024] [--device cuda] [--nodes 2 [--fault node]] [--api dcp]

Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ftrun.worker import snapshot_budget as budget

JOB = Path(__file__).resolve().parent / "snapshot_job.py"
CRASH_AT = 15
STEPS = 19


def run_once(snapshots: bool, a: argparse.Namespace, workdir: Path) -> dict[str, float]:
    state_mb, device, nodes, fault = a.state_mb, a.device, a.nodes, a.fault
    tl = workdir / "timeline.jsonl"
    job = [str(JOB), "--state-mb", str(state_mb), "--steps", str(STEPS), "--device", device, "--api", a.api]
    job += (["--crash-at", str(CRASH_AT)] if fault == "crash" else []) + ["--timeline", str(tl)]
    job += ["--snapshots"] if snapshots else []
    cmd = [sys.executable, "-m", "ftrun", "--nproc-per-node", str(2 // nodes), "--max-restarts", "1"]
    # What a node's ranks may hold at most (snapshot_budget: on several nodes their copies of the previous node's
    # too): the default 25% of RAM would refuse a big state on several nodes.
    most = budget.need(state_mb << 20, pinned=budget.PINNED, copies=nodes > 1).bytes * (2 // nodes)
    cmd += ["--snapshot-memory", str(most)]
    store = None
    if nodes > 1:  # agents as separate processes on this machine around a standalone store
        store = subprocess.Popen([sys.executable, "-m", "ftrun", "store", "--port", "0"], stderr=subprocess.PIPE,
                                 text=True, start_new_session=True)  # fmt: skip
        assert store.stderr is not None
        found = re.search(r"serving on (\S+)", store.stderr.readline())
        if found is None:
            raise SystemExit("ftrun store did not say where it serves")
        cmd += ["--nnodes", f"{nodes}:{nodes}", "--rdzv-backend", "c10d", "--rdzv-endpoint", found.group(1)]
        cmd += ["--rdzv-id", "bench", "--local-addr", "127.0.0.1"]
    count = nodes + (fault == "node")  # the last one a hot spare
    agents = [
        subprocess.Popen(
            [*cmd, "--log-dir", str(workdir / f"logs-{n}"), "--event-log", str(workdir / f"events-{n}.jsonl"), *job],
            cwd=workdir, stdout=subprocess.DEVNULL, stderr=(workdir / f"console-{n}.txt").open("wb"),
            start_new_session=True,
        )
        for n in range(count)
    ]  # fmt: skip
    try:
        if fault == "node":
            lost = kill_rank_1s_node(agents, workdir, tl)
            agents.remove(lost)
        for agent in agents:
            if agent.wait(timeout=900) != 0:
                raise SystemExit(f"an agent exited {agent.returncode}; its logs are in {workdir}")
    finally:
        for proc in [*agents, *([store] if store else [])]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    records = timeline(tl)
    crash = next(r["wall"] for r in records if r["event"] == "crash")
    events = [json.loads(line) for n in range(count) for line in (workdir / f"events-{n}.jsonl").open()]

    def first(kind: str) -> float:
        after = [e["wall"] - crash for e in events if e["kind"] == kind and e["wall"] > crash]
        return min(after, default=float("nan"))

    restored = [r["wall"] - crash for r in records if r["event"] == "restored"]
    print(f"  {'snapshots' if snapshots else 'none'}: after the crash, s: failure {first('failure'):.2f}, "
          f"workers stopped {first('group_stopped'):.2f}, attempt 1 {first('attempt_started'):.2f}, "
          f"restored {max(restored, default=float('nan')):.2f}", flush=True)  # fmt: skip
    # by the clock, not by attempt: a spare's workers count their node's attempts, from 0 (as torchrun's do)
    after = [r for r in records if r["event"] == "step" and r["wall"] > crash]
    again = {r["rank"]: r["wall"] for r in reversed(after)}
    first_again = min((r["step"] for r in after), default=0)
    done = max((r["step"] for r in records if r["event"] == "step" and r["wall"] <= crash), default=-1)
    steps = [r["blocked_s"] for r in records if r["event"] == "step" and r["wall"] <= crash and r["rank"] == 0]
    # per step: the first few share two cores with ftrun's warm pool being made, so the median, not the mean
    each = [b - a for a, b in zip([0.0, *steps], steps, strict=False)]
    blocked, worst = (statistics.median(each), max(each)) if steps else (0.0, 0.0)
    restore = [r["took_s"] for r in records if r["event"] == "restored"]
    return {"recovery_s": max(again.values()) - crash, "blocked_s": blocked, "worst_s": worst,
            "lost_steps": done + 1 - first_again,
            "restore_s": max(restore) if restore else 0.0}  # fmt: skip


def timeline(tl: Path) -> list[dict[str, Any]]:
    """The job's records so far (a line being written is left for the next look)."""
    records = []
    for line in tl.read_text().splitlines() if tl.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def kill_rank_1s_node(agents: list[subprocess.Popen[bytes]], workdir: Path, tl: Path) -> subprocess.Popen[bytes]:
    """At rank 1's step CRASH_AT, SIGKILL its node: the agent whose log directory holds rank 1, and its worker."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if any(r["event"] == "step" and r["rank"] == 1 and r["step"] == CRASH_AT for r in timeline(tl)):
            break
        time.sleep(0.02)
    else:
        raise SystemExit(f"rank 1 never reached step {CRASH_AT}; the logs are in {workdir}")
    [node] = [a for n, a in enumerate(agents) if list((workdir / f"logs-{n}").glob("*/attempt_0/1"))]
    os.killpg(node.pid, signal.SIGKILL)
    with tl.open("a") as f:
        f.write(json.dumps({"event": "crash", "wall": time.time(), "rank": 1, "attempt": 0}) + "\n")
    node.wait()
    return node


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--state-mb", type=int, default=1024)
    p.add_argument("--device", default="cpu", help="cuda: every rank's tensors on GPU 0")
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1, help="2: two agents of one rank each")
    p.add_argument("--fault", choices=("crash", "node"), default="crash",
                   help="node (with --nodes 2): rank 1's node SIGKILLed, a hot spare takes it")  # fmt: skip
    p.add_argument("--api", choices=("snapshot", "dcp"), default="snapshot",
                   help="dcp: dcp.save / dcp.load through ftrun.SnapshotWriter / SnapshotReader")  # fmt: skip
    p.add_argument("--keep", type=Path, default=None, help="keep each run's logs and events under this directory")
    a = p.parse_args()
    if a.fault == "node" and a.nodes != 2:
        p.error("--fault node needs --nodes 2 (the node lost, the other survives, a third waits as the spare)")
    what = f"rank 1 exits at step {CRASH_AT}" if a.fault == "crash" else f"rank 1's node SIGKILLed at step {CRASH_AT}"
    print(f"{a.reps} runs each, 2 ranks on {a.nodes} node(s), {a.state_mb} MiB of state per rank on {a.device}, "
          f"{what}, {a.api} API")  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {"snapshots": [], "none": []}
    for _ in range(a.reps):
        for name, trials in runs.items():
            if a.keep is not None:
                a.keep.mkdir(parents=True, exist_ok=True)
            d = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=a.keep))
            trials.append(run_once(name == "snapshots", a, d))  # a run that fails keeps its logs, and says where
            if a.keep is None:
                shutil.rmtree(d)
    for name, trials in runs.items():
        med = {k: statistics.median(t[k] for t in trials) for k in trials[0]}
        each = ", ".join(f"{t['recovery_s']:.2f}" for t in trials)
        print(f"{name:9s} blocked per step {med['blocked_s'] * 1000:7.1f} ms ({med['blocked_s']:.2%} of a 1 s step, "
              f"the worst {med['worst_s']:.2f} s); "
              f"restore {med['restore_s']:.2f} s; crash -> stepping again {med['recovery_s']:.2f} s ({each}); "
              f"steps done again {med['lost_steps']:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
