"""Non-zero ranks wait for rank 0's TCPStore to listen before torch connects (torch would back off 500 ms)."""

from __future__ import annotations

import socket
from types import ModuleType
from typing import Any

from ftrun.worker.master_wait import await_listening, hook_rendezvous


def test_a_listening_port_is_seen_and_a_closed_one_is_given_up_on_at_the_bound() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert await_listening("127.0.0.1", server.getsockname()[1], 1.0)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, not listening: refused
        assert not await_listening("127.0.0.1", port, 0.05)


def test_the_hook_waits_for_other_ranks_only_and_passes_everything_on() -> None:
    calls: list[tuple[Any, ...]] = []
    module = ModuleType("torch.distributed.rendezvous")

    def create(hostname: str, port: int, rank: int, world_size: int, timeout: float, use_libuv: bool = True) -> str:
        calls.append((hostname, port, rank, world_size, timeout, use_libuv))
        return "store"

    module._create_c10d_store = create  # type: ignore[attr-defined]
    hook_rendezvous(module)
    hook_rendezvous(module)  # once only
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert module._create_c10d_store("127.0.0.1", port, 1, 2, 30.0, use_libuv=False) == "store"
        assert module._create_c10d_store("127.0.0.1", port, 0, 2, 30.0) == "store"
    assert calls == [("127.0.0.1", port, 1, 2, 30.0, False), ("127.0.0.1", port, 0, 2, 30.0, True)]
    assert module._create_c10d_store._ftrun  # type: ignore[attr-defined]
