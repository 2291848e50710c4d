"""Which snapshot step the nodes of a job restore: one step for every rank, or none.

Each node's agent offers, for the round, what it can give (:class:`Offer`): for each of its ranks the steps
whole there (its own files, or a peer's copies it holds: :mod:`ftrun.job.snapshot_mirror`), the other ranks'
steps it holds as a peer, and where its mirror listens. The node of group rank 0 waits for every node's offer,
takes the newest step every rank of the job can have, from its own node or from a node holding a copy (none
when a node did not offer in time), and publishes that with, for each rank whose node lacks it, the mirror to
fetch it from. Every node starts its workers with the decision. A node that hears no decision in time cannot
restore alone without perhaps leaving its ranks on another step than the others' (their weights would silently
differ): its workers' restore fails instead (``UNAGREED_STEP``), the round fails, and the next one agrees again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftrun.errors import StoreError
from ftrun.job.board import JobBoard

UNAGREED_STEP = -1  # a Decision's step when the nodes did not agree on one
STEPS_S = 10.0  # the decider waits this long for every node's offer (they start the round together)
DECISION_S = 20.0  # the others wait this long for its decision


@dataclass(frozen=True, slots=True)
class Offer:
    have: Mapping[int, set[int]]  # this node's ranks -> the steps whole here for each
    holds: Mapping[int, set[int]] = field(default_factory=dict)  # other ranks -> the steps it holds of theirs
    mirror: str | None = None  # where its mirror listens
    group_rank: int = 0
    replicated: Mapping[int, int] = field(default_factory=dict)  # a step whose state serves any rank -> a rank here

    def steps(self) -> set[int]:
        """The steps whole here for every one of this node's ranks."""
        sets = list(self.have.values())
        return set.intersection(*sets) if sets else set()

    def to_json(self) -> dict[str, Any]:
        return {
            "have": {str(r): sorted(s) for r, s in self.have.items()},
            "holds": {str(r): sorted(s) for r, s in self.holds.items()},
            "mirror": self.mirror,
            "group_rank": self.group_rank,
            "replicated": {str(step): rank for step, rank in self.replicated.items()},
        }


@dataclass(frozen=True, slots=True)
class Decision:
    step: int | None  # UNAGREED_STEP: the nodes did not agree
    # this node's ranks it lacks the step of -> the mirror to fetch it from, and whose file: the rank's own, or
    # (a state the job said serves any rank) another rank's
    fetch: Mapping[int, tuple[str, int]] = field(default_factory=dict)
    # every old rank's file of the step -> a mirror holding it (:func:`parts_of`), for a world that changed size
    parts: Mapping[int, str] = field(default_factory=dict)


def alone(offer: Offer) -> Decision:
    """A job of one node: the newest step whole on all its ranks."""
    return Decision(max(offer.steps(), default=None))


class RoundAgreement:
    """One round's restore for a job of several nodes, through the board."""

    def __init__(self, board: JobBoard, round_: int, nodes: int, group_rank: int, domain: str = "") -> None:
        self._board = board
        self._round = round_
        self._nodes = nodes
        self._group_rank = group_rank
        self._domain = domain  # --failure-domain

    def agree(self, offer: Offer) -> Decision:
        board, round_ = self._board, self._round
        try:
            board.publish_snapshot_offer(round_, {**offer.to_json(), "domain": self._domain})
            if self._group_rank == 0:
                offers = board.snapshot_offers(round_, self._nodes, STEPS_S)
                step, sources = decide(offers, self._nodes)
                parts = parts_of(offers, step) if step is not None else {}
                published = {str(r): list(a) for r, a in sources.items()}
                board.publish_snapshot_decision(
                    round_, {"step": step, "from": published, "parts": {str(r): m for r, m in parts.items()}}
                )
                return Decision(step, {r: a for r, a in sources.items() if r in offer.have}, parts)
        except StoreError:
            return Decision(UNAGREED_STEP)
        decision = board.snapshot_decision(round_, DECISION_S)
        if decision is None:
            return Decision(UNAGREED_STEP)
        chosen, wanted = decision.get("step"), decision.get("from")
        if not isinstance(chosen, int) or isinstance(chosen, bool):
            return Decision(None)
        wanted = wanted if isinstance(wanted, dict) else {}
        told = decision.get("parts")
        held_by = told if isinstance(told, dict) else {}
        return Decision(
            chosen,
            {int(r): a for r, raw in wanted.items() if (a := _source(raw)) and int(r) in offer.have},
            {int(r): m for r, m in held_by.items() if str(r).isdigit() and isinstance(m, str)},
        )

    def successor_mirror(self) -> str | None:
        """The mirror of the node after this one in the round's ring (:func:`ring`), once every node offered;
        None before, or alone."""
        offers = self._board.snapshot_offers(self._round, self._nodes, 0.0)
        order = ring(offers)
        if len(order) < self._nodes or self._group_rank not in order or self._nodes < 2:
            return None
        after = order[(order.index(self._group_rank) + 1) % len(order)]
        mirror = next((o.get("mirror") for o in offers if o.get("group_rank") == after), None)
        return mirror if isinstance(mirror, str) else None


