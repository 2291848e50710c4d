"""The agent's health for Kubernetes' probes, served beside /metrics: ready only while its workers run."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from ftrun.cli.status import probe as probe_run
from ftrun.observe.metrics import Metrics
from ftrun.observe.node_status import STATUS_FILE, STATUS_VERSION


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


def test_the_exec_probes_answer_from_the_run_directory_as_the_http_ones(tmp_path: Path, capsys: Any) -> None:
    """``ftrun status RUN_DIR --probe ready|live``: Kubernetes' probes with no port; live while the agent's
    process is there, whatever it does (a recovery never fails liveness)."""
    dead = int(Path("/proc/sys/kernel/pid_max").read_text())  # never a process's id: ids stay below it
    for phase, pid, ready, live in (
        ("waiting", os.getpid(), 1, 0),  # in the rendezvous, or restarting
        ("running", os.getpid(), 0, 0),
        ("running", dead, 1, 1),  # the agent is gone: its record still says running
        ("finished", dead, 1, 0),  # ended as it should: nothing to restart
    ):
        record = {"v": STATUS_VERSION, "phase": phase, "agent_pid": pid, "updated": time.time()}
        (tmp_path / STATUS_FILE).write_text(json.dumps(record))
        assert [probe_run(kind, str(tmp_path)) for kind in ("ready", "live")] == [ready, live], phase
    assert capsys.readouterr().out.splitlines()[-4:] == ["agent gone", "agent gone", "finished", "finished"]
