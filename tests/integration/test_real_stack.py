"""A pretraining job built as big runs build theirs (examples/pretrain_stack.py: FSDP2 on a 2-D DeviceMesh,
torch.compile, AdamW with a schedule, DCP with get_state_dict/set_state_dict, a stateful loader with worker
processes reading a `datasets` Arrow table), a script that never imports ftrun: a crash restarts warm, with
nothing the pool refuses, and the job resumes to the weights of a run that never failed, bit for bit; its main
under @ftrun.restartable (--restartable) restarts in place to the same weights."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import run_ftrun

pytest.importorskip("datasets")
pytest.importorskip("torchdata")
pytestmark = pytest.mark.torch

JOB = Path(__file__).resolve().parents[2] / "examples" / "pretrain_stack.py"
# aot_eager: torch.compile traces each block as with inductor, without inductor's C++ build (tens of seconds on
# 2 cores); bench/recovery.py --job stack measures the job with inductor.
ARGS = ["--steps", "20", "--ckpt-every", "5", "--compile-backend", "aot_eager"]


def checksum(output: str) -> str:
    # torchrun's workers write to one stdout as they please: the line may not be one of its own there
    found = re.findall(r"checksum ([0-9a-f]{16})", output)
    assert len(found) == 1, output
    return found[0]


@pytest.mark.slow
def test_the_real_stack_restarts_warm_and_in_place_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    (tmp_path / "clean").mkdir()
    clean = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(JOB),
         "--workdir", str(tmp_path / "clean"), *ARGS],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert clean.returncode == 0, clean.stderr[-3000:]
    (tmp_path / "crashed").mkdir()
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "2", str(JOB),
                  "--workdir", str(tmp_path / "crashed"), *ARGS, "--crash-at", "13", timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warm pool" not in r.stderr  # nothing refused (pyarrow's jemalloc thread included), nothing off
    assert [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1] == [True, True]
    assert "resumed from step 10" in r.stdout
    assert checksum(r.stdout) == checksum(clean.stdout)
    # Its training under @ftrun.restartable: rank 0 trains again in its process, rank 1 is new where it exited and
    # keeps its process too where it raised (both then remake FSDP2's blocks and run the code compiled before).
    for crash_by, kept in (("exit", {0: True, 1: False}), ("raise", {0: True, 1: True})):
        here = tmp_path / f"in-place-{crash_by}"  # its own logs and checkpoints
        here.mkdir()
        job = [str(JOB), "--restartable", "--workdir", str(here), *ARGS, "--crash-at", "13", "--crash-by", crash_by]
        r = run_ftrun(here, "--nproc-per-node", "2", "--max-restarts", "2", *job, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        again = {e["rank"]: e["in_place"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1}
        assert again == kept, again
        assert "resumed from step 10" in r.stdout
        assert checksum(r.stdout) == checksum(clean.stdout)
