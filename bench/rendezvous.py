"""Rendezvous at scale: N simulated nodes, each a thread with its own store connection, spread over --procs
harness processes (the simulated nodes are the harness's cost, not the store's).

For N in --sizes, on the embedded tcp store (a separate `ftrun store` process) and on
a real etcd (when installed):

- join: every node starts at once; the time until the last one knows its rank
  (one round, min = max = N; torch's handler gets the same);
- ops/node: store calls and watch notifications per node for that round (and for the next);
- store: the store process's CPU seconds for each round, the bytes it wrote to its sockets per node, and its
  CPU share while the nodes only keep their leases alive (steady training);
- rejoin: one node leaves (its lease revoked, as on a clean exit); the time until
  every survivor runs in the next round. A node that dies silently adds the
  keep-alive TTL (interval x max attempts) on top, the detection time.

torch's DynamicRendezvousHandler (c10d backend over a TCPStore) runs in the same
harness for N up to --torch-max.

    python bench/rendezvous.py --sizes 64,1024,4096,16384 --backends tcp
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import selectors
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ftrun.clock import SystemClock
from ftrun.rendezvous.driver import Rendezvous
from ftrun.rendezvous.state import Action, Local, Me, Rules, Timing
from ftrun.store.base import Store, Watch
from ftrun.store.factory import open_store
from ftrun.testing.etcd import EtcdHarness

TIMEOUT_S = 300.0


class Counted:
    """A store proxy that counts calls and delivered watch events (ops per node)."""

    def __init__(self, inner: Store, counts: Counter[str]) -> None:
        self._inner, self._counts = inner, counts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr) or name in ("close", "fileno"):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if name != "keep_alive":  # periodic, not per round
                self._counts["ops"] += 1
            result = attr(*args, **kwargs)
            return CountedWatch(result, self._counts) if name == "watch" else result

        return call


class CountedWatch:
    def __init__(self, inner: Watch, counts: Counter[str]) -> None:
        self._inner, self._counts = inner, counts

    def get(self, timeout_s: float | None) -> Any:
        event = self._inner.get(timeout_s)
        if event is not None:
            self._counts["events"] += 1
        return event

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> CountedWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()


@dataclass
class SimNode:
    """One simulated node: the agent's loop without workers (RUN = remember the round)."""

    name: str
    url: str
    run_id: str
    rules: Rules
    counts: Counter[str] = field(default_factory=Counter)
    ran: dict[int, float] = field(default_factory=dict)  # round -> when this node learned its rank
    changed: threading.Condition = field(default_factory=threading.Condition)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    left_at: float = 0.0  # when this node's lease was revoked (it left)

    def run(self, ready: threading.Barrier, leave: threading.Event) -> None:
        store = Counted(open_store(self.url, retry_deadline_s=60.0), self.counts)
        r = Rendezvous(
            store,  # type: ignore[arg-type]
            self.run_id,
            Me(self.name, "127.0.0.1", 1),
            self.rules,
            Timing(5.0, 3),
            clock=SystemClock(),
            offer_port=lambda: 29500,
            log=lambda text: None,
        )
        local = Local()
        try:
            ready.wait()
            r.start()
            with selectors.DefaultSelector() as sel:
                sel.register(r.fileno(), selectors.EVENT_READ)
                while not self.stop.is_set():
                    if leave.is_set():
                        return
                    step = r.next(local)
                    d = step.decision
                    if d.action is Action.RUN and d.assignment is not None and d.assignment.round not in self.ran:
                        local = Local(running_round=d.assignment.round)
                        with self.changed:
                            self.ran[d.assignment.round] = time.monotonic()
                            self.changed.notify_all()
                    elif d.action is Action.STOP:
                        local = Local()
                        continue
                    elif d.action is Action.FAIL:
                        raise RuntimeError(d.reason)
                    sel.select(max(0.0, min(step.wake_at - time.monotonic(), 1.0)))
        except BaseException as e:  # reported by the harness
            self.error = e
            print(f"{self.name}: {e!r}", file=sys.stderr, flush=True)
            with self.changed:
                self.changed.notify_all()
        finally:
            r.close(leave=True)
            self.left_at = time.monotonic()
            store.close()


