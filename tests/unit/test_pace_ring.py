"""The step-time ring in a worker's slot, written by the worker's client and read by the agent (layout only)."""

from __future__ import annotations

import struct

import pytest

from ftrun.worker import layout


def write(buf: bytearray, base: int, times: list[tuple[float, float]], start: int = 0) -> int:
    """As the client writes: each entry, then the count that shows it."""
    n = start
    for compute, step in times:
        layout.PACE.pack_into(buf, base + layout.pace_entry(n), compute, step)
        n += 1
        layout.PACED.pack_into(buf, base + layout.OFF_PACED, n)
    return n


def test_what_was_written_since_the_last_read_is_read_once() -> None:
    buf = bytearray(layout.slot_offset(2))
    base = layout.slot_offset(1)
    n = write(buf, base, [(0.25, 1.0), (0.5, 1.0)])
    seen, got = layout.read_pace(buf, base, 0)
    assert (seen, got) == (2, [(0.25, 1.0), (0.5, 1.0)])
    write(buf, base, [(0.75, 2.0)], start=n)
    assert layout.read_pace(buf, base, seen) == (3, [(0.75, 2.0)])
    assert layout.read_pace(buf, base, 3) == (3, [])


def test_a_reader_that_fell_behind_gets_the_ring_less_the_entry_that_may_be_rewritten() -> None:
    buf = bytearray(layout.slot_offset(1))
    times = [(float(i), 1.0) for i in range(layout.PACE_LEN * 3 + 5)]
    n = write(buf, 0, times)
    seen, got = layout.read_pace(buf, 0, 0)
    assert seen == n
    assert got == times[-(layout.PACE_LEN - 1) :]  # the oldest in the ring is the next one written over


def test_the_ring_and_the_timeouts_fit_the_slot() -> None:
    assert layout.OFF_PACE + layout.PACE_LEN * layout.PACE.size == layout.OFF_REQUEST_HEAD
    assert layout.TIMEOUTS_MAX >= 1024
    assert layout.read_pace(bytearray(layout.SLOT_SIZE), 0, 0) == (0, [])
    with pytest.raises(struct.error):  # a slot cut short is not read past its end
        layout.read_pace(bytearray(64), 0, 0)
