"""The monitor table: a shared-memory file with one slot per local rank (layout: :mod:`ftrun.worker.layout`).

The agent creates it for each attempt as an anonymous memory file (memfd) and
gives the workers its path under ``/proc/<agent pid>/fd``: it vanishes with
the agent, however the agent ends, so nothing is ever left in ``/dev/shm``.
Each worker maps it and writes only its own slot, with plain stores into the
mapping (no system call; a lock only between the worker's own threads). The
agent reads every slot when it checks for hangs.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
from pathlib import Path

from ftrun.worker.layout import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    SEQ,
    SLOT_SIZE,
    VERSION,
    CorruptSlot,
    SlotView,
    parse_slot,
    read_pace,
    slot_offset,
)

# x86 keeps one process's stores in program order for every other (total store order): a copy taken between two
# equal even sequence numbers is whole. ARM (e.g. Grace nodes) and POWER may show another core the stores out of
# order, and Python has no memory barrier to stop it; there a copy is kept only once a second copy, taken after
# it (a 4 KiB copy in Python takes a microsecond or more, longer than a store buffer takes to drain), is byte for
# byte the same: a write in flight changes the bytes (its sequence number at least).
TOTAL_STORE_ORDER = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}


class MonitorTable:
    """The agent's side: creates the memory file, reads slots, releases it at the end of the attempt."""

    def __init__(self, slots: int, *, tag: str = "") -> None:
        if slots < 1:
            raise ValueError("a monitor table needs at least one slot")
        self.slots = slots
        size = HEADER_SIZE + slots * SLOT_SIZE
        # Close-on-exec: workers open it by path (a fork from the warm pool inherits no fd of the agent's).
        self._fd = os.memfd_create(f"ftrun-monitor-{tag}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size)
        except OSError:
            os.close(self._fd)
            raise
        self.path = Path(f"/proc/{os.getpid()}/fd/{self._fd}")
        HEADER.pack_into(self._map, 0, MAGIC, VERSION, slots, SLOT_SIZE)

    def read(self, index: int, attempts: int = 100, *, confirm: bool = not TOTAL_STORE_ORDER) -> SlotView:
        """A consistent copy of slot ``index``; raises CorruptSlot if it does not parse."""
        return read_slot(self._map, index, attempts, confirm=confirm)

    def pace(self, index: int, seen: int) -> tuple[int, list[tuple[float, float]]]:
        """Slot ``index``'s step times after the first ``seen``, and how many there were in all."""
        return read_pace(self._map, slot_offset(index), seen)

    def clear(self, index: int) -> None:
        """Zero a slot (a worker of a new attempt starts from nothing)."""
        base = slot_offset(index)
        self._map[base : base + SLOT_SIZE] = bytes(SLOT_SIZE)

    def close(self) -> None:
        """Release the table (again: nothing). Workers that still map it keep their pages; the file is
        gone with the last mapping."""
        if self._fd >= 0:
            self._map.close()
            os.close(self._fd)
            self._fd = -1


def read_slot(
    mapping: mmap.mmap, index: int, attempts: int = 100, *, confirm: bool = not TOTAL_STORE_ORDER
) -> SlotView:
    """A consistent copy of slot ``index`` of a mapped table (a seqlock read; ``confirm``: by a second copy, as
    weakly ordered CPUs need); raises CorruptSlot."""
    base = slot_offset(index)
    for _ in range(attempts * 10 if confirm else attempts):  # two copies must fall between writes: more tries
        (before,) = SEQ.unpack_from(mapping, base)
        raw = mapping[base : base + SLOT_SIZE]
        (after,) = SEQ.unpack_from(mapping, base)
        if before == after and not before & 1:
            if not confirm:
                return parse_slot(raw)
            if mapping[base : base + SLOT_SIZE] == raw:
                return parse_slot(raw)
    raise CorruptSlot(f"slot {index} kept changing (seq {before} -> {after}) or is stuck mid-write")


def read_live(path: str, indexes: list[int]) -> dict[int, SlotView]:
    """The slots ``indexes`` of the table at ``path`` (another process's: ``ftrun status``), read now; those
    that cannot be read are left out, and an unreadable table gives nothing (the agent may be gone)."""
    found: dict[int, SlotView] = {}
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapping:
            magic, version, slots, slot_size = HEADER.unpack_from(mapping, 0)
            if magic != MAGIC or version != VERSION or slot_size != SLOT_SIZE:
                return found
            for index in indexes:
                if 0 <= index < slots:
                    with contextlib.suppress(CorruptSlot):
                        found[index] = read_slot(mapping, index)
    except (OSError, ValueError):
        pass
    return found
