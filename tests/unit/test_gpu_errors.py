"""CUDA and NCCL errors named from what ranks printed on an H200 (tests/fixtures/gpu/h200, bench/gpu_errors.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrun.observe.gpu_errors import BLOCKING, diagnose
from ftrun.observe.last_words import shown_tail

H200 = Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "h200"


def lines(case: str, rank: int) -> list[str]:
    return (H200 / case / f"rank{rank}.stderr").read_text().splitlines()


def test_a_device_side_assert_names_the_kernel_and_its_condition() -> None:
    found = diagnose(lines("device-assert", 1))
    assert found is not None
    assert found.kind == "device-assert"
    assert "IndexKernel.cu:111" in found.what
    assert "index out of bounds" in found.what
    assert found.hint is not None
    assert BLOCKING in found.hint


def test_an_illegal_address_says_to_rerun_with_launch_blocking() -> None:
    found = diagnose(lines("illegal-address", 1))
    assert found is not None
    assert found.kind == "illegal-address"
    assert found.hint is not None
    assert "CUDA_LAUNCH_BLOCKING=1" in found.hint
    assert not found.device_broken  # this process's context is gone, not the GPU


def test_out_of_memory_says_what_was_asked_and_what_was_free() -> None:
    found = diagnose(lines("out-of-memory", 1))
    assert found is not None
    assert found.kind == "out-of-memory"
    assert found.what == (
        "CUDA out of memory on GPU 0: asked for 147.80 GiB with 128.93 GiB free of 139.80 GiB "
        "(this process held 1.16 GiB)"
    )


def test_nccls_watchdog_timeout_names_the_collective() -> None:
    found = diagnose(lines("nccl-timeout", 0))
    assert found is not None
    assert found.kind == "nccl-timeout"
    assert "ALLREDUCE #11 (139792 elements)" in found.what
    assert "ran 10.1 s" in found.what
    assert "timeout of 10 s" in found.what
    assert diagnose(lines("nccl-timeout", 1)) is None  # only told to dump: nothing failed there


@pytest.mark.parametrize("case", ["device-assert", "illegal-address", "out-of-memory", "nccl-remote"])
def test_the_rank_that_waited_met_a_remote_error(case: str) -> None:
    found = diagnose(lines(case, 0))
    assert found is not None
    assert found.kind == "nccl-remote"
    assert "ALLREDUCE #11" in found.what
    assert "closed its connection" in found.what


def test_the_peer_is_named_when_nccl_says_it() -> None:
    text = ["NCCL error: remote process exited or there was a network error, NCCL version 2.28.9"]
    text += ["ncclRemoteError: A call failed", "Last error:"]
    text += ["socketProgress: Connection closed by remote peer h2<4063>"]
    found = diagnose(text)
    assert found is not None
    assert "a peer (h2<4063>) closed" in found.what


def test_a_broken_device_is_said_to_be() -> None:
    found = diagnose(["RuntimeError: CUDA error: uncorrectable ECC error encountered"])
    assert found is not None
    assert found.device_broken
    assert "nvidia-smi" in (found.hint or "")


def test_plain_python_errors_are_not_gpu_errors() -> None:
    assert diagnose(["Traceback (most recent call last):", "ValueError: CUDA is not the problem"]) is None


def test_the_traceback_is_shown_when_teardown_warnings_follow_it() -> None:
    text = lines("illegal-address", 1)
    shown = shown_tail(text, diagnose(text))
    assert shown[0].endswith("Traceback (most recent call last):")
    assert any("CUDA error: an illegal memory access was encountered" in line for line in shown)
    assert any("CUDA_LAUNCH_BLOCKING=1" in line for line in shown)  # torch's own words after it
    assert shown[-1].startswith("... and ")
    assert "more lines" in shown[-1]
    assert not any("CUDAEvent.h" in line for line in shown)  # the warnings of its teardown stay in the log
