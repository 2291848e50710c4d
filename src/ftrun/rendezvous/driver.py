"""Runs the pure rules of :mod:`ftrun.rendezvous.state` against a real Store (the keys:
:mod:`ftrun.rendezvous.records`).

Every node watches ``r/`` (a few small keys: O(1) notifications per round) and reads its own place once per
round (:mod:`ftrun.rendezvous.places`); only the leader also watches ``n/`` and reads the roster. When the
leader's lease lapses its key vanishes, every node sees that on ``r/`` and one of them wins the
compare-and-set to lead.

The agent calls :meth:`Rendezvous.next` whenever something may have changed (a
store event made :meth:`fileno` readable, ``wake_at`` passed, its workers
exited). ``next`` applies the store's changes, asks the rules what to do,
carries out the store's part itself (register, close, reopen, complete) and
returns only what the agent must act on: run, stop, wait, finish or fail.
"""

from __future__ import annotations

import contextlib
import selectors
from collections.abc import Callable

from ftrun.clock import Clock
from ftrun.errors import (
    FtrunError,
    LeaseExpired,
    StoreConnectionLost,
    StoreError,
    StoreGone,
    StoreUnavailable,
    WatchLost,
)
from ftrun.rendezvous import state
from ftrun.rendezvous.failover import StoreFailover
from ftrun.rendezvous.jobs_store import JobsStore
from ftrun.rendezvous.lease import LeaseKeeper
from ftrun.rendezvous.liveness import Liveness, Watched
from ftrun.rendezvous.places import Places
from ftrun.rendezvous.records import (
    Head,
    Keys,
    LenientReader,
    NodeInfo,
    RoundRecord,
    Status,
    decode_head,
    decode_node,
    decode_round,
    encode_node,
    encode_round,
)
from ftrun.rendezvous.state import Action, Advice, Decision, Local, Me, Rules, Timing
from ftrun.rendezvous.values import JobValues
from ftrun.store.base import EventType, Store, Watch

RETRY_S = 1.0  # cut off from the store: how often to try again
MAX_STEPS = 10_000  # store actions in one next(); each is a compare-and-set won or a record changed


