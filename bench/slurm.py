"""A worker crash under SLURM against the same crash outside it: does srun cost anything in recovery?

A real SLURM 22.05 cluster on this machine (ftrun.testing.slurm: slurmctld, a slurmd per node in a network
namespace of its own). The job (bench/plain_ddp.py: DDP, gloo, CPU, never imports ftrun) runs on 2 nodes x 2
ranks; rank 3 kills itself (SIGKILL) at step 20 of the first attempt. Alternating in one run:

  srun      srun -N2 --ntasks-per-node=1 ftrun ... with no rendezvous flag (ftrun takes it from SLURM)
  outside   two ftrun agents started directly on this machine (loopback, the embedded store)

Figure, from the job's own timeline: the crash -> every rank having finished its first step after the restart.

    python bench/slurm.py [--reps 3]

Needs root, slurm-wlm and munge (scripts/test installs them). Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ftrun.testing.slurm import SlurmCluster, available
from recovery import kill_leftovers  # bench/ is this script's sys.path[0]

JOB = Path(__file__).resolve().parent / "plain_ddp.py"
CRASH_AT = 20
BOUND_S = 180.0


def recovery(timeline: Path) -> float | None:
    records = [json.loads(line) for line in timeline.read_text().splitlines()] if timeline.exists() else []
    crash = next((r["wall"] for r in records if r["event"] == "crash"), None)
    firsts: dict[int, float] = {}
    for r in records:
        if r["event"] == "step" and r["attempt"] == 1:
            firsts.setdefault(r["rank"], r["wall"])
    return max(firsts.values()) - crash if crash is not None and len(firsts) == 4 else None


def job(workdir: Path) -> list[str]:
    return [str(JOB), "--steps", str(CRASH_AT + 10), "--crash-at", str(CRASH_AT), "--culprit", "3",
            "--timeline", str(workdir / "timeline.jsonl"), "--checkpoint", str(workdir / "ckpt.pt")]  # fmt: skip


def under_srun(cluster: SlurmCluster, workdir: Path) -> float | None:
    argv = ["-N2", "--ntasks-per-node=1", "--chdir", str(workdir), sys.executable, "-m", "ftrun"]
    argv += ["--log-dir", str(workdir / "logs"), "--nproc-per-node", "2", "--max-restarts", "1", *job(workdir)]
    proc = cluster.srun(argv, workdir / "srun.out")
    try:
        proc.wait(BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return recovery(workdir / "timeline.jsonl")


def outside(workdir: Path) -> float | None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdzv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "b"]
    procs = []
    for node in ("a", "b"):
        cmd = [sys.executable, "-m", "ftrun", *rdzv, "--nproc-per-node", "2", "--max-restarts", "1"]
        cmd += ["--log-dir", str(workdir / f"logs-{node}"), *job(workdir)]
        with (workdir / f"{node}.log").open("wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir))
        time.sleep(0.5)  # node a registers first: ranks 0-1 there, the culprit on b
    for proc in procs:
        try:
            proc.wait(BOUND_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    kill_leftovers(workdir)
    return recovery(workdir / "timeline.jsonl")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    if why := available():
        raise SystemExit(f"no SLURM cluster here: {why}")
    runs: dict[str, list[float | None]] = {"srun": [], "outside": []}
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-") as d, SlurmCluster(Path(d) / "cluster") as cluster:
        for rep in range(a.reps):
            for how, times in runs.items():
                workdir = Path(d) / f"{how}-{rep}"
                workdir.mkdir()
                times.append(under_srun(cluster, workdir) if how == "srun" else outside(workdir))
    for how, times in runs.items():
        done = [t for t in times if t is not None]
        shown = ", ".join(f"{t:.2f}" if t is not None else "none" for t in times)
        median = f"median {statistics.median(done):.2f} s" if done else "never"
        print(f"{how:8s} crash -> every rank stepping again: {median} ({shown})")
    if runs["srun"] and all(runs.values()):
        ratio = statistics.median(t for t in runs["srun"] if t) / statistics.median(t for t in runs["outside"] if t)
        print(f"srun / outside: {ratio:.2f}")


if __name__ == "__main__":
    main()