def child(url: str, run_id: str, first: int, count: int, n: int) -> None:
    """One harness process: ``count`` simulated nodes (threads), driven by the parent through stdin/stdout."""
    sys.setswitchinterval(0.5)
    threading.stack_size(512 * 1024)  # thousands of threads per process: small stacks
    rules = Rules(max(1, n - 1), n, last_call_s=30.0, join_timeout_s=TIMEOUT_S, max_restarts=10)
    nodes = [SimNode(f"node{i:05d}", url, run_id, rules) for i in range(first, first + count)]
    go = threading.Event()
    leaving = {x.name: threading.Event() for x in nodes}
    started = threading.Barrier(count + 1)

    def run(x: SimNode) -> None:
        started.wait()
        go.wait()
        x.run(threading.Barrier(1), leaving[x.name])

    threads = [threading.Thread(target=run, args=(x,), daemon=True) for x in nodes]
    for t in threads:
        t.start()
    started.wait()
    say({"ready": count})
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "go":
            go.set()
        elif command == "round":  # report when every node here (but those that left) ran round ARG
            k = int(arg)
            here = [x for x in nodes if not leaving[x.name].is_set()]
            try:
                last = wait_round(here, k, time.monotonic() + TIMEOUT_S)
                say({"round": k, "last": last, "ops": [x.counts["ops"] for x in here],
                     "events": [x.counts["events"] for x in here]})  # fmt: skip
            except (RuntimeError, TimeoutError) as e:
                say({"round": k, "error": str(e)})
        elif command == "leave":
            x = next(x for x in nodes if x.name == arg)
            leaving[x.name].set()
            x.stop.set()
            threads[nodes.index(x)].join(TIMEOUT_S)
            say({"left": x.left_at})
        elif command == "stop":
            break
    for x in nodes:
        x.stop.set()
    for t in threads:
        t.join(30)


def say(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)


def wait_round(nodes: list[SimNode], round_: int, deadline: float) -> float:
    """The time the last node learned its rank in ``round_``."""
    last = 0.0
    for n in nodes:
        with n.changed:
            left = max(0.0, deadline - time.monotonic())
            n.changed.wait_for(lambda n=n: round_ in n.ran or n.error is not None, left)  # type: ignore[misc]
        if n.error is not None:
            raise RuntimeError(f"{n.name}: {n.error}")
        if round_ not in n.ran:
            raise TimeoutError(f"{n.name} never ran round {round_}")
        last = max(last, n.ran[round_])
    return last


