"""PURE: the snapshots' memory rule, in one place: how many files of a rank's size a node holds for each of its
ranks, whether a step fits the rank's share of ``--snapshot-memory``, and which steps are pruned.

For each local rank a node holds, at most:

- its own newest :data:`KEEP` whole steps (the newest, and one to fall back to), and the one being written
  (written over the oldest pruned file, its *spare*);
- up to :data:`PINNED` older steps of its own, kept while the copies between nodes lag (the step the ring is
  copying, and the one before it, so that a copy lost on its way meets a step every survivor still has);
- in a job of several nodes, the copies of the previous node's rank it mirrors: its newest :data:`KEEP` steps
  and the one being received (its spare). Ranks of one job are assumed alike in size: the copies are counted
  at this rank's own size.

Every door (``ftrun.snapshot``, DCP's writer) asks :func:`fits`; every pruner (the worker, the agent, the
mirror) asks :func:`to_prune`. Nothing here touches a file.
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


def fits(share: int, size: int, *, pinned: int, copies: bool) -> bool:
    """Whether a step of ``size`` bytes fits a rank's ``share`` (0: no bound)."""
    return not share or need(size, pinned=pinned, copies=copies).bytes <= share


def to_prune(whole: Iterable[int], pinned: Collection[int] = ()) -> list[int]:
    """Of a rank's whole steps, those pruned, oldest first: all but the newest :data:`KEEP`, less the pinned."""
    steps = sorted(whole)
    return [s for s in steps[: max(0, len(steps) - KEEP)] if s not in pinned]


def still_pinned(pinned: Iterable[int]) -> list[int]:
    """Of the steps pinned, the ones that stay pinned: the newest :data:`PINNED`."""
    return sorted(pinned)[-PINNED:]
