"""What passes between a worker and its agent besides the slot's data: the two signals, and the check that a
mapped table is one this client understands (the layout itself is :mod:`ftrun.worker.layout`)."""

from __future__ import annotations

import mmap
import signal

from ftrun.worker.layout import HEADER, MAGIC, SLOT_SIZE, VERSION

STACK_SIGNAL = signal.SIGRTMIN + 7  # rarely used by anything else; harmless unless the client registered it
REQUEST_SIGNAL = signal.SIGRTMIN + 6  # a worker wakes its agent with it after writing a workload request
INTERRUPT_SIGNAL = signal.SIGRTMIN + 5  # the agent interrupts a restartable rank's function (worker.in_place)


def check_header(mapping: mmap.mmap, slot: int) -> None:
    """The client's check that it mapped a table it understands; raises ValueError."""
    magic, version, slots, slot_size = HEADER.unpack_from(mapping, 0)
    if magic != MAGIC or version != VERSION or slot_size != SLOT_SIZE:
        raise ValueError(f"not an ftrun monitor table of version {VERSION}")
    if not 0 <= slot < slots:
        raise ValueError(f"slot {slot} is outside the table ({slots} slots)")
