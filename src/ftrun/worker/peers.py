"""Peer liveness (``ftrun.start_peer_heartbeat``): the ranks of a job check each other over their own side channel.

An agent sees its own workers and the store, not the network between the
workers: a rank can be alive to its agent and frozen or unreachable to its peers.
Here every rank sends a small token to the next rank of a ring (rank + 1, modulo
the world) every ``period_s`` over UDP, and expects one from the rank before it.
No token for ``timeout_s``, or a token from another restart of the job (a peer
restarted out of step), is reported to this rank's agent as a peer failure, which
restarts the job as a crash would, naming that peer. The side channel is never
the job's process group, so it cannot deadlock with the job's collectives; the
addresses are exchanged once, from the heartbeat's own thread (its caller never
waits), through ftrun itself (:mod:`ftrun.job.peer_relay`: a file per rank on
the node, the job's rendezvous store between nodes), so before or without
``init_process_group``. Only a static multi-node job, which has no store of
ftrun's, exchanges through the job's own (torch's TCPStore at MASTER_ADDR:MASTER_PORT,
as ``init_process_group("env://")`` makes it: before it exists, the exchange waits).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import hmac
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from ftrun.jsonobject import load_object

EXCHANGE_TIMEOUT_S = 60.0  # for every rank to publish its address
POLL_S = 0.05  # for a neighbour's address file
MAX_DATAGRAM = 512  # a peer heartbeat: rank, restart
PEER_DIR_ENV = "FTRUN_PEER_DIR"  # set by the agent when it relays the addresses
PEER_KEY_ENV = "FTRUN_PEER_KEY"  # the job's key (hex) that signs every datagram: a stranger's are ignored
MAC_BYTES = 32

_started: PeerHeartbeat | None = None
_lock = threading.Lock()


class PeerHeartbeat:
    """One rank's side of the ring; ``report`` is called once, with the peer and what is wrong with it."""

    def __init__(
        self,
        rank: int,
        world: int,
        restart: int,
        period_s: float,
        timeout_s: float,
        addresses: Callable[[str], dict[int, tuple[str, int]]],
        report: Callable[[int, str], None],
        *,
        bind_host: str,
        key: bytes = b"",
    ) -> None:
        """``key``: the job's, shared by every rank; a datagram not signed with it is not a peer's."""
        self.rank, self.world, self.restart = rank, world, restart
        self._key = key
        self.period_s, self.timeout_s = period_s, timeout_s
        self._report = report
        self._bind_host = bind_host
        self._sock = socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET, socket.SOCK_DGRAM)
        self._mine = ""  # host:port, once bound
        self._addresses = addresses  # called from the thread: the exchange may wait for init_process_group
        self.previous = (rank - 1) % world
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-peer-heartbeat", daemon=True)

    def start(self) -> PeerHeartbeat:
        self._sock.bind((self._bind_host, 0))
        self._mine = f"{self._bind_host}:{self._sock.getsockname()[1]}"
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.period_s * 2 + 1)
        self._sock.close()

    def _run(self) -> None:
        try:
            successor = self._addresses(self._mine)[(self.rank + 1) % self.world]
        except Exception as e:  # no ring, and the job goes on as it would without one: said, never raised
            os.write(2, f"ftrun: the peer heartbeat could not start: {type(e).__name__}: {e}\n".encode())
            return
        token = self._signed(json.dumps({"rank": self.rank, "restart": self.restart}).encode())
        heard = time.monotonic()  # the previous rank gets one timeout from our start to be heard
        next_send = 0.0
        self._sock.settimeout(self.period_s)
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_send:
                with contextlib.suppress(OSError):  # a host unreachable: that peer's successor notices
                    self._sock.sendto(token, successor)
                next_send = now + self.period_s
            try:
                data, _ = self._sock.recvfrom(MAX_DATAGRAM)
            except TimeoutError:
                data = b""
            except OSError:
                return  # closed
            if data:
                problem = self._check(data)
                if problem:
                    self._report(self.previous, problem)
                    return
                heard = time.monotonic()
            elif time.monotonic() - heard > self.timeout_s:
                silent = time.monotonic() - heard
                self._report(
                    self.previous, f"no peer heartbeat from it for {silent:.1f} s (timeout {self.timeout_s:g} s)"
                )
                return

    def _signed(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest() + body

    def _check(self, data: bytes) -> str:
        mac, body = data[:MAC_BYTES], data[MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.new(self._key, body, hashlib.sha256).digest()):
            return ""  # not signed with the job's key: a stranger's (or a spoof), ignored
        try:
            theirs = load_object(body, limit=MAX_DATAGRAM, what="a peer heartbeat", error=ValueError)
            rank, restart = int(theirs["rank"]), int(theirs["restart"])
        except (ValueError, KeyError, TypeError):
            return ""  # not ours: ignored
        if rank != self.previous:
            return ""
        if restart != self.restart:
            return f"its peer heartbeat says restart {restart}, this rank is in restart {self.restart} (out of step)"
        return ""


def start_peer_heartbeat(period_s: float = 1.0, timeout_s: float = 10.0) -> None:
    """Check this rank's peers every ``period_s`` (a ring over UDP, never the job's process group); a peer
    silent for ``timeout_s`` or out of step restarts the job, naming it. Call it in every rank, before or after
    ``init_process_group``: it returns at once, and the ring starts once every rank's address is known
    (exchanged through the job's store, as soon as rank 0 hosts it). A second call does nothing. Raises
    RuntimeError outside ftrun."""
    global _started  # noqa: PLW0603 - one heartbeat per process
    if not isinstance(period_s, (int, float)) or not isinstance(timeout_s, (int, float)):
        raise ValueError("period_s and timeout_s are seconds (numbers)")
    if not 0 < period_s < timeout_s:
        raise ValueError(f"need 0 < period_s < timeout_s, got period_s={period_s}, timeout_s={timeout_s}")
    from ftrun.worker import workload

    with _lock:
        if _started is not None:
            return
        env = os.environ
        if not env.get("FTRUN_MONITOR"):
            raise RuntimeError("ftrun: nothing was done: not running under ftrun (no FTRUN_MONITOR)")
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if world < 2:
            return  # nobody to check
        master = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        here = env.get(PEER_DIR_ENV)

        def exchange(mine: str) -> dict[int, tuple[str, int]]:
            if here:
                return _exchange_through_ftrun(Path(here), rank, world, mine, int(env["FTRUN_AGENT_PID"]))
            return _exchange(master, rank, world, restart, mine)

        def report(peer: int, why: str) -> None:
            workload.report_peer_failure(peer, why)

        _started = PeerHeartbeat(
            rank, world, restart, float(period_s), float(timeout_s),
            exchange, report, bind_host=_route_to(master), key=bytes.fromhex(env.get(PEER_KEY_ENV, "")),
        ).start()  # fmt: skip
        atexit.register(_started.stop)


def stop_peer_heartbeat() -> None:
    """End this process's heartbeat (a rank restarting in place: the next attempt's ring is another)."""
    global _started
    with _lock:
        heartbeat, _started = _started, None
    if heartbeat is not None:
        atexit.unregister(heartbeat.stop)
        heartbeat.stop()


def _route_to(master: tuple[str, int]) -> str:
    """This host's address on the way to the master: what the other ranks can reach."""
    family = socket.AF_INET6 if ":" in master[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(master)  # no packet is sent: it only picks the route
        host: str = probe.getsockname()[0]
    return host


def _exchange(master: tuple[str, int], rank: int, world: int, restart: int, mine: str) -> dict[int, tuple[str, int]]:
    """Every rank's UDP address, through the job's TCPStore (the one ``init_process_group`` set up)."""
    import torch.distributed  # only torch.distributed jobs get here

    # torch.distributed exports TCPStore from its C extension, which mypy does not see
    store = torch.distributed.TCPStore(  # type: ignore[attr-defined,unused-ignore]
        master[0], master[1], is_master=False, timeout=timedelta(seconds=EXCHANGE_TIMEOUT_S)
    )
    prefix = f"ftrun/peer/{restart}/"
    store.set(f"{prefix}{rank}", mine)
    keys = [f"{prefix}{r}" for r in range(world)]
    store.wait(keys, timedelta(seconds=EXCHANGE_TIMEOUT_S))
    return {r: _address(store.get(key).decode()) for r, key in enumerate(keys)}


def write_address(peer_dir: Path, rank: int, address: str) -> None:
    """A rank's address file, whole or not at all (readers never see half of one)."""
    tmp = peer_dir / f".{rank}.{os.getpid()}"
    tmp.write_text(address)
    tmp.rename(peer_dir / str(rank))


def _exchange_through_ftrun(peer_dir: Path, rank: int, world: int, mine: str, agent: int) -> dict[int, tuple[str, int]]:
    """The next rank's address, through the agent's peer directory (its file; the agent writes the files of
    ranks on other nodes)."""
    from ftrun.worker.signals import REQUEST_SIGNAL

    write_address(peer_dir, rank, mine)
    with contextlib.suppress(OSError):
        os.kill(agent, REQUEST_SIGNAL)  # the agent relays this node's first and last ranks' addresses
    successor = (rank + 1) % world
    found = await_address(peer_dir, successor, EXCHANGE_TIMEOUT_S)
    if found is None:
        raise TimeoutError(f"rank {successor} published no address within {EXCHANGE_TIMEOUT_S:g} s")
    return {successor: _address(found)}


def await_address(
    peer_dir: Path, rank: int, timeout_s: float, stopped: Callable[[], bool] = lambda: False
) -> str | None:
    """Rank ``rank``'s address once its file is there (None after ``timeout_s``, or when ``stopped`` says so)."""
    deadline = time.monotonic() + timeout_s
    while (found := read_address(peer_dir, rank)) is None and time.monotonic() < deadline and not stopped():
        time.sleep(POLL_S)
    return found


def read_address(peer_dir: Path, rank: int) -> str | None:
    """The address rank ``rank`` published (here, or relayed from its node), if known."""
    try:
        return (peer_dir / str(rank)).read_text()
    except OSError:
        return None


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)
