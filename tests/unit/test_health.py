"""The agent's health for Kubernetes' probes, served beside /metrics: ready only while its workers run."""

from __future__ import annotations

import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any, cast

from ftrun.observe.metrics import Metrics


def probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_ready_only_while_the_nodes_workers_run_alive_throughout() -> None:
    metrics = Metrics.serve("127.0.0.1", 0)
    try:
        assert probe(metrics.port, "/readyz") == (503, "starting\n")
        assert probe(metrics.port, "/livez") == (200, "alive\n")
        status = SimpleNamespace(record={"phase": "waiting"}, node="n")
        metrics.watch(cast(Any, SimpleNamespace(events=[])), cast(Any, status), "r")
        assert probe(metrics.port, "/readyz") == (503, "waiting\n")  # in the rendezvous, or restarting
        for liveness in ("/livez", "/healthz"):  # a liveness probe on Kubernetes' legacy path never kills a recovery
            assert probe(metrics.port, liveness) == (200, "alive\n")
        status.record = {"phase": "running"}
        assert probe(metrics.port, "/readyz") == (200, "running\n")
        status.record = {"phase": "finished"}
        assert probe(metrics.port, "/readyz")[0] == 503
    finally:
        metrics.close()
