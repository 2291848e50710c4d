"""Retry policy for store operations: which errors are worth retrying, and for how long; :class:`Backoff`, the
pause before trying again, for every loop of ftrun's that retries (none may spin).

Retried: the store could not be reached or the connection broke (refused,
reset, timed out, a leader change in etcd). Fatal at once: wrong credentials,
a refused or malformed request, an expired lease, a lost watch; retrying
those cannot help. Between attempts the policy sleeps with jittered
exponential backoff; once the monotonic deadline passes it raises
:class:`~ftrun.errors.StoreUnavailable` naming the endpoint and how long it tried.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ftrun.clock import Clock, SystemClock
from ftrun.errors import StoreConnectionLost, StoreUnavailable

T = TypeVar("T")


class Backoff:
    """How long to wait before trying again what failed: the pause doubles from ``first_s`` up to ``most_s``,
    each drawn between half and all of it, so that many nodes that failed together do not try again together."""

    def __init__(self, first_s: float, most_s: float, jitter: Callable[[], float]) -> None:
        """``jitter``: a draw in [0, 1) (``random.random``)."""
        self.first_s = first_s
        self.most_s = most_s
        self._jitter = jitter
        self._pause = first_s
        self.tries = 0  # failed tries since the last success

    def failed(self) -> float:
        """A try failed: the pause before the next one."""
        pause = self._pause * (0.5 + self._jitter() / 2)
        self._pause = min(self._pause * 2, self.most_s)
        self.tries += 1
        return pause

    def succeeded(self) -> None:
        self._pause, self.tries = self.first_s, 0


class RequestNotSent(StoreConnectionLost):
    """The request surely never reached the store: safe to retry even if it is not idempotent."""


RETRYABLE: tuple[type[BaseException], ...] = (StoreConnectionLost, ConnectionError, TimeoutError, socket.gaierror)
# For calls whose effect must not happen twice (compare-and-set, counter add, lease grant): only
# failures before the request left are retried; after that the outcome is unknown.
RETRYABLE_UNSENT: tuple[type[BaseException], ...] = (RequestNotSent,)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long to keep trying, and how fast.

    Attributes:
        deadline_s: give up (StoreUnavailable) this long after the first attempt.
            Longer rides out a store restart or an etcd leader election; shorter
            notices a dead store sooner.
        initial_backoff_s: the first pause; it doubles up to ``max_backoff_s``,
            each pause drawn between half and all of it (jitter keeps many
            clients from retrying in lockstep).
    """

    deadline_s: float = 30.0
    initial_backoff_s: float = 0.02
    max_backoff_s: float = 1.0

    def run(
        self,
        endpoint: str,
        attempt: Callable[[], T],
        *,
        retry_on: tuple[type[BaseException], ...] = RETRYABLE,
        clock: Clock | None = None,
        sleep: Callable[[float], None] = time.sleep,
        jitter: Callable[[], float] = random.random,
    ) -> T:
        clock = clock or SystemClock()
        start = clock.monotonic()
        backoff = Backoff(self.initial_backoff_s, self.max_backoff_s, jitter)
        while True:
            try:
                return attempt()
            except retry_on as e:
                waited = clock.monotonic() - start
                if waited >= self.deadline_s:
                    raise StoreUnavailable(endpoint, waited, f"{type(e).__name__}: {e}") from e
                sleep(min(backoff.failed(), self.deadline_s - waited))
