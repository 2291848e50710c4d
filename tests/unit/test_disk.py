"""ftrun's writes to a disk that fails: dropped and counted, the end of what was dropped kept for the report."""

from __future__ import annotations

import os
from pathlib import Path

from ftrun.procs import disk


def test_what_a_failing_file_could_not_take_is_counted_and_its_end_kept_until_it_takes_writes_again(
    tmp_path: Path,
) -> None:
    path = tmp_path / "stderr.log"
    path.write_bytes(b"")
    failing = os.open(path, os.O_RDONLY)  # every write fails (EBADF), as on a full disk
    try:
        assert not disk.write_all(failing, b"x" * (disk.TAIL_BYTES + 10), str(path))
        assert not disk.write_all(failing, b"RuntimeError: bad batch\n", str(path))
        assert disk.lost_from(str(path)) == disk.TAIL_BYTES + 10 + 24
        tail = disk.unwritten_tail(str(path))
        assert len(tail) == disk.TAIL_BYTES
        assert tail.endswith(b"RuntimeError: bad batch\n")
    finally:
        os.close(failing)
    working = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        assert disk.write_all(working, b"later\n", str(path))
    finally:
        os.close(working)
    assert disk.unwritten_tail(str(path)) == b""  # the file has the newest lines again
    assert path.read_bytes() == b"later\n"


def test_the_unwritten_ends_kept_are_bounded_whatever_the_number_of_files(tmp_path: Path) -> None:
    failing = os.open(tmp_path, os.O_RDONLY)  # a directory: every write fails
    try:
        for n in range(disk.TAILS + 10):
            disk.write_all(failing, b"line\n", str(tmp_path / f"f{n}"))
    finally:
        os.close(failing)
    assert disk.unwritten_tail(str(tmp_path / "f0")) == b""  # the oldest went first
    assert disk.unwritten_tail(str(tmp_path / f"f{disk.TAILS + 9}")) == b"line\n"
