"""Store latency and throughput: memory, the embedded tcp store, etcd, and torch's TCPStore.

Servers run in their own processes (the embedded store via `ftrun store`, TCPStore
via a small torch script, etcd from Debian), clients in this one, all on loopback.

    python bench/store.py [--ops 2000] [--seconds 2] [--clients 1,64,512]

Prints a table of p50/p99 latencies in microseconds and ops/s per client count,
and the embedded store's ratios to TCPStore. Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ftrun.store.factory import open_store
from ftrun.testing.etcd import EtcdHarness

TORCH_SERVER = """
import sys, time, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
print(s.port, flush=True)
sys.stdin.read()
"""


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    return samples[len(samples) // 2] * 1e6, samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e6


def latency(fn: Callable[[int], Any], ops: int) -> tuple[float, float]:
    for i in range(min(100, ops)):  # warm up connections and caches
        fn(i)
    samples = []
    for i in range(ops):
        start = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - start)
    return percentiles(samples)


def throughput(make_client: Callable[[], Any], op: Callable[[Any, int], Any], clients: int, seconds: float) -> float:
    handles = [make_client() for _ in range(clients)]
    counts = [0] * clients
    start_line = threading.Barrier(clients + 1)
    stop = threading.Event()

    def work(i: int) -> None:
        start_line.wait()
        n = 0
        while not stop.is_set():
            op(handles[i], n)
            n += 1
        counts[i] = n

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    start_line.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    elapsed = time.perf_counter() - began
    for h in handles:
        with contextlib.suppress(Exception):
            h.close()
    return sum(counts) / elapsed


@contextlib.contextmanager
def ftrun_store_server() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "ftrun", "store", "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        port = re.search(r":(\d+) ", proc.stderr.readline())
        assert port, "ftrun store did not start"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # never let its log pipe fill
        yield f"tcp://127.0.0.1:{port.group(1)}"
    finally:
        proc.terminate()
        proc.wait(30)


@contextlib.contextmanager
def torch_server() -> Iterator[int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", TORCH_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(30)


def bench_ftrun_store(
    name: str, url: str, args: argparse.Namespace, rows: dict[str, dict[str, str]]
) -> dict[str, float]:
    store = open_store(url)
    watcher = store if name == "memory" else open_store(url)  # each memory:// is a store of its own
    p50s: dict[str, float] = {}
    row = rows.setdefault(name, {})
    store.put("/bench/k", b"v" * 64)

    ops = {"get": lambda i: store.get("/bench/k"), "put": lambda i: store.put("/bench/k", b"v" * 64)}
    revision = [0]

    def cas(i: int) -> None:  # one round trip: the revision comes from the previous answer
        if not revision[0]:
            current = store.get("/bench/k")
            revision[0] = current.revision if current else 0
        ok, revision[0] = store.compare_and_set("/bench/k", b"v" * 64, revision[0])
        assert ok

    ops["cas"] = cas
    for op, fn in ops.items():
        p50, p99 = latency(fn, args.ops)
        p50s[op] = p50
        row[op] = f"{p50:.0f} / {p99:.0f}"
    _, rev = store.list_prefix("/bench/w/")
    with watcher.watch("/bench/w/", rev + 1) as watch:

        def put_to_event(i: int) -> None:
            store.put("/bench/w/k", b"x")
            assert watch.get(10) is not None

        p50, p99 = latency(put_to_event, min(args.ops, 1000))
        row["watch"] = f"{p50:.0f} / {p99:.0f}"
        p50s["watch_p99"] = p99
    for n in args.clients:
        if name == "memory":
            tput = throughput(lambda: store, lambda s, i: s.get("/bench/k"), n, args.seconds)
        else:
            tput = throughput(lambda: open_store(url), lambda s, i: s.get("/bench/k"), n, args.seconds)
        row[f"{n} clients"] = f"{tput:,.0f}"
    store.close()
    if watcher is not store:
        watcher.close()
    return p50s


def bench_torch(args: argparse.Namespace, rows: dict[str, dict[str, str]]) -> dict[str, float]:
    import torch.distributed as dist

    with torch_server() as port:

        def client() -> Any:
            return dist.TCPStore("127.0.0.1", port, 1, False, wait_for_workers=False)

        c = client()
        c.set("k", "v" * 64)
        row = rows.setdefault("torch TCPStore", {})
        p50s = {}
        ops = {
            "get": lambda i: c.get("k"),
            "put": lambda i: c.set("k", "v" * 64),
            "cas": lambda i: c.compare_set("k", "v" * 64, "v" * 64),
            "add": lambda i: c.add("n", 1),
        }
        for op, fn in ops.items():
            p50, p99 = latency(fn, args.ops)
            p50s[op] = p50
            row[op] = f"{p50:.0f} / {p99:.0f}"
        row["watch"] = "n/a"
        for n in args.clients:
            row[f"{n} clients"] = f"{throughput(client, lambda s, i: s.get('k'), n, args.seconds):,.0f}"
        return p50s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--clients", default="1,64,512")
    args = p.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    rows: dict[str, dict[str, str]] = {}
    bench_ftrun_store("memory", "memory://", args, rows)
    with ftrun_store_server() as url:
        ours = bench_ftrun_store("ftrun tcp", url, args, rows)
    with EtcdHarness() as etcd:
        bench_ftrun_store("etcd", etcd.url, args, rows)
    theirs: dict[str, float] = {}
    try:
        theirs = bench_torch(args, rows)
    except ImportError:
        print("torch not installed: no TCPStore comparison")
    columns = ["get", "put", "cas", "watch", *(f"{n} clients" for n in args.clients)]
    print("latency p50 / p99 in us (put->watch: from put until the watcher has the event); throughput: get ops/s")
    print(f"{'store':16s}" + "".join(f"{c:>16s}" for c in columns))
    for name, row in rows.items():
        print(f"{name:16s}" + "".join(f"{row.get(c, ''):>16s}" for c in columns))
    if theirs:
        ratios = ", ".join(f"{op} {ours[op] / theirs[op]:.2f}x" for op in ("get", "put", "cas"))
        print(f"embedded tcp / TCPStore, p50 latency: {ratios} (TCPStore's set does not wait for an answer)")
    print(f"embedded tcp put->watch p99: {ours['watch_p99'] / 1000:.2f} ms")


if __name__ == "__main__":
    main()
