"""A worker's process phase moves along its arrows only (procs.workers.ProcessPhase), and what the group reads
of it (released, finishing, reaped, status lost) follows from the phase alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrun.procs.logs import RankPaths
from ftrun.procs.workers import ProcessPhase, Worker


def worker(tmp_path: Path) -> Worker:
    return Worker(0, 0, 0, RankPaths.under(tmp_path, 0), ["python"], {})


def test_a_released_worker_stays_released_once_reaped(tmp_path: Path) -> None:
    w = worker(tmp_path)
    assert (w.released, w.reaped) == (False, False)
    w._move(ProcessPhase.FINISHING)
    assert (w.released, w.finishing, w.reaped) == (True, True, False)
    w._move(ProcessPhase.RELEASED)  # its teardown took too long: killed
    assert (w.released, w.finishing) == (True, False)
    w._move(ProcessPhase.RELEASED_REAPED)
    assert (w.released, w.reaped, w.status_lost) == (True, True, False)


def test_a_lost_status_is_reaped_and_not_released(tmp_path: Path) -> None:
    w = worker(tmp_path)
    w._move(ProcessPhase.STATUS_LOST)
    assert (w.reaped, w.released, w.status_lost) == (True, False, True)


@pytest.mark.parametrize(
    ("path", "wrong"),
    [
        ([ProcessPhase.REAPED], ProcessPhase.RELEASED),  # a reaped pid may be another process's: never released
        ([ProcessPhase.RELEASED], ProcessPhase.FINISHING),  # killed for good: never left to finish again
        ([ProcessPhase.RELEASED], ProcessPhase.REAPED),  # its status was known when it was released
        ([], ProcessPhase.RELEASED_REAPED),
    ],
)
def test_a_move_off_the_arrows_is_refused(tmp_path: Path, path: list[ProcessPhase], wrong: ProcessPhase) -> None:
    w = worker(tmp_path)
    for phase in path:
        w._move(phase)
    with pytest.raises(AssertionError, match=wrong.value):
        w._move(wrong)
