"""This node's link to the job's other nodes, as its local group uses it from attempt to attempt: the board every
node reads and writes (:mod:`.board`), a hang that only waited held for the other nodes' word (:mod:`.crosscheck`),
and the ranks' peer heartbeat addresses relayed between the nodes (:mod:`.peer_relay`), signed with the job's key.

A job of one node, or a static job (no store), has a link with no board: nothing is held, nothing is relayed
beyond the node, and its peer key is its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from ftrun.clock import Clock
from ftrun.job.board import JobBoard
from ftrun.job.crosscheck import HeldHangs
from ftrun.job.peer_relay import PeerRelay

T = TypeVar("T")  # a hung worker (the agent's Worker)


class JobLink(Generic[T]):
    def __init__(self, board: JobBoard | None, peer_key: Callable[[], bytes], clock: Clock) -> None:
        """``peer_key``: the job's key, asked once it is first needed (as the first attempt starts: a node that
        started again at the endpoint reads it from the job's store, where its rendezvous took it, not from the
        store of its own it began with)."""
        self.board = board
        self._peer_key = peer_key
        self._held: HeldHangs[T] = HeldHangs(clock, board)
        self._peers: PeerRelay | None = None  # the attempt's (ftrun.start_peer_heartbeat)

    @functools.cached_property
    def peer_key(self) -> bytes:
        """Signs the ranks' peer heartbeats (and the snapshot copies between nodes)."""
        return self._peer_key()

    def new_attempt(self, round_: int | None, peer_dir: Path, first: int, last: int, world: int) -> None:
        """An attempt of this node's ranks ``first``..``last`` of ``world`` starts (in ``round_``, elastic jobs)."""
        self._held.forget()
        if self._peers is not None:
            self._peers.stop()
        self._peers = PeerRelay.open(self.board, round_, peer_dir, first, last, world, self.peer_key)

    def env(self) -> dict[str, str]:
        """What a worker needs to join the peer heartbeat ring."""
        return self._peers.env() if self._peers is not None else {}

    @property
    def peer_dir(self) -> Path | None:
        """Where the attempt's ranks write their peer heartbeat addresses."""
        return self._peers.dir if self._peers is not None else None

    def poke(self) -> None:
        """A worker woke the agent: relay its address once it wrote one."""
        if self._peers is not None:
            self._peers.poke()

    def hold(self, hung: T, round_: int | None) -> None:
        """``round_``: hold ``hung`` until another node spoke for that round (at most a few seconds); None: act at
        once."""
        self._held.add(hung, round_)

    def due(self) -> list[T]:
        """The hung workers to act on now (each returned once)."""
        return self._held.due()

    def seconds_to_next(self) -> float | None:
        return self._held.seconds_to_next()

    def close(self) -> None:
        if self._peers is not None:
            self._peers.stop()
