"""Who hosts the embedded store after its host is lost: decided alike by every survivor, with no store to ask.

Every agent knows the last round it saw (its first two members in group-rank order, and their addresses: the
round record's ``heads``) and which node hosted the store. The successor is the first member of that round, in
group-rank order, other than the lost host: each survivor computes the same answer from the same record, and
the clients find the new store at the successor's address on the endpoint's port. PURE.

Whether the survivors may fail over at all: only on proof that the host is gone, not merely unreachable. A
host whose machine refuses the connection (its kernel answers, nothing listens: the agent died) is gone; one
that does not answer may be partitioned and still serving the others, and a second store would split the job
in two. Without proof, a new round needs a majority of the last round's members (``may_reform``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ftrun.rendezvous.records import RoundRecord


@dataclass(frozen=True, slots=True)
class Successor:
    node_id: str
    addr: str  # the store is served there, on the endpoint's port


def successor(last: RoundRecord, lost_host: str) -> Successor | None:
    """The node that hosts the store after ``lost_host`` (the node id that hosted it), or None when the last
    round leaves nobody (it had no members, or only the lost host)."""
    for node, addr in last.heads:
        if node != lost_host:
            return Successor(node, addr)
    return None


def may_reform(last_members: tuple[str, ...], present: set[str], proven_gone: set[str]) -> bool:
    """Whether a new round may form with the nodes ``present`` after the store moved: a majority of the last
    round's members, where members proven gone (their machine refused the connection) no longer count. Two
    sides of a partition can never both have one."""
    electorate = [m for m in last_members if m not in proven_gone]
    if not electorate:
        return bool(present)
    return 2 * len(present & set(electorate)) > len(electorate)
