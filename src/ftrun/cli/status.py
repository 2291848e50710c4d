"""``ftrun status``: a job as a person wants to see it, live in the terminal until it ends, or once (also
whenever its output is no terminal), or as JSON.

It reads what the agents write for it and never talks to them: a run
directory's ``status.json`` (one node, or the node whose logs you have), or,
for a multi-node job, every node's status record in the job's store (``--rdzv-*``
as given to the agents) with the rendezvous' current round and spares. The
same works while the job runs and after it ended.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from ftrun.cli.rdzv_flags import rdzv_store_url, store_token
from ftrun.errors import ConfigError, FtrunError
from ftrun.job.board import read_statuses
from ftrun.monitor.table import read_live
from ftrun.node.addresses import DEFAULT_STORE_PORT
from ftrun.observe.node_status import STATUS_FILE, read_status, slot_progress, status_from_events
from ftrun.procs.logs import last_written
from ftrun.store.url import StoreUrl
from ftrun.worker.layout import SlotView

REFRESH_S = 1.0
PROBES = ("ready", "live")
STALE_S = 15.0  # a record of a running job older than this: its agent may be gone


def main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    p = argparse.ArgumentParser(prog="ftrun status", description="Show a job's nodes, ranks, restarts and goodput.")
    p.add_argument("run_dir", nargs="?", help="the run's log directory (as printed at start: 'logs in ...')")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    p.add_argument("--interval", type=float, default=REFRESH_S, help="seconds between refreshes of the live view")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="c10d", help="a multi-node job's store: c10d or etcd")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="", help="the job's --rdzv-endpoint")
    p.add_argument("--rdzv-id", "--rdzv_id", default="", help="the job's --rdzv-id")
    p.add_argument("--rdzv-token-file", default=None, help="the embedded store's token file (or FTRUN_TOKEN)")
    p.add_argument(
        "--probe",
        choices=PROBES,
        help="a Kubernetes exec probe of RUN_DIR's agent, with no port: exit 0 when it is live (ready: its "
        "workers run in a round), 1 otherwise; prints the phase",
    )
    a = p.parse_args(list(argv))
    try:
        if a.probe:
            return probe(a.probe, a.run_dir)
        source = _source(a, environ)
        if a.json:
            print(json.dumps(source.snapshot(), indent=2))
            return 0
        from ftrun.cli.status_view import live, render

        if a.once or not sys.stdout.isatty():  # piped, redirected: one snapshot (a live view would never end)
            render(source.snapshot(), sys.stdout)
            return 0
        return live(source.snapshot, a.interval)
    except (ConfigError, FtrunError) as e:
        print(f"ftrun status: error: {e}", file=sys.stderr)
        return 2


def probe(kind: str, run_dir: str | None) -> int:
    """As ``--metrics-port``'s ``/readyz`` and ``/livez`` answer, from the run directory (a liveness probe
    never fails while ftrun recovers or stops workers: only an agent whose process is gone is not live)."""
    if not run_dir:
        raise ConfigError("--probe", "needs the run's directory", "pass RUN_DIR, the 'logs in ...' at start")
    phase = str(RunDir(Path(run_dir)).snapshot()["phase"])
    ok = phase == "running" if kind == "ready" else phase != "agent gone"
    print(phase)
    return 0 if ok else 1


class RunDir:
    """One node's run directory."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def snapshot(self) -> dict[str, Any]:
        record = read_status(self.path) or status_from_events(self.path)  # the first record may be late
        if record is None:
            raise FtrunError(f"{self.path}: neither {STATUS_FILE} nor events.jsonl yet (is ftrun starting there?)")
        _check_agent(record)
        return _job([record], source=str(self.path))


class JobStore:
    """Every node's record in a multi-node job's store."""

    def __init__(self, url: StoreUrl, run_id: str, token: str | None) -> None:
        from ftrun.store.factory import open_store

        self.run_id = run_id
        self.url = url
        self._store = open_store(url, token=token, retry_deadline_s=3.0)

    def snapshot(self) -> dict[str, Any]:
        from ftrun.rendezvous.records import Keys, RecordError, decode_roster, decode_round

        records = read_statuses(self._store, self.run_id)
        if not records:
            where = self.url.display
            raise FtrunError(f"no node of run {self.run_id!r} published a status at {where}: check --rdzv-id")
        keys = Keys.of(self.run_id)
        round_kv = self._store.get(keys.round)
        members: tuple[str, ...] = ()
        try:  # the round's roster (a person's view may read the O(N) record: the agents never do but the leader)
            roster_id = decode_round(round_kv.value).roster_id if round_kv is not None else ""
            roster_kv = self._store.get(keys.roster(roster_id)) if roster_id else None
            members = decode_roster(roster_kv.value).members if roster_kv is not None else ()
        except RecordError:
            members = ()
        registered = sorted(kv.key.rsplit("/", 1)[-1] for kv in self._store.list_prefix(keys.nodes)[0])
        job = _job(records, source=self.url.display)
        job["spares"] = [n for n in registered if members and n not in members]
        return job


