"""In-process restart against today's warm process restart, of the same job in the same run, alternating.

The job is examples/restartable_ddp.py: DDP on gloo over 2 nodes x 2 ranks (two ftrun agents on this machine,
the first hosting the rendezvous store), a model built once per process (``--compile``: torch.compile with
inductor), ftrun.snapshot every step. Rank 3 exits (os._exit) at a step; the job restarts either in place
(@ftrun.restartable: ranks 0-2 keep their processes, rank 3 is a warm worker) or as processes
(``--process-restart``: every rank a warm worker, as without the decorator). Figures from the job's own
timeline (wall-clock lines written by every rank): the crash -> every rank having finished its first step
after the restart; the slowest survivor's part of it; and, in place, where the new process's time goes (its
script's start, its model on its device: on a GPU its CUDA context, its group and state, its first step).

    python bench/in_place.py [--reps 3] [--compile] [--crash-at 30] [--busy] [--crash-by exit|raise] [--nccl]
                             [--leaks N]

--busy: one busy loop per core for the whole run (a node whose cores are all taken). --crash-by raise: rank 3's
function raises instead of its process exiting (in place, rank 3 then keeps its process too: nobody compiles
again). --leaks N: instead, N in-place restarts in a row (the last rank exits in each attempt); what rank 0
holds as the first restart's attempt starts and as the last's (RSS, threads, descriptors, process groups; on a
GPU the memory torch's allocator reserved and the pinned host memory). --nccl (a GPU node): 2 nodes x 1 rank
on NCCL, both on GPU 0, each agent with its own NCCL_HOSTID (NCCL takes them for two hosts and talks over its
sockets); rank 1 fails. Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "restartable_ddp.py"
MODES = ("in-place", "process")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_once(
    mode: str, workdir: Path, crash_at: int, compile_: bool, crash_by: str, timeout: float, nccl: bool = False
) -> dict[str, float] | None:
    timeline = workdir / "timeline.jsonl"
    world = 2 if nccl else 4
    job = ["--steps", str(crash_at + 15), "--crash-at", str(crash_at), "--crash-rank", str(world - 1),
           "--timeline", str(timeline), "--crash-by", crash_by]  # fmt: skip
    job += ["--compile"] if compile_ else []
    job += ["--process-restart"] if mode == "process" else []
    if not run_job(workdir, job, nccl, 2, timeout):
        return None
    lines = [json.loads(line) for line in timeline.read_text().splitlines()]
    [crash] = [x for x in lines if x.get("crash")]
    first, restored, replaced = {}, {}, {}
    for x in lines:
        if x["attempt"] != 1:
            continue
        if phase := next((k for k in ("started", "built") if x.get(k)), None):
            if x["rank"] == world - 1:
                replaced[phase] = x["t"]  # the new process's own timeline
        elif x.get("restored"):
            restored[x["rank"]] = x["t"]
        elif not x.get("crash"):
            first.setdefault(x["rank"], x["t"])
    if sorted(first) != list(range(world)):
        return None
    return {
        "every_rank_s": max(first.values()) - crash["t"],
        "survivors_s": max(first[r] for r in range(world - 1)) - crash["t"],
        "replaced_s": first[world - 1] - crash["t"],
        "restored_s": max(restored.values()) - crash["t"],  # every rank has its group and its state
        # where the replacement's time goes (a new process only: its script's start, its model on its device)
        **{f"replaced_{phase}_s": t - crash["t"] for phase, t in replaced.items()},
        "replaced_restored_s": restored[world - 1] - crash["t"],
    }


HOLDS = re.compile(r"rank 0 attempt (\d+) holds (.*)")


def leaks(workdir: Path, restarts: int, compile_: bool, nccl: bool, timeout: float) -> None:
    """The last rank exits in each of ``restarts`` attempts in a row; what rank 0 holds as each attempt starts
    (RSS, threads, descriptors, process groups; on a GPU the allocator's reserved memory and pinned host
    memory), its first restart against its last."""
    world = 2 if nccl else 4
    job = ["--steps", str(20 + restarts + 10), "--crash-at", "20", "--crashes", str(restarts),
           "--crash-rank", str(world - 1), "--leaks"]  # fmt: skip
    job += ["--compile"] if compile_ else []
    if not run_job(workdir, job, nccl, restarts, timeout):
        return
    held = {int(at): dict(zip(what.split()[::2], map(int, what.split()[1::2]), strict=True))
            for name in "ab" for at, what in HOLDS.findall((workdir / f"{name}.out").read_text())}  # fmt: skip
    if 1 not in held or restarts not in held:
        print(f"  rank 0's holdings not seen at restarts 1 and {restarts}: {sorted(held)}", flush=True)
        return
    first, last = held[1], held[restarts]
    print(f"\n{restarts} in-process restarts in a row, rank 0 at the first restart -> at the last:")
    for name in first:
        grew = f" ({(last[name] - first[name]) / first[name]:+.1%})" if first[name] else ""
        print(f"  {name}: {first[name]} -> {last[name]}{grew}")


def run_job(workdir: Path, job: list[str], nccl: bool, restarts: int, timeout: float) -> bool:
    """The example with ``job``'s arguments on two agents (their consoles in workdir/a.out, b.out: either may
    have group rank 0); whether both ended well (else their last lines are printed: the directory goes with the
    run)."""
    per_node = 1 if nccl else 2
    job = [str(EXAMPLE), "--step-time", "0.05", *job, *(["--backend", "nccl"] if nccl else [])]
    port = free_port()
    agents = []
    for name in "ab":
        env = {**os.environ, "NCCL_HOSTID": f"bench-{name}-{port}"} if nccl else None
        flags = ["--nnodes", "2", "--nproc-per-node", str(per_node), "--max-restarts", str(restarts),
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench-{port}",
                 "--local-addr", "127.0.0.1", "--log-dir", str(workdir / f"logs-{name}")]  # fmt: skip
        argv = [sys.executable, "-m", "ftrun", *flags, *job]
        out = (workdir / f"{name}.out").open("w")
        agents.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env))
    try:
        codes = [a.wait(timeout) for a in agents]
    except subprocess.TimeoutExpired:
        codes = [1]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, 9)
                a.wait()
    if any(codes):
        print(f"  {workdir.name}: a run failed ({codes}); the agents' last lines:", flush=True)
        for name in "ab":  # the directory goes with the run: what it says is kept here
            for line in (workdir / f"{name}.out").read_text(errors="replace").splitlines()[-12:]:
                print(f"    {name}| {line[:240]}", flush=True)
        return False
    return True


def busy_loops() -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--crash-at", type=int, default=30)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--busy", action="store_true")
    p.add_argument("--crash-by", choices=("exit", "raise"), default="exit")
    p.add_argument("--nccl", action="store_true", help="2 nodes x 1 rank on NCCL, sharing GPU 0")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--leaks", type=int, default=0, metavar="N", help="instead: N in-place restarts in a row, what "
                   "rank 0 holds at the first and the last")  # fmt: skip
    a = p.parse_args()
    if a.leaks:
        with tempfile.TemporaryDirectory(prefix="ftrun-bench-in-place-") as tmp:
            leaks(Path(tmp), a.leaks, a.compile, a.nccl, a.timeout)
        return
    loads = busy_loops() if a.busy else []
    found: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        with tempfile.TemporaryDirectory(prefix="ftrun-bench-in-place-") as tmp:
            for rep in range(a.reps):
                for mode in MODES if rep % 2 == 0 else reversed(MODES):
                    workdir = Path(tmp) / f"{mode}-{rep}"
                    workdir.mkdir()
                    trial = run_once(mode, workdir, a.crash_at, a.compile, a.crash_by, a.timeout, a.nccl)
                    if trial is not None:
                        found[mode].append(trial)
                        shown = ", ".join(f"{k} {v:.2f}" for k, v in trial.items())
                        print(f"rep {rep} {mode:9s} {shown}", flush=True)
    finally:
        for loop in loads:
            loop.kill()
    machine = f"{os.cpu_count()} cores{', every core busy' if a.busy else ''}{', compiled' if a.compile else ''}"
    last = "rank 1" if a.nccl else "rank 3"
    machine += f", {last} raises" if a.crash_by == "raise" else f", {last} exits"
    shape = "2 nodes x 1 rank, NCCL on one GPU" if a.nccl else "2 nodes x 2 ranks, gloo"
    print(f"\nin-process restart vs process restart, {shape} ({machine}):")
    medians = {m: statistics.median(t["every_rank_s"] for t in found[m]) for m in MODES if found[m]}
    for mode in MODES:
        if found[mode]:
            runs = ", ".join(f"{t['every_rank_s']:.2f}" for t in found[mode])
            survivors = statistics.median(t["survivors_s"] for t in found[mode])
            print(f"  {mode:9s} crash -> every rank stepping again: median {medians[mode]:.2f} s ({runs}); "
                  f"the survivors: {survivors:.2f} s")  # fmt: skip
    if len(medians) == 2:
        print(f"  ratio in-place / process: {medians['in-place'] / medians['process']:.2f}x")
    phases = ("replaced_started_s", "replaced_built_s", "replaced_restored_s", "replaced_s")
    if found["in-place"] and all(k in t for t in found["in-place"] for k in phases):  # a new process replaced it
        at = [statistics.median(t[k] for t in found["in-place"]) for k in phases]
        print(
            f"  in place, the new {last} after the crash (medians): its script started {at[0]:.2f} s, its model "
            f"on its device {at[1]:.2f} s, its group and state {at[2]:.2f} s, its first step {at[3]:.2f} s"
        )


if __name__ == "__main__":
    main()
