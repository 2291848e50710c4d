"""Every key a job writes in the store, in one place: all under ``/ftrun/<run id>/``, each concept in a part
of its own (tests/integration/test_keyspace.py checks that a real two-node run writes nowhere else)::

    rdzv/                      the rendezvous: rounds, leader, values, nodes, the store's host (records.Keys)
    status/<node>              each node's status record (ftrun status)
    hang/<round>/<node>        what each node found at a hang, failure/<round>/<node> at a failure (job.board)
    peers/<round>/<rank>       the ranks' peer heartbeat addresses; peer_key: their key (job.peer_relay)
    pace/<round>/<node>        the ranks' pace, for stragglers (job.pace_share)
    collectives/<round>/<node> the collectives the ranks wait in (job.collective_share)
    excluded/<host>            nodes excluded from the job (job.exclusions)
    exit/<node>                the exit barrier (job.exit_barrier)
    snapshots/<round>/<node>   the snapshot steps each node can restore; snapshot-decision/<round>/<node>: the
                               step they all restore (job.snapshot_agreement)
"""

from __future__ import annotations

PREFIXES = frozenset(
    {"rdzv", "status", "hang", "failure", "peers", "pace", "collectives", "excluded", "exit", "snapshots",
     "snapshot-decision"}
)  # fmt: skip
KEYS = frozenset({"peer_key"})


def root(run_id: str) -> str:
    return f"/ftrun/{run_id}/"


def prefix(run_id: str, part: str) -> str:
    """The prefix of one of the job's parts (a name in PREFIXES), ending in '/'."""
    if part not in PREFIXES:
        raise ValueError(f"{part!r} is not a part of the job's keyspace (ftrun.store.keyspace.PREFIXES)")
    return f"{root(run_id)}{part}/"


def key(run_id: str, name: str) -> str:
    """One of the job's single keys (a name in KEYS)."""
    if name not in KEYS:
        raise ValueError(f"{name!r} is not a key of the job's keyspace (ftrun.store.keyspace.KEYS)")
    return f"{root(run_id)}{name}"


def part_of(run_id: str, full_key: str) -> str | None:
    """The part ``full_key`` falls under (a prefix's or a key's name); None where it is outside the keyspace."""
    rest = full_key.removeprefix(root(run_id))
    if rest == full_key:
        return None
    head, slash, _ = rest.partition("/")
    return head if (slash and head in PREFIXES) or (not slash and head in KEYS) else None
