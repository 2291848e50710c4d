"""A wait for a descriptor takes any descriptor number (select's FD_SETSIZE is 1,024)."""

from __future__ import annotations

import os
import resource

import pytest

from ftrun.worker.readable import wait_readable


def test_a_descriptor_numbered_past_1024_is_waited_for() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2048:
        pytest.skip(f"the hard file limit ({hard}) leaves no descriptor past 1,024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    read_end, write_end = os.pipe()
    high = os.dup2(read_end, 1500)
    try:
        assert not wait_readable(high, 0)
        os.write(write_end, b"x")
        assert wait_readable(high, 1.0)
        os.close(write_end)
        os.read(high, 1)
        assert wait_readable(high, None)  # hung up: readable (the read says end of file)
    finally:
        for fd in {read_end, high} | ({write_end} if _open(write_end) else set()):
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
