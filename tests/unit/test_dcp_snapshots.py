"""torch.distributed.checkpoint through ftrun's snapshots: under ftrun a save is each rank's snapshot part (its
whole state and the metadata to read it), a load reads the step the agent names once the part verifies; outside
ftrun both are torch's own, at the path given."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrun.worker import snapshot as snap
from ftrun.worker import snapshot_file as file

# In one process, without a process group (what DCP says it assumes then is what these tests want).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from ftrun.worker import dcp as ftrun_dcp  # noqa: E402 - needs torch
from ftrun.worker.dcp import SnapshotReader, SnapshotWriter  # noqa: E402


def state(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(64, 32).state_dict(), "step": torch.tensor(seed)}


def equal(a: dict[str, object], b: dict[str, object]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["model"].values(), b["model"].values(), strict=True))  # type: ignore[attr-defined]


def restored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, named: int) -> tuple[int | None, dict[str, object]]:
    """What a restart that the agent names step ``named`` for loads: the reader's step and the state."""
    monkeypatch.setenv(snap.ENV_RESTORE, str(named))
    into = state(0)
    reader = SnapshotReader(tmp_path / "ckpt")
    dcp.load(into, storage_reader=reader)
    return reader.step, into


@pytest.fixture
def in_ftrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shm = tmp_path / "shm"
    monkeypatch.setenv(snap.ENV_DIR, str(shm))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(snap.ENV_RESTORE, raising=False)
    monkeypatch.setattr(ftrun_dcp, "_said", False)  # said once per worker: each test is a worker
    return shm


