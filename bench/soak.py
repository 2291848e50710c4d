"""A soak: bench/chaos.py's two-node DDP job under faults for half an hour or more, and what each node's agent
holds meanwhile: does anything grow?

Every few seconds (one fault at a time, at random moments, each waited out until both ranks step again): a
worker SIGKILLed, a node partitioned shorter and longer than its lease, its store connection reset, the store's
host lost (worker and agent, in a random order), or strangers at every port of a node's agent (idle connections
by the hundred, held a few seconds, then closed). Sampled every --sample-s seconds, per node: the agent and
its descendants (its zygotes, wardens and workers): their RSS, descriptors and threads; the
node's snapshots and the rest of /dev/shm; the bytes its logs grew by. Printed: each figure's median over the
first 5 minutes against the last 5, as a ratio, and the agents that died of themselves (none may; one that
does is started again, and the soak goes on). The job's weights are bench/chaos.py's business. Needs root and
iproute2.

    python bench/soak.py [--minutes 30] [--faults 200] [--seed 1] [--sample-s 5] [--keep DIR]
    python bench/soak.py --report DIR/soak/samples.jsonl    # the figures again, from a kept run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos import Job, inject, wait_training
from ftrun.testing import netns

# Every kind chaos.py injects, strangers too; the store's host lost in 1 of 7 (each loss replaces an agent).
FAULTS = ("kill", "kill", "cut-short", "cut-long", "reset", "host", "strangers")
STRANGERS = 300  # idle connections to each port of the flooded agent
WINDOW_S = 300.0  # the first and the last 5 minutes


def flood(job: Job, rng: random.Random) -> str:
    """Strangers at every port a node's agent listens on, held 3 s, then closed."""
    node = rng.choice(job.nodes)
    ports = listening(job.procs[node.name].pid)
    if not ports:
        return f"strangers at {node.name}: its agent is gone"
    held: list[socket.socket] = []
    try:
        for port in ports:
            for _ in range(STRANGERS):
                s = socket.socket()
                s.setblocking(False)
                with contextlib.suppress(OSError):
                    s.connect_ex((node.addr, port))
                held.append(s)
        time.sleep(3.0)  # held: the flood is the fault
    finally:
        for s in held:
            s.close()
    return f"strangers at {node.name}: {len(held)} idle connections to its {len(ports)} ports for 3 s"


def listening(pid: int) -> list[int]:
    """The ports the process listens on, in its own network namespace (psutil reads this one's)."""
    try:
        mine = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        tables = [Path(f"/proc/{pid}/net/{t}").read_text().splitlines()[1:] for t in ("tcp", "tcp6")]
    except OSError:
        return []
    ports = set()
    for line in (line for table in tables for line in table):
        fields = line.split()  # sl local_address rem_address st ... inode
        if fields[3] == "0A" and f"socket:[{fields[9]}]" in mine:  # LISTEN, one of its own sockets
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def node_sample(job: Job, node: netns.Node) -> dict[str, float]:
    """What the node's agent and its descendants (zygotes, wardens, workers) hold now."""
    try:
        agent = psutil.Process(job.procs[node.name].pid)
        tree = [agent, *agent.children(recursive=True)]
    except psutil.Error:
        return {}
    rss = fds = threads = agent_rss = 0.0
    for p in tree:
        try:
            with p.oneshot():
                mem, n_fds, n_threads = p.memory_info().rss, p.num_fds(), p.num_threads()
        except psutil.Error:
            continue
        rss, fds, threads = rss + mem, fds + n_fds, threads + n_threads
        if p.pid == agent.pid:
            agent_rss = mem
    return {"rss_mib": rss / 2**20, "agent_rss_mib": agent_rss / 2**20, "fds": fds, "threads": threads}


def dir_bytes(root: Path) -> int:
    total = 0
    for where, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(where, name)).st_blocks * 512
    return total


def sample(job: Job, work: Path, started: float) -> dict[str, float]:
    row: dict[str, float] = {"t": time.time() - started}
    for node in job.nodes:
        for key, value in node_sample(job, node).items():
            row[key] = row.get(key, 0.0) + value
    row["shm_mib"] = dir_bytes(Path("/dev/shm")) / 2**20
    consoles = sum(f.stat().st_size for f in work.glob("agent-*.stderr"))
    row["logs_mib"] = (sum(dir_bytes(d) for d in work.glob("logs-*")) + consoles) / 2**20
    return row


def window(rows: list[dict[str, float]], first: bool) -> list[dict[str, float]]:
    end = rows[-1]["t"]
    return [r for r in rows if (r["t"] <= WINDOW_S if first else r["t"] >= end - WINDOW_S)]


