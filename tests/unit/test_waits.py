"""Whom a process's main thread waits for, read from /proc: real processes, each waiting one way."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from ftrun.monitor.waits import waiting_for

WAYS = {
    "its exit": "import subprocess; subprocess.run(['sleep', '30'])",
    "its output": "import subprocess; subprocess.check_output(['sleep', '30'])",
    "its output and errors": "import subprocess; subprocess.run('sleep 30', shell=True, capture_output=True)",
    "a thread's program": (
        "import subprocess, concurrent.futures as cf\n"
        "cf.ThreadPoolExecutor(1).submit(subprocess.run, ['sleep', '30']).result()\n"
    ),
    "a thread's sleep": (
        "import subprocess, time, concurrent.futures as cf\n"
        "p = subprocess.Popen(['sleep', '30'])\n"
        "cf.ThreadPoolExecutor(1).submit(time.sleep, 30).result()\n"
    ),
    "a helper's queue": (
        "import multiprocessing as mp, time\n"
        "def helper(q): time.sleep(30)\n"
        "if __name__ == '__main__':\n"
        "    mp.set_start_method('fork'); q = mp.Queue(); mp.Process(target=helper, args=(q,)).start(); q.get()\n"
    ),
    "a stopped program": "import subprocess; subprocess.run(['sh', '-c', 'kill -STOP $$; sleep 30'])",
    "nobody": "import os, time; os.fork() or time.sleep(30); time.sleep(30)",
}


@pytest.fixture
def waiting(request: pytest.FixtureRequest) -> Iterator[psutil.Process]:
    """A python process waiting ``request.param``'s way, once blocked with its child started."""
    proc = psutil.Popen([sys.executable, "-c", WAYS[request.param]])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with open(f"/proc/{proc.pid}/syscall") as f:
                blocked = f.read().split()[0].isdigit()
            if blocked and proc.children() and all(c.status() != psutil.STATUS_RUNNING for c in proc.children()):
                break
            time.sleep(0.05)
        time.sleep(0.2)  # a wait found blocked stays so (the child's exec, the stop, are done by now)
        yield proc
    finally:
        for p in [*proc.children(recursive=True), proc]:
            p.kill()
        proc.wait()


@pytest.mark.parametrize(
    "waiting", ["its exit", "its output", "its output and errors", "a thread's program"], indirect=True
)
def test_a_process_waiting_for_a_program_it_started_waits_for_that_program(waiting: psutil.Process) -> None:
    [child] = waiting.children()
    said = waiting_for(waiting.pid)
    assert said.startswith(f"the program it started (pid {child.pid}: "), said
    assert "sleep 30" in said


@pytest.mark.parametrize(
    "waiting", ["a helper's queue", "a stopped program", "a thread's sleep", "nobody"], indirect=True
)
def test_a_process_waiting_for_its_own_helper_or_a_program_that_cannot_run_waits_for_itself(
    waiting: psutil.Process,
) -> None:
    assert waiting_for(waiting.pid) == ""