def ring(offers: Sequence[Mapping[str, Any]]) -> list[int]:
    """PURE: the order the nodes copy their snapshots in (each to the next, the last to the first): by group
    rank, or, where they named failure domains, the nodes of each domain set apart, so that a node's copy lands
    in another domain wherever the domains' sizes allow (a domain lost whole leaves its copies on survivors)."""
    domains: dict[str, list[int]] = {}
    for offer in sorted(offers, key=lambda o: int(o.get("group_rank", 0))):
        domains.setdefault(str(offer.get("domain") or ""), []).append(int(offer.get("group_rank", 0)))
    if len(domains) < 2:
        return [rank for ranks in domains.values() for rank in ranks]
    # The biggest domain first, its nodes at every other place of the ring, then the rest in the places left:
    # no two neighbours share a domain unless one domain holds more than half the nodes.
    flat = [rank for ranks in sorted(domains.values(), key=len, reverse=True) for rank in ranks]
    half = (len(flat) + 1) // 2
    order = [0] * len(flat)
    order[0::2], order[1::2] = flat[:half], flat[half:]
    return order


def decide(offers: Sequence[Mapping[str, Any]], nodes: int) -> tuple[int | None, dict[int, tuple[str, int]]]:
    """PURE: the newest step every rank of the job can have (from its own node, fetched from a node holding a
    copy, or, for a state the job said serves any rank, another rank's file of it: a world that grew), and for
    each rank whose node lacks it the mirror to fetch it from and whose file; (None, {}) when a node did not
    offer or no step will do."""
    if len(offers) < nodes:
        return None, {}
    have: dict[int, set[int]] = {}
    holders = _holders(offers)
    shared: dict[int, tuple[str, int]] = {}  # step -> a mirror and a rank whose file of it serves any rank
    for offer in offers:
        have.update(_ranks(offer.get("have")))
        mirror = offer.get("mirror")
        if isinstance(mirror, str):
            for step, rank in _ranks_of(offer.get("replicated")).items():
                shared.setdefault(step, (mirror, rank))

    def source(rank: int, step: int) -> tuple[str, int] | None:
        """Where a rank's node fetches the step it lacks: its own file's copy, else a file that serves any rank."""
        return (holders[rank, step], rank) if (rank, step) in holders else shared.get(step)

    candidates = sorted({s for steps in have.values() for s in steps} | {s for _, s in holders}, reverse=True)
    for step in candidates:
        lacking = {rank: source(rank, step) for rank, steps in have.items() if step not in steps}
        if all(lacking.values()):
            return step, {rank: found for rank, found in lacking.items() if found is not None}
    return None, {}


def parts_of(offers: Sequence[Mapping[str, Any]], step: int) -> dict[int, str]:
    """PURE: every rank whose file of ``step`` a node holds (its own, or a copy of a lost node's), with a mirror
    holding it: what a node fetches where the world changed size, for a job that reshards the old ranks' parts
    itself (``ftrun.restore_parts``)."""
    return {rank: mirror for (rank, s), mirror in sorted(_holders(offers).items()) if s == step}


def _holders(offers: Sequence[Mapping[str, Any]]) -> dict[tuple[int, int], str]:
    """(rank, step) -> a mirror holding that rank's file of the step, its own or a copy."""
    holders: dict[tuple[int, int], str] = {}
    for offer in offers:
        mirror = offer.get("mirror")
        if isinstance(mirror, str):
            for rank, steps in [*_ranks(offer.get("holds")).items(), *_ranks(offer.get("have")).items()]:
                for step in steps:
                    holders.setdefault((rank, step), mirror)
    return holders


def _source(raw: object) -> tuple[str, int] | None:
    """A decision's [mirror, rank] as read from the store."""
    if isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], str) and isinstance(raw[1], int):
        return raw[0], raw[1]
    return None


def _ranks_of(raw: object) -> dict[int, int]:
    """An offer's {"step": rank} as read from another node (what does not parse is left out)."""
    if not isinstance(raw, dict):
        return {}
    return {int(s): r for s, r in raw.items() if str(s).isdigit() and isinstance(r, int) and not isinstance(r, bool)}


def _ranks(raw: object) -> dict[int, set[int]]:
    """An offer's {"rank": [steps]} as read from another node (what does not parse is left out)."""
    if not isinstance(raw, dict):
        return {}
    found: dict[int, set[int]] = {}
    for rank, steps in raw.items():
        if str(rank).isdigit() and isinstance(steps, list):
            found[int(rank)] = {s for s in steps if isinstance(s, int) and not isinstance(s, bool)}
    return found
