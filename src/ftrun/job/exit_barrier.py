"""The exit barrier (torchrun's ``exit_barrier_timeout``): the nodes of a finished job leave together.

The first node whose workers all succeed finishes the job; the others may still
be running theirs. Each member writes how its run ended under the job's key, and a
node whose workers succeeded waits (bounded) until every member of the round has
written: if one failed after this node's workers had succeeded, the job failed, and
this node says so and exits 1 too, so that no node reports a success the job did
not have. Once per job, not per round: each node follows the others' records (O(N)).
"""

from __future__ import annotations

from collections.abc import Callable

from ftrun.clock import Clock
from ftrun.errors import StoreError
from ftrun.store import keyspace
from ftrun.store.base import Store
from ftrun.store.follow import follow


class ExitBarrier:
    def __init__(self, store: Store, run_id: str, node_id: str, clock: Clock) -> None:
        self._store = store
        self._root = keyspace.prefix(run_id, "exit")
        self._node = node_id
        self._clock = clock

    def settle(self, code: int, members: int, timeout_s: float, say: Callable[[str], None]) -> int:
        """Tell the others how this node ended (``code``); with 0, wait for the other ``members - 1`` of the
        round's members. Returns the exit code."""
        try:
            self._store.put(self._root + self._node, str(code).encode())
            if code != 0 or timeout_s <= 0:
                return code
            ended = self._wait(members, timeout_s)
        except StoreError as e:
            say(f"exit barrier: the store is unreachable ({e}); exiting with this node's own result")
            return code
        failed = sorted(node for node, theirs in ended.items() if theirs != "0")
        if failed:
            say(f"the workers of {', '.join(failed)} failed after this node's succeeded: the job failed")
            return 1
        if len(ended) < members:
            missing = members - len(ended)
            say(f"exit barrier: {missing} node(s) not done after {timeout_s:g} s (exit_barrier_timeout); exiting")
        return 0

    def _wait(self, members: int, timeout_s: float) -> dict[str, str]:
        """How each member ended, as far as known when all ``members`` told or ``timeout_s`` passed."""
        now, later = follow(self._store, self._root, self._clock, timeout_s)
        ended = {c.key.removeprefix(self._root): (c.value or b"").decode(errors="replace") for c in now}
        if len(ended) < members:
            for change in later:
                ended[change.key.removeprefix(self._root)] = (change.value or b"").decode(errors="replace")
                if len(ended) >= members:
                    break
        return ended
