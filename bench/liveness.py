"""Node-level events between several agents on this machine: how long until the job trains again.

  dead agent     two agents (1:2 nodes, one worker each, the default keep-alive: 5 s x 3), a gloo job with an
                 all-reduce per step; the agent that does not host the store is SIGKILLed (its worker with
                 it); figure: the kill -> the survivor's worker stepping alone in a new round. ftrun
                 (embedded store, c10d) against torchrun (c10d), alternating.
  exclusion      two members and a hot spare (2:2 nodes); rank 1 calls ftrun.exclude_this_node(); figure: the
                 call -> the spare's worker stepping in its place. ftrun only (NVIDIA's launcher acts at the
                 next failure; torchrun has no such call).
  frozen peer    two agents, a DDP job (gloo) calling ftrun.start_peer_heartbeat(0.5, 3); rank 1 SIGSTOPs
                 itself; no hang timeout; figure: the stop -> rank 1 stepping again after a restart.
                 torchrun runs the same job (there the call raises and the job goes on without it): it
                 finds nothing within --bound (gloo's own timeout is 30 min).

    python bench/liveness.py [--reps 3] [--bound 60]

Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recovery import kill_leftovers  # bench/ is this script's sys.path[0]

FTRUN = [sys.executable, "-m", "ftrun"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
LAUNCHERS = {"ftrun": FTRUN, "torchrun": TORCHRUN}

JOB = """
import json, os, signal, sys, time
import torch, torch.distributed as dist
timeline, mode = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
if mode == "freeze":
    try:
        import ftrun
        ftrun.start_peer_heartbeat(period_s=0.5, timeout_s=3.0)
    except (ImportError, RuntimeError):
        pass  # torchrun: no peer heartbeat
rank, world = dist.get_rank(), dist.get_world_size()
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
def record(event):
    with open(timeline, "a") as f:
        f.write(json.dumps({"event": event, "rank": rank, "restart": restart, "world": world,
                            "pid": os.getpid(), "wall": time.time()}) + "\\n")
t = torch.ones(4)
for step in range(10**6):
    if rank == 1 and restart == 0 and step == 20 and mode == "exclude":
        import ftrun
        open(sys.argv[3]).read()  # a FIFO: the bench opens it once the hot spare waits
        record("exclude")
        ftrun.exclude_this_node("bench: this node leaves")
    if rank == 1 and restart == 0 and step == 20 and mode == "freeze":
        record("frozen")
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(t)  # the job's own collective: a lost peer breaks it
    record("step")
    time.sleep(0.05)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def agent_flags(nnodes: str) -> list[str]:
    """One worker per agent, the embedded store on a free port hosted by the first agent (c10d)."""
    endpoint = f"127.0.0.1:{free_port()}"
    flags = ["--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d"]
    return [*flags, "--rdzv-endpoint", endpoint, "--rdzv-id", "bench", "--rdzv-conf", "last_call_timeout=1"]


def records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(path: Path, predicate, bound: float) -> dict[str, object] | None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        found = next((r for r in records(path) if predicate(r)), None)
        if found is not None:
            return found
        time.sleep(0.05)
    return None


def write_job(workdir: Path) -> tuple[Path, Path]:
    """The job script and the timeline its ranks append to."""
    job, timeline = workdir / "w.py", workdir / "timeline.jsonl"
    job.write_text(JOB)
    return job, timeline


