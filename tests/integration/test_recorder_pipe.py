"""Asking a rank's NCCL process group for its flight recorder through NCCL's debug pipe (a FIFO torch makes
and its monitor thread reads): a line when something reads it, nothing, and no wait, when nothing does."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ftrun.monitor.dumps import ask_flight_recorder, wait_for_file


def test_a_line_goes_to_the_reader_of_the_pipe(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe_3.pipe"
    os.mkfifo(pipe)
    fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # as NCCL's monitor holds it open
    try:
        assert ask_flight_recorder(pipe)
        assert os.read(fd, 16) == b"1\n"
    finally:
        os.close(fd)


def test_no_reader_no_pipe_or_not_a_pipe_is_no_and_never_blocks(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe_0.pipe"
    os.mkfifo(pipe)
    assert not ask_flight_recorder(pipe)  # gloo, or the group not made yet: nobody reads
    assert not ask_flight_recorder(tmp_path / "pipe_1.pipe")
    (tmp_path / "pipe_2.pipe").write_text("")
    assert not ask_flight_recorder(tmp_path / "pipe_2.pipe")


def test_the_dump_is_waited_for_within_a_bound(tmp_path: Path) -> None:
    dump = tmp_path / "rank_0"
    assert not wait_for_file(dump, bound_s=0.2)
    timer = threading.Timer(0.1, dump.write_bytes, args=(b"x",))
    timer.start()
    try:
        assert wait_for_file(dump, bound_s=10.0)
    finally:
        timer.cancel()
