"""The agent and the job's store: serving the embedded store, sharing it, reaching it, and moving it when its
host is lost.

The first agent on the endpoint's machine hosts the store (as torchrun's c10d); another agent finding the port
taken joins it once the store there greeted it, and names whatever else holds the port instead. Two jobs may
share one endpoint: the hosting agent serves on at its own job's end until the other job's agents have left.
The rendezvous decides who takes over a lost host's store (:mod:`ftrun.rendezvous.succession`); this hosts the
new store when the successor is this node, on its address and the endpoint's port, and points the job's store
handle there.
"""

from __future__ import annotations

import errno
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from ftrun.agent.returned_host import ReturnedHost
from ftrun.clock import Clock
from ftrun.config import LaunchConfig
from ftrun.errors import ConfigError, FtrunError, StoreError
from ftrun.node.addresses import is_loopback, unreachable
from ftrun.node.ports import is_local_address, listener_of
from ftrun.observe.events import EventKind
from ftrun.rendezvous.liveness import refuses
from ftrun.rendezvous.records import Head
from ftrun.store.base import Store
from ftrun.store.factory import open_store
from ftrun.store.greeting import probe
from ftrun.store.moving import MovingStore
from ftrun.store.tcp import TcpStoreClient
from ftrun.store.url import StoreUrl
from ftrun.worker.readable import wait_readable

if TYPE_CHECKING:
    from ftrun.agent.narrator import Narrator
    from ftrun.procs.signals import SignalWakeup
    from ftrun.store.tcp_server import TcpStoreServer

PROBE_S = 2.0  # an ftrun store on this machine greets within milliseconds; silence this long is something else
NAME_RETRY_S = 1.0  # how often a store's host name that does not resolve yet is asked again


def host_store(config: LaunchConfig, narrator: Narrator) -> TcpStoreServer | None:
    """Serve the embedded store in-process when its endpoint is this machine (as torchrun's c10d); None when
    this node is a client of it.

    In an elastic job several agents may share a machine (and the endpoint): the first one to bind hosts the
    store; the others find the port taken, and join once the store there has greeted them.
    """
    r = config.rdzv
    if not r.embedded_store or r.store is None:
        return None
    host, port = r.store.endpoints[0]  # no endpoint given: 127.0.0.1 (one node; the CLI insists on one for more)
    wanted = r.conf.is_host
    if wanted is None:
        wanted = config.standalone or is_local_address(host)
    if not wanted:
        return None
    try:
        server = serve_store(config, host, port)
    except OSError as e:
        if config.elastic and e.errno == errno.EADDRINUSE and r.conf.is_host is None:
            narrator.warn(_whose_store(config, host, port))
            return None
        raise ConfigError(
            "--rdzv-endpoint",
            f"cannot host the store on {host}:{port}: {e.strerror or e}",
            "pick a free port (or :0) or stop whatever holds it",
        ) from None
    narrator.emit(EventKind.STORE_HOSTED, host=host, port=server.port)
    narrator.say(f"hosting the rendezvous store on {host}:{server.port}")
    server.on_new_job = lambda job, peer: narrator.warn(
        f"job {job!r} (from {peer}) uses the store this agent hosts too: at the end of this job the agent serves "
        "it on until that job's agents have left"
    )
    if r.token is None and not (r.store and r.store.tls) and not is_loopback(host):
        narrator.warn(
            f"warning: the store on {host}:{server.port} has no token: anyone who can reach it can read the job's "
            "records and steer its rounds; pass --rdzv-token-file FILE (or set FTRUN_TOKEN) on every node"
        )
    return server


