"""The agent's part in moving the embedded store when the node that hosted it is lost.

The rendezvous decides who takes over (:mod:`ftrun.rendezvous.succession`); this hosts the new store when the
successor is this node, on its address and the endpoint's port, and points the job's store handle there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ftrun.config import LaunchConfig
from ftrun.errors import FtrunError
from ftrun.rendezvous.succession import Successor
from ftrun.store.factory import open_store
from ftrun.store.moving import MovingStore
from ftrun.store.tcp import TcpStoreClient
from ftrun.store.url import tcp_url

if TYPE_CHECKING:
    from ftrun.store.tcp_server import TcpStoreServer


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

    def __call__(self, successor: Successor) -> None:
        r = self._config.rdzv
        options = dict(r.conf.etcd)
        where = f"{successor.addr}:{self._port}"
        if successor.node_id == self.me:
            from ftrun.store.tcp_server import TcpStoreServer  # asyncio and msgpack: only when hosting
            from ftrun.store.tls import server_context

            tls = server_context(options) if r.store_url.startswith("tcps://") else None
            try:
                self.server = TcpStoreServer(successor.addr, self._port, token=r.token, tls=tls).start()
            except OSError as e:
                raise FtrunError(f"the store's host was lost and this node cannot take over on {where}: {e}") from e
            self._say(f"the store's host was lost: this node hosts the store now, on {where}")
        else:
            self._say(f"the store's host was lost: {successor.node_id} hosts the store now, on {where}")
        client = open_store(
            tcp_url(successor.addr, self._port, options), token=r.token, retry_deadline_s=self._deadline_s
        )
        if isinstance(client, TcpStoreClient):
            client.on_reconnect = self._say
        self._store.move_to(client)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
