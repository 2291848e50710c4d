"""A seeded chaos driver: network and process faults against a DDP job on two nodes, checksum against a clean run.

Two ftrun agents, each in a network namespace of its own (ftrun.testing.netns), run bench/plain_ddp.py (gloo,
one rank per node, --nnodes 2:2: the job never trains on fewer, so the arithmetic is the same on every run).
The job checkpoints every step and resumes from its checkpoint. First a run with no fault; then the same job
while a random schedule (from --seed) injects, one at a time, at random moments:

  kill         SIGKILL a random rank's worker
  cut-short    partition a random node for 1 s (shorter than its lease: nothing should happen)
  cut-long     partition a random node for 6 s (longer than its lease, TTL 3 s: it fences itself, rejoins)
  reset        reset the client node's connection to the store (ss -K: not a lost node)
  host         the node hosting the store is lost: its worker and its agent SIGKILLed in a random order, a
               random 0-2 s apart (the worker first: mid-rendezvous); the other node takes the store over, and a
               new agent starts on the lost node's machine, pointed at the store where it is now

Each fault waits for both ranks to train again, and its downtime (the fault -> both ranks stepping) is printed
with the schedule, so a failure can be replayed with the same --seed. Prints the restarts each node made, and
whether the final checksum equals the clean run's. Needs root and iproute2.

    python bench/chaos.py [--seed 1] [--faults 20] [--steps 3000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
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
FAULTS = ("kill", "cut-short", "cut-long", "reset", "host", "host")  # a host loss in a third of the faults


class Job:
    """The job's agents, one per node; ``host``: the node whose agent serves the store now."""

    def __init__(self, nodes: list[netns.Node], work: Path, steps: int, max_restarts: int = 100) -> None:
        self.nodes, self.work, self.steps, self.max_restarts = nodes, work, steps, max_restarts
        self.host = nodes[0]
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.lost: list[subprocess.Popen[bytes]] = []  # agents killed on purpose
        self.generation: dict[str, int] = {}
        for node in nodes:
            self.start(node)

    def start(self, node: netns.Node) -> None:
        """An agent on ``node``, pointed at the store where it is now (a lost host's replacement too)."""
        n = self.generation[node.name] = self.generation.get(node.name, -1) + 1
        w = self.work
        argv = [sys.executable, "-m", "ftrun", "--log-dir", str(w / f"logs-{node.name}-{n}"), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.host.addr}:{PORT}", "--rdzv-id", "chaos", "--local-addr", node.addr,
                "--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", str(self.max_restarts),
                "--rdzv-conf", CONF, str(JOB), "--steps", str(self.steps), "--step-time", "0.05", "--every", "1",
                "--timeline", str(w / "timeline.jsonl"), "--checkpoint", str(w / "ckpt.pt"),
                "--checksum", str(w / "checksum")]  # fmt: skip
        with (w / f"agent-{node.name}-{n}.stderr").open("w") as err:
            # gloo finds its peers by the node's hostname, which every namespace resolves to 127.0.0.1: name the link
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}
            self.procs[node.name] = subprocess.Popen(node.argv(argv), stdout=subprocess.DEVNULL, stderr=err, cwd=w,
                                                     env=env, start_new_session=True)  # fmt: skip

    def lose_host(self, rng: random.Random) -> str:
        """The store's host lost (its worker and agent, in a random order and gap); a new agent in its place."""
        lost, survivor = self.host, next(n for n in self.nodes if n is not self.host)
        agent = self.procs[lost.name]
        worker = self.worker_pid(lost)
        gap = rng.uniform(0.0, 2.0)
        workers_first = rng.random() < 0.5
        first, then = (worker, agent.pid) if workers_first else (agent.pid, worker)
        for i, pid in enumerate((first, then)):
            if i:
                time.sleep(gap)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        agent.wait()
        self.lost.append(agent)
        self.host = survivor
        # The survivor serves the store once it proved the host gone (2 s): the replacement finds it there.
        self.start(lost)
        order = "worker then agent" if workers_first else "agent then worker"
        return f"host {lost.name} lost ({order}, {gap:.2f} s apart); {survivor.name} takes over"

    def worker_pid(self, node: netns.Node) -> int | None:
        """The pid of the node's newest worker: of the workers the timeline names, the agent's descendant."""
        agent = self.procs[node.name].pid
        for e in reversed(timeline(self.work)):
            if e["event"] == "start" and agent in ancestors(int(e["pid"])):  # type: ignore[call-overload]
                return int(e["pid"])  # type: ignore[call-overload]
        return None

    def client(self) -> netns.Node:
        return next(n for n in self.nodes if n is not self.host)

    def wait(self, timeout: float) -> list[int]:
        return [p.wait(timeout) for p in self.procs.values()]

    def close(self) -> None:
        for p in [*self.procs.values(), *self.lost]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def ancestors(pid: int) -> list[int]:
    found = []
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat[stat.rfind(")") + 2 :].split()[1])
        found.append(pid)
    return found


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