def _whose_store(config: LaunchConfig, host: str, port: int) -> str:
    """What holds the endpoint's port on this machine, said before joining it; raises ConfigError when it is
    not an ftrun store (at once, not after a handshake's timeout)."""
    try:
        greeting = probe(host, port, PROBE_S, client_tls(config))
    except StoreError as e:
        raise ConfigError(
            "--rdzv-endpoint", f"{e}; the port is held by {listener_of(port)}", "pick another port, or stop it"
        ) from None
    except OSError:  # it closed since: whoever comes back there is met by the rendezvous's own retries
        return f"{host}:{port} is taken and then closed: joining the store there as a client"
    if greeting.job == config.run_id:
        return f"another agent of this job on this machine hosts the store on {host}:{port}: joining it"
    if not greeting.job:
        return f"{host}:{port} is an ftrun store already (`ftrun store`?): joining it as a client"
    return (
        f"the store on {host}:{port} belongs to job {greeting.job!r} (its agent on this machine hosts it): this "
        "job shares it. At its end that agent serves on until this job's agents have left; a signal that stops "
        "it before ends the store for this job too (a port of this job's own in --rdzv-endpoint avoids that)"
    )


def serve_on_for_others(server: TcpStoreServer, run_id: str, narrator: Narrator, wakeup: SignalWakeup) -> None:
    """At this job's end, the store this agent hosts may still serve other jobs that share the endpoint: keep
    serving until their agents have left, or until a signal to ftrun (``wakeup``) says to stop now."""
    if wakeup.drain():  # a signal came while the job ended: the person wants out now
        return
    others = _other_jobs(server, run_id)
    if not others:
        return
    where = f"{server.host}:{server.port}"
    narrator.warn(
        f"job(s) {others} still use the store this agent hosts on {where}: serving it until their agents have "
        "left (a signal to ftrun stops it now, and they lose it)"
    )
    while others:
        if wait_readable(wakeup.fd, 0.5) and wakeup.drain():
            narrator.warn(f"stopping the store on {where} now: job(s) {others} lose it")
            return
        others = _other_jobs(server, run_id)
    narrator.warn(f"the other jobs left the store on {where}: it stops")


def _other_jobs(server: TcpStoreServer, job: str) -> str:
    return ", ".join(repr(j) for j in sorted(server.jobs()) if j not in ("", job))


def serve_store(config: LaunchConfig, host: str, port: int) -> TcpStoreServer:
    """The embedded store served here (over TLS when the job's store URL is ``tcps://``); raises OSError when
    the address cannot be bound."""
    from ftrun.store.tcp_server import TcpStoreServer  # asyncio and msgpack: only when hosting
    from ftrun.store.tls import server_context

    r = config.rdzv
    tls = server_context(dict(r.conf.etcd)) if r.store and r.store.tls else None
    return TcpStoreServer(host, port, token=r.token, tls=tls, job=config.run_id).start()


def client_tls(config: LaunchConfig) -> ssl.SSLContext | None:
    """A client's TLS context for the job's store when it is served over TLS."""
    from ftrun.store.tls import client_context

    r = config.rdzv
    return client_context(dict(r.conf.etcd)) if r.store and r.store.tls else None


def wait_for_names(
    url: StoreUrl,
    timeout_s: float,
    clock: Clock,
    say: Callable[[str], None],
    wake_fd: int,
    interrupted: Callable[[], bool],
) -> None:
    """Return once a host of the store's endpoints resolves (etcd: any member will do).

    A name that does not resolve is waited for, up to ``timeout_s`` (the join timeout), and said once: on
    Kubernetes a pod's name enters DNS only once the pod runs, and the store's pod may start after this one
    (torchrun waits too). A typo then costs that wait, but the line says what is wrong at once. Past it, or at
    a signal to ftrun (``wake_fd`` readable, ``interrupted()``), raises ConfigError naming --rdzv-endpoint."""
    names = ", ".join(dict.fromkeys(host for host, _ in url.endpoints))
    began = clock.monotonic()
    deadline = began + timeout_s
    said = False
    while True:
        why = ""
        for host, port in url.endpoints:
            try:
                socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                return
            except socket.gaierror as e:
                why = e.strerror or str(e)
        if clock.monotonic() >= deadline or interrupted():
            raise ConfigError(
                "--rdzv-endpoint",
                f"the store's host {names} does not resolve ({why}; waited {clock.monotonic() - began:.0f} s)",
                "check the name, or give the host's address",
            )
        if not said:
            say(
                f"the store's host {names} does not resolve ({why}): waiting up to {timeout_s:g} s (join_timeout) "
                "for it to, as for a store's pod that has not started yet"
            )
            said = True
        wait_readable(wake_fd, min(NAME_RETRY_S, max(0.0, deadline - clock.monotonic())))


