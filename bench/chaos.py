"""A seeded chaos driver: network and process faults against a DDP job on two nodes, checksum against a clean run.

Two ftrun agents, each in a network namespace of its own (ftrun.testing.netns), run bench/plain_ddp.py (gloo,
one rank per node, --nnodes 2:2: the job never trains on fewer, so the arithmetic is the same on every run).
The job checkpoints every step and resumes from its checkpoint. First a run with no fault; then the same job
while a random schedule (from --seed) injects, one at a time, with training under way between them:

  kill         SIGKILL a random rank's worker
  cut-short    partition a random node for 1 s (shorter than its lease: nothing should happen)
  cut-long     partition a random node for 6 s (longer than its lease, TTL 3 s: it fences itself, rejoins)
  reset        reset the client node's connection to the store (ss -K: not a lost node)

Prints the faults injected, the restarts each node made, and whether the final checksum equals the clean
run's. Needs root and iproute2.

    python bench/chaos.py [--seed 1] [--faults 8] [--steps 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from ftrun.testing import netns

JOB = Path(__file__).resolve().parent / "plain_ddp.py"
PORT = 29456
CONF = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1,join_timeout=300"
FAULTS = ("kill", "cut-short", "cut-long", "reset")


def agents(net: netns.Network, nodes: list[netns.Node], work: Path, steps: int) -> list[subprocess.Popen[bytes]]:
    store = nodes[0]
    procs = []
    for node in nodes:
        argv = [sys.executable, "-m", "ftrun", "--log-dir", str(work / f"logs-{node.name}"), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{store.addr}:{PORT}", "--rdzv-id", "chaos", "--local-addr", node.addr,
                "--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "100", "--rdzv-conf", CONF,
                str(JOB), "--steps", str(steps), "--step-time", "0.05", "--every", "1",
                "--timeline", str(work / "timeline.jsonl"), "--checkpoint", str(work / "ckpt.pt"),
                "--checksum", str(work / "checksum")]  # fmt: skip
        with (work / f"agent-{node.name}.stderr").open("w") as err:
            # gloo finds its peers by the node's hostname, which every namespace resolves to 127.0.0.1: name the link
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}
            procs.append(subprocess.Popen(node.argv(argv), stdout=subprocess.DEVNULL, stderr=err, cwd=work, env=env,
                                          start_new_session=True))  # fmt: skip
    return procs


def timeline(work: Path) -> list[dict[str, object]]:
    path = work / "timeline.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def last_step_wall(work: Path) -> float:
    return max((float(e["wall"]) for e in timeline(work) if e["event"] == "step"), default=0.0)  # type: ignore[arg-type]


def wait_training(work: Path, since: float, timeout: float = 180.0) -> bool:
    """Both ranks made a step after ``since``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        ranks = {e["rank"] for e in timeline(work) if e["event"] == "step" and float(e["wall"]) > since}  # type: ignore[arg-type]
        if ranks == {0, 1}:
            return True
        time.sleep(0.2)
    return False


def inject(kind: str, rng: random.Random, net: netns.Network, nodes: list[netns.Node], work: Path) -> str:
    if kind == "kill":
        rank = rng.choice([0, 1])
        starts = [e for e in timeline(work) if e["event"] == "start" and e["rank"] == rank]
        pid = int(starts[-1]["pid"])  # type: ignore[call-overload]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return f"kill rank {rank}: already gone"
        return f"kill rank {rank} (pid {pid})"
    if kind in ("cut-short", "cut-long"):
        node = rng.choice(nodes)
        length = 1.0 if kind == "cut-short" else 6.0
        net.cut(node)
        time.sleep(length)  # the partition's length is the fault
        net.heal(node)
        return f"partition {node.name} for {length:g} s"
    killed = net.reset(nodes[1], PORT)
    return f"reset {nodes[1].name}'s store connection ({killed} killed)"


def run(steps: int, faults: int, seed: int | None, work: Path) -> dict[str, object]:
    work.mkdir(parents=True)
    rng = random.Random(seed)
    injected: list[str] = []
    with netns.Network() as net:
        nodes = [net.add("a"), net.add("b")]
        started = time.time()
        procs = agents(net, nodes, work, steps)
        try:
            wait_training(work, 0.0)
            schedule = [FAULTS[i % len(FAULTS)] for i in range(faults if seed is not None else 0)]
            rng.shuffle(schedule)  # every kind of fault, in a random order
            for kind in schedule:
                time.sleep(rng.uniform(1.0, 4.0))
                if (work / "checksum").exists():
                    break  # the job finished before the schedule did
                injected.append(inject(kind, rng, net, nodes, work))
                print(f"  {time.time() - started:6.1f} s  {injected[-1]}", flush=True)
                wait_training(work, time.time())
            codes = [p.wait(600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    restarts = {}
    for node in ("a", "b"):
        events = [json.loads(line) for f in (work / f"logs-{node}").glob("*/events.jsonl") for line in f.open()]
        restarts[node] = sum(1 for e in events if e["kind"] == "restart")
    checksum = (work / "checksum").read_text() if (work / "checksum").exists() else None
    return {"codes": codes, "restarts": restarts, "checksum": checksum, "wall_s": time.time() - started,
            "injected": injected}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults", type=int, default=8)
    p.add_argument("--steps", type=int, default=1000)
    a = p.parse_args()
    why = netns.available()
    if why:
        print(f"chaos: cannot run here: {why}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="ftrun-chaos-") as tmp:
        print(f"clean run: {a.steps} steps, 2 nodes", flush=True)
        clean = run(a.steps, 0, None, Path(tmp) / "clean")
        print(f"  exit codes {clean['codes']}, checksum {clean['checksum']}, {clean['wall_s']:.1f} s")
        print(f"chaos run: seed {a.seed}, {a.faults} faults", flush=True)
        chaos = run(a.steps, a.faults, a.seed, Path(tmp) / "chaos")
        kinds = Counter(str(f).split(" ")[0] for f in chaos["injected"])  # type: ignore[attr-defined]
        print(f"  exit codes {chaos['codes']}, checksum {chaos['checksum']}, {chaos['wall_s']:.1f} s")
        print(f"faults injected: {len(chaos['injected'])} ({dict(kinds)})")  # type: ignore[arg-type]
        print(f"restarts: {chaos['restarts']}")
        equal = clean["checksum"] is not None and clean["checksum"] == chaos["checksum"]
        print(f"checksum equal to the clean run: {equal}")
        return 0 if equal and chaos["codes"] == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