def launch(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    """One agent, in its own session (stop_all kills its group), one thread per worker."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=out, env=env, start_new_session=True)


def stop_all(procs: list[subprocess.Popen[bytes]], workdir: Path) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    kill_leftovers(workdir)


def dead_agent(launcher: str, workdir: Path, bound: float) -> float | None:
    job, timeline = write_job(workdir)
    base = LAUNCHERS[launcher]
    flags = agent_flags("1:2")
    host = launch([*base, *flags, str(job), str(timeline), "run"], workdir / "host.log")
    procs = [host]
    try:
        if wait_for(timeline, lambda r: True, bound) is None:
            return None
        other = launch([*base, *flags, str(job), str(timeline), "run"], workdir / "other.log")
        procs.append(other)
        if wait_for(timeline, lambda r: r["world"] == 2, bound) is None:
            return None
        time.sleep(1.0)  # both train for a while (the job's story, not a synchronisation)
        killed = time.time()
        os.killpg(other.pid, signal.SIGKILL)  # the agent and its worker: a node lost
        back = wait_for(timeline, lambda r: r["world"] == 1 and r["wall"] > killed, bound)
        return float(back["wall"]) - killed if back else None  # type: ignore[arg-type]
    finally:
        stop_all(procs, workdir)


def exclusion(workdir: Path, bound: float) -> float | None:
    job, timeline = write_job(workdir)
    flags = agent_flags("2:2")
    gate = workdir / "gate"
    os.mkfifo(gate)
    args = [str(job), str(timeline), "exclude", str(gate)]
    procs = [launch([*FTRUN, *flags, *args], workdir / f"{n}.log") for n in "ab"]
    try:
        if wait_for(timeline, lambda r: r["world"] == 2, bound) is None:
            return None
        procs.append(launch([*FTRUN, *flags, *args], workdir / "spare.log"))
        deadline = time.monotonic() + bound
        while b"hot spare" not in (workdir / "spare.log").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)
        gate.write_text("go\n")  # all agents share this host: the spare must be in before the host is excluded
        excluded = wait_for(timeline, lambda r: r["event"] == "exclude", bound)
        if excluded is None:
            return None
        pids = {r["pid"] for r in records(timeline) if float(r["wall"]) <= float(excluded["wall"])}  # type: ignore[arg-type]
        back = wait_for(timeline, lambda r: r["rank"] == 1 and r["pid"] not in pids, bound)
        return float(back["wall"]) - float(excluded["wall"]) if back else None  # type: ignore[arg-type]
    finally:
        stop_all(procs, workdir)


def frozen_peer(launcher: str, workdir: Path, bound: float) -> float | None:
    job, timeline = write_job(workdir)
    base = LAUNCHERS[launcher]
    flags = agent_flags("2:2")
    procs = [launch([*base, *flags, str(job), str(timeline), "freeze"], workdir / f"{n}.log") for n in "ab"]
    try:
        frozen = wait_for(timeline, lambda r: r["event"] == "frozen", bound * 2)
        if frozen is None:
            return None
        back = wait_for(timeline, lambda r: r["event"] == "step" and r["restart"] > 0 and r["rank"] == 1, bound)
        return float(back["wall"]) - float(frozen["wall"]) if back else None  # type: ignore[arg-type]
    finally:
        stop_all(procs, workdir)


def describe(values: list[float | None]) -> str:
    done = [v for v in values if v is not None]
    if not done:
        return f"never within the bound ({len(values)} runs)"
    return (f"median {statistics.median(done):6.2f} s  min {min(done):6.2f}  max {max(done):6.2f}  "
            f"({len(done)}/{len(values)} within the bound)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bound", type=float, default=60.0, help="seconds to wait for the job to train again")
    args = p.parse_args()
    figures: dict[str, list[float | None]] = {}
    with tempfile.TemporaryDirectory(prefix="ftrun-liveness-") as tmp:
        for rep in range(args.reps):
            for name, run in (
                ("dead agent, ftrun", lambda d: dead_agent("ftrun", d, args.bound)),
                ("dead agent, torchrun", lambda d: dead_agent("torchrun", d, args.bound)),
                ("exclusion -> spare training, ftrun", lambda d: exclusion(d, args.bound)),
                ("frozen peer -> restarted, ftrun", lambda d: frozen_peer("ftrun", d, args.bound)),
                ("frozen peer -> restarted, torchrun", lambda d: frozen_peer("torchrun", d, args.bound)),
            ):
                workdir = Path(tmp) / f"{rep}-{len(figures.get(name, []))}-{name.split(',')[0].replace(' ', '_')}"
                workdir = workdir.with_name(workdir.name + ("-t" if "torchrun" in name else "-f"))
                workdir.mkdir()
                value = run(workdir)
                figures.setdefault(name, []).append(value)
                shown = "never" if value is None else f"{value:.2f} s"
                print(f"rep {rep} {name:38s} {shown}", flush=True)
    print()
    for name, values in figures.items():
        print(f"{name:38s} {describe(values)}")


if __name__ == "__main__":
    main()