def open_job_store(
    config: LaunchConfig,
    url: StoreUrl,
    retry_deadline_s: float,
    say: Callable[[str], None],
    host_dead: Callable[[], bool] | None = None,
) -> Store:
    """A client of the job's store at ``url``, which says when a broken connection is back; ``host_dead``: asked
    while a store that never answered refuses connections (a successor lost before it served: gone)."""
    store = open_store(url, token=config.rdzv.token, retry_deadline_s=retry_deadline_s, job=config.run_id)
    if isinstance(store, TcpStoreClient):
        store.on_reconnect = say
        store.host_dead = host_dead
    return store


class StoreSuccession:
    def __init__(
        self,
        config: LaunchConfig,
        store: MovingStore,
        port: int,
        retry_deadline_s: float,
        say: Callable[[str], None],
        me: str,
    ) -> None:
        """``port``: the store's port, where a successor serves it too; ``me``: this node's id in the rendezvous."""
        self._config = config
        self._store = store
        self._port = port
        self._deadline_s = retry_deadline_s
        self._say = say
        self._me = me
        self.server: TcpStoreServer | None = None  # the store this node took over, if it did
        self._returned: ReturnedHost | None = None  # then: the lost host started again at the endpoint is told
        self._unreachable: set[str] = set()  # successors' addresses said to be out of reach

    def __call__(self, successor: Head | None) -> None:
        """Host the store here, or go to ``successor``'s; None: no successor is known (no round closed yet, or
        every one named is lost): wait for a store at the endpoint, as a node that starts early does."""
        if successor is None:
            url = self._config.rdzv.store
            assert url is not None  # a store that moves is an elastic job's
            self._say(f"no successor is known for the store's lost host: waiting for a store at {url.display}")
            self._store.move_to(open_job_store(self._config, url, self._deadline_s, self._say))
            return
        where = f"{successor.addr}:{self._port}"
        if successor.node_id == self._me:
            try:
                self.server = serve_store(self._config, successor.addr, self._port)
            except OSError as e:
                raise FtrunError(f"the store's host was lost and this node cannot take over on {where}: {e}") from e
            self._say(f"the store's host was lost: this node hosts the store now, on {where}")
            self._returned = self._watch_the_endpoint(successor, self.server.store_id)
        else:
            self._say(f"the store's host was lost: {successor.node_id} hosts the store now, on {where}")
            self._tell_if_unreachable(successor)
        moved = self._config.rdzv.store
        assert moved is not None  # a store that moves is an elastic job's
        url = moved.at(successor.addr, self._port)
        port = successor.alive_port
        dead = (lambda: refuses(successor.addr, port)) if port else None
        self._store.move_to(open_job_store(self._config, url, self._deadline_s, self._say, dead))

    def _tell_if_unreachable(self, successor: Head) -> None:
        """Said once per address: retrying cannot help, the node that hosts the store must advertise another."""
        endpoint = self._config.rdzv.store
        why = unreachable(successor.addr, endpoint.endpoints if endpoint is not None else [])
        if not why or successor.addr in self._unreachable:
            return
        self._unreachable.add(successor.addr)
        self._say(
            f"the job's store is on {successor.node_id} at {successor.addr}:{self._port}, which this node cannot "
            f"reach: {why}. That node advertises an address its peers do not reach: start it with --local-addr "
            "set to one they do (its IP address, or a name every node resolves)"
        )

    def _watch_the_endpoint(self, here: Head, store_id: str) -> ReturnedHost:
        endpoint = self._config.rdzv.store
        assert endpoint is not None  # a store that moves is an elastic job's
        host, port = endpoint.endpoints[0]
        tls = client_tls(self._config)
        return ReturnedHost(
            self._config.run_id,
            here,
            store_id,
            greet=lambda: probe(host, port, PROBE_S, tls),
            client=lambda: open_job_store(self._config, endpoint, PROBE_S, self._say),
            say=self._say,
            endpoint=endpoint.display,
        ).start()

    def close(self) -> None:
        if self._returned is not None:
            self._returned.close()
        if self.server is not None:
            self.server.stop()