def report(rows: list[dict[str, float]]) -> list[str]:
    """Each figure's median and least over the first 5 minutes and the last 5 (log growth: MiB per hour): the
    least is the floor a leak would lift (the nodes' processes' RSS moves between levels with the zygotes and
    workers up at a sample)."""
    head, tail = window(rows, True), window(rows, False)
    lines = []
    for key, what in [("agent_rss_mib", "the agents' RSS (MiB)"), ("rss_mib", "the nodes' processes' RSS (MiB)"),
                      ("fds", "the nodes' processes' descriptors"), ("threads", "their threads"),
                      ("shm_mib", "/dev/shm (MiB)")]:  # fmt: skip
        a = statistics.median(r.get(key, 0.0) for r in head)
        b = statistics.median(r.get(key, 0.0) for r in tail)
        peak = max(r.get(key, 0.0) for r in rows)
        low_a, low_b = min(r.get(key, 0.0) for r in head), min(r.get(key, 0.0) for r in tail)
        ratio = f"{b / a:.2f}" if a else "-"
        floor = f"{low_b / low_a:.2f}" if low_a else "-"
        lines.append(f"  {what:34s} first 5 min {a:9.1f} (least {low_a:9.1f})   last 5 min {b:9.1f} "
                     f"(least {low_b:9.1f})   ratio {ratio} (least {floor})   peak {peak:9.1f}")  # fmt: skip
    for part, name in [(head, "first"), (tail, "last")]:
        span = part[-1]["t"] - part[0]["t"]
        grown = part[-1]["logs_mib"] - part[0]["logs_mib"]
        lines.append(f"  logs grew {grown / span * 3600 if span else 0.0:7.1f} MiB/hour over the {name} 5 min")
    return lines


@dataclass
class Soak:
    injected: list[str]
    rows: list[dict[str, float]]
    died: list[str]
    wall_s: float = 0.0


def run(minutes: float, faults: int, seed: int | None, work: Path, sample_s: float, steps: int) -> Soak:
    work.mkdir(parents=True)
    rng = random.Random(seed)
    soak = Soak([], [], [])
    injected, rows, died = soak.injected, soak.rows, soak.died
    with netns.Network() as net:
        nodes = [net.add("a"), net.add("b")]
        started = time.time()
        job = Job(nodes, work, steps, max_restarts=100_000)  # every fault is a restart: the budget is not the test
        try:
            wait_training(work, 0.0)
            deadline, sampled = started + minutes * 60, 0.0
            gap = minutes * 60 / max(faults, 1) if seed is not None else 0.0
            while seed is not None and (time.time() < deadline or len(injected) < faults):
                if time.time() - sampled >= sample_s:
                    rows.append(sample(job, work, started))
                    sampled = time.time()
                time.sleep(rng.uniform(0.0, gap))
                if (work / "checksum").exists():
                    break  # the job finished before the soak did: --steps too few
                kind = rng.choice(FAULTS)
                at = time.time()
                said = flood(job, rng) if kind == "strangers" else inject(kind, rng, net, job)
                back = wait_training(work, time.time())
                injected.append(said)
                print(f"  {at - started:7.1f} s  {said}: both ranks step again after "
                      f"{time.time() - at if back else float('inf'):.1f} s", flush=True)  # fmt: skip
                rows.append(sample(job, work, started))
                with (work / "samples.jsonl").open("a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
                for node in job.nodes:  # an agent that died of itself (not one a fault killed): counted, replaced
                    code = job.procs[node.name].poll()
                    if code is not None:
                        died.append(f"{node.name}'s agent exited {code} after '{said}'")
                        print(f"  AGENT DIED: {died[-1]}", flush=True)
                        job.start(node)
        finally:
            job.close()  # the job never ends by itself: its steps outnumber the soak's
    soak.wall_s = time.time() - started
    return soak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--faults", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--keep", type=Path, help="keep the runs' logs and timelines in this new directory")
    p.add_argument("--report", type=Path, help="only print the figures of a kept run's samples.jsonl")
    a = p.parse_args()
    if a.report:
        print("\n".join(report([json.loads(line) for line in a.report.read_text().splitlines()])))
        return 0
    why = netns.available()
    if why:
        print(f"soak: cannot run here: {why}", file=sys.stderr)
        return 1
    steps = int(a.minutes * 60 / 0.05 * 10)  # 50 ms steps: more than the soak lasts (its end stops the job)
    with contextlib.ExitStack() as stack:
        tmp = Path(a.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="ftrun-soak-")))
        print(f"soak: {a.minutes:g} min, at least {a.faults} faults, seed {a.seed}", flush=True)
        soak = run(a.minutes, a.faults, a.seed, tmp / "soak", a.sample_s, steps)
        kinds = Counter(f.split(" ")[0].rstrip(":") for f in soak.injected)
        print(f"faults injected: {len(soak.injected)} ({dict(kinds)}) in {soak.wall_s / 60:.1f} min")
        print("what the nodes held (two nodes summed):")
        print("\n".join(report(soak.rows)))
        print(f"agents that died of themselves: {len(soak.died)}")
        return 0 if not soak.died else 1


if __name__ == "__main__":
    sys.exit(main())
