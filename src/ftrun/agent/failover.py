"""The agent and the job's store: serving the embedded store, reaching it, and moving it when its host is lost.

The rendezvous decides who takes over (:mod:`ftrun.rendezvous.succession`); this hosts the new store when the
successor is this node, on its address and the endpoint's port, and points the job's store handle there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ftrun.config import LaunchConfig
from ftrun.errors import FtrunError
from ftrun.rendezvous.liveness import refuses
from ftrun.rendezvous.records import Head
from ftrun.store.base import Store
from ftrun.store.factory import open_store
from ftrun.store.moving import MovingStore
from ftrun.store.tcp import TcpStoreClient
from ftrun.store.url import tcp_url

if TYPE_CHECKING:
    from ftrun.store.tcp_server import TcpStoreServer


def serve_store(config: LaunchConfig, host: str, port: int) -> TcpStoreServer:
    """The embedded store served here (over TLS when the job's store URL is ``tcps://``); raises OSError when
    the address cannot be bound."""
    from ftrun.store.tcp_server import TcpStoreServer  # asyncio and msgpack: only when hosting
    from ftrun.store.tls import server_context

    r = config.rdzv
    tls = server_context(dict(r.conf.etcd)) if r.store_url.startswith("tcps://") else None
    return TcpStoreServer(host, port, token=r.token, tls=tls).start()


def open_job_store(
    config: LaunchConfig,
    url: str,
    retry_deadline_s: float,
    say: Callable[[str], None],
    host_dead: Callable[[], bool] | None = None,
) -> Store:
    """A client of the job's store at ``url``, which says when a broken connection is back; ``host_dead``: asked
    while a store that never answered refuses connections (a successor lost before it served: gone)."""
    store = open_store(url, token=config.rdzv.token, retry_deadline_s=retry_deadline_s)
    if isinstance(store, TcpStoreClient):
        store.on_reconnect = say
        store.host_dead = host_dead
    return store


class StoreSuccession:
    def __init__(
        self, config: LaunchConfig, store: MovingStore, port: int, retry_deadline_s: float, say: Callable[[str], None]
    ) -> None:
        """``port``: the store's port, where a successor serves it too."""
        self._config = config
        self._store = store
        self._port = port
        self._deadline_s = retry_deadline_s
        self._say = say
        self.me = ""  # this node's id, once the rendezvous named it
        self.server: TcpStoreServer | None = None  # the store this node took over, if it did

    def __call__(self, successor: Head | None) -> None:
        """Host the store here, or go to ``successor``'s; None: no successor is known (no round closed yet, or
        every one named is lost): wait for a store at the endpoint, as a node that starts early does."""
        if successor is None:
            url = self._config.rdzv.store_url
            self._say(f"no successor is known for the store's lost host: waiting for a store at {url}")
            self._store.move_to(open_job_store(self._config, url, self._deadline_s, self._say))
            return
        where = f"{successor.addr}:{self._port}"
        if successor.node_id == self.me:
            try:
                self.server = serve_store(self._config, successor.addr, self._port)
            except OSError as e:
                raise FtrunError(f"the store's host was lost and this node cannot take over on {where}: {e}") from e
            self._say(f"the store's host was lost: this node hosts the store now, on {where}")
        else:
            self._say(f"the store's host was lost: {successor.node_id} hosts the store now, on {where}")
        url = tcp_url(successor.addr, self._port, dict(self._config.rdzv.conf.etcd))
        port = successor.alive_port
        dead = (lambda: refuses(successor.addr, port)) if port else None
        self._store.move_to(open_job_store(self._config, url, self._deadline_s, self._say, dead))

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
