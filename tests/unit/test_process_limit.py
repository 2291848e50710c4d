"""The process limit (RLIMIT_NPROC) as the kernel counts it: every thread of the user's real id."""

from __future__ import annotations

import os
from pathlib import Path

from ftrun.node import process_limit


def status(proc: Path, pid: int, uid: int, threads: int) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "status").write_text(f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nThreads:\t{threads}\n")


def test_every_thread_of_the_users_processes_counts(tmp_path: Path) -> None:
    status(tmp_path, 10, 1000, 4)
    status(tmp_path, 11, 1000, 1)
    status(tmp_path, 12, 0, 30)  # root's: not this user's
    (tmp_path / "self").mkdir()  # not a process
    assert process_limit.tasks_of(1000, tmp_path) == 5
    assert process_limit.tasks_of(2000, tmp_path) == 0


def test_an_agent_needs_a_task_per_worker_and_its_output_threads_besides_its_own() -> None:
    assert process_limit.tasks_needed(2) == process_limit.TASKS_OF_THE_AGENT + 6
    assert process_limit.said((40, 12)) == "this user runs 12 of its 40 processes and threads"


def test_root_is_never_held_to_it() -> None:
    if os.getuid() == 0:
        assert process_limit.room() is None  # the kernel exempts root: nothing to check, nothing refused
