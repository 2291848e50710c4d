"""Rendezvous at scale: N simulated nodes spread over --procs harness processes (the simulated nodes are the
harness's cost, not the store's). In each process a few threads (--steppers) step its nodes as each agent's main
loop would, every node with its own Rendezvous, lease and watches; the nodes share one store connection per
64 (an agent has its own: thousands of connections would need as many reader threads here, and the threads,
not the store, would set the pace), and their leases are renewed by 4 threads per process.

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

    python bench/rendezvous.py --sizes 64,128,1024,4096,16384 --backends tcp,etcd --torch-max 128
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import os
import queue
import re
import resource
import selectors
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from ftrun.clock import SystemClock
from ftrun.rendezvous.driver import Rendezvous
from ftrun.rendezvous.lease import LeaseKeeper
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


NODES_PER_CONNECTION = 64  # the store allows 256 watches per connection; a node holds one, the leader two


class SimNode:
    """One simulated node: the agent's loop without workers (RUN = remember the round), stepped by a Stepper."""

    def __init__(self, name: str, store: Store, run_id: str, rules: Rules, renewals: Renewals) -> None:
        self.name = name
        self.counts: Counter[str] = Counter()
        self.ran: dict[int, float] = {}  # round -> when this node learned its rank
        self.error: BaseException | None = None
        self.left_at = 0.0  # when this node's lease was revoked (it left)
        self.wake_at = 0.0  # when the node next wants a step (its heap entries for other times are stale)
        self._local = Local()
        self.r = Rendezvous(
            Counted(store, self.counts),
            run_id,
            Me(name, "127.0.0.1", 1),
            rules,
            Timing(5.0, 3),
            clock=SystemClock(),
            offer_port=lambda: 29500,
            log=lambda text: None,
            renewals=renewals.add,
        )

    def step(self) -> float:
        """One turn of the agent's loop; when it next wants one (it may be woken earlier by its fd)."""
        while True:
            advice = self.r.next(self._local)
            d = advice.decision
            if d.action is Action.RUN and d.assignment is not None and d.assignment.round not in self.ran:
                self._local = Local(running_round=d.assignment.round)
                self.ran[d.assignment.round] = time.monotonic()
            elif d.action is Action.STOP:
                self._local = Local()
                continue
            elif d.action is Action.FAIL:
                raise RuntimeError(d.reason)
            return advice.wake_at

    def leave(self) -> None:
        self.r.close(leave=True)
        self.left_at = time.monotonic()


class Renewals:
    """The lease keepers of one harness process's nodes, renewed by a few threads (an agent gives its own keeper a
    thread; thousands of threads per process would starve each other, so the harness shares them)."""

    def __init__(self, threads: int) -> None:
        self._due: list[tuple[float, int, LeaseKeeper]] = []
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._stopped = False
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def add(self, keeper: LeaseKeeper) -> None:
        with self._cond:
            heapq.heappush(self._due, (time.monotonic() + keeper.interval_s, next(self._ids), keeper))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._due or self._due[0][0] > time.monotonic()):
                    self._cond.wait(self._due[0][0] - time.monotonic() if self._due else None)
                if self._stopped:
                    return
                _, _, keeper = heapq.heappop(self._due)
            if keeper.renew():
                self.add(keeper)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


