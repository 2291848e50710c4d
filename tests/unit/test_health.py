"""Node health checks: users' commands (real processes), the built-ins against a fake NVML library and a fake
sysfs tree (this machine has no GPU), and a directory that cannot be written."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ftrun.errors import ConfigError
from ftrun.node.health import check_spec, gpus, nic_links, run_check


def test_a_command_that_exits_0_passes_and_one_that_does_not_fails_with_its_output() -> None:
    assert run_check("echo fine").healthy
    bad = run_check("echo 'disk /ckpt is full' >&2; exit 3")
    assert not bad.healthy
    assert bad.output == "disk /ckpt is full\n"
    assert bad.ended == "exit 3"
    assert bad.describe() == "health check \"echo 'disk /ckpt is full' >&2; exit 3\" failed: disk /ckpt is full"
    assert run_check("exit 4").describe() == "health check 'exit 4' failed: exit 4"


def test_a_command_that_does_not_answer_is_killed_with_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "child"
    slow = run_check(f"sleep 60 & echo $! > {pidfile}; wait", timeout_s=0.5)
    assert not slow.healthy
    assert slow.ended == "no answer within 0.5 s"
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10  # SIGKILL was sent to its group; the kernel takes a moment to end it
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(child)


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_builtins_are_checked_before_anything_starts() -> None:
    check_spec("./my-check.sh --fast")
    check_spec("builtin:gpu")
    check_spec("builtin:nic=eth0,ib0")
    with pytest.raises(ConfigError, match="no built-in check 'gpus'"):
        check_spec("builtin:gpus")
    with pytest.raises(ConfigError, match="builtin:writable needs a directory"):
        check_spec("builtin:writable")


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_nvml(
    *, gpus: int = 2, ecc: dict[int, int] | None = None, lost: set[int] | None = None, driver: bool = True
) -> Any:
    """A stand-in for nvidia-ml-py's ``pynvml`` with what the check calls."""
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if not driver:
            raise NVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED

    def memory(handle: int) -> object:
        if handle in (lost or set()):
            raise NVMLError(15)  # NVML_ERROR_GPU_IS_LOST
        return SimpleNamespace(total=80 << 30)

    def pending(handle: int) -> int:
        raise NVMLError(3)  # not supported on this GPU

    return SimpleNamespace(
        NVMLError=NVMLError, NVML_ERROR_NOT_SUPPORTED=3, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0,
        nvmlInit=init, nvmlShutdown=lambda: calls.append("shutdown"), nvmlDeviceGetCount=lambda: gpus,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetTotalEccErrors=lambda h, kind, counter: (ecc or {}).get(h, 0),
        nvmlDeviceGetRetiredPagesPendingStatus=pending, calls=calls,
    )  # fmt: skip


def test_gpus_healthy_sick_lost_and_absent() -> None:
    nvml = fake_nvml()
    assert gpus("", nvml) == (True, "2 GPU(s) healthy")
    assert nvml.calls == ["init", "shutdown"]
    healthy, said = gpus("", fake_nvml(gpus=4, ecc={2: 7}, lost={3}))
    assert not healthy
    assert said == (
        "GPU 2 has 7 uncorrectable ECC error(s) since the driver loaded; GPU 3 does not answer: NVML error 15"
    )
    healthy, said = gpus("", fake_nvml(driver=False))
    assert healthy
    assert said.startswith("nothing checked: no NVIDIA driver")


def test_nic_links_from_sysfs(tmp_path: Path) -> None:
    for name, state, device in [("lo", "unknown", False), ("eth0", "up", True), ("ib0", "down", True)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "operstate").write_text(f"{state}\n")
        if device:
            (tmp_path / name / "device").mkdir()
    assert nic_links("", tmp_path) == (False, "ib0: link down")  # every interface backed by a device
    assert nic_links("eth0", tmp_path) == (True, "link up: eth0")
    assert nic_links("eth0,eth9", tmp_path) == (False, "eth9: no such interface")


def test_a_directory_that_cannot_be_written(tmp_path: Path) -> None:
    good = run_check(f"builtin:writable={tmp_path}")
    assert good.healthy
    assert list(tmp_path.iterdir()) == []  # the probe is gone
    (tmp_path / "file").write_text("")
    bad = run_check(f"builtin:writable={tmp_path / 'file'}")
    assert not bad.healthy
    assert "cannot write in" in bad.output