def test_under_ftrun_a_save_is_a_snapshot_step_and_a_load_reads_it_verified(
    in_ftrun: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for step in (4, 5):
        dcp.save(state(step), storage_writer=SnapshotWriter(tmp_path / "ckpt", step))
    snap.wait()
    assert not (tmp_path / "ckpt").exists()  # in memory, not at the path
    assert file.whole_steps(in_ftrun, [0]) == {4, 5}
    _, part = snap.read(snap.path_of(in_ftrun, 5, 0))
    assert set(part) == {ftrun_dcp.WHOLE}  # the rank's whole state and the metadata to read it
    step, into = restored(tmp_path, monkeypatch, 5)
    assert step == 5
    assert equal(into, state(5))


def test_a_changed_byte_in_a_part_is_never_loaded(
    in_ftrun: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dcp.save(state(7), storage_writer=SnapshotWriter(tmp_path / "ckpt", 7))
    snap.wait()
    part = snap.path_of(in_ftrun, 7, 0)
    raw = bytearray(part.read_bytes())
    raw[len(raw) // 2] ^= 0x08
    part.write_bytes(raw)
    monkeypatch.setenv(snap.ENV_RESTORE, "7")
    with pytest.raises(snap.CorruptSnapshot, match="checksum"):
        SnapshotReader(tmp_path / "ckpt")
    assert (in_ftrun / "step-000000000007" / snap.BAD_MARK).exists()  # the next restart takes the step before


def test_outside_ftrun_both_are_torchs_own_at_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(snap.ENV_DIR, raising=False)
    dcp.save(state(3), storage_writer=SnapshotWriter(tmp_path / "ckpt", 3))
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    into = state(0)
    reader = SnapshotReader(tmp_path / "ckpt")
    dcp.load(into, storage_reader=reader)
    assert reader.step is None
    assert equal(into, state(3))


def test_async_save_takes_the_same_writer(in_ftrun: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dcp.async_save(state(6), storage_writer=SnapshotWriter(tmp_path / "ckpt", 6)).result(timeout=60)
    snap.wait()
    assert snap.is_whole(snap.path_of(in_ftrun, 6, 0))
    _, into = restored(tmp_path, monkeypatch, 6)
    assert equal(into, state(6))


def test_a_step_too_big_for_snapshot_memory_goes_to_the_path_said_once(
    in_ftrun: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Linear(64, 32): 8,320 bytes of tensors; three copies at once (two kept, one written) are 24,960 bytes."""
    monkeypatch.setenv(snap.ENV_MEMORY, "20000")
    for step in (8, 9):
        dcp.save(state(step), storage_writer=SnapshotWriter(tmp_path / "ckpt", step))
    assert (tmp_path / "ckpt" / ".metadata").is_file()  # the job's own checkpoint, as outside ftrun
    assert all(set(snap.read(p)[1]) == {ftrun_dcp.AT_PATH} for p in in_ftrun.glob("step-*/rank-*"))  # no state
    said = capfd.readouterr().err
    assert said.count("over a rank's share of --snapshot-memory") == 1, said  # said once, not every step
    assert "written to" in said
    step, into = restored(tmp_path, monkeypatch, 9)  # the step's part names the path: agreed on as any step
    assert step == 9
    assert equal(into, state(9))


def test_a_step_at_the_path_is_not_passed_over_for_an_older_one_in_memory(
    in_ftrun: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state that grows past --snapshot-memory: step 3 in memory, step 4 at the path. The agent names the newest
    step whole on every rank, 4, and the reader reads it from the path."""
    monkeypatch.setenv(snap.ENV_MEMORY, "30000")
    dcp.save(state(3), storage_writer=SnapshotWriter(tmp_path / "ckpt", 3))
    monkeypatch.setenv(snap.ENV_MEMORY, "20000")
    dcp.save(state(4), storage_writer=SnapshotWriter(tmp_path / "ckpt", 4))
    assert max(file.whole_steps(in_ftrun, [0])) == 4
    step, into = restored(tmp_path, monkeypatch, 4)
    assert (step, equal(into, state(4))) == (4, True)


def test_a_step_that_fits_stays_in_memory(in_ftrun: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(snap.ENV_MEMORY, str(30_000))  # above the three copies' 24,960 bytes
    dcp.save(state(2), storage_writer=SnapshotWriter(tmp_path / "ckpt", 2))
    snap.wait()
    assert snap.is_whole(snap.path_of(in_ftrun, 2, 0))
    assert not (tmp_path / "ckpt").exists()


def test_a_sharded_state_is_read_from_its_part_only_by_the_world_that_wrote_it(
    in_ftrun: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's part holds its own shards: in a world of another size they are not its shards any more."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    def part(rows_held: int, world: int) -> dict[str, object]:
        chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([rows_held, 4]))
        md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([8, 4]), [chunk])
        return {"metadata": Metadata({"w": md}), "items": {}, "world": world}

    monkeypatch.setenv("WORLD_SIZE", "4")
    assert ftrun_dcp._readable_here(part(8, 2), "ckpt")  # replicated (DDP): any world
    assert ftrun_dcp._readable_here(part(4, 4), "ckpt")  # sharded, the same world
    assert not ftrun_dcp._readable_here(part(4, 2), "ckpt")  # sharded, another world: the job's checkpoint


@pytest.mark.parametrize("kept", [True, False], ids=["one-planner", "a-planner-per-save"])
def test_dcps_plan_caching_is_taken_and_each_step_is_still_the_ranks_whole_state(
    in_ftrun: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kept: bool
) -> None:
    """DCP's plan caching sends a rank's plan once and then 'unchanged' (an empty plan) while it does not change:
    every step's part still holds the rank's whole state, and the step restored is the one saved."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    planner = DefaultSavePlanner(enable_plan_caching=True)
    for step in (4, 5, 6):
        into = planner if kept else DefaultSavePlanner(enable_plan_caching=True)
        dcp.save(state(step), storage_writer=SnapshotWriter(tmp_path / "ckpt", step), planner=into)
    snap.wait()
    assert not (tmp_path / "ckpt").exists()
    step, loaded = restored(tmp_path, monkeypatch, 6)
    assert (step, equal(loaded, state(6))) == (6, True)


def test_a_plan_cached_where_ftrun_cannot_forget_it_is_a_clear_error(
    in_ftrun: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch whose plan caches ftrun does not know: the second save names the flag to drop, no part half made."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    real = ftrun_dcp._PLAN_CACHES
    monkeypatch.setattr(ftrun_dcp, "_PLAN_CACHES", ())
    planner = DefaultSavePlanner(enable_plan_caching=True)
    try:
        dcp.save(state(1), storage_writer=SnapshotWriter(tmp_path / "ckpt", 1), planner=planner)
        with pytest.raises(BaseException, match="without enable_plan_caching"):  # DCP raises a BaseException
            dcp.save(state(2), storage_writer=SnapshotWriter(tmp_path / "ckpt", 2), planner=planner)
        snap.wait()
        assert file.whole_steps(in_ftrun, [0]) == {1}
    finally:  # torch's caches (class-level) as the next test expects them
        monkeypatch.setattr(ftrun_dcp, "_PLAN_CACHES", real)
        ftrun_dcp._plan_afresh_next_time(planner)
