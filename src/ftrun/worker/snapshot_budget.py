"""PURE: the snapshots' memory rule, in one place: how many files of a rank's size a node holds for each of its
ranks, what a rank keeps within its share of ``--snapshot-memory`` (:func:`keep_for`: fewer pins, then fewer
steps, before none), and which steps are pruned.

For each local rank a node holds, at most:

- its own newest :data:`KEEP` whole steps (the newest, and one to fall back to), and the one being written
  (written over the oldest pruned file, its *spare*);
- up to :data:`PINNED` older steps of its own, kept while the copies between nodes lag (the step the ring is
  copying, and the one before it, so that a copy lost on its way meets a step every survivor still has);
- in a job of several nodes, the copies of the previous node's rank it mirrors: its newest :data:`KEEP` steps
  and the one being received (its spare). Ranks of one job are assumed alike in size: the copies are counted
  at this rank's own size.

``ftrun.snapshot`` asks :func:`keep_for` (DCP's writer, :func:`need` at the full count); every pruner (the
worker, the agent, the mirror) asks :func:`to_prune` with what the rank keeps. Nothing here touches a file.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

KEEP = 2  # whole steps of a rank kept, its own and a peer's copies alike: the newest, and one to fall back to
PINNED = 2  # older steps of its own a node keeps while the copies between nodes lag


@dataclass(frozen=True, slots=True)
class Need:
    """What a step of ``size`` bytes asks of a rank's share."""

    files: int  # files of this size held at once
    bytes: int
    pinned: int  # of them, older own steps kept for the copies
    copies: bool  # of them, the previous node's rank's copies

    def says(self) -> str:
        """'4 files (the 2 kept, 1 older kept for the copies between nodes, and the one being written)'."""
        parts = [f"the {KEEP} kept"]
        if self.pinned:
            parts.append(f"{self.pinned} older kept for the copies between nodes")
        if self.copies:
            parts.append(f"{KEEP + 1} of the previous node's rank's copies")
        return f"{self.files} files ({', '.join(parts)}, and the one being written)"


def need(size: int, *, pinned: int, copies: bool) -> Need:
    """The files one rank's step of ``size`` needs held at once: its own kept, pinned and being written, and in
    a job of several nodes the copies it mirrors of the previous node's rank."""
    files = KEEP + 1 + min(pinned, PINNED) + (KEEP + 1 if copies else 0)
    return Need(files, files * size, min(pinned, PINNED), copies)


@dataclass(frozen=True, slots=True)
class Keep:
    """What a rank keeps under its share: its newest ``steps`` whole steps (in a job of several nodes, as many of
    the previous node's rank's copies), and at most ``pinned`` older ones of its own for the copies between
    nodes. Decided once for a step's size, before a file is made: the pins and the copies that come later are
    inside it, so that the share is a bound at every moment, not a check at the door."""

    steps: int
    pinned: int
    copies: bool

    @property
    def files(self) -> int:
        """Its own kept, pinned and being written; the copies kept and being received."""
        return self.steps + 1 + self.pinned + (self.steps + 1 if self.copies else 0)

    @property
    def full(self) -> bool:
        return self.steps == KEEP and (self.pinned == PINNED or not self.copies)

    def says(self) -> str:
        """'1 step and 1 older one for the copies between nodes (5 files)'."""
        older = f" and {self.pinned or 'no'} older one{'s' * (self.pinned != 1)} for the copies between nodes"
        return f"{self.steps} step{'s' * (self.steps != 1)}{older if self.copies else ''} ({self.files} files)"


def keep_for(share: int, size: int, *, copies: bool) -> Keep | None:
    """The most a rank keeps of steps of ``size`` bytes within ``share`` (0: no bound): fewer pins, then fewer
    steps, down to one step (with its copies) before none (None)."""
    tried = [(KEEP, PINNED), (KEEP, 1), (KEEP, 0), (1, 1), (1, 0)] if copies else [(KEEP, 0), (1, 0)]
    for steps, pinned in tried:
        keep = Keep(steps, pinned, copies)
        if not share or keep.files * size <= share:
            return keep
    return None


FULL = Keep(KEEP, PINNED, True)  # what a pruner keeps where no rank said otherwise


def to_prune(whole: Iterable[int], pinned: Collection[int] = (), keep: Keep = FULL) -> list[int]:
    """Of a rank's whole steps, those pruned, oldest first: all but the newest ``keep.steps``, less the newest
    ``keep.pinned`` of the pinned."""
    steps = sorted(whole)
    held = set(still_pinned(pinned, keep))
    return [s for s in steps[: max(0, len(steps) - keep.steps)] if s not in held]


def still_pinned(pinned: Iterable[int], keep: Keep = FULL) -> list[int]:
    """Of the steps pinned, the ones that stay pinned: the newest ``keep.pinned``."""
    return sorted(pinned)[-keep.pinned :] if keep.pinned else []
