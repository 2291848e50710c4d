"""Which exceptions end a restartable function's attempt in place, and which end its process (pure logic)."""

from __future__ import annotations

import os

import pytest

from ftrun.worker import in_place
from ftrun.worker.in_place import restarts_in_place, restarts_the_job
from ftrun.worker.interrupt import RestartInPlace


@pytest.mark.parametrize(
    "e",
    [
        RestartInPlace("ftrun restarts the job in place"),
        RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer"),
    ],
)
def test_the_jobs_restart_reaching_a_rank_is_not_its_failure(e: BaseException) -> None:
    assert restarts_the_job(e)


def test_an_exception_the_jobs_cleanup_raised_while_the_interrupt_went_through_it_is_not_its_failure() -> None:
    cleanup_failed = ValueError("a cleanup that failed")  # from a finally block the interrupt went through
    cleanup_failed.__context__ = RestartInPlace("ftrun restarts the job in place")
    assert restarts_the_job(cleanup_failed)
    assert not restarts_the_job(ValueError("bad batch"))


@pytest.mark.parametrize("e", [ValueError("bad batch"), RuntimeError("loss is nan"), KeyError("x"), OSError(5, "EIO")])
def test_a_ranks_own_exception_restarts_it_in_place(e: BaseException) -> None:
    assert not restarts_the_job(e)
    assert restarts_in_place(e)


@pytest.mark.parametrize(
    "e",
    [
        SystemExit(3),
        KeyboardInterrupt(),
        MemoryError(),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: device-side assert triggered"),
        RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`"),
    ],
)
def test_an_exit_or_an_exception_that_leaves_the_process_unfit_ends_it(e: BaseException) -> None:
    assert not restarts_the_job(e)
    assert not restarts_in_place(e)


@pytest.mark.parametrize(("given", "then"), [(None, "2"), ("1", "2"), ("3", "2"), ("0", "0"), ("2", "2")])
def test_nccls_watchdog_is_told_to_leave_a_restartable_ranks_process(
    given: str | None, then: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 and 3 (torch's default) end the process at a communicator's error; 2 aborts the communicators only. 0
    (no handling) is the job's choice, kept."""
    if given is None:
        monkeypatch.delenv(in_place.NCCL_ERROR_HANDLING, raising=False)
    else:
        monkeypatch.setenv(in_place.NCCL_ERROR_HANDLING, given)
    in_place._nccl_errors_leave_the_process()
    assert os.environ[in_place.NCCL_ERROR_HANDLING] == then
