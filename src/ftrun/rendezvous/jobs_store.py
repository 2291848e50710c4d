"""The job's store elsewhere: this node's store at the endpoint is not the job's (a lost host started again with
the job's command, while a survivor trains on the store it took over), and that node wrote where the job's is
(``r/moved_to``). The node goes there; when that store refused it (its agent's port too), it waits and goes
again after a growing pause, for up to the join timeout, saying so once: a loop with no pause once printed
21,349 lines in 10 s and never joined.
"""

from __future__ import annotations

import random

from ftrun.errors import FtrunError
from ftrun.rendezvous.records import Head
from ftrun.rendezvous.state import Action, Advice, Decision
from ftrun.store.retry import Backoff

MOST_PAUSE_S = 60.0  # the longest pause between tries


class JobsStore:
    def __init__(self, join_timeout_s: float) -> None:
        self.told: Head | None = None  # where the store at the endpoint says the job's is (read, not yet acted on)
        self.going_to: Head | None = None  # where this node went, until that store answers or refuses
        self._join_timeout_s = join_timeout_s
        self._again = Backoff(1.0, MOST_PAUSE_S, random.random)
        self._again_at = 0.0
        self._refused_since: float | None = None  # monotonic: since the job's store first refused this node

    def go(self, now: float, running_round: int | None) -> tuple[Head, Advice, str]:
        """Go to the store told of (``told`` set): the head to go to, what the node does (workers started here
        stop first: this store's rounds are no job's), and what to say (once: "" after)."""
        head, again = self.told, self._again.tries > 0
        assert head is not None
        self.going_to, self.told = head, None
        why = f"the job's store is on {head.node_id} ({head.addr}), which took it over from a lost host"
        said = "" if again else f"rendezvous: this store at the endpoint is not the job's: {why}; joining there"
        why = self.wait(head, now).decision.reason if again else why
        if running_round is not None:
            return head, Advice(Decision(Action.STOP, f"my workers run in round {running_round}, but {why}"), now), said
        return head, Advice(Decision(Action.WAIT, why, wake_at=now), now), said

    def pausing(self, now: float) -> bool:
        return now < self._again_at

    def answered(self, went_to: Head | None) -> None:
        """A call on the store succeeded, the first since this node went to ``went_to``: the job's store
        answered, it is this node's store now."""
        if went_to is not None and self.going_to is went_to:
            self.going_to, self._refused_since = None, None
            self._again.succeeded()

    def refused(self, now: float, why: str) -> tuple[Advice, str]:
        """The job's store, where this node went, refused it (``why``): wait to go again after a pause (what the
        node does), and what to say (once: "" after)."""
        assert self.going_to is not None
        head, self.going_to = self.going_to, None
        self._refused_since = now if self._refused_since is None else self._refused_since
        said = "" if self._again.tries else f"rendezvous: {why}; back to the store at the endpoint, to go again"
        self._again_at = now + self._again.failed()
        self.told = self.told or head
        return self.wait(head, now), said

    def wait(self, head: Head, now: float) -> Advice:
        """Wait to go to ``head`` again; past the join timeout, FtrunError."""
        assert self._refused_since is not None  # set with the pause
        where = f"the job's store on {head.node_id} ({head.addr})"
        if now - self._refused_since > self._join_timeout_s:
            raise FtrunError(
                f"{where} refused this node for {now - self._refused_since:.0f} s, longer than join_timeout "
                f"({self._join_timeout_s:g} s): its node must advertise an address this node reaches "
                "(--local-addr on it)"
            )
        pause = f"going again after a growing pause (at most {MOST_PAUSE_S:g} s)"
        why = f"{where} refused this node, its agent's port too: {pause}"
        return Advice(Decision(Action.WAIT, why, wake_at=self._again_at), now)