def _source(a: argparse.Namespace, environ: Mapping[str, str]) -> RunDir | JobStore:
    if a.rdzv_id or a.rdzv_endpoint:
        if a.run_dir:
            raise ConfigError("RUN_DIR", "given with --rdzv-*", "pass either a run directory or the job's store")
        if not a.rdzv_id:
            raise ConfigError("--rdzv-id", "is missing", "pass the job's --rdzv-id")
        url = rdzv_store_url(a.rdzv_backend, a.rdzv_endpoint, DEFAULT_STORE_PORT)
        return JobStore(url, a.rdzv_id, store_token(None, a.rdzv_token_file, environ))
    if not a.run_dir:
        raise ConfigError("RUN_DIR", "is missing", "pass the run's log directory, or --rdzv-endpoint and --rdzv-id")
    return RunDir(find_run_dir(Path(a.run_dir)))


def find_run_dir(path: Path) -> Path:
    """``path`` if it is a run directory, else its newest run (``path`` may be the --log-dir)."""
    if (path / STATUS_FILE).exists() or (path / "events.jsonl").exists():
        return path
    if not path.is_dir():
        raise ConfigError("RUN_DIR", f"{path} is not a directory", "pass the directory printed as 'logs in ...'")
    runs = [d for d in path.iterdir() if (d / STATUS_FILE).exists() or (d / "events.jsonl").exists()]
    if not runs:
        raise ConfigError("RUN_DIR", f"{path} holds no ftrun run", "pass the directory printed as 'logs in ...'")
    return max(runs, key=last_written)


def _check_agent(record: dict[str, Any]) -> None:
    """A local run whose agent is gone without finishing says so, rather than 'running' forever."""
    if record.get("phase") == "finished":
        return
    pid = int(record.get("agent_pid") or 0)
    if pid <= 0 or psutil.pid_exists(pid):  # not known, or alive (another user's included)
        return
    record["phase"] = "agent gone"
    for rank in record.get("ranks", []):  # nobody watches them any more: what they do is not known
        if rank.get("state") == "running":
            rank["state"] = "unknown (agent gone)"


def _live_slots(record: dict[str, Any]) -> dict[int, SlotView]:
    """The running ranks' slots, read now from the agent's monitor table when it is on this machine (the
    record's heartbeat stamps are up to a second old); nothing otherwise."""
    path = record.get("monitor")
    if not isinstance(path, str) or record.get("phase") != "running" or record.get("host") != socket.gethostname():
        return {}
    return read_live(path, [int(r["local_rank"]) for r in record.get("ranks", []) if r.get("state") == "running"])


def _job(records: list[dict[str, Any]], *, source: str) -> dict[str, Any]:
    """The view's model: the nodes' records, with the ages a person reads computed now."""
    now = time.time()
    for r in records:
        r["age_s"] = max(0.0, now - float(r.get("updated") or now))
        if r.get("phase") == "running" and r["age_s"] > STALE_S:
            r["phase"] = f"no news for {r['age_s']:.0f} s"
        slots = _live_slots(r)
        for rank in r.get("ranks", []):
            beat = rank.get("last_beat")
            live = r.get("phase") == "running" and rank.get("state") == "running"
            slot = slots.get(rank.get("local_rank"))
            if live and slot is not None and slot.pid == rank.get("pid") and slot.last_beat:
                rank.update(slot_progress(slot, now - time.monotonic()), heartbeat_live=True)
                rank["heartbeat_age_s"] = max(0.0, time.monotonic() - slot.last_beat)
            else:
                rank["heartbeat_age_s"] = max(0.0, now - float(beat)) if beat and live else None
    first = records[0]
    phases = {str(r.get("phase")) for r in records}
    return {
        "run_id": first.get("run_id"),
        "source": source,
        "now": now,
        "phase": phases.pop() if len(phases) == 1 else "mixed",
        "round": max((r["round"] for r in records if r.get("round") is not None), default=None),
        "world_size": max(int(r.get("world_size") or 0) for r in records),
        "restarts": max(int(r.get("restarts") or 0) for r in records),
        "root_causes": max((r.get("root_causes") or [] for r in records), key=len),
        "spares": [],
        "nodes": records,
    }
