"""Strangers at every port of a training agent: the cost to the job, and to the agent.

One agent (`--nnodes 1:2`, hosting the embedded store, metrics and probes on), 2 workers training
bench/plain_ddp.py (DDP, gloo on CPU, never importing ftrun). Windows of --window-s seconds alternate: quiet,
then RATE new connections per second opened to every port the agent listens on (the store, the liveness
listener, the snapshot copies' server, the metrics and probes), by a flooder process that never speaks and holds
each connection until the agent closes it. Prints, per window kind:

  step     the median step time of rank 0 (flood / quiet as a ratio; the flooder runs on the same cores, so the
           ratio bounds ftrun's share from above)
  agent    the agent's own CPU seconds per second, its resident memory at the window's end, its open files
           (most seen): bounded whatever the flood's length

    python bench/strangers.py [--rate 1000] [--window-s 30] [--reps 2] [--tls]

With --tls the store is served over TLS (`tcps://`, certificates made with openssl for the run).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

HERE = Path(__file__).resolve().parent
HOLD_S = 10.0  # the flooder's own limit: a connection the agent kept this long is closed by the flooder


def flood(ports: list[int], rate: int, seconds: float) -> None:
    """Open ``rate`` connections a second to each port, never speaking; close each once the agent did."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    room = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64 - 2 * len(ports)
    held: collections.deque[tuple[float, socket.socket]] = collections.deque()
    start = time.monotonic()
    opened = 0
    while (now := time.monotonic()) - start < seconds:
        due = int((now - start) * rate)
        for _ in range(max(0, due - opened)):
            for port in ports:
                if len(held) >= room:  # behind the rate, or holding for long: our own files run out first
                    held.popleft()[1].close()
                s = socket.socket()
                s.setblocking(False)
                with contextlib.suppress(OSError):
                    s.connect_ex(("127.0.0.1", port))
                held.append((now, s))
            opened += 1
        while held and (now - held[0][0] > HOLD_S or len(held) > room):
            held.popleft()[1].close()
        time.sleep(0.005)
    for _, s in held:
        s.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rate", type=int, default=1000, help="new connections per second to each port")
    p.add_argument("--window-s", type=float, default=30.0)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--tls", action="store_true")
    p.add_argument("--flood", help=argparse.SUPPRESS)  # PORTS,SECONDS: run as the flooder
    a = p.parse_args()
    if a.flood:
        ports, seconds = a.flood.rsplit(":", 1)
        flood([int(x) for x in ports.split(",")], a.rate, float(seconds))
        return
    with tempfile.TemporaryDirectory(prefix="ftrun-strangers-") as tmp:
        run(a, Path(tmp))


def run(a: argparse.Namespace, tmp: Path) -> None:
    timeline = tmp / "timeline.jsonl"
    conf = "last_call_timeout=1"
    if a.tls:
        from ftrun.testing.etcd import make_certificates

        (tmp / "certs").mkdir()
        c = make_certificates(tmp / "certs")
        conf += f",cacert={c['ca.crt']},cert={c['server.crt']},key={c['server.key']}"
    argv = [sys.executable, "-m", "ftrun", "--log-dir", str(tmp / "logs"), "--nnodes", "1:2", "--rdzv-backend",
            "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-conf", conf, "--metrics-port", "127.0.0.1:0",
            "--nproc-per-node", "2", str(HERE / "plain_ddp.py"), "--steps", "1000000", "--step-time", "0.02",
            "--timeline", str(timeline), "--checkpoint", str(tmp / "ckpt.pt")]  # fmt: skip
    agent = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(tmp / "agent.err", "w"))  # noqa: SIM115
    try:
        deadline = time.monotonic() + 120
        while not _steps(timeline):
            if time.monotonic() > deadline or agent.poll() is not None:
                sys.exit(f"the job never stepped: {(tmp / 'agent.err').read_text()[-2000:]}")
            time.sleep(0.2)
        me = psutil.Process(agent.pid)
        ports = sorted({c.laddr.port for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN})
        print(f"agent pid {agent.pid}, ports {ports}, {a.rate} new connections/s to each in flood windows"
              f"{' (store over TLS)' if a.tls else ''}")  # fmt: skip
        seen: dict[str, list[dict[str, float]]] = {"quiet": [], "flood": []}
        for rep in range(a.reps):
            for kind in ("quiet", "flood"):
                seen[kind].append(window(kind, me, ports, a, timeline))
                w = seen[kind][-1]
                print(f"rep {rep} {kind:5}  step {w['step_ms']:.1f} ms  agent {w['cpu']:.3f} CPU s/s  "
                      f"RSS {w['rss'] / 2**20:.0f} MiB  files {w['files']:.0f}", flush=True)  # fmt: skip
        q, f = (statistics.median(x["step_ms"] for x in seen[k]) for k in ("quiet", "flood"))
        cq, cf = (statistics.median(x["cpu"] for x in seen[k]) for k in ("quiet", "flood"))
        print(f"median step: quiet {q:.1f} ms, flood {f:.1f} ms: ratio {f / q:.3f}")
        print(f"agent CPU: quiet {cq:.3f} s/s, flood {cf:.3f} s/s; RSS at the end "
              f"{me.memory_info().rss / 2**20:.0f} MiB; most open files {max(x['files'] for x in seen['flood']):.0f}"
              f" (limit {me.rlimit(psutil.RLIMIT_NOFILE)[0]})")  # fmt: skip
        said = [line for line in (tmp / "agent.err").read_text().splitlines() if "refusing" in line]
        print(f"the agent said {len(said)} line(s) of refusals:", *said, sep="\n  ")
    finally:
        agent.terminate()
        agent.wait(60)


def window(kind: str, me: psutil.Process, ports: list[int], a: argparse.Namespace, timeline: Path) -> dict[str, float]:
    start_wall, cpu0 = time.time(), sum(me.cpu_times()[:2])
    flooder = None
    if kind == "flood":
        spec = ",".join(map(str, ports)) + f":{a.window_s}"
        flooder = subprocess.Popen([sys.executable, __file__, "--flood", spec, "--rate", str(a.rate)])
    files = 0.0
    end = time.monotonic() + a.window_s
    while time.monotonic() < end:
        files = max(files, me.num_fds())
        time.sleep(0.5)
    if flooder is not None:
        flooder.wait(60)
    cpu = (sum(me.cpu_times()[:2]) - cpu0) / (time.time() - start_wall)
    walls = [s["wall"] for s in _steps(timeline) if s["wall"] >= start_wall]
    gaps = [b - x for x, b in itertools.pairwise(walls)]
    return {"step_ms": 1000 * statistics.median(gaps) if gaps else float("nan"), "cpu": cpu,
            "rss": me.memory_info().rss, "files": files}  # fmt: skip


def _steps(timeline: Path) -> list[dict[str, float]]:
    if not timeline.exists():
        return []
    lines = [json.loads(x) for x in timeline.read_text().splitlines() if x.endswith("}")]
    return [x for x in lines if x.get("event") == "step" and x.get("rank") == 0]


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
