"""ftrun.snapshot / restore in the worker: a snapshot file outlives its writer, is trusted only when whole and
its checksum matches, and the job's next optimizer step waits for the copy in flight."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from ftrun.worker import snapshot as snap

torch = pytest.importorskip("torch")


@pytest.fixture
def in_ftrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(snap.ENV_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv(snap.ENV_RESTORE, raising=False)
    return tmp_path


def state() -> dict[str, object]:
    torch.manual_seed(0)
    model = collections.OrderedDict(w=torch.randn(512, 1024), b=torch.randn(8), n=torch.tensor(5))
    model._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    return {"model": model, "step": 41, "rng": torch.get_rng_state(), "loader": (3, [7, 8]), "empty": torch.ones(0)}


def test_a_snapshot_restores_exactly_what_was_taken(in_ftrun: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = state()
    snap.snapshot(41, taken)
    snap.wait()
    monkeypatch.setenv(snap.ENV_RESTORE, "41")
    restored = snap.restore()
    assert restored is not None
    step, got = restored
    assert step == 41
    assert set(got) == set(taken)
    for key in ("w", "b", "n"):
        assert torch.equal(got["model"][key], taken["model"][key])  # type: ignore[index]
    assert got["model"]._metadata == {"": {"version": 2}}
    assert torch.equal(got["rng"], taken["rng"])
    assert (got["step"], got["loader"], got["empty"].shape) == (41, (3, [7, 8]), (0,))
    assert snap.path_of(in_ftrun, 41, 3).is_file()


def test_a_changed_byte_or_an_unfinished_write_is_never_trusted(in_ftrun: Path) -> None:
    snap.snapshot(7, state())
    snap.wait()
    path = snap.path_of(in_ftrun, 7, 3)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(raw)
    with pytest.raises(snap.CorruptSnapshot, match="checksum does not match"):
        snap.read(path)
    path.write_bytes(bytes(raw[:-8]) + bytes(8))  # the footer never written: its writer died
    with pytest.raises(snap.CorruptSnapshot, match="incomplete"):
        snap.read(path)


def test_a_byte_changed_in_any_chunk_of_a_big_snapshot_is_found(in_ftrun: Path) -> None:
    """A big file is checked chunk by chunk on several cores while its tensors are copied out: a change in the
    last chunk is found as surely as one in the head."""
    snap.snapshot(9, {"big": torch.arange(3 * snap.file.CHUNK // 4, dtype=torch.float32)})  # three chunks
    snap.wait()
    path = snap.path_of(in_ftrun, 9, 3)
    assert torch.equal(snap.read(path)[1]["big"], torch.arange(3 * snap.file.CHUNK // 4, dtype=torch.float32))
    good = path.read_bytes()
    for at in (20, len(good) // 2, len(good) - 200):
        raw = bytearray(good)
        raw[at] ^= 0x10
        path.write_bytes(raw)
        with pytest.raises(snap.CorruptSnapshot, match="checksum does not match"):
            snap.read(path)


def test_a_rank_keeps_two_steps_and_writes_the_oldest_file_again_never_whole_until_sealed(in_ftrun: Path) -> None:
    for step in (1, 2, 3):
        snap.snapshot(step, {"w": torch.full((1 << 18,), float(step))})
        snap.wait()
    assert sorted(p.name for p in in_ftrun.iterdir()) == ["spare-rank-3.snap", f"step-{2:012d}", f"step-{3:012d}"]
    spare = snap.file.spare_of(in_ftrun, 3)
    table = [("float32", (1 << 18,), 1 << 20)]
    planned = snap.file.begin(4, table, b"", snap.file.World(1, 3))
    view = planned.make(in_ftrun)  # the writer dies before it seals the file
    view.close()
    assert not spare.exists()
    assert not snap.is_whole(snap.path_of(in_ftrun, 4, 3))  # the old foot was wiped before the file moved
    assert snap.read(snap.path_of(in_ftrun, 3, 3))[1]["w"][0] == 3.0


def test_a_step_pinned_for_the_copies_between_nodes_is_kept_beyond_the_two_newest(
    in_ftrun: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(snap.ENV_COPIES, "1")  # a job of several nodes: the agent's mirror copies steps on
    for step in (1, 2):
        snap.snapshot(step, {"w": torch.full((1 << 10,), float(step))})
        snap.wait()
    (in_ftrun / snap.file.STEP_DIR.format(1) / snap.file.PIN_MARK).touch()  # the agent's mirror copies step 1
    for step in (3, 4):
        snap.snapshot(step, {"w": torch.full((1 << 10,), float(step))})
        snap.wait()
    assert sorted(p.name for p in in_ftrun.glob("step-*")) == [snap.file.STEP_DIR.format(s) for s in (1, 3, 4)]
    assert snap.read(snap.path_of(in_ftrun, 1, 3))[1]["w"][0] == 1.0


def test_a_restored_file_is_never_written_again_while_its_tensors_live(
    in_ftrun: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Restored tensors are on the file's pages (nothing copied): the worker's later snapshots never reuse that
    file, and the job's own writes to them never reach it."""
    for step in (1, 2):
        snap.snapshot(step, {"w": torch.full((1 << 18,), float(step))})
        snap.wait()
    monkeypatch.setenv(snap.ENV_RESTORE, "1")
    restored = snap.restore()
    assert restored is not None
    w = restored[1]["w"]
    w[:10] = -1.0  # the job's own write: a private copy of that page
    for step in (3, 4, 5):
        snap.snapshot(step, {"w": torch.full((1 << 18,), float(step))})
        snap.wait()
    assert (w[10:] == 1.0).all()
    assert (w[:10] == -1.0).all()


