"""Workload control from inside a worker: leave the job, stop it, restart it, report a peer.

Each call writes one request (:mod:`ftrun.worker.requests` says what a valid one is) into the worker's
slot of the monitor table and wakes the agent, which acts on it at once.
"""

from __future__ import annotations

from ftrun.worker import client
from ftrun.worker.requests import encode


def exclude_this_node(reason: str) -> None:
    """This node leaves the job for good, now: its agent stops its workers and exits (code 3, never readmitted
    under this run id); the other nodes go on in a new round. Raises ValueError for a bad reason, RuntimeError
    outside ftrun."""
    client.request(encode("exclude_node", reason))


def stop_job(reason: str) -> None:
    """Stop the whole job, now: every node stops its workers, nothing restarts, every agent exits non-zero and
    prints ``reason``."""
    client.request(encode("stop_job", reason))


def request_restart(reason: str) -> None:
    """A job-wide restart, now, counted against --max-restarts (as a failure would be)."""
    client.request(encode("restart", reason))


def report_peer_failure(peer: int, why: str) -> None:
    """ftrun's peer heartbeat: the peer of global rank ``peer`` is silent or out of step (a failure)."""
    client.request(encode("peer_failed", why[:300], peer))
