"""The demo job really trains with torch DDP (gloo, CPU) and a crash loses nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.conftest import run_ftrun

pytestmark = pytest.mark.torch
DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py")
STEPS = ["--steps", "120", "--checkpoint-every", "10"]


def final_checksum(stdout: str) -> str:
    found = re.findall(r"final loss [0-9.]+ checksum ([0-9a-f]{16}) world 2", stdout)
    assert len(found) == 1, stdout
    return str(found[0])


@pytest.fixture(scope="module")
def clean_checksum(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("clean")
    r = run_ftrun(tmp, "--nproc-per-node", "2", DEMO, *STEPS, "--checkpoint-dir", str(tmp / "ckpt"))
    assert r.returncode == 0, r.stderr
    return final_checksum(r.stdout)


@pytest.mark.parametrize("fault", ["--crash-at", "--raise-at"])
def test_fault_mid_run_recovers_with_identical_weights(tmp_path: Path, clean_checksum: str, fault: str) -> None:
    r = run_ftrun(
        tmp_path, "--nproc-per-node", "2", "--max-restarts", "2", DEMO, *STEPS,
        "--checkpoint-dir", str(tmp_path / "ckpt"), fault, "55", "--crash-rank", "1",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "attempt 1: resumed from step 50" in r.stdout
    assert final_checksum(r.stdout) == clean_checksum
    root = r.report(0)["root_cause"]
    assert root["rank"] == 1  # type: ignore[index]
    if fault == "--crash-at":
        assert root["signal"] == "SIGKILL"  # type: ignore[index]
    else:
        assert "injected failure at step 55" in root["error"]["message"]  # type: ignore[index]
