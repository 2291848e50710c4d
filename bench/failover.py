"""The store's host lost: how long until every survivor trains again. ftrun against torchrun, same harness.

N agents on this machine (separate processes, one worker each, the embedded store on 127.0.0.1, --nnodes 1:N,
default settings otherwise); the job never imports ftrun: each worker appends a line (its world size) every
50 ms. Once all N train together, the agent that hosts the store is SIGKILLed with its worker (its process
group). Figure: the kill -> every survivor has written a line in a world of N-1 ("never" past --bound).

    python bench/failover.py [--nodes 2,16] [--reps 3] [--bound 30] [--launchers ftrun,torchrun]
    python bench/failover.py --store etcd [--nodes 2,16] [--reps 4]
    python bench/failover.py --stagger 1 --nodes 2,3 --reps 20 --launchers ftrun [--seed 1]

With ``--stagger S`` the host goes as a GPU fault takes a node: its worker is SIGKILLed first and its agent a
random 0-S s later (the next round is open by then, or closing); the figure counts from the agent's death.

With ``--store etcd`` (ftrun only: torchrun's etcd backend speaks etcd's v2 API, which etcd 3.4 serves only
when asked), the job's store is a separate etcd and the agent SIGKILLed is a node: the first one started
(which leads the rendezvous, in the first of each pair of reps) or the second (a member).

Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = """
import json, os, time
me = {"world": int(os.environ["WORLD_SIZE"]), "rank": int(os.environ["RANK"]), "node": os.environ["NODE"],
      "pid": os.getpid()}
while True:
    with open(os.environ["TRAIN_LOG"], "a") as f:
        f.write(json.dumps({**me, "t": time.time()}) + "\\n")
    time.sleep(0.05)
"""
LAUNCHERS = {
    "ftrun": [sys.executable, "-m", "ftrun"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def lines(log: Path) -> list[dict[str, object]]:
    if not log.exists():
        return []
    return [json.loads(x) for x in log.read_text().splitlines() if x.endswith("}")]


def hosting(launcher: str, procs: dict[str, subprocess.Popen[bytes]], port: int, work: Path) -> str | None:
    """Which agent hosts the store: ftrun says so; for torchrun, the process listening on the port."""
    if launcher == "ftrun":
        for name in procs:
            if "hosting the rendezvous store" in (work / f"{name}.err").read_text(errors="replace"):
                return name
        return None
    found = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=False)
    for name, p in procs.items():
        if f"pid={p.pid}," in found.stdout:
            return name
    return None


def trial(
    launcher: str, nodes: int, bound: float, work: Path, etcd: str = "", victim: int = 0, stagger: float = 0.0
) -> float | None:
    """The kill of the host's agent (``stagger``: its worker first, a random 0-``stagger`` s before) -> every
    survivor training again, or None."""
    work.mkdir(parents=True)
    (work / "job.py").write_text(JOB)
    log = work / "train.log"
    port = free_port()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd] if etcd else [
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]  # fmt: skip
    for i in range(nodes):
        name = f"n{i:02d}"
        argv = [*LAUNCHERS[launcher], "--nnodes", f"1:{nodes}", "--nproc-per-node", "1", *rdzv,
                "--rdzv-id", f"failover-{work.name}", "--max-restarts", "3", str(work / "job.py")]  # fmt: skip
        if launcher == "ftrun":
            argv[3:3] = ["--log-dir", str(work / "logs"), "--local-addr", "127.0.0.1"]
        env = {**os.environ, "NODE": name, "TRAIN_LOG": str(log)}
        with (work / f"{name}.err").open("w") as err:
            procs[name] = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                           start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 120
        while {x["node"] for x in lines(log) if x["world"] == nodes} != set(procs):
            if time.time() > deadline:
                print(f"    {launcher}: {nodes} nodes never trained together", flush=True)
                return None
            time.sleep(0.1)
        host = sorted(procs)[victim] if etcd else hosting(launcher, procs, port, work)
        if host is None:
            print(f"    {launcher}: cannot tell which agent hosts the store", flush=True)
            return None
        if stagger:  # as a GPU fault takes a node: its workers die first, the node a moment later
            pid = max((x for x in lines(log) if x["node"] == host), key=lambda x: float(x["t"]))["pid"]  # type: ignore[arg-type]
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)  # type: ignore[call-overload]
            time.sleep(random.uniform(0.0, stagger))
        os.killpg(procs[host].pid, signal.SIGKILL)
        killed = time.time()
        survivors = set(procs) - {host}
        while time.time() < killed + bound:
            fresh = [x for x in lines(log) if float(x["t"]) > killed and x["world"] == nodes - 1]  # type: ignore[arg-type]
            back = {str(x["node"]) for x in fresh}
            if back >= survivors:
                return max(min(float(x["t"]) for x in fresh if x["node"] == n) for n in survivors) - killed  # type: ignore[arg-type]
            time.sleep(0.05)
        return None
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="2,16")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bound", type=float, default=30.0)
    p.add_argument("--launchers", default="ftrun,torchrun")
    p.add_argument("--store", choices=("c10d", "etcd"), default="c10d")
    p.add_argument("--stagger", type=float, default=0.0, help="kill the host's worker first, 0-S s before its agent")
    p.add_argument("--seed", type=int, default=1, help="for --stagger's random gaps (printed with each trial)")
    p.add_argument("--keep-slow", type=float, default=None, help="copy the logs of trials slower than this to $OUT")
    a = p.parse_args()
    if a.store == "etcd":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
        from ftrun.testing.etcd import EtcdHarness

        etcd = EtcdHarness().start()
        endpoint = f"127.0.0.1:{etcd.client_port}"
        a.launchers = "ftrun"
    else:
        etcd, endpoint = None, ""
    random.seed(a.seed)
    results: dict[tuple[str, int], list[float | None]] = {}
    with tempfile.TemporaryDirectory(prefix="ftrun-failover-") as tmp:
        for nodes in (int(n) for n in a.nodes.split(",")):
            for rep in range(a.reps):
                for launcher in a.launchers.split(","):  # alternating, in one run: the machine is noisy
                    work = Path(tmp) / f"{launcher}-{nodes}-{rep}"
                    took = trial(launcher, nodes, a.bound, work, endpoint, victim=rep % 2, stagger=a.stagger)
                    results.setdefault((launcher, nodes), []).append(took)
                    if a.keep_slow is not None and (took is None or took > a.keep_slow):  # to read why
                        shutil.copytree(work, Path(os.environ.get("OUT", ".")) / f"slow-{work.name}")
                    shown = "never" if took is None else f"{took:.2f} s"
                    print(f"  {nodes:3d} nodes  {launcher:9s} rep {rep}: {shown}", flush=True)
    if etcd is not None:
        etcd.close()
    lost = "a node (first or second started, alternately)" if etcd else "the store's host"
    if a.stagger:
        lost += f" (its worker first, a random 0-{a.stagger:g} s before its agent; seed {a.seed})"
    print(f"\n{lost} SIGKILLed -> every survivor training again (bound {a.bound:g} s; store: {a.store})")
    for (launcher, nodes), found in results.items():
        ok = [x for x in found if x is not None]
        median = f"{statistics.median(ok):.2f} s ({min(ok):.2f}-{max(ok):.2f})" if ok else "never"
        print(f"  {nodes:3d} nodes  {launcher:9s} {median}  recovered {len(ok)}/{len(found)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