class Harness:
    """The simulated nodes of one job, spread over ``procs`` processes (their cost is the harness's)."""

    def __init__(self, url: str, n: int, procs: int) -> None:
        run_id = f"bench-{uuid.uuid4().hex[:8]}"
        per = -(-n // procs)
        self.children = []
        for first in range(0, n, per):
            argv = [sys.executable, __file__, "--child", url, run_id, str(first), str(min(per, n - first)), str(n)]
            self.children.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for c in self.children:
            self.read(c)  # ready

    def read(self, c: subprocess.Popen[str]) -> dict[str, Any]:
        assert c.stdout is not None
        line = c.stdout.readline()
        if not line:
            raise RuntimeError(f"a harness process ended (exit {c.wait()})")
        doc: dict[str, Any] = json.loads(line)
        if "error" in doc:
            raise RuntimeError(doc["error"])
        return doc

    def tell(self, c: subprocess.Popen[str], command: str) -> None:
        assert c.stdin is not None
        c.stdin.write(command + "\n")
        c.stdin.flush()

    def round(self, k: int) -> tuple[float, list[int], list[int]]:
        """When the last node ran round ``k``, and every node's store calls and watch events so far."""
        for c in self.children:
            self.tell(c, f"round {k}")
        docs = [self.read(c) for c in self.children]
        return max(d["last"] for d in docs), [o for d in docs for o in d["ops"]], [e for d in docs for e in d["events"]]

    def close(self) -> None:
        for c in self.children:
            with contextlib.suppress(OSError):
                self.tell(c, "stop")
        for c in self.children:
            try:
                c.wait(60)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()


class StoreMeter:
    """The store process's CPU seconds (/proc/<pid>/stat), and the bytes through the loopback interface (both
    directions, everything on it: the benchmark talks only to 127.0.0.1) since mark()."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self.mark()

    def _now(self) -> tuple[float, int]:
        with open(f"/proc/{self._pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        with open("/proc/net/dev") as f:
            lo = next(line for line in f if line.strip().startswith("lo:"))
        return cpu, int(lo.split(":", 1)[1].split()[8])  # transmitted bytes

    def mark(self) -> None:
        self._cpu, self._bytes = self._now()

    def since(self) -> tuple[float, int]:
        cpu, sent = self._now()
        return cpu - self._cpu, sent - self._bytes


def enough_thread_ids(n: int) -> None:
    """Each simulated node runs three threads (its loop, its lease keeper, its store client's reader), and every
    thread takes a process id: 16,384 nodes need more than Linux's default kernel.pid_max of 32,768. Raised when
    this runs as root (said), else the benchmark stops and says how."""
    path = "/proc/sys/kernel/pid_max"
    with open(path) as f:
        have = int(f.read())
    need = 4 * n + 10_000
    if have >= need:
        return
    try:
        with open(path, "w") as f:
            f.write(str(need))
        print(f"(raised kernel.pid_max from {have} to {need}: {n} simulated nodes run {3 * n} threads)")
    except OSError as e:
        raise SystemExit(f"{n} simulated nodes need kernel.pid_max >= {need} (it is {have}: {e}); as root: "
                         f"sysctl -w kernel.pid_max={need}") from None  # fmt: skip


def bench_ftrun(url: str, n: int, procs: int, meter: StoreMeter | None, idle_s: float) -> dict[str, float]:
    enough_thread_ids(n)
    harness = Harness(url, n, procs)
    try:
        if meter is not None:
            meter.mark()
        t0 = time.monotonic()
        for c in harness.children:
            harness.tell(c, "go")
        last, ops, events = harness.round(1)
        join_cpu, join_bytes = meter.since() if meter is not None else (float("nan"), 0)
        victim = harness.children[-1]
        harness.tell(victim, f"leave node{n - 1:05d}")
        t1 = float(harness.read(victim)["left"])
        if meter is not None:
            meter.mark()
        last2, ops2, events2 = harness.round(2)
        survivors = n - 1
        rejoin_cpu, rejoin_bytes = meter.since() if meter is not None else (float("nan"), 0)
        idle_cpu = float("nan")
        if meter is not None and idle_s > 0:
            meter.mark()
            time.sleep(idle_s)  # steady training: only the keep-alives go on
            idle_cpu = meter.since()[0] / idle_s
        return {
            "join_s": last - t0, "ops_mean": sum(ops) / n, "ops_max": max(ops), "events_mean": sum(events) / n,
            "events_max": max(events), "rejoin_s": last2 - t1,
            "ops2_mean": (sum(ops2) - sum(ops[:survivors])) / survivors,
            "events2_mean": (sum(events2) - sum(events[:survivors])) / survivors,
            "store_cpu_join": join_cpu, "bytes_join": join_bytes / n, "store_cpu_rejoin": rejoin_cpu,
            "bytes_rejoin": rejoin_bytes / survivors, "idle_cpu": idle_cpu,
        }  # fmt: skip
    finally:
        harness.close()


def bench_torch(n: int) -> float | None:
    """DynamicRendezvousHandler over torch's c10d backend: join time for N nodes, or None if it timed out."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    done: list[float] = []
    errors: list[BaseException] = []
    started: list[float] = []
    ready = threading.Barrier(n + 1, action=lambda: started.append(time.monotonic()))

    def node() -> None:
        try:
            store = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
            handler = DynamicRendezvousHandler.from_backend(
                run_id, store, C10dRendezvousBackend(store, run_id), n, n,
                timeout=RendezvousTimeout(join=timedelta(seconds=TIMEOUT_S)),
            )  # fmt: skip
            ready.wait()
            handler.next_rendezvous()
            done.append(time.monotonic())
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=node, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    ready.wait(TIMEOUT_S)
    t0 = started[0]
    for t in threads:
        t.join(max(0.0, t0 + TIMEOUT_S - time.monotonic()))
    if errors or len(done) < n:
        return None
    return max(done) - t0


def start_tcp_store() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "ftrun", "store", "--port", "0"], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    found = re.search(r"serving on (\S+:\d+)", proc.stderr.readline())
    if not found:
        proc.kill()
        raise RuntimeError("ftrun store did not start")
    return proc, f"tcp://{found.group(1)}"


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        url, run_id, first, count, n = sys.argv[2:7]
        child(url, run_id, int(first), int(count), int(n))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,1024,4096,16384")
    p.add_argument("--backends", default="tcp,etcd")
    p.add_argument("--procs", type=int, default=8, help="harness processes the simulated nodes are spread over")
    p.add_argument("--idle", type=float, default=10.0, help="seconds of steady state to measure keep-alives")
    p.add_argument("--torch-max", type=int, default=64, help="largest N to run torch's handler for (it is slow)")
    a = p.parse_args()
    sys.setswitchinterval(0.5)  # see child(): a thousand I/O-bound threads share one GIL per process
    sizes = [int(x) for x in a.sizes.split(",")]
    backends = a.backends.split(",")
    print(f"rendezvous, {os.cpu_count()} cores, nodes spread over {a.procs} processes; one round, min = max = N")
    print("join/rejoin: s until the last node knows its rank; ops, events: store calls and watch events per node")
    print("(mean/max) for the join, and per survivor for the rejoin (ops2, ev2); store cpu: the store process's CPU")
    print("s for the join/rejoin; B/node: loopback bytes per node for the join; idle: the store's CPU share while")
    print("the N nodes only keep their leases alive (steady training, keep-alive every 5 s)")
    header = f"{'backend':8} {'N':>6} {'join':>7} {'ops':>9} {'events':>10} {'rejoin':>7} {'ops2':>5} {'ev2':>5}"
    header += f" {'store cpu':>10} {'B/node':>7} {'idle cpu':>9} {'torch join':>11} {'ratio':>6}"
    print(header)
    etcd = EtcdHarness().start() if "etcd" in backends else None
    try:
        for backend in backends:
            for n in sizes:
                proc, url = start_tcp_store() if backend == "tcp" else (None, etcd.url)  # type: ignore[union-attr]
                try:
                    meter = StoreMeter(proc.pid if proc is not None else etcd.pid)  # type: ignore[union-attr]
                    r = bench_ftrun(url, n, a.procs, meter, a.idle)
                finally:
                    if proc is not None:
                        proc.kill()
                        proc.wait()
                torch_s = bench_torch(n) if backend == "tcp" and n <= a.torch_max else None
                torch_col = "-" if n > a.torch_max or backend != "tcp" else "timeout"
                if torch_s is not None:
                    torch_col = f"{torch_s:.2f}"
                ratio = f"{r['join_s'] / torch_s:.3f}" if torch_s else "-"
                print(
                    f"{backend:8} {n:>6} {r['join_s']:>7.2f} {r['ops_mean']:>5.1f}/{r['ops_max']:<3.0f} "
                    f"{r['events_mean']:>5.1f}/{r['events_max']:<4.0f} {r['rejoin_s']:>7.2f}"
                    f" {r['ops2_mean']:>5.1f} {r['events2_mean']:>5.1f}"
                    f" {r['store_cpu_join']:>4.1f}/{r['store_cpu_rejoin']:<4.1f} {r['bytes_join']:>7.0f}"
                    f" {r['idle_cpu']:>8.1%} {torch_col:>11} {ratio:>6}",
                    flush=True,
                )
    finally:
        if etcd is not None:
            etcd.stop()
    print("the max of ops/events is the leader's (it watches every node key and writes every member's place)")
    print("rejoin: a node leaves (lease revoked) -> every survivor runs the next round; a silent death adds the TTL")


if __name__ == "__main__":
    main()
