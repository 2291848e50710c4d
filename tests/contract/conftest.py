"""One Store contract, run against every backend: memory, the embedded tcp server, and a real etcd."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from ftrun.store.base import Store
from ftrun.store.factory import open_store
from ftrun.store.memory import MemoryStore
from ftrun.store.tcp import TcpStoreClient
from ftrun.store.tcp_server import TcpStoreServer
from ftrun.testing.etcd import EtcdHarness

BACKENDS = ["memory", "tcp", "etcd"]
TOKEN = "contract-test-token"

OpenClient = Callable[[], Store]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[OpenClient]:
    """A factory of clients of one fresh store of the parametrized kind; closes them all at teardown."""
    clients: list[Store] = []
    server: TcpStoreServer | None = None
    if request.param == "memory":
        shared = MemoryStore()
        clients.append(shared)

        def open_client() -> Store:
            return shared

    elif request.param == "tcp":
        server = TcpStoreServer(token=TOKEN).start()

        def open_client() -> Store:
            clients.append(TcpStoreClient("127.0.0.1", server.port, token=TOKEN))
            return clients[-1]

    else:
        etcd: EtcdHarness = request.getfixturevalue("etcd")

        def open_client() -> Store:
            clients.append(open_store(etcd.url))
            return clients[-1]

    yield open_client
    for c in clients:
        c.close()
    if server is not None:
        server.stop()


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdHarness]:
    """One real etcd for the session; tests keep apart by key prefix."""
    with EtcdHarness() as harness:
        yield harness


@pytest.fixture
def store(backend: OpenClient) -> Store:
    return backend()


@pytest.fixture
def ns() -> str:
    """A key prefix of this test's own, so tests never see each other's keys."""
    return f"/t-{uuid.uuid4().hex[:10]}/"
