"""Who is where in a closed round: the roster (the leader's) and each member's place, in the store.

Closing a round, the leader names the close (a random ``roster_id``), writes the roster and every member's
place under that name (in chunks of about 128 members: a few puts, not one per member), and only then
compare-and-sets the round record: a node that sees the round closed finds its place already written, and a
close the leader lost (another wrote the round first) leaves keys under a name no round record carries, which
nobody reads. Each node reads the one chunk its id hashes to, once per round: one get of a bounded size,
whatever the job's size; only the leader reads the roster. A new close deletes the round before's keys.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from ftrun.errors import StoreError
from ftrun.rendezvous.records import (
    Assignment,
    Keys,
    Roster,
    RoundRecord,
    Status,
    chunk_count,
    chunk_of,
    chunked,
    decode_place,
    decode_roster,
    encode_places,
    encode_roster,
    encode_round,
)
from ftrun.store.base import Store

T = TypeVar("T")
Decode = Callable[[Callable[[bytes], T], str, bytes], T | None]  # the driver's: a bad record said once, ignored


class Places:
    def __init__(self, store: Store, keys: Keys, me: str, decode: Decode[object]) -> None:
        self._store = store
        self._keys = keys
        self._me = me
        self._decode = decode
        self.roster: Roster | None = None  # the leader's: the last closed round's
        self._mine: tuple[int, str, Assignment | None] | None = None  # (round, roster_id, my place or None)

    def forget(self) -> None:
        """A store that started afresh (a failover): nothing read from the old one stands."""
        self.roster, self._mine = None, None

    def mine(self, record: RoundRecord | None) -> Assignment | None:
        """My place in ``record``'s round (None: not a member, or the round is not closed): read once per round."""
        if record is None or record.status is Status.OPEN or not record.roster_id:
            return None
        if self._mine is None or self._mine[:2] != (record.round, record.roster_id):
            key = self._keys.places(record.round, record.roster_id, chunk_of(self._me, record.chunks))
            found = self._store.get(key)
            place = self._decode(lambda raw: decode_place(raw, self._me), key, found.value) if found else None
            self._mine = (record.round, record.roster_id, place if isinstance(place, Assignment) else None)
        return self._mine[2]

    def read_roster(self, record: RoundRecord | None) -> Roster | None:
        """The leader's roster of the close ``record`` names (its own round's, or the round before's when open),
        read when it has not read that one yet."""
        wanted = record.roster_id if record is not None else ""
        if wanted and (self.roster is None or self.roster.roster_id != wanted):
            key = self._keys.roster(wanted)
            found = self._store.get(key)
            roster = self._decode(decode_roster, key, found.value) if found is not None else None
            self.roster = roster if isinstance(roster, Roster) and roster.roster_id == wanted else None
        return self.roster

    def close(self, record: RoundRecord, roster: Roster, record_rev: int) -> tuple[bool, int, RoundRecord]:
        """Write the round's places, then compare-and-set the record closed; returns (won, revision, record)."""
        name = secrets.token_hex(6)
        roster, record = replace(roster, roster_id=name), replace(record, roster_id=name)
        self._store.put(self._keys.roster(name), encode_roster(roster))
        mine = None
        for chunk, places in chunked(roster, record.chunks).items():
            self._store.put(self._keys.places(roster.round, name, chunk), encode_places(roster.round, name, places))
            mine = places.get(self._me, mine)
        won, rev = self._store.compare_and_set(self._keys.round, encode_round(record), record_rev)
        if won:
            before, self.roster, self._mine = self.roster, roster, (record.round, name, mine)
            if before is not None:
                self._forget_close(before)
        return won, rev, record

    def _forget_close(self, old: Roster) -> None:
        """The round before's roster and places: nobody reads them once a new round closed (best effort: left
        behind, they are only unread keys)."""
        with contextlib.suppress(StoreError):
            for chunk in range(chunk_count(len(old.members))):
                self._store.delete(self._keys.places(old.round, old.roster_id, chunk))
            self._store.delete(self._keys.roster(old.roster_id))
