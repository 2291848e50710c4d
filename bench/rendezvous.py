"""Rendezvous at scale: N simulated nodes in one process, each a thread with its own store connection.

For N in --sizes, on the embedded tcp store (a separate `ftrun store` process) and on
a real etcd (when installed):

- join: every node starts at once; the time until the last one knows its rank
  (one round, min = max = N; torch's handler gets the same);
- ops/node: store calls and watch notifications per node for that round;
- rejoin: one node leaves (its lease revoked, as on a clean exit); the time until
  every survivor runs in the next round. A node that dies silently adds the
  keep-alive TTL (interval x max attempts) on top, the detection time.

torch's DynamicRendezvousHandler (c10d backend over a TCPStore) runs in the same
harness for N up to --torch-max.

    python bench/rendezvous.py --sizes 16,64,256,1024
"""

from __future__ import annotations

import argparse
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
            with self.changed:
                self.changed.notify_all()
        finally:
            r.close(leave=True)
            self.left_at = time.monotonic()
            store.close()


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


def bench_ftrun(url: str, n: int) -> dict[str, float]:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    # min = max = N for the first round; survivors may continue with N - 1.
    rules = Rules(max(1, n - 1), n, last_call_s=30.0, join_timeout_s=TIMEOUT_S, max_restarts=10)
    nodes = [SimNode(f"node{i:04d}", url, run_id, rules) for i in range(n)]
    started: list[float] = []  # stamped as the barrier trips, before any node is let go
    ready = threading.Barrier(n + 1, action=lambda: started.append(time.monotonic()))
    leaving = [threading.Event() for _ in nodes]
    threads = [threading.Thread(target=x.run, args=(ready, leaving[i]), daemon=True) for i, x in enumerate(nodes)]
    for t in threads:
        t.start()
    try:
        ready.wait(TIMEOUT_S)
        t0 = started[0]
        join_s = wait_round(nodes, 1, t0 + TIMEOUT_S) - t0
        ops = [x.counts["ops"] for x in nodes]
        events = [x.counts["events"] for x in nodes]
        victim = n - 1
        leaving[victim].set()
        nodes[victim].stop.set()
        threads[victim].join(TIMEOUT_S)  # its lease is revoked when its loop ends
        t1 = nodes[victim].left_at
        survivors = nodes[:victim]
        rejoin_s = (wait_round(survivors, 2, t1 + TIMEOUT_S) - t1) if survivors else float("nan")
        return {
            "join_s": join_s,
            "ops_mean": sum(ops) / n,
            "ops_max": max(ops),
            "events_mean": sum(events) / n,
            "events_max": max(events),
            "rejoin_s": rejoin_s,
        }
    finally:
        for x in nodes:
            x.stop.set()
        for t in threads:
            t.join(30)


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16,64,256,1024")
    p.add_argument("--backends", default="tcp,etcd")
    p.add_argument("--torch-max", type=int, default=64, help="largest N to run torch's handler for (it is slow)")
    a = p.parse_args()
    # A thousand simulated nodes are a thousand I/O-bound threads sharing one GIL. With the default
    # 5 ms switch interval every thread waiting for the GIL wakes each 5 ms to ask for it, and the
    # kernel time of those futex storms dominates (seen with perf: ~80 % of the CPU at N = 1,024).
    # The nodes give the GIL up whenever they wait on I/O, so a long interval loses nothing; real
    # nodes are separate machines and never pay this.
    sys.setswitchinterval(0.5)
    sizes = [int(x) for x in a.sizes.split(",")]
    backends = a.backends.split(",")
    print(f"rendezvous, {os.cpu_count()} cores; times in s, one round, min = max = N")
    header = f"{'backend':8} {'N':>5} {'join':>7} {'ops/node':>9} {'events/node':>12} {'rejoin':>7}"
    header += f" {'torch join':>11} {'ratio':>6}"
    print(header)
    etcd = EtcdHarness().start() if "etcd" in backends else None
    proc, tcp_url = start_tcp_store()
    try:
        for backend in backends:
            url = tcp_url if backend == "tcp" else etcd.url  # type: ignore[union-attr]
            for n in sizes:
                r = bench_ftrun(url, n)
                torch_s = bench_torch(n) if backend == "tcp" and n <= a.torch_max else None
                torch_col = "-" if n > a.torch_max or backend != "tcp" else "timeout"
                if torch_s is not None:
                    torch_col = f"{torch_s:.2f}"
                ratio = f"{r['join_s'] / torch_s:.3f}" if torch_s else "-"
                print(
                    f"{backend:8} {n:>5} {r['join_s']:>7.2f} {r['ops_mean']:>5.1f}/{r['ops_max']:<3.0f} "
                    f"{r['events_mean']:>7.1f}/{r['events_max']:<4.0f} {r['rejoin_s']:>7.2f}"
                    f" {torch_col:>11} {ratio:>6}",
                    flush=True,
                )
    finally:
        proc.kill()
        proc.wait()
        if etcd is not None:
            etcd.stop()
    print("ops/node and events/node: mean/max over nodes (the max is the leader, which watches every node key)")
    print("rejoin: a node leaves (lease revoked) -> every survivor runs the next round; a silent death adds the TTL")


if __name__ == "__main__":
    main()
