"""Every node applies the same calculated hang timeouts: the widest any rank of the job calculated.

Each agent already takes the widest over its own local ranks (the monitor table).
Across nodes the agents agree through the store, never through the job's own
process group (which may have no CPU backend, or be the thing that hangs): a
job-wide value that every node widens by compare-and-set and every node hears
on the watch it keeps anyway. Static multi-node jobs have no store; there each
node applies what its own ranks calculated.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Protocol

from ftrun.jsonobject import load_object
from ftrun.rendezvous.driver import Rendezvous
from ftrun.worker.timeouts import Timeouts

VALUE = "timeouts"
MAX_VALUE_BYTES = 64 * 1024  # a few timeouts and the sections' names


class HoldsTimeouts(Protocol):
    """What the agreement needs of the node's hang watch (:class:`ftrun.monitor.hangs.HangWatch`)."""

    kept: Timeouts  # what this node's ranks calculated, widened by what it adopted

    def adopt(self, theirs: Timeouts, why: str) -> None: ...


class TimeoutAgreement:
    """``warn``: what a user must hear (a garbled value in the store, ignored)."""

    def __init__(self, hangs: HoldsTimeouts, rendezvous: Rendezvous, warn: Callable[[str], None]) -> None:
        self._hangs = hangs
        self._rendezvous = rendezvous
        self._warn = warn
        self._published = Timeouts()  # what this node last merged into the job's value
        self._heard: bytes | None = None  # the job's value this node last applied

    def sync(self) -> None:
        """Publish what this node's ranks calculated, and apply what the job agreed; cheap when nothing changed."""
        mine = self._hangs.kept
        if mine != self._published and mine.any:
            self._rendezvous.values.merge(VALUE, lambda current: _widened(current, mine))
            self._published = mine
        heard = self._rendezvous.values.get(VALUE)
        if heard is not None and heard != self._heard:
            self._heard = heard
            try:
                theirs = Timeouts.from_json(_timeouts(heard))
            except ValueError as e:
                self._warn(f"ignoring the job's calculated timeouts in the store: {e}")
                return
            self._hangs.adopt(theirs, "the job's nodes calculated timeouts")


def _widened(current: bytes | None, mine: Timeouts) -> bytes | None:
    """The job's value widened by ``mine`` (a garbled value is replaced)."""
    merged = mine
    if current is not None:
        with contextlib.suppress(ValueError):
            merged = Timeouts.from_json(_timeouts(current)).widest(mine)
    return json.dumps(merged.to_json(), sort_keys=True).encode()


def _timeouts(raw: bytes) -> dict[str, object]:
    return load_object(raw, limit=MAX_VALUE_BYTES, what="the job's calculated timeouts", error=ValueError)
