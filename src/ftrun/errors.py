"""Errors a user of ftrun can act on.

Every error derives from :class:`FtrunError` and carries a message that names
what was wrong and how to fix it. Nothing is printed and dropped: the CLI is
the only place that turns an error into a message and an exit code.
"""

from __future__ import annotations


class FtrunError(Exception):
    """Root of every error ftrun raises on purpose."""


class ConfigError(FtrunError):
    """A flag, option or environment value is invalid.

    The CLI prints it as one line and exits 2 before anything is started.
    """

    def __init__(self, flag: str, problem: str, fix: str) -> None:
        self.flag = flag
        self.problem = problem
        self.fix = fix
        super().__init__(f"{flag}: {problem}; {fix}")


class SpawnError(FtrunError):
    """A worker process could not be started (missing binary, bad cwd, ...)."""


class ErrorFileError(FtrunError):
    """A worker's error file exists but is not a valid error record."""


class StoreError(FtrunError):
    """Something went wrong talking to the key-value store."""


class StoreUnavailable(StoreError):
    """The store could not be reached before the retry deadline.

    The message names the endpoint and how long ftrun tried; check that the
    store (the agent hosting it, or etcd) is running and reachable.
    """

    def __init__(self, endpoint: str, waited_s: float, cause: str) -> None:
        self.endpoint = endpoint
        self.waited_s = waited_s
        super().__init__(f"store {endpoint} unavailable after {waited_s:.1f} s: {cause}")


class StoreGone(StoreError):
    """The store this client was talking to refuses connections since it went away: its host (the agent that
    hosted it, or ``ftrun store``) exited. Not retried for long: a store that comes back is a fresh, empty one."""


class StoreConnectionLost(StoreError):
    """The connection to the store broke; retryable (the client reconnects)."""


class StoreAuthError(StoreError):
    """The store refused our credentials; fatal: check --rdzv-token / FTRUN_TOKEN or the etcd user."""


class StoreProtocolError(StoreError):
    """A malformed, oversized or unexpected message; the connection is closed."""


class StoreRequestError(StoreError):
    """The store understood the request and refused it (bad key, too many pending requests...)."""


class LeaseExpired(StoreError):
    """The lease does not exist (anymore): its TTL passed, it was revoked, or the store restarted.

    Keys bound to it are gone. A node that sees this must assume it has been
    declared dead by the others.
    """


class WatchLost(StoreError):
    """Events the watch should deliver are no longer available.

    Happens when the store was restarted without its history (the embedded
    store) or compacted past the watch's revision (etcd). Re-read the state
    and start a new watch from the revision of that read.
    """