class Stepper:
    """One thread stepping many simulated nodes, as each agent's main loop would: a node is stepped when its
    rendezvous fd is readable or its wake time passed. Commands from other threads come through a queue."""

    def __init__(self, nodes: list[SimNode], changed: threading.Condition) -> None:
        self.nodes = nodes
        self._changed = changed
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        self._stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def call(self, command: Callable[[], None]) -> None:
        """Run ``command`` on the stepping thread (a Rendezvous is not thread-safe)."""
        self._commands.put(command)
        os.write(self._wake_w, b"x")

    def stop(self) -> None:
        def stop() -> None:
            self._stopped = True

        self.call(stop)

    def leave(self, node: SimNode) -> None:
        def leave() -> None:
            node.leave()
            with self._changed:
                self._changed.notify_all()

        self.call(leave)

    def _step(self, node: SimNode, sel: selectors.BaseSelector, wake: list[tuple[float, int, SimNode]]) -> None:
        rounds = len(node.ran)
        try:
            node.wake_at = node.step()
            heapq.heappush(wake, (node.wake_at, id(node), node))
        except BaseException as e:  # reported by the harness
            node.error = e
            print(f"{node.name}: {e!r}", file=sys.stderr, flush=True)
            sel.unregister(node.r.fileno())
        if node.error is not None or len(node.ran) != rounds:
            with self._changed:
                self._changed.notify_all()

    def _run(self) -> None:
        wake: list[tuple[float, int, SimNode]] = []
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake_r, selectors.EVENT_READ)
            for node in self.nodes:
                try:
                    node.r.start()
                except BaseException as e:  # reported by the harness
                    node.error = e
                    continue
                sel.register(node.r.fileno(), selectors.EVENT_READ, node)
                self._step(node, sel, wake)
            while not self._stopped:
                timeout = max(0.0, min(wake[0][0] - time.monotonic(), 1.0)) if wake else 1.0
                for key, _ in sel.select(timeout):
                    if key.data is None:
                        os.read(self._wake_r, 4096)
                        while not self._commands.empty():
                            self._commands.get()()
                    elif key.data.left_at == 0.0 and key.data.error is None:
                        self._step(key.data, sel, wake)
                now = time.monotonic()
                while wake and wake[0][0] <= now:
                    at, _, node = heapq.heappop(wake)
                    if at == node.wake_at and node.left_at == 0.0 and node.error is None:  # else stale
                        self._step(node, sel, wake)


