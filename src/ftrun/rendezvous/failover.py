"""One node's side of the embedded store's failover, inside the rendezvous: who hosts the store, which hosts
were lost, and the round the survivors open where the store moved (:mod:`.succession` decides who takes over;
this holds what a node remembers between store calls).

A store that cannot move (etcd survives its members) has no failover: ``move`` is None, and a lost store is
raised to the agent as any store error.
"""

from __future__ import annotations

from collections.abc import Callable

from ftrun.errors import StoreGone
from ftrun.rendezvous.records import Head, Keys, RoundRecord, encode_round
from ftrun.rendezvous.state import Rules, after_lost_store
from ftrun.rendezvous.succession import Takeover, takeover
from ftrun.store.base import Store


class StoreFailover:
    """``move``: host the store here or go to the successor (None: to the endpoint), once its host is lost."""

    def __init__(self, move: Callable[[Head | None], None] | None, rules: Rules) -> None:
        self._move = move
        self._rules = rules
        self.host = ""  # the node that hosts the store, as it said in the store (r/store_host)
        self._lost: set[str] = set()  # hosts of the store lost so far: never a successor again
        self.seed: RoundRecord | None = None  # the round to open in a store that took over from a lost one

    def take_over(self, last: RoundRecord | None, e: StoreGone) -> Takeover:
        """The store's host is gone (``e``): every survivor goes to the successor, computed from the round
        record this node holds (``last``, or the seed of a takeover under way whose successor is lost too)."""
        lost = self.host
        if self._move is None or not lost:
            raise e
        self._lost.add(lost)
        plan = takeover(last or self.seed, lost, self._lost, self._rules)
        self.host, self.seed = plan.host.node_id if plan.host else "", plan.seed
        return plan

    def move(self, plan: Takeover) -> None:
        """Go to the store ``plan`` names (after the rendezvous forgot what the lost one said)."""
        assert self._move is not None
        self._move(plan.host)

    @property
    def can_move(self) -> bool:
        return self._move is not None

    def go_to(self, host: Head) -> None:
        """Go to the job's store, which ``host`` took over while this node's store at the endpoint was not the
        job's (a lost host started again with the job's command)."""
        assert self._move is not None
        self.host = host.node_id
        self._move(host)

    def restarted_empty(self, last: RoundRecord | None) -> None:
        """The store lost its history (a successor took over where it was): the next round to open there."""
        if last is not None and self._move is not None and self.host:
            why = f"the store restarted empty (its host {self.host} was lost)"
            self.seed = after_lost_store(last, self._rules, self.host, why)

    def seed_store(self, store: Store, keys: Keys, me: str) -> None:
        """In a store that took over: the next round opened (by whoever comes first), and its host named."""
        if self.seed is None:
            return
        seed, self.seed = self.seed, None
        store.compare_and_set(keys.round, encode_round(seed), 0)  # one survivor's stands
        if self.host == me:  # a seed comes only with a store that moved here
            store.put(keys.store_host, me.encode())
