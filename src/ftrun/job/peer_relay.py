"""The agent's part in ``ftrun.start_peer_heartbeat``: the ranks' side-channel addresses, exchanged through ftrun.

Each rank of the ring sends to the next rank and listens to the one before. A
rank writes its UDP address into the attempt's peer directory (a file per
rank, on this node) and wakes its agent; a rank whose neighbour is on this node
reads the neighbour's file. Only the node's first and last ranks have
neighbours elsewhere: the agent publishes those two addresses in the job's
store (under the round) and writes the two it needs, its neighbours on the
nodes before and after, into the directory. Two writes and two reads per node,
whatever the size of the job; nothing waits on the job's own store, so the ring
starts before, or without, ``init_process_group``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from pathlib import Path

from ftrun.job.board import JobBoard
from ftrun.private import make_dir
from ftrun.store import keyspace
from ftrun.store.base import Store
from ftrun.worker.peers import (
    EXCHANGE_TIMEOUT_S,
    PEER_DIR_ENV,
    PEER_KEY_ENV,
    await_address,
    write_address,
)


class PeerRelay:
    """One attempt's relay: started once the node's first (or last) rank wrote its address."""

    @classmethod
    def open(
        cls, board: JobBoard | None, round_: int | None, peer_dir: Path, first: int, last: int, world: int, key: bytes
    ) -> PeerRelay:
        """The relay of the node's ranks ``first``..``last`` of ``world``, their address files in ``peer_dir``;
        ``key``: the job's, that signs the ranks' datagrams (:func:`job_key`)."""
        make_dir(peer_dir)
        return cls(board, round_, peer_dir, first, last, world, key)

    def __init__(
        self, board: JobBoard | None, round_: int | None, peer_dir: Path, first: int, last: int, world: int, key: bytes
    ) -> None:
        self._key = key
        self._board, self._round = board, round_
        self.dir = peer_dir
        self._first, self._last, self._world = first, last, world
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def env(self) -> dict[str, str]:
        """What a worker needs to join the ring: the job's key, and this relay when the ranks can use it."""
        found = {PEER_KEY_ENV: self._key.hex()}
        if self.usable:
            found[PEER_DIR_ENV] = str(self.dir)
        return found

    @property
    def usable(self) -> bool:
        """Whether the ranks can exchange through it: all of them are here, or the job has a store."""
        return not self.needed or (self._board is not None and self._round is not None)

    @property
    def needed(self) -> bool:
        """Whether any neighbour is on another node (else the ranks find each other's files here)."""
        return self._last - self._first + 1 < self._world

    def poke(self) -> None:
        """Called when a worker woke the agent: start relaying once this node's first rank has an address."""
        if self._thread is None and self.needed and (self.dir / str(self._first)).exists():
            self._thread = threading.Thread(target=self._relay, name="ftrun-peer-relay", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _relay(self) -> None:
        board, round_ = self._board, self._round
        if board is None or round_ is None:
            return
        for rank in sorted({self._first, self._last}):
            # the first rank's file is there; the last rank may still be starting
            address = await_address(self.dir, rank, EXCHANGE_TIMEOUT_S, self._stop.is_set)
            if address is None:
                return
            board.publish_peer(round_, rank, address)
        for rank in sorted({(self._first - 1) % self._world, (self._last + 1) % self._world}):
            address = board.peer_address(round_, rank, EXCHANGE_TIMEOUT_S, self._stop.is_set)
            if address is not None and not self._stop.is_set():
                write_address(self.dir, rank, address)


def job_key(run_id: str, token: str | None, store: Store | None) -> bytes:
    """The key every rank of the job signs its peer heartbeats with. From the store's token where there is one
    (nobody without it can forge a datagram); else a random key the first agent puts in the store (anyone who
    can read the store can read it: no weaker than the store); else (a static job of several nodes, no token)
    one derived from the run id, which only keeps out datagrams from outside the job by mistake."""
    if token or store is None:
        secret = (token or "").encode()
        return hmac.new(secret, f"ftrun peer heartbeat {run_id}".encode(), hashlib.sha256).digest()
    key = keyspace.key(run_id, "peer_key")
    store.compare_and_set(key, secrets.token_bytes(32), 0)  # the first agent's stands
    found = store.get(key)
    return found.value if found is not None else secrets.token_bytes(32)