class Rendezvous:
    """One node's side of the rendezvous. Not thread-safe: the agent's main thread owns it."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        me: Me,
        rules: Rules,
        timing: Timing,
        *,
        clock: Clock,
        offer_port: Callable[[], int],
        log: Callable[[str], None],
        warn: Callable[[str], None] | None = None,
        move_store: Callable[[Head | None], None] | None = None,
        liveness: Liveness | None = None,
        renewals: Callable[[LeaseKeeper], None] | None = None,
    ) -> None:
        """``log``: how the rendezvous goes (--verbose); ``warn``: what a user must hear (default: ``log``);
        ``move_store``: host the store here or go to the successor (None: to the endpoint) when the host is gone;
        None: a store that cannot move (etcd's survives); ``renewals``: who renews the lease (default: a thread)."""
        self._renewals = renewals
        self._failover = StoreFailover(move_store, rules)
        # With a store whose leases outlive a dead agent by their TTL (etcd): the leader holds a connection to
        # every member, the others one to the leader; one that ends is a node gone (see rendezvous.liveness).
        self._watched = Watched(liveness, me.node_id) if liveness is not None else None
        self._store = store
        self._keys = Keys.of(run_id)
        self._me = me
        self._rules = rules
        self._timing = timing
        self._clock = clock
        self._offer_port = offer_port
        self._log = log
        self._warn = warn or log
        self._selector = selectors.DefaultSelector()
        self._keeper: LeaseKeeper | None = None
        self._shared_watch: Watch | None = None
        self._nodes_watch: Watch | None = None  # only while leading
        self._record: RoundRecord | None = None
        self._record_rev = 0
        self._leader: str | None = None
        self.values = JobValues(store, self._keys.values)  # job-wide values, merged by compare-and-set
        self._nodes: dict[str, NodeInfo] = {}
        self._registered: int | None = None
        self._changed_at = 0.0
        self._waiting_since = 0.0
        self._joined_wall = clock.wall()
        self._decode = LenientReader(self._warn)  # a record that is not ftrun's: said once, ignored
        self._places = Places(store, self._keys, me.node_id, self._decode)
        self._cut_off_since: float | None = None  # monotonic: since when store calls fail
        self._jobs_store = JobsStore(rules.join_timeout_s)  # this store is not the job's: the job's is there

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Rendezvous:
        now = self._clock.monotonic()
        self._changed_at = self._waiting_since = now
        self._new_lease()
        self._follow_shared()
        if self._watched is not None:
            self._selector.register(self._watched.liveness.fileno(), selectors.EVENT_READ)
        return self

    def fileno(self) -> int:
        """Readable when the store changed or the lease was lost (an epoll fd: nest it in any select)."""
        return self._selector.fileno()

    @property
    def node_id(self) -> str:
        return self._me.node_id

    def finished_with(self) -> int:
        """How many nodes the round the job finished in had, if this node was one of them (else 0)."""
        r = self._record
        if r is None or r.status is not Status.FINISHED or self._places.mine(r) is None:
            return 0
        return r.size

    @property
    def leading(self) -> bool:
        return self._nodes_watch is not None

    def close(self, *, leave: bool = True) -> None:
        """Stop renewing; with ``leave``, revoke the lease so the others see this node go at once."""
        self._stop_leading()
        if self._shared_watch is not None:
            self._unwatch(self._shared_watch)
            self._shared_watch = None
        if self._keeper is not None:
            with contextlib.suppress(KeyError):  # on the way out after an error, it may not be registered
                self._selector.unregister(self._keeper.fileno())
            self._keeper.close(revoke=leave)
            self._keeper = None
        self._selector.close()

    # --- the step --------------------------------------------------------------------------

    def next(self, local: Local) -> Advice:
        """Apply what changed, do the store's part of the rules, return what the agent must do.

        Cut off from the store, the node goes on as long as its lease may still hold, stops its workers when it
        may have lapsed (by its own clock: the others may form a round without it from then on), and keeps
        trying to reach the store, to rejoin as a newcomer, for up to the join timeout."""
        going_to = self._jobs_store.going_to  # set: this call is the first on the job's store, where it was sent
        try:
            advice = self._next(local)
        except StoreGone as e:
            return self._store_lost(local, e)
        except (StoreUnavailable, StoreConnectionLost) as e:
            return self._cut_off(local, e)
        if self._cut_off_since is not None:
            self._warn(
                f"rendezvous: the store answers again after {self._clock.monotonic() - self._cut_off_since:.1f} s"
            )
            self._cut_off_since = None
        self._jobs_store.answered(going_to)
        return advice

    def _cut_off(self, local: Local, e: StoreError) -> Advice:
        now = self._clock.monotonic()
        if self._cut_off_since is None:
            self._cut_off_since = now
            self._warn(f"rendezvous: cut off from the store ({e}); trying again every {RETRY_S:g} s")
        elif now - self._cut_off_since > self._rules.join_timeout_s:
            raise FtrunError(
                f"the store was unreachable for {now - self._cut_off_since:.0f} s, longer than join_timeout "
                f"({self._rules.join_timeout_s:g} s): {e}"
            ) from None
        self._notice_lost_lease(now)
        if local.running_round is not None and self._keeper is None:
            return Advice(self._fence(local.running_round), now)
        wake = now + RETRY_S if self._keeper is None else min(now + RETRY_S, self._keeper.fence_at)
        what = "my workers go on while my lease may hold" if local.running_round is not None else "waiting"
        return Advice(Decision(Action.WAIT, f"the store is unreachable: {what}", wake_at=wake), wake)

    def _store_lost(self, local: Local, e: StoreGone) -> Advice:
        """The store's host is gone (its machine refuses the connection: the agent died), in whatever state the
        rendezvous is: every survivor goes to the successor (:func:`succession.takeover`) and the job re-forms in
        the next round, the lost node counted as lost (a failure of the round, as any lost node)."""
        lost = self._failover.host
        going = self._jobs_store.going_to
        plan = self._failover.take_over(self._record, e)
        self._leave_this_store()
        now = self._clock.monotonic()
        if going is not None and lost == going.node_id:  # the job's store, where this node was sent, refused it
            advice, said = self._jobs_store.refused(now, f"{plan.why} ({e})")
            self._warn_once(said)
            self._failover.move(plan)
            return advice
        if plan.host is None:
            self._warn(f"rendezvous: {plan.why} ({e}); waiting for a store at the endpoint, as early nodes do")
        else:
            self._warn(f"rendezvous: the store's host {lost} is lost ({e}); {plan.host.node_id} takes over")
        self._failover.move(plan)
        if local.running_round is not None:
            running = f"my workers run in round {local.running_round}"
            stop = f"{running}, but {plan.why}: stopping them; the job re-forms there"
            return Advice(Decision(Action.STOP, stop, record=plan.seed), now)
        return Advice(Decision(Action.WAIT, plan.why, record=plan.seed, wake_at=now), now)

    def _go_to_the_jobs_store(self, local: Local) -> Advice:
        """This store is not the job's (:mod:`ftrun.rendezvous.jobs_store`): go there, join as a newcomer."""
        self._leave_this_store()
        head, advice, said = self._jobs_store.go(self._clock.monotonic(), local.running_round)
        self._warn_once(said)
        self._failover.go_to(head)
        return advice

    def _warn_once(self, said: str) -> None:
        if said:  # "" when it was said before
            self._warn(said)

    def _leave_this_store(self) -> None:
        """Before moving to another store: nothing read from this one, no lease, no watch on it is kept."""
        self._forget_watches()
        self._drop_lease()
        self._record, self._record_rev, self._leader = None, 0, None
        self._places.forget()

    def _fence(self, round_: int) -> Decision:
        return Decision(
            Action.STOP,
            f"my workers run in round {round_}, but my lease may have lapsed: stopping them (no two rounds train "
            "at once); this node rejoins as a newcomer once the store answers",
        )

    def _next(self, local: Local) -> Advice:
        for _ in range(MAX_STEPS):
            self._absorb()
            now = self._clock.monotonic()
            told = self._jobs_store.told
            if told is not None and self._failover.can_move:
                if self._jobs_store.pausing(now):
                    return self._jobs_store.wait(told, now)
                return self._go_to_the_jobs_store(local)
            if self._keeper is None:  # lost: the workers stop first; a new lease only for a node without any
                if local.running_round is not None:
                    return Advice(self._fence(local.running_round), now)
                self._new_lease()
                self._failover.seed_store(self._store, self._keys, self._me.node_id)
            decision = state.decide(self._view(local, now, self._nodes if self.leading else None), self._rules)
            if decision.action is Action.COUNT:
                listed, _ = self._list_nodes()
                decision = state.decide(self._view(local, now, listed), self._rules)
            try:
                if decision.action is Action.REGISTER:
                    self._register(decision.round)
                elif decision.action in (Action.CLOSE, Action.REOPEN, Action.COMPLETE, Action.ABORT):
                    assert decision.record is not None
                    self._write_round(decision)
                else:
                    return Advice(decision, self._wake_at(decision))
            except LeaseExpired as e:  # the store dropped my lease before my keeper knew: lost, as by my clock
                self._warn(f"rendezvous: {e}; my node key is gone")
                self._drop_lease()
        raise FtrunError(f"rendezvous did not settle after {MAX_STEPS} store actions; the store may be misbehaving")

    def _view(self, local: Local, now: float, nodes: dict[str, NodeInfo] | None) -> state.View:
        roster = self._places.read_roster(self._record) if nodes is not None else None
        return state.View(
            record=self._record,
            roster=roster,
            assignment=self._places.mine(self._record),
            nodes=nodes,
            me=self._me.node_id,
            registered=self._registered,
            now=now,
            changed_at=self._changed_at,
            waiting_since=self._waiting_since,
            running_round=local.running_round,
            local_failure=local.local_failure,
            job_done=local.job_done,
            stop_job=local.stop_job,
        )

    def _wake_at(self, decision: Decision) -> float:
        if self._keeper is None:
            return decision.wake_at if decision.wake_at is not None else self._clock.monotonic() + RETRY_S
        lease_check = self._keeper.fence_at
        return lease_check if decision.wake_at is None else min(decision.wake_at, lease_check)

    # --- store actions ---------------------------------------------------------------------

    def _register(self, round_: int) -> None:
        assert self._keeper is not None
        me = self._me
        info = NodeInfo(me.node_id, me.addr, me.nproc, self._offer_port(), round_, self._joined_wall, me.alive_port)
        self._store.put(self._keys.node(self._me.node_id), encode_node(info), lease=self._keeper.lease)
        self._registered = round_
        if self.leading:  # no need to wait for my own key to come back on the watch
            self._nodes[self._me.node_id] = info
            self._changed_at = self._clock.monotonic()
        self._log(f"rendezvous: registered for round {round_}")

    def _write_round(self, decision: Decision) -> None:
        record = decision.record
        assert record is not None
        if decision.roster is not None:  # closing: every member's place first
            won, rev, record = self._places.close(record, decision.roster, self._record_rev)
        else:
            won, rev = self._store.compare_and_set(self._keys.round, encode_round(record), self._record_rev)
        if won:
            self._set_record(record, rev)
            self._log(f"rendezvous: {decision.reason}")
            return
        current = self._store.get(self._keys.round)  # someone else moved first: read what they wrote
        if current is None:
            self._record, self._record_rev = None, 0
        else:
            self._apply_round(current.value, current.revision)

    # --- what the store says -----------------------------------------------------------------

    def _absorb(self) -> None:
        """Drain the watches and notice a lost lease; everything else is read from these."""
        self._notice_lost_lease(self._clock.monotonic())
        try:
            if self._shared_watch is None:  # it failed while the store was out of reach
                self._follow_shared()
            self._drain_shared()
            self._drain_nodes()
        except WatchLost as e:
            # The store lost its history (an embedded store restarted empty, or a successor took over where it
            # was): start from what it holds now, the next round opened there if nobody did yet.
            self._log(f"rendezvous: {e}; reading the store afresh")
            self._failover.restarted_empty(self._record)
            self._drop_lease()
            self._forget_watches()
            self._follow_shared()
        except (StoreUnavailable, StoreConnectionLost):
            self._forget_watches()  # a watch that failed while the store was out of reach is dead: follow afresh
            raise
        if self._leader is None and self._keeper is not None:
            self._try_to_lead()
        if self._watched is not None:
            self._check_liveness(self._watched)

    def _check_liveness(self, watched: Watched) -> None:
        """Remove the keys of the agents whose connection ended (the leader: members'; the others: the leader's
        and its leadership), and hold connections to the agents to watch now."""
        for node in watched.liveness.gone():
            self._warn(f"rendezvous: node {node} is gone (its agent's connection to this one ended)")
            if self.leading or node == self._leader:
                self._store.delete(self._keys.node(node))
            if node == self._leader and not self.leading:
                self._store.delete(self._keys.leader)
        watched.follow(self.leading, self._nodes, self._leader, self._read_node)

    def _read_node(self, node: str) -> NodeInfo | None:
        found = self._store.get(self._keys.node(node))
        return self._decode(decode_node, self._keys.node(node), found.value) if found else None

    def _forget_watches(self) -> None:
        self._stop_leading()
        if self._shared_watch is not None:
            self._unwatch(self._shared_watch)
            self._shared_watch = None

    def _notice_lost_lease(self, now: float) -> None:
        """By this node's clock: a lease that may have lapsed is dropped (the workers stop next: fencing)."""
        if self._keeper is not None and (lost := self._keeper.lost(now)):
            self._warn(f"rendezvous: {lost}; my node key is gone")
            self._drop_lease()

    def _drop_lease(self) -> None:
        """My lease is gone (or the store forgot it): no key, no leadership. No store call here: the workers
        stop first (fencing), and a node without workers asks for a new lease in :meth:`next`."""
        self._registered = None
        self._stop_leading()
        if self._keeper is not None:
            self._selector.unregister(self._keeper.fileno())
            self._keeper.close(revoke=False)
            self._keeper = None

    def _drain_shared(self) -> None:
        assert self._shared_watch is not None
        while (event := self._shared_watch.get(0)) is not None:
            self._apply_shared(event.key, event.value if event.type is EventType.PUT else None, event.revision)

    def _apply_shared(self, key: str, value: bytes | None, revision: int) -> None:
        if key == self._keys.round:
            if revision > self._record_rev:
                self._apply_round(value, revision)
        elif key == self._keys.moved_to and value is not None:
            self._jobs_store.told = self._decode(decode_head, key, value)
        elif key == self._keys.store_host:
            self._failover.host = "" if value is None else value.decode(errors="replace")
        elif key == self._keys.leader:
            self._leader = None if value is None else value.decode(errors="replace")
            if self._leader != self._me.node_id:
                self._stop_leading()
        elif key.startswith(self._keys.values):
            self.values.apply(key, value, revision)

    def _apply_round(self, value: bytes | None, revision: int) -> None:
        if value is None:
            self._set_record(None, 0)
        elif (record := self._decode(decode_round, self._keys.round, value)) is not None:
            self._set_record(record, revision)
        else:  # garbage over the round: the last good round stands, and the leader's next write replaces it
            self._record_rev = revision

    def _set_record(self, record: RoundRecord | None, revision: int) -> None:
        old = self._record
        self._record, self._record_rev = record, revision
        if record is not None and (old is None or old.round != record.round) and record.status is Status.OPEN:
            self._waiting_since = self._clock.monotonic()  # a new round: the join timeout counts from here

    def _drain_nodes(self) -> None:
        if self._nodes_watch is None:
            return
        changed = False
        while (event := self._nodes_watch.get(0)) is not None:
            node_id = event.key[len(self._keys.nodes) :]
            if event.type is EventType.DELETE:
                changed |= self._nodes.pop(node_id, None) is not None
            elif (info := self._decode(decode_node, event.key, event.value)) is not None:
                self._nodes[node_id] = info
                changed = True
        if changed:
            self._changed_at = self._clock.monotonic()

    def _follow_shared(self) -> None:
        kvs, rev = self._store.list_prefix(self._keys.shared)
        self._record, self._record_rev, self._leader = None, 0, None
        self._places.forget()
        self.values.clear()
        for kv in kvs:
            self._apply_shared(kv.key, kv.value, kv.revision)
        self._shared_watch = self._watch(self._keys.shared, rev + 1)

    def _try_to_lead(self) -> None:
        assert self._keeper is not None
        won, _ = self._store.compare_and_set(self._keys.leader, self._me.node_id.encode(), 0, lease=self._keeper.lease)
        if not won:
            return  # someone else leads; its key arrives on the shared watch
        self._leader = self._me.node_id
        self._nodes, rev = self._list_nodes()
        self._nodes_watch = self._watch(self._keys.nodes, rev + 1)
        self._changed_at = self._clock.monotonic()
        self._log(f"rendezvous: leading (watching {len(self._nodes)} node key(s))")

    def _stop_leading(self) -> None:
        if self._nodes_watch is not None:
            self._unwatch(self._nodes_watch)
            self._nodes_watch = None
            self._nodes = {}
        if self._leader == self._me.node_id:
            self._leader = None

    def _list_nodes(self) -> tuple[dict[str, NodeInfo], int]:
        """Every registered node, and the store revision of the read (to watch from)."""
        kvs, rev = self._store.list_prefix(self._keys.nodes)
        found = {kv.key[len(self._keys.nodes) :]: self._decode(decode_node, kv.key, kv.value) for kv in kvs}
        return {node: info for node, info in found.items() if info is not None}, rev

    def _new_lease(self) -> None:
        self._keeper = LeaseKeeper.grant(
            self._store,
            ttl_s=self._timing.ttl_s,
            interval_s=self._timing.keep_alive_interval_s,
            clock=self._clock,
        ).start(self._renewals)
        self._selector.register(self._keeper.fileno(), selectors.EVENT_READ)

    def _watch(self, prefix: str, start_revision: int) -> Watch:
        watch = self._store.watch(prefix, start_revision)
        self._selector.register(watch.fileno(), selectors.EVENT_READ)
        return watch

    def _unwatch(self, watch: Watch) -> None:
        self._selector.unregister(watch.fileno())
        watch.close()
