"""Newest: store writes off the agent's loop, only the newest of those offered while one is written."""

from __future__ import annotations

import threading

from ftrun.errors import StoreError
from ftrun.job.offloop import Newest

BOUND_S = 10.0


def test_while_one_is_handled_only_the_newest_offered_is_kept_and_a_store_error_costs_one_item() -> None:
    handled: list[int] = []
    release = threading.Event()
    seen = {n: threading.Event() for n in (1, 3, 4)}

    def handle(item: int) -> None:
        handled.append(item)
        seen[item].set()
        if item == 1:
            assert release.wait(BOUND_S)
            raise StoreError("the store does not answer")

    newest = Newest(handle, "test")
    newest.offer(1)
    assert seen[1].wait(BOUND_S)
    newest.offer(2)
    newest.offer(3)  # 2 is dropped: 3 is newer
    release.set()
    assert seen[3].wait(BOUND_S)
    newest.offer(4)  # the thread may have ended; a new one starts if so
    assert seen[4].wait(BOUND_S)
    assert handled == [1, 3, 4]
