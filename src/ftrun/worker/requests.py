"""PURE: what a worker may ask of ftrun about the whole job (workload control), and how a request is written.

A training script often knows before ftrun does that something is wrong (a GPU with
ECC errors, a loss that is NaN, a node that is too slow). It can ask for:

    exclude_node   this node leaves the job for good; the others go on in a new round
    stop_job       every node stops its workers, nothing restarts, every agent exits non-zero
    restart        a job-wide restart now, counted against --max-restarts
    peer_failed    (ftrun's peer heartbeat) a peer rank is silent or out of step: a failure, that peer to blame

A request is a small JSON record in the worker's slot of the monitor table (the
client writes it, the agent reads it when the worker wakes it); this module is
the one place that says what a valid request is.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from ftrun.jsonobject import load_object

MAX_REASON_BYTES = 400  # UTF-8; the reason travels to every node and into the reports
MAX_REQUEST_BYTES = 4 * MAX_REASON_BYTES  # the reason escaped, the action and the peer


class Action(enum.Enum):
    EXCLUDE_NODE = "exclude_node"
    STOP_JOB = "stop_job"
    RESTART = "restart"
    PEER_FAILED = "peer_failed"


@dataclass(frozen=True, slots=True)
class Request:
    action: Action
    reason: str
    peer: int | None = None  # PEER_FAILED: the global rank of the peer

    def describe(self) -> str:
        what = {
            Action.EXCLUDE_NODE: "excluded its node from the job",
            Action.STOP_JOB: "stopped the job",
            Action.RESTART: "asked for a restart",
            Action.PEER_FAILED: f"lost its peer rank {self.peer}",
        }[self.action]
        return f"{what}: {self.reason}"


def encode(action: object, reason: object, peer: int | None = None) -> bytes:
    """The record for a request; a ValueError names what is wrong with it (raised in the worker, at the call)."""
    names = ", ".join(a.value for a in Action)
    if not isinstance(action, str) or action not in {a.value for a in Action}:
        raise ValueError(f"unknown workload control action {action!r}; one of: {names}")
    if not isinstance(reason, str):
        raise ValueError(f"the reason must be a str, not {type(reason).__name__}")
    if not reason.strip():
        raise ValueError("give a reason: it is printed by every agent and kept in the reports")
    size = len(reason.encode("utf-8"))
    if size > MAX_REASON_BYTES:
        raise ValueError(f"the reason is {size} bytes of UTF-8; at most {MAX_REASON_BYTES}")
    if action == Action.PEER_FAILED.value and (not isinstance(peer, int) or isinstance(peer, bool) or peer < 0):
        raise ValueError(f"a peer failure names the peer's rank (an int >= 0), not {peer!r}")
    return json.dumps({"action": action, "reason": reason, "peer": peer}).encode()


def decode(raw: bytes) -> Request:
    """A request read from a slot; ValueError if it is not one (a stray write)."""
    record = load_object(raw, limit=MAX_REQUEST_BYTES, what="the request", error=ValueError)
    encode(record.get("action"), record.get("reason"), record.get("peer"))  # the same checks as the worker's
    return Request(Action(record["action"]), record["reason"], record.get("peer"))