def child(url: str, run_id: str, first: int, count: int, n: int, steppers: int) -> None:
    """One harness process: ``count`` simulated nodes stepped by ``steppers`` threads over shared connections,
    driven by the parent through stdin/stdout."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a node holds a few fds (epoll, eventfds)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # The first round closes when all N came (a late node must not be left a spare); the next when every
    # survivor is back (the rules close a reopened round then, without a last call).
    rules = Rules(max(1, n - 1), n, last_call_s=TIMEOUT_S, join_timeout_s=TIMEOUT_S, max_restarts=10)
    stores = [open_store(url, retry_deadline_s=60.0) for _ in range(-(-count // NODES_PER_CONNECTION))]
    renewals = Renewals(threads=4)
    nodes = [SimNode(f"node{i:05d}", stores[(i - first) % len(stores)], run_id, rules, renewals)
             for i in range(first, first + count)]  # fmt: skip
    changed = threading.Condition()
    groups = [Stepper(nodes[k::steppers], changed) for k in range(min(steppers, count))]
    owner = {x.name: g for g in groups for x in g.nodes}
    say({"ready": count})
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "go":
            for g in groups:
                g.thread.start()
        elif command == "round":  # report when every node here (but those that left) ran round ARG
            k = int(arg)
            here = [x for x in nodes if x.left_at == 0.0]
            try:
                last = wait_round(here, k, changed, time.monotonic() + TIMEOUT_S)
                say({"round": k, "last": last, "ops": [x.counts["ops"] for x in here],
                     "events": [x.counts["events"] for x in here]})  # fmt: skip
            except (RuntimeError, TimeoutError) as e:
                say({"round": k, "error": str(e)})
        elif command == "leave":
            x = next(x for x in nodes if x.name == arg)
            owner[x.name].leave(x)
            with changed:
                changed.wait_for(lambda x=x: x.left_at > 0.0, TIMEOUT_S)  # type: ignore[misc]
            say({"left": x.left_at})
        elif command == "stop":
            break
    for g in groups:  # the nodes need not leave one by one: closing the connections ends their leases
        g.stop()
    for g in groups:
        g.thread.join(60)
    renewals.stop()
    for store in stores:
        store.close()


def say(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)


def wait_round(nodes: list[SimNode], round_: int, changed: threading.Condition, deadline: float) -> float:
    """The time the last node learned its rank in ``round_``."""
    pending = list(nodes)

    def done() -> bool:  # checks each node once, not all of them on every notification
        while pending and (round_ in pending[-1].ran or pending[-1].error is not None):
            pending.pop()
        return not pending

    with changed:
        changed.wait_for(done, max(0.0, deadline - time.monotonic()))
    for x in nodes:
        if x.error is not None:
            raise RuntimeError(f"{x.name}: {x.error}")
        if round_ not in x.ran:
            raise TimeoutError(f"{x.name} never ran round {round_}")
    return max(x.ran[round_] for x in nodes)


class Harness:
    """The simulated nodes of one job, spread over ``procs`` processes (their cost is the harness's)."""

    def __init__(self, url: str, n: int, procs: int, steppers: int) -> None:
        run_id = f"bench-{uuid.uuid4().hex[:8]}"
        per = -(-n // procs)
        self.children = []
        for first in range(0, n, per):
            argv = [sys.executable, __file__, "--child", url, run_id, str(first), str(min(per, n - first)), str(n)]
            argv.append(str(steppers))
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


def cpu_seconds(*pids: int) -> float:
    """The CPU seconds (user + system) these processes used so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


class StoreMeter:
    """The store process's CPU seconds (/proc/<pid>/stat), and the bytes through the loopback interface (both
    directions, everything on it: the benchmark talks only to 127.0.0.1) since mark()."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self.mark()

    def _now(self) -> tuple[float, int]:
        cpu = cpu_seconds(self._pid)
        with open("/proc/net/dev") as f:
            lo = next(line for line in f if line.strip().startswith("lo:"))
        return cpu, int(lo.split(":", 1)[1].split()[8])  # transmitted bytes

    def mark(self) -> None:
        self._cpu, self._bytes = self._now()

    def since(self) -> tuple[float, int]:
        cpu, sent = self._now()
        return cpu - self._cpu, sent - self._bytes


def bench_ftrun(
    url: str, n: int, procs: int, steppers: int, meter: StoreMeter | None, idle_s: float
) -> dict[str, float]:
    harness = Harness(url, n, procs, steppers)
    try:
        if meter is not None:
            meter.mark()
        t0 = time.monotonic()
        harness_cpu = cpu_seconds(*(c.pid for c in harness.children))
        for c in harness.children:
            harness.tell(c, "go")
        last, ops, events = harness.round(1)
        harness_cpu = cpu_seconds(*(c.pid for c in harness.children)) - harness_cpu
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
            "harness_cpu_join": harness_cpu,
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
        url, run_id, *numbers = sys.argv[2:8]
        first, count, n, steppers = (int(x) for x in numbers)
        child(url, run_id, first, count, n, steppers)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64,1024,4096,16384")
    p.add_argument("--backends", default="tcp,etcd")
    p.add_argument("--procs", type=int, default=8, help="harness processes the simulated nodes are spread over")
    p.add_argument("--steppers", type=int, default=4, help="threads per harness process stepping its nodes")
    p.add_argument("--idle", type=float, default=10.0, help="seconds of steady state to measure keep-alives")
    p.add_argument("--etcd-max", type=int, default=4096, help="largest N to run on etcd (it is slower)")
    p.add_argument("--torch-max", type=int, default=64, help="largest N to run torch's handler for (it is slow)")
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    backends = a.backends.split(",")
    print(f"rendezvous, {os.cpu_count()} cores, nodes spread over {a.procs} processes; one round, min = max = N")
    print("join/rejoin: s until the last node knows its rank; ops, events: store calls and watch events per node")
    print("(mean/max) for the join, and per survivor for the rejoin (ops2, ev2); store cpu: the store process's CPU")
    print("s for the join/rejoin; harness: the harness processes' CPU s for the join (the simulated nodes' own")
    print("work: with the store's, it shares this machine's cores); B/node: loopback bytes per node for the join;")
    print("idle: the store's CPU share while the N nodes only keep their leases alive (steady training,")
    print("a keep-alive per node every 5 s)")
    header = f"{'backend':8} {'N':>6} {'join':>7} {'ops':>9} {'events':>10} {'rejoin':>7} {'ops2':>5} {'ev2':>5}"
    header += f" {'store cpu':>10} {'harness':>8} {'B/node':>7} {'idle cpu':>9} {'torch join':>11} {'ratio':>6}"
    print(header)
    etcd = EtcdHarness().start() if "etcd" in backends else None
    try:
        for backend in backends:
            for n in sizes:
                if backend == "etcd" and n > a.etcd_max:
                    print(f"{backend:8} {n:>6}  (over --etcd-max: etcd's gateway spends ~0.6 ms of CPU per keep-alive)")
                    continue
                proc, url = start_tcp_store() if backend == "tcp" else (None, etcd.url)  # type: ignore[union-attr]
                try:
                    meter = StoreMeter(proc.pid if proc is not None else etcd.pid)  # type: ignore[union-attr]
                    r = bench_ftrun(url, n, a.procs, a.steppers, meter, a.idle)
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
                    f" {r['store_cpu_join']:>4.1f}/{r['store_cpu_rejoin']:<4.1f} {r['harness_cpu_join']:>8.1f}"
                    f" {r['bytes_join']:>7.0f}"
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