def inject(kind: str, rng: random.Random, net: netns.Network, job: Job) -> str:
    if kind == "kill":
        rank = rng.choice([0, 1])
        starts = [e for e in timeline(job.work) if e["event"] == "start" and e["rank"] == rank]
        pid = int(starts[-1]["pid"])  # type: ignore[call-overload]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return f"kill rank {rank}: already gone"
        return f"kill rank {rank} (pid {pid})"
    if kind in ("cut-short", "cut-long"):
        node = rng.choice(job.nodes)
        length = 1.0 if kind == "cut-short" else 6.0
        net.cut(node)
        time.sleep(length)  # the partition's length is the fault
        net.heal(node)
        return f"partition {node.name} for {length:g} s"
    if kind == "host":
        return job.lose_host(rng)
    killed = net.reset(job.client(), PORT)
    return f"reset {job.client().name}'s store connection ({killed} killed)"


def run(steps: int, faults: int, seed: int | None, work: Path) -> dict[str, object]:
    work.mkdir(parents=True)
    rng = random.Random(seed)
    injected: list[str] = []
    downtimes: list[float] = []
    with netns.Network() as net:
        nodes = [net.add("a"), net.add("b")]
        started = time.time()
        job = Job(nodes, work, steps)
        try:
            wait_training(work, 0.0)
            schedule = [FAULTS[i % len(FAULTS)] for i in range(faults if seed is not None else 0)]
            rng.shuffle(schedule)  # every kind of fault, in a random order
            for kind in schedule:
                time.sleep(rng.uniform(0.0, 3.0))  # a random moment of training
                if (work / "checksum").exists():
                    break  # the job finished before the schedule did
                at = time.time()
                injected.append(inject(kind, rng, net, job))
                back = wait_training(work, time.time())
                downtimes.append(time.time() - at if back else float("inf"))
                print(f"  {at - started:6.1f} s  {injected[-1]}: both ranks step again after {downtimes[-1]:.1f} s",
                      flush=True)  # fmt: skip
            codes = job.wait(900)
        finally:
            job.close()
    restarts = {}
    for node in ("a", "b"):
        events = [json.loads(line) for f in work.glob(f"logs-{node}-*/*/events.jsonl") for line in f.open()]
        restarts[node] = sum(1 for e in events if e["kind"] == "restart")
    checksum = (work / "checksum").read_text() if (work / "checksum").exists() else None
    return {"codes": codes, "restarts": restarts, "checksum": checksum, "wall_s": time.time() - started,
            "injected": injected, "downtimes": downtimes}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--keep", type=Path, help="keep the runs' logs and timelines in this new directory")
    a = p.parse_args()
    why = netns.available()
    if why:
        print(f"chaos: cannot run here: {why}", file=sys.stderr)
        return 1
    with contextlib.ExitStack() as stack:
        tmp = a.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="ftrun-chaos-"))
        print(f"clean run: {a.steps} steps, 2 nodes", flush=True)
        clean = run(a.steps, 0, None, Path(tmp) / "clean")
        print(f"  exit codes {clean['codes']}, checksum {clean['checksum']}, {clean['wall_s']:.1f} s")
        print(f"chaos run: seed {a.seed}, {a.faults} faults", flush=True)
        chaos = run(a.steps, a.faults, a.seed, Path(tmp) / "chaos")
        kinds = Counter(str(f).split(" ")[0] for f in chaos["injected"])  # type: ignore[attr-defined]
        print(f"  exit codes {chaos['codes']}, checksum {chaos['checksum']}, {chaos['wall_s']:.1f} s")
        print(f"faults injected: {len(chaos['injected'])} ({dict(kinds)})")  # type: ignore[arg-type]
        down = sorted(float(d) for d in chaos["downtimes"])  # type: ignore[attr-defined]
        if down:
            print(f"downtime per fault: median {down[len(down) // 2]:.1f} s, max {down[-1]:.1f} s")
        print(f"restarts: {chaos['restarts']}")
        equal = clean["checksum"] is not None and clean["checksum"] == chaos["checksum"]
        print(f"checksum equal to the clean run: {equal}")
        return 0 if equal and chaos["codes"] == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
