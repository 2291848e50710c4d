"""The node's own faults never end the job: a log disk that fills up while the job writes to it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import WAIT_S, ftrun_argv

CHATTY = """
import os, sys
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(150):
    print(f"rank {rank} step {step} " + "x" * 20_000, flush=True)  # 20 KB a step
    if attempt == 0 and rank == 1 and step == 100:
        raise RuntimeError("bad batch at step 100")
print(f"rank {rank} done", file=sys.stderr, flush=True)
"""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: the log directory fills up while the job runs."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_log_disk_ends_nothing(tmp_path: Path, small_disk: Path) -> None:
    """2 ranks print 20 KB a step onto a 2 MiB log disk; rank 1 raises at step 100. The workers are drained
    as before, the failure is reported and restarted, the job finishes, and ftrun says once what it could not
    write, with no traceback of its own."""
    (tmp_path / "w.py").write_text(CHATTY)
    argv = ftrun_argv(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py", logs=str(small_disk))
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=WAIT_S * 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("ftrun: cannot write ") == 1, r.stderr[-3000:]
    assert "No space left on device" in r.stderr
    assert "Exception in thread" not in r.stderr
    assert "ROOT CAUSE  rank 1" in r.stderr
    assert "RuntimeError: bad batch at step 100" in r.stderr  # the console has it
    assert "rank 0 done" in r.stderr
    assert "rank 1 done" in r.stderr
    assert "rank 0 step 149 " in r.stdout  # the last step of both ranks reached the console
    assert "rank 1 step 149 " in r.stdout
    assert "its logs lack " in r.stderr  # the report says what the rank's log files lack
