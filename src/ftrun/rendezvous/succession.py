"""Who hosts the embedded store after its host is lost: decided alike by every survivor, with no store to ask.

Every agent knows the last round it saw: its first members in group-rank order, their addresses and their
agents' listeners (the round record's ``heads``, carried on while the next round is open), and which node
hosted the store. The successor is the first of them other than the lost host: each survivor computes the
same answer from the same record, and the clients find the new store at the successor's address on the
endpoint's port. A successor lost during its takeover is passed over for the next, once proven dead. PURE.

Whether the survivors may fail over at all: only on proof that the host is gone, not merely unreachable. A
host whose machine refuses the connection (its kernel answers, nothing listens: the agent died) is gone; one
that does not answer may be partitioned and still serving the others, and a second store would split the job
in two. Without proof, a new round needs a majority of the last round's members (``may_reform``).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ftrun.rendezvous.records import Head, RoundRecord, Status
from ftrun.rendezvous.state import Rules, after_lost_store


def successor(last: RoundRecord, lost: Collection[str]) -> Head | None:
    """The node that hosts the store once the nodes ``lost`` (the host, and any successor lost since) are gone:
    the first of the last closed round's heads not among them; None when none is left (no round closed yet,
    or every head lost: the survivors wait for a store at the endpoint)."""
    return next((h for h in last.heads if h.node_id not in lost), None)


@dataclass(frozen=True, slots=True)
class Takeover:
    """What the survivors do once the store's host is lost: go to ``host`` (None: no successor is known, wait
    for a store at the endpoint as a node that starts early does) and open ``seed`` there."""

    host: Head | None
    seed: RoundRecord | None
    why: str


def takeover(last: RoundRecord | None, lost: str, lost_hosts: Collection[str], rules: Rules) -> Takeover:
    """``last``: the round record this node holds (open, closed, or the seed of a takeover under way whose
    successor is lost too); ``lost``: the host just lost; ``lost_hosts``: every host lost so far, it included."""
    found = successor(last, lost_hosts) if last is not None else None
    if last is None or found is None:
        return Takeover(None, None, f"the store's host {lost} was lost before any round closed: no successor is known")
    when = f"while round {last.round} was open" if last.status is Status.OPEN else f"in round {last.round}"
    why = f"the store's host {lost} was lost {when}; {found.node_id} hosts the store now"
    gone = sum(1 for h in last.heads if h.node_id in lost_hosts)
    return Takeover(found, after_lost_store(last, rules, lost, why, gone), why)


def may_reform(last_members: tuple[str, ...], present: set[str], proven_gone: set[str]) -> bool:
    """Whether a new round may form with the nodes ``present`` after the store moved: a majority of the last
    round's members, where members proven gone (their machine refused the connection) no longer count. Two
    sides of a partition can never both have one."""
    electorate = [m for m in last_members if m not in proven_gone]
    if not electorate:
        return bool(present)
    return 2 * len(present & set(electorate)) > len(electorate)