def test_a_snapshot_over_the_ranks_share_of_snapshot_memory_is_refused_once_and_said(
    in_ftrun: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(snap, "_writer", snap._Writer())
    monkeypatch.setenv(snap.ENV_MEMORY, str(3 << 20))  # 3 MiB: not even one kept 2 MiB file and the one written
    for step in (1, 2):
        snap.snapshot(step, {"w": torch.zeros(1 << 19)})
        snap.wait()
    said = capsys.readouterr().err
    assert said.count("ftrun.snapshot: no snapshots on rank 3") == 1, said
    assert "raise --snapshot-memory or snapshot less" in said
    assert not list(in_ftrun.glob("step-*"))
    monkeypatch.setenv(snap.ENV_MEMORY, str(8 << 20))
    snap.snapshot(3, {"w": torch.zeros(1 << 19)})
    snap.wait()
    assert snap.is_whole(snap.path_of(in_ftrun, 3, 3))


def test_a_share_too_small_for_two_steps_keeps_one_and_says_so_once(
    in_ftrun: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """5 MiB holds two 2 MiB files, not three: one step kept (and the one being written), said once."""
    monkeypatch.setattr(snap, "_writer", snap._Writer())
    monkeypatch.setenv(snap.ENV_MEMORY, str(5 << 20))
    for step in (1, 2, 3, 4):
        snap.snapshot(step, {"w": torch.zeros(1 << 19)})
        snap.wait()
        assert len(list(in_ftrun.glob("step-*/rank-3.snap"))) == 1  # one kept (the spare is the next write's)
    said = capsys.readouterr().err
    assert said.count("ftrun.snapshot: rank 3 keeps 1 step (2 files), not 2 steps (3 files)") == 1, said


def test_the_next_optimizer_step_waits_for_the_copy_and_changes_nothing_copied(in_ftrun: Path) -> None:
    """The big tensors are copied in the background; an optimizer step first waits for that copy."""
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    snap.snapshot(1, {"model": model.state_dict()})
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()  # waits, then changes the weights
    assert snap._writer.copied.is_set()  # the step's pre-hook waited for the copy (the checksum may still run)
    snap.wait()
    _, got = snap.read(snap.path_of(in_ftrun, 1, 3))
    assert all(torch.equal(got["model"][k], before[k]) for k in before)
    assert not torch.equal(model.weight, before["weight"])
    assert snap.blocked_s() >= 0.0


def test_outside_ftrun_both_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(snap.ENV_DIR, raising=False)
    snap.snapshot(1, {"w": torch.ones(3)})
    assert snap.restore() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu.py runs it on one)")
def test_gpu_tensors_are_copied_as_they_were_at_the_call_while_the_host_goes_on(in_ftrun: Path) -> None:
    """Big GPU tensors go through pinned memory on a stream of their own; the optimizer's step waits for that copy
    on the GPU, and a small tensor changed in place by the next forward (BatchNorm's statistics) keeps its value."""
    device = torch.device("cuda:0")
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(8, 1024, device=device)).sum().backward()
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    snap.snapshot(2, {"model": model.state_dict()})
    model(torch.randn(8, 1024, device=device)).sum().backward()  # changes BatchNorm's running statistics
    opt.step()  # the GPU waits for the copy, then the weights change
    torch.cuda.synchronize()
    snap.wait()
    _, got = snap.read(snap.path_of(in_ftrun, 2, 3))
    assert all(torch.equal(got["model"][k], before[k]) for k in before)
    assert not torch.equal(model[0].weight.cpu(), before["0.weight"])
    assert not torch.equal(model[1].running_mean.cpu(), before["1.running_mean"])


@pytest.mark.parametrize("replicated", [False, True])
def test_a_snapshot_of_another_worlds_size_is_restored_only_when_replicated(
    in_ftrun: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], replicated: bool
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    snap.snapshot(9, {"part": torch.full((4,), 7.0)}, replicated=replicated)
    snap.wait()
    assert snap.file.world_of(snap.path_of(in_ftrun, 9, 0)) == snap.file.World(2, 0, replicated)
    monkeypatch.setenv("WORLD_SIZE", "1")  # a node lost: rank 1's part is gone with it
    monkeypatch.setenv(snap.ENV_RESTORE, "9")
    restored = snap.restore()
    said = capsys.readouterr().err
    if replicated:
        assert restored is not None
        assert restored[0] == 9
        assert said == ""
    else:
        assert restored is None
        assert "step 9 was snapshotted in a world of 2 ranks, this one has 1: not restored" in said
    monkeypatch.setenv("WORLD_SIZE", "2")  # the same world: restored either way
    assert snap.restore() is not None


def test_an_interrupt_as_the_copy_starts_leaves_the_next_optimizer_step_free(
    in_ftrun: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ftrun's interrupt (an in-place restart) raised in the job's thread as the copy's thread was to start: no
    copy is in flight, so the next call's first optimizer step must not wait for one (it waited for good: a
    fifty-restart run hung so)."""
    from ftrun.worker.interrupt import RestartInPlace

    def interrupted(self: object) -> None:
        raise RestartInPlace("ftrun restarts the job in place")

    with monkeypatch.context() as m:
        m.setattr(snap.threading.Thread, "start", interrupted)
        with pytest.raises(RestartInPlace):
            snap.snapshot(41, state())
    assert snap._writer.copied.is_set()
    snap.snapshot(42, state())  # and the next one is taken as usual
    snap.wait()
    assert snap.path_of(in_ftrun, 42, 3).is_file()
