"""The agent's keeping of the workers' snapshots: which step a restart restores, what is pruned, what is freed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ftrun.agent import snapshots
from ftrun.agent.snapshots import Restore, SnapshotKeeper, restore_plan, whole_steps
from ftrun.job.snapshot_agreement import UNAGREED_STEP, Decision
from ftrun.worker.snapshot import BAD_MARK, ENV_COPIES, ENV_DIR, ENV_MEMORY, ENV_RANKS, ENV_RESTORE, path_of
from ftrun.worker.snapshot_file import FOOT

ALONE = restore_plan(1, None, None, 0)


def part(directory: Path, step: int, rank: int, whole: bool = True) -> None:
    path = path_of(directory, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * 64 + (FOOT.pack(0, b"DONE") if whole else bytes(FOOT.size)))


@pytest.fixture
def keeper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SnapshotKeeper:
    monkeypatch.setattr(snapshots, "SHARED_MEMORY", tmp_path)
    said: list[str] = []
    return SnapshotKeeper.open("train-1", said.append)


def test_a_restart_restores_the_newest_step_whole_on_every_rank_and_not_a_bad_one(keeper: SnapshotKeeper) -> None:
    for step in (3, 4, 5):
        part(keeper.dir, step, 0)
        part(keeper.dir, step, 1, whole=step != 5)  # rank 1 died writing step 5
    assert whole_steps(keeper.dir, [0, 1]) == {3, 4}
    keeper.new_attempt([0, 1], ALONE)
    assert keeper.env() == {
        ENV_DIR: str(keeper.dir),
        ENV_RESTORE: "4",
        ENV_MEMORY: str(1 << 30),
        ENV_COPIES: "0",
        ENV_RANKS: "0,1",
    }
    (keeper.dir / "step-000000000004" / BAD_MARK).touch()  # rank 1's part of step 4 did not verify
    keeper.new_attempt([0, 1], ALONE)
    assert keeper.env()[ENV_RESTORE] == "3"
    assert not (keeper.dir / "step-000000000004").exists()  # written again whole, it will count again
    keeper.new_attempt([0, 1], None)  # a static job of several nodes: nothing to agree through, none restored
    assert ENV_RESTORE not in keeper.env()
    keeper.new_attempt([0, 1], Restore(lambda offer: Decision(UNAGREED_STEP)))  # not agreed: the workers' restore fails
    assert keeper.env()[ENV_RESTORE] == "unagreed"


def test_a_step_restored_twice_and_failed_after_each_time_is_given_up_then_the_one_before(
    keeper: SnapshotKeeper,
) -> None:
    """A NaN in the state fails every attempt that restores it: after two, the step before; after two of that,
    none (the job's own checkpoint)."""
    for step in (7, 8):
        part(keeper.dir, step, 0)
    restored = []
    for _ in range(5):  # each attempt fails before a newer snapshot is whole
        keeper.new_attempt([0], ALONE)
        restored.append(keeper.env().get(ENV_RESTORE))
    assert restored == ["8", "8", "7", "7", None]
    part(keeper.dir, 9, 0)  # progress: a newer step is whole again
    keeper.new_attempt([0], ALONE)
    assert keeper.env()[ENV_RESTORE] == "9"


def test_older_whole_steps_are_pruned_and_everything_freed_at_the_end(keeper: SnapshotKeeper) -> None:
    for step in range(5):
        part(keeper.dir, step, 0)
    keeper.new_attempt([0], ALONE)
    assert whole_steps(keeper.dir, [0]) == {3, 4}
    keeper.close()
    assert not keeper.dir.exists()


def test_the_snapshots_of_an_agent_that_died_are_removed_by_the_next(tmp_path: Path, keeper: SnapshotKeeper) -> None:
    dead = int(Path("/proc/sys/kernel/pid_max").read_text())  # the kernel never gives a process this one
    stale = keeper.dir.parent / f"{dead}-train-0-abc"
    stale.mkdir()
    SnapshotKeeper.open("train-2", lambda said: None)
    assert not stale.exists()
    assert keeper.dir.exists()  # this agent (alive) keeps its own
    assert keeper.dir.name.startswith(f"{os.getpid()}-train-1-")
