"""The monitor table: a shared-memory file with one fixed-size slot per local rank.

The agent creates it for each attempt; each worker maps it and writes only
its own slot, with plain stores into the mapping (no system call, no lock).
The agent reads every slot when it checks for hangs. Layout (little endian)::

    header   magic "FTRUNMON", version, slot count, slot size
    slot     seq        u64  odd while the worker rewrites its sections (a seqlock)
             pid        i64  0 until the worker's client attached
             attached   f64  CLOCK_MONOTONIC (shared by all processes) at attach
             last_beat  f64  0 before the first heartbeat
             beats      u64
             idle_since f64  when the last open section closed (0 before the first one did)
             open       u32  open sections
             flags      u32  FLAG_STACKS: the client dumps its stacks on STACK_SIGNAL;
                             FLAG_EXITING: the script ended, the interpreter is tearing down
             t_seq      u64  bumped after the worker published timeouts (below)
             t_len      u32  length of that JSON
             entries    MAX_OPEN x (start f64, name length u8, name)
             timeouts   JSON written by calculate_timeouts (rare: not on the hot path)

A reader copies a slot and keeps the copy only if ``seq`` was even and equal
before and after; x86 and ARM keep these stores in program order for another
process as long as each is one aligned word (the seq) written last.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"FTRUNMON"
VERSION = 1
HEADER = struct.Struct("<8sIII")
HEADER_SIZE = 64
SLOT_SIZE = 4096
MAX_OPEN = 16  # sections open at once in one worker
NAME_MAX = 55  # bytes of a section name (UTF-8)
FLAG_STACKS = 1
FLAG_EXITING = 2  # the script has ended (atexit): its teardown is not a hang
STACK_SIGNAL = signal.SIGRTMIN + 7  # rarely used by anything else; harmless unless the client registered it

SEQ = struct.Struct("<Q")  # offset 0
IDENTITY = struct.Struct("<qd")  # pid, attached: offset 8
BEAT = struct.Struct("<dQ")  # last_beat, beats: offset 24
IDLE = struct.Struct("<dII")  # idle_since, open, flags: offset 40
TIMEOUTS_HEAD = struct.Struct("<QI")  # t_seq, t_len: offset 56
ENTRY = struct.Struct(f"<dB{NAME_MAX}s")  # 64 bytes each, from offset 72
OFF_IDENTITY, OFF_BEAT, OFF_IDLE, OFF_TIMEOUTS_HEAD, OFF_ENTRIES = 8, 24, 40, 56, 72
OFF_TIMEOUTS = OFF_ENTRIES + MAX_OPEN * ENTRY.size
TIMEOUTS_MAX = SLOT_SIZE - OFF_TIMEOUTS
_FIXED = struct.Struct("<Qqd" + "dQ" + "dII" + "QI")  # seq .. t_len in one unpack, offsets as above


def _shm_dir() -> str:
    # mkstemp in it: a private, unpredictable name, so a shared /dev/shm is safe.
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()  # noqa: S108


@dataclass(frozen=True, slots=True)
class SlotView:
    """One consistent copy of a slot (plain data for the pure watchdog)."""

    pid: int
    attached: float
    last_beat: float
    beats: int
    idle_since: float
    sections: tuple[tuple[str, float], ...]  # (name, start), open ones only
    flags: int
    timeouts_seq: int
    timeouts_json: bytes


class CorruptSlot(ValueError):
    """A slot that does not make sense (a stray write into the shared memory)."""


def slot_offset(index: int) -> int:
    return HEADER_SIZE + index * SLOT_SIZE


class MonitorTable:
    """The agent's side: creates the file, reads slots, removes it at the end of the attempt."""

    def __init__(self, slots: int, *, tag: str = "") -> None:
        if slots < 1:
            raise ValueError("a monitor table needs at least one slot")
        self.slots = slots
        fd, name = tempfile.mkstemp(prefix=f"ftrun-monitor-{tag}-", dir=_shm_dir())
        self.path = Path(name)
        try:
            os.ftruncate(fd, HEADER_SIZE + slots * SLOT_SIZE)
            self._map = mmap.mmap(fd, HEADER_SIZE + slots * SLOT_SIZE)
        finally:
            os.close(fd)
        HEADER.pack_into(self._map, 0, MAGIC, VERSION, slots, SLOT_SIZE)

    def read(self, index: int, attempts: int = 100) -> SlotView:
        """A consistent copy of slot ``index``; raises CorruptSlot if it does not parse."""
        base = slot_offset(index)
        for _ in range(attempts):
            (before,) = SEQ.unpack_from(self._map, base)
            raw = self._map[base : base + SLOT_SIZE]
            (after,) = SEQ.unpack_from(self._map, base)
            if before == after and not before & 1:
                return parse_slot(raw)
        raise CorruptSlot(f"slot {index} kept changing (seq {before} -> {after}) or is stuck mid-write")

    def clear(self, index: int) -> None:
        """Zero a slot (a worker of a new attempt starts from nothing)."""
        base = slot_offset(index)
        self._map[base : base + SLOT_SIZE] = bytes(SLOT_SIZE)

    def close(self) -> None:
        self._map.close()
        self.path.unlink(missing_ok=True)


def parse_slot(raw: bytes) -> SlotView:
    _seq, pid, attached, last_beat, beats, idle_since, open_, flags, t_seq, t_len = _FIXED.unpack_from(raw)
    if not 0 <= open_ <= MAX_OPEN or not 0 <= t_len <= TIMEOUTS_MAX or pid < 0:
        raise CorruptSlot(f"impossible values (open sections {open_}, timeouts length {t_len}, pid {pid})")
    sections = []
    for i in range(MAX_OPEN):
        start, length, name = ENTRY.unpack_from(raw, OFF_ENTRIES + i * ENTRY.size)
        if length:
            if length > NAME_MAX:
                raise CorruptSlot(f"section entry {i} has a name of {length} bytes")
            sections.append((name[:length].decode("utf-8", errors="replace"), start))
    if len(sections) != open_:
        raise CorruptSlot(f"{open_} sections counted open but {len(sections)} entries in use")
    timeouts = bytes(raw[OFF_TIMEOUTS : OFF_TIMEOUTS + t_len])
    return SlotView(pid, attached, last_beat, beats, idle_since, tuple(sections), flags, t_seq, timeouts)


def check_header(mapping: mmap.mmap, slot: int) -> None:
    """The client's check that it mapped a table it understands; raises ValueError."""
    magic, version, slots, slot_size = HEADER.unpack_from(mapping, 0)
    if magic != MAGIC or version != VERSION or slot_size != SLOT_SIZE:
        raise ValueError(f"not an ftrun monitor table of version {VERSION}")
    if not 0 <= slot < slots:
        raise ValueError(f"slot {slot} is outside the table ({slots} slots)")
