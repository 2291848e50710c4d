"""``--metrics-port``: this agent's job, in Prometheus' text format at ``/metrics`` (prometheus-client), and
its health for Kubernetes' probes, by Kubernetes' own names: ``/readyz`` (readiness: this node's workers run in a
round; 503 otherwise, with the phase), ``/livez`` (liveness: the agent answers) and ``/healthz``, the legacy
health check, as liveness: a liveness probe copied onto it must never kill a pod while ftrun recovers the job.

Everything is computed when Prometheus scrapes, from the same sources as the
summary and ``ftrun status``: the event log (restarts, hangs, downtime, goodput)
and the node's last status record (workers, heartbeat stamps, round). So
nothing is added to the agent's loop; a heartbeat age is as fresh as the status
record, which is rewritten at least every second while workers run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ftrun.errors import ConfigError
from ftrun.observe.events import summarize
from ftrun.observe.goodput import measure
from ftrun.strangers import AtTheDoor

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from ftrun.observe.events import EventLog
    from ftrun.observe.node_status import NodeStatus

LABELS = ["run_id", "node"]
READINESS = "/readyz"
PROBES = (READINESS, "/livez", "/healthz")  # /healthz: Kubernetes' legacy health check, answered as liveness
REQUEST_TIMEOUT_S = 10.0  # for a client's request, read whole
ALL_ADDRESSES = "0.0.0.0"  # noqa: S104 - an exporter is scraped from elsewhere; pass HOST: to narrow it


class Metrics(Collector):
    """The endpoint, bound at once (a bad port fails before any worker starts); :meth:`watch` gives it a job."""

    @classmethod
    def serve(cls, host: str, port: int) -> Metrics:
        """Bound to ``host:port`` and answering, from a thread of its own."""
        metrics = cls(host, port)
        threading.Thread(target=metrics._server.serve_forever, name="ftrun-metrics", daemon=True).start()
        return metrics

    def __init__(self, host: str, port: int) -> None:
        """Use :meth:`serve`."""
        self._watched: tuple[EventLog, NodeStatus, str] | None = None
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        host = host or ALL_ADDRESSES
        self._metrics = make_wsgi_app(registry)
        try:
            self._server = make_server(host, port, self._serve, _Server, handler_class=_Quiet)
        except OSError as e:
            raise ConfigError(  # bad input, found before anything started: exit 2
                "--metrics-port",
                f"cannot serve metrics on {host}:{port}: {e.strerror or e}",
                "pick a free port (each agent on a machine needs its own)",
            ) from None
        self.port = self._server.server_port
        self.url = f"http://{host}:{self.port}/metrics"

    def watch(self, events: EventLog, status: NodeStatus, run_id: str) -> None:
        """The node's events and status record, read at each scrape (from the HTTP server's thread)."""
        self._watched = (events, status, run_id)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def ready(self) -> tuple[bool, str]:
        """Kubernetes' readiness: the agent is up and its node's workers run in a round (the phase otherwise)."""
        if self._watched is None:
            return False, "starting"
        phase = str(self._watched[1].record.get("phase") or "starting")
        return phase == "running", phase

    def _serve(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in PROBES:
            return self._metrics(environ, start_response)  # type: ignore[no-any-return]
        ok, phase = self.ready() if path == READINESS else (True, "alive")
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
        return [f"{phase}\n".encode()]

    def collect(self) -> Iterator[Metric]:
        if self._watched is None:
            return
        log, status, run_id = self._watched
        events = list(log.events)  # appended by the agent's thread: a copy to read
        record = dict(status.record)
        labels = [run_id, status.node]
        summary = summarize(events)
        yield _counter("ftrun_restarts", "Restarts of this node's workers", labels, summary.restarts)
        yield _counter("ftrun_hangs", "Hangs found in this node's workers", labels, summary.hangs)
        yield _counter(
            "ftrun_downtime_seconds", "From each failure to the workers restarted", labels, summary.downtime_s
        )
        ranks = record.get("ranks") or []
        running = sum(1 for r in ranks if r.get("state") == "running") if record.get("phase") == "running" else 0
        yield _gauge("ftrun_workers_running", "Workers of this node running now", labels, running)
        yield _gauge("ftrun_attempt", "The current attempt (0 before the first restart)", labels, summary.attempts - 1)
        yield _gauge("ftrun_round", "The rendezvous round of the current attempt", labels, record.get("round") or 0)
        yield _gauge("ftrun_world_size", "Workers in the whole job (WORLD_SIZE)", labels, record.get("world_size") or 0)
        goodput = measure(events, now=time.monotonic())
        yield _gauge("ftrun_goodput_ratio", "Training time less lost work, over wall time", labels, goodput.fraction)
        if goodput.lost_s is not None:
            yield _gauge("ftrun_lost_work_seconds", "Work the failures made the job do again", labels, goodput.lost_s)
        ages = GaugeMetricFamily(
            "ftrun_heartbeat_age_seconds",
            "Seconds since each running rank's last heartbeat, read from the monitor table at the scrape",
            labels=[*LABELS, "rank"],
        )
        live, now = status.live_beats(), time.monotonic()  # the slots' clock is CLOCK_MONOTONIC
        for r in ranks:
            if r.get("state") == "running" and r["rank"] in live and record.get("phase") == "running":
                ages.add_metric([*labels, str(r["rank"])], max(0.0, now - live[r["rank"]]))
        yield ages
        scores = GaugeMetricFamily(
            "ftrun_straggler_score",
            "How much longer each rank computes per step than the job's other ranks (0.3: 30%); above 0.05 for three"
            " windows in a row, it is named a straggler",
            labels=[*LABELS, "rank"],
        )
        for r in ranks:
            if r.get("straggler_score") is not None:
                scores.add_metric([*labels, str(r["rank"])], float(r["straggler_score"]))
        yield scores


def _counter(name: str, text: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, text, labels=LABELS)
    family.add_metric(labels, value)
    return family


def _gauge(name: str, text: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text, labels=LABELS)
    family.add_metric(labels, value)
    return family


class _Server(AtTheDoor, ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight never holds the agent's exit

    def server_bind(self) -> None:
        super().server_bind()
        self.open_door(f"the metrics and probes on port {self.server_port}")


class _Quiet(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # a client that sends its request a byte at a time (slowloris) is let go

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes are not news: nothing on the agent's stderr."""
