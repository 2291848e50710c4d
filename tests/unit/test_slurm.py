"""Inside a SLURM job step, the rendezvous comes from SLURM's variables unless a flag or PET_* says otherwise."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ftrun.cli import main as cli
from ftrun.cli.slurm import expand_hostlist
from ftrun.errors import ConfigError

STEP = {
    "SLURM_JOB_ID": "4217",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NUM_NODES": "2",
}


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[07-09]", ["gpu07", "gpu08", "gpu09"]),
        ("gpu[1,3-4],login2", ["gpu1", "gpu3", "gpu4", "login2"]),
        ("a[8-10]b", ["a8b", "a9b", "a10b"]),
        ("rack1-n[001-002]", ["rack1-n001", "rack1-n002"]),
    ],
)
def test_a_compressed_host_list_is_expanded(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["", "gpu[1-", "gpu[a-b]", "gpu[3-1]", "gpu[1]x[2]"])
def test_a_host_list_that_is_not_one_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - every message names the part it could not read
        expand_hostlist(bad)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


def test_in_a_step_with_no_rendezvous_flag_slurm_decides_and_it_is_said(tmp_path: Path, script: Path) -> None:
    c = cli.parse(["train.py"], STEP, tmp_path)
    assert (c.nnodes.min, c.nnodes.max) == (2, 2)
    assert c.rdzv.backend == "c10d"
    assert c.rdzv.store is not None
    assert c.rdzv.store.endpoints == (("gpu07", 20000 + 4217),)
    assert c.rdzv.run_id == "4217"  # a requeued job keeps its id: the same run
    [said] = [n for n in c.notices if n.startswith("SLURM job 4217")]
    for source in ("SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST", "SLURM_JOB_ID", "this one number 1"):
        assert source in said


def test_flags_and_pet_variables_win_over_slurm(tmp_path: Path, script: Path) -> None:
    c = cli.parse(["--nnodes", "1", "--rdzv-id", "mine", "train.py"], STEP, tmp_path)
    assert (c.nnodes.max, c.rdzv.run_id) == (1, "mine")
    assert not [n for n in c.notices if n.startswith("SLURM")]
    c = cli.parse(["train.py"], {**STEP, "PET_NNODES": "1"}, tmp_path)
    assert c.nnodes.max == 1


def test_outside_a_step_nothing_is_taken_from_slurm(tmp_path: Path, script: Path) -> None:
    """The batch script itself has the job's variables but no step: one ftrun there is one node."""
    batch = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}
    c = cli.parse(["train.py"], batch, tmp_path)
    assert (c.nnodes.max, c.rdzv.backend) == (1, "static")


def test_a_step_node_list_that_cannot_be_read_is_named(tmp_path: Path, script: Path) -> None:
    with pytest.raises(ConfigError, match="SLURM_STEP_NODELIST: cannot read 'gpu\\[1-'"):
        cli.parse(["train.py"], {**STEP, "SLURM_STEP_NODELIST": "gpu[1-"}, tmp_path)


def test_in_a_step_slurms_warning_signals_are_only_said_unless_handled(tmp_path: Path, script: Path) -> None:
    """SLURM sends --signal=USR1@90 to every process of the step, the workers too: ftrun does not end the run."""
    assert cli.parse(["train.py"], STEP, tmp_path).warning_signals == {signal.SIGUSR1, signal.SIGUSR2}
    handled = cli.parse(["--signals-to-handle", "SIGTERM,SIGUSR1", "train.py"], STEP, tmp_path)
    assert handled.warning_signals == {signal.SIGUSR2}
    assert cli.parse(["train.py"], {}, tmp_path).warning_signals == frozenset()
