"""PURE: the layout of the monitor table, one fixed-size slot per local rank, and how a slot is parsed.

The table itself (the shared memory, the agent's reads) is :mod:`ftrun.monitor.table`;
the worker's writes are :mod:`ftrun.worker.client`.

Layout (little endian)::

    header   magic "FTRUNMON", version, slot count, slot size
    slot     seq        u64  odd while the worker rewrites its sections (a seqlock)
             pid        i64  0 until the worker's client attached
             attached   f64  CLOCK_MONOTONIC (shared by all processes) at attach
             last_beat  f64  0 before the first heartbeat
             beats      u64
             idle_since f64  when the last open section closed (0 before the first one did)
             open       u32  open sections
             flags      u32  FLAG_STACKS: the client dumps its stacks on STACK_SIGNAL;
                             FLAG_EXITING: the script ended, the interpreter is tearing down;
                             FLAG_MEETING: in init_process_group, meeting its peers (torch's store);
                             FLAG_RESTARTABLE: its function restarts in place (ftrun.restartable)
             t_seq      u64  bumped after the worker published timeouts (below)
             t_len      u32  length of that JSON
             ended      f64  when the script itself ended (its interpreter tears down next); 0 before
             end_code   i32  the exit code the script ended with
             first_beat f64  when the first heartbeat came (0 before it): the attempt's first step
             step       i64  the step the job last named (heartbeat(step=N)); -1: it never named one
             first_step i64  the step the first heartbeat named (-1: none), written before first_beat
                             (step and beats are two stores a reader can see apart: no resumed step from them)
             entries    MAX_OPEN x (start f64, name length u8, name)
             timeouts   JSON written by calculate_timeouts (rare: not on the hot path)
             c_seq      u64  the collectives' summary last written (ftrun.worker.collectives: once a second,
             c_len      u32  once the job met its peers), in buffer c_seq % 2
             collectives 2 x JSON: outside the seqlock (written by a thread of its own, which a main thread
                        that takes the GIL for good could stop mid-write: the slot must stay readable); the
                        next summary goes to the other buffer, then the head points to it in one store
             paced      u64  how many steps the worker has timed (below), bumped after each entry is written
             pace       PACE_LEN x (compute f32, step f32): a ring of the last steps' times, entry n at n % PACE_LEN
                        (compute: from the end of the previous optimizer step to the start of the backward pass;
                        step: from the end of the previous optimizer step to the end of this one)
             r_seq      u64  bumped after the worker wrote a workload control request (below);
             r_len      u32  in the last REQUEST_AREA bytes of the slot
             request    JSON (ftrun.worker.requests)

A reader copies a slot and keeps the copy only if ``seq`` was even and equal
before and after (on CPUs that may reorder stores, ARM, only once a second copy
is the same: :mod:`ftrun.monitor.table`). The heartbeat (last_beat, beats) is
written outside the seqlock: two aligned words, each read whole.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # collections.abc.Buffer from Python 3.12
    from typing_extensions import Buffer

MAGIC = b"FTRUNMON"
VERSION = 7
HEADER = struct.Struct("<8sIII")
HEADER_SIZE = 64
SLOT_SIZE = 8192
MAX_OPEN = 16  # sections open at once in one worker
NAME_MAX = 55  # bytes of a section name (UTF-8)
FLAG_STACKS = 1
FLAG_EXITING = 2  # the script has ended (atexit): its teardown is not a hang
FLAG_MEETING = 4  # in init_process_group until torch's store is made: waiting for the other ranks
FLAG_RESTARTABLE = 8  # its function restarts in place (ftrun.restartable): interrupted, not stopped

SEQ = struct.Struct("<Q")  # offset 0
IDENTITY = struct.Struct("<qd")  # pid, attached: offset 8
BEAT = struct.Struct("<dQ")  # last_beat, beats: offset 24
IDLE = struct.Struct("<dII")  # idle_since, open, flags: offset 40
TIMEOUTS_HEAD = struct.Struct("<QI")  # t_seq, t_len: offset 56
ENDED = struct.Struct("<di")  # ended, end_code: offset 72
FIRST_BEAT = struct.Struct("<d")  # offset 88
STEP = struct.Struct("<q")  # offset 96
FIRST_STEP = struct.Struct("<q")  # offset 104
ENTRY = struct.Struct(f"<dB{NAME_MAX}s")  # 64 bytes each, from offset 112
OFF_IDENTITY, OFF_BEAT, OFF_IDLE, OFF_TIMEOUTS_HEAD, OFF_ENDED = 8, 24, 40, 56, 72
OFF_FIRST_BEAT, OFF_STEP, OFF_FIRST_STEP, OFF_ENTRIES = 88, 96, 104, 112
OFF_TIMEOUTS = OFF_ENTRIES + MAX_OPEN * ENTRY.size
REQUEST_AREA = 512
REQUEST_HEAD = struct.Struct("<QI4x")  # r_seq, r_len
OFF_REQUEST_HEAD = SLOT_SIZE - REQUEST_AREA
OFF_REQUEST = OFF_REQUEST_HEAD + REQUEST_HEAD.size
REQUEST_MAX = SLOT_SIZE - OFF_REQUEST
PACE_LEN = 64  # steps: at a window's end the agent reads the last ones (a sample; the others were read before)
PACED = struct.Struct("<Q")
PACE = struct.Struct("<ff")
OFF_PACED = OFF_REQUEST_HEAD - PACED.size - PACE_LEN * PACE.size
OFF_PACE = OFF_PACED + PACED.size
COLLECTIVES_HEAD = struct.Struct("<QI4x")  # c_seq, c_len
COLLECTIVES_MAX = 1536  # bytes of one summary (a buffer)
OFF_COLLECTIVES_HEAD = OFF_PACED - COLLECTIVES_HEAD.size - 2 * COLLECTIVES_MAX
OFF_COLLECTIVES = OFF_COLLECTIVES_HEAD + COLLECTIVES_HEAD.size
TIMEOUTS_MAX = OFF_COLLECTIVES_HEAD - OFF_TIMEOUTS
_FIXED = struct.Struct("<Qqd" + "dQ" + "dII" + "QI" + "4x" + "di" + "4x" + "dqq")  # seq .. first_step, offsets as above


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
    ended: float = 0.0  # when the script ended (monotonic); 0: it has not
    end_code: int = 0
    request_seq: int = 0  # how many workload control requests the worker wrote
    request_json: bytes = b""  # the last one
    first_beat: float = 0.0  # monotonic: the first heartbeat; 0 before it
    step: int = -1  # the step the job last named; -1: none
    first_step: int = -1  # the step its first heartbeat named; -1: none
    collectives_seq: int = 0  # how many summaries of its collectives the worker wrote (0: none yet)
    collectives_json: bytes = b""  # the last one


class CorruptSlot(ValueError):
    """A slot that does not make sense (a stray write into the shared memory)."""


def slot_offset(index: int) -> int:
    return HEADER_SIZE + index * SLOT_SIZE


def parse_slot(raw: bytes) -> SlotView:
    fixed = _FIXED.unpack_from(raw)
    _seq, pid, attached, last_beat, beats, idle_since, open_, flags, t_seq, t_len, ended, code, *steps = fixed
    first, step, step0 = steps
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
    r_seq, r_len = REQUEST_HEAD.unpack_from(raw, OFF_REQUEST_HEAD)
    if r_len > REQUEST_MAX:
        raise CorruptSlot(f"a request of {r_len} bytes")
    request = bytes(raw[OFF_REQUEST : OFF_REQUEST + r_len])
    c_seq, c_len = COLLECTIVES_HEAD.unpack_from(raw, OFF_COLLECTIVES_HEAD)
    at = collectives_buffer(c_seq)
    collectives = bytes(raw[at : at + c_len]) if c_len <= COLLECTIVES_MAX else b""  # a head read mid-write
    return SlotView(
        pid, attached, last_beat, beats, idle_since, tuple(sections), flags, t_seq, timeouts, ended, code,
        r_seq, request, first, step, step0, c_seq, collectives,
    )  # fmt: skip


def collectives_buffer(seq: int) -> int:
    """Where in a slot the ``seq``-th summary of the collectives goes."""
    return OFF_COLLECTIVES + seq % 2 * COLLECTIVES_MAX


def pace_entry(n: int) -> int:
    """Where in a slot the ``n``-th step's times go."""
    return OFF_PACE + n % PACE_LEN * PACE.size


def read_pace(mapping: Buffer, base: int, since: int) -> tuple[int, list[tuple[float, float]]]:
    """The step times a worker wrote into the slot at ``base`` after the first ``since`` (those the ring still
    holds), and how many it wrote in all. Written outside the seqlock, like the heartbeat: an entry is complete
    once the count covers it, and one the worker may be overwriting while it is read (the count moved past it
    by the whole ring meanwhile) is dropped."""
    (paced,) = PACED.unpack_from(mapping, base + OFF_PACED)
    first = max(since, paced - PACE_LEN)
    entries = [PACE.unpack_from(mapping, base + pace_entry(n)) for n in range(first, paced)]
    (after,) = PACED.unpack_from(mapping, base + OFF_PACED)
    overwritten = max(0, after - PACE_LEN + 1 - first)  # entries the writer may have reached while we read
    return paced, entries[overwritten:]
