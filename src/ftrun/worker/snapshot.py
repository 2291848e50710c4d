"""In-memory snapshots of the job's state, written where the worker's death does not free them.

``ftrun.snapshot(step, state)`` takes the state the job already has (model and optimizer state dicts, the step,
the data position, RNG states: any picklable structure whose big parts are CPU tensors) and writes it into a
file of its own under the directory the agent gives (``FTRUN_SNAPSHOT_DIR``, in shared memory: the file
outlives the worker, the agent keeps and prunes it). The copy is cheap where it has to be: tensors under
:data:`AT_ONCE_BYTES` (BatchNorm's running statistics, which a forward pass changes in place) are copied at the
call; the big ones by a thread of its own while the job goes on, and the job's next optimizer step, the first
thing that changes them, waits for that copy to end (torch's global optimizer step pre-hook). Only that wait
and the small copies block the job (:func:`blocked_s`).

A snapshot is complete once its checksums (CRC-32C, per chunk) are written last; ``restore()`` reads
the step the agent names (``FTRUN_RESTORE_STEP``: the newest complete on every rank) and verifies it before it
trusts it. Outside ftrun both do nothing: ``snapshot`` returns at once, ``restore`` returns None, and the job
loads its own checkpoint.
"""

from __future__ import annotations

import contextlib
import importlib
import mmap
import os
import pickle
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftrun.worker import client, in_place
from ftrun.worker import snapshot_budget as budget
from ftrun.worker import snapshot_file as file
from ftrun.worker.snapshot_file import BAD_MARK, CorruptSnapshot, is_whole, path_of

__all__ = ["CorruptSnapshot", "Parts", "blocked_s", "restore", "restore_parts", "snapshot", "wait"]

ENV_DIR = "FTRUN_SNAPSHOT_DIR"
ENV_RESTORE = "FTRUN_RESTORE_STEP"
ENV_MEMORY = "FTRUN_SNAPSHOT_MEMORY"  # bytes this rank's files may take: its share of --snapshot-memory
RESTORE_UNAGREED = "unagreed"  # in ENV_RESTORE: the nodes did not agree on a step (ftrun.job.snapshot_agreement)
ENV_RANKS = "FTRUN_SNAPSHOT_RANKS"  # this attempt's ranks on this node: the files of any other are an old world's
ENV_COPIES = "FTRUN_SNAPSHOT_COPIES"  # "1": the job has several nodes, and this node holds its predecessor's copies
AT_ONCE_BYTES = 1 << 20


class _Writer:
    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.copied = threading.Event()  # the CPU tensors of the snapshot in flight are in the file
        self.copied.set()
        self.gpu_copied: list[tuple[Any, Any]] = []  # (device, CUDA event): its GPU tensors are in pinned memory
        self.pinned: Any = None  # the staging buffer, kept from one snapshot to the next
        self.streams: dict[Any, Any] = {}  # device -> the copies' stream
        self.restored: set[Path] = set()  # files whose pages restored tensors are on
        self.refused = False  # a snapshot did not fit --snapshot-memory (said once)
        self.keep: budget.Keep | None = None  # what this rank keeps within its share, as decided last
        self.no_room = False  # /dev/shm had no room for a snapshot (said once)
        self.error: BaseException | None = None
        self.blocked_s = 0.0
        self.hooked = False

    def wait(self) -> None:
        """Until the snapshot in flight is written (the next snapshot, the end of a job)."""
        if self.thread is not None:
            started = time.perf_counter()
            self.thread.join()
            self.thread = None
            self.blocked_s += time.perf_counter() - started
        self._raise()

    def before_step(self, torch: Any) -> None:
        """The job's optimizer is about to change its tensors: the CPU ones wait for their copy on the host, the
        GPU ones on the GPU (the job's stream waits for the copies' event; the host goes on)."""
        if not self.copied.is_set():
            started = time.perf_counter()
            self.copied.wait()
            self.blocked_s += time.perf_counter() - started
        for device, event in self.gpu_copied:
            torch.cuda.current_stream(device).wait_event(event)
        self.gpu_copied = []
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"ftrun.snapshot: the last snapshot could not be written: {error!r}") from error


_writer = _Writer()


def snapshot(step: int, state: Mapping[str, Any], *, replicated: bool = False) -> None:
    """Snapshot ``state`` at ``step`` (see the module's doc); outside ftrun, nothing. ``replicated``: the state
    does not depend on the world (DDP's replicated model and optimizer, no per-rank data position or RNG): any
    rank's part serves a world of another size. By default a snapshot is restored only in a world of its size."""
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return
    _writer.wait()  # one in flight at a time
    started = time.perf_counter()
    name_step(step + 1)
    torch = sys.modules["torch"]
    tensors: list[Any] = []
    skeleton = pickle.dumps(file.strip(state, tensors, torch), protocol=pickle.HIGHEST_PROTOCOL)
    table = [(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size()) for t in tensors]
    planned = file.begin(step, table, skeleton, _world(replicated))
    if not _fits(step, planned.size):
        _writer.blocked_s += time.perf_counter() - started
        return
    try:
        view = planned.make(Path(directory))
    except OSError as e:  # /dev/shm full (or smaller than --snapshot-memory): this step is not snapshotted
        _no_room(step, planned.size, e)
        _writer.blocked_s += time.perf_counter() - started
        return
    offsets, data_end = planned.offsets, planned.data_end
    late, on_gpu = [], []
    for t, at, (_, _, nbytes) in zip(tensors, offsets, table, strict=True):
        if t.is_cuda:
            on_gpu.append((t, at, nbytes))
        elif nbytes < AT_ONCE_BYTES:
            _copy(view, at, t, nbytes, torch)  # small, and perhaps changed by the next forward: now
        else:
            late.append((t, at, nbytes))
    staged = _stage(on_gpu, torch) if on_gpu else _Staged([], [], [])
    _hook_optimizer(torch)
    thread = threading.Thread(
        target=_finish,
        args=(view, late, staged, data_end, path_of(Path(directory), step, _rank()), torch),
        name="ftrun-snapshot",
    )
    try:
        _writer.copied.clear()
        thread.start()
    except BaseException:  # ftrun's interrupt (an in-place restart) before the copy began: nothing would set it
        if not thread.is_alive():  # and the next call's first optimizer step would wait for it for good
            _writer.copied.set()
        raise
    _writer.thread = thread
    _writer.blocked_s += time.perf_counter() - started


def write_now(step: int, state: Mapping[str, Any]) -> None:
    """A small snapshot without tensors, written whole at once in the caller's thread (where a DCP step went:
    :mod:`ftrun.worker.dcp`); outside ftrun, nothing."""
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return
    # DCP's step: where its files are, which DCP reshards itself for a world of any size
    planned = file.begin(step, [], pickle.dumps(dict(state), protocol=pickle.HIGHEST_PROTOCOL), _world(True))
    view = planned.make(Path(directory))
    try:
        file.seal(view, planned.data_end)
    finally:
        view.close()
    _prune(Path(directory), _rank())
    name_step(step + 1)


def restore_step() -> int | None:
    """The step the agent names for this attempt's restore (None: none, or outside ftrun); raises where the
    nodes did not agree on one."""
    step = os.environ.get(ENV_RESTORE) if os.environ.get(ENV_DIR) else None
    if step == RESTORE_UNAGREED:  # restoring alone could leave this node's ranks on another step than the others'
        raise RuntimeError(
            "ftrun.restore: this node did not hear which snapshot step the job's nodes restore; "
            "this attempt ends and the next one agrees again"
        )
    return int(step) if step else None


def restore() -> tuple[int, Any] | None:
    """The step and the state of the newest snapshot complete on every rank, verified; None outside ftrun or
    when there is none (then load your own checkpoint). Raises CorruptSnapshot for one that does not verify."""
    directory, step = os.environ.get(ENV_DIR), restore_step()
    if not directory:
        return None
    if step is None:
        name_start(None)
        return None
    path = path_of(Path(directory), step, _rank())
    _writer.restored.add(path)  # its pages are the restored tensors': never written again
    try:
        then = file.world_of(path)
        if then is not None and not then.replicated and then.size != _world(False).size:
            _world_changed(step, then)
            name_start(None)
            return None
        restored = read(path)
    except CorruptSnapshot as e:
        (path.parent / BAD_MARK).touch()  # the agent restores the step before at the next restart
        raise CorruptSnapshot(f"{e}; ftrun restores an older snapshot at the next restart") from None
    name_start(restored[0])
    return restored


@dataclass(frozen=True, slots=True)
class Parts:
    """Every rank's part of one snapshot step, as the world it was taken in had them (``ftrun.restore_parts``)."""

    step: int
    world_size: int  # of the world the step was taken in
    parts: dict[int, object]  # that world's rank -> its state, for each part found on this node
    missing: tuple[int, ...]  # that world's ranks whose part is not on this node

    @property
    def whole(self) -> bool:
        return not self.missing


def restore_parts() -> Parts | None:
    """For a job that reshards its state itself when the world changed size: every rank's part of the step the
    agent names, from this node's own files and the copies it holds of the other nodes' (a lost node's parts
    are on the node after it in the ring), each verified; the parts not found here are named in ``missing``.
    None outside ftrun or when there is no step to restore (then load your own checkpoint). In the same world
    it gives every rank's part this node holds, this rank's included."""
    directory, step = os.environ.get(ENV_DIR), restore_step()
    if not directory or step is None:
        return None
    here = Path(directory)
    size = _world_of_step(here, step) or _world(False).size
    parts: dict[int, object] = {}
    for rank in range(size):
        for path in (path_of(here, step, rank), file.peer_path(here, step, rank)):
            if is_whole(path):
                _writer.restored.add(path)  # its pages are the restored tensors': never written again
                parts[rank] = read(path)[1]
                break
    missing = tuple(r for r in range(size) if r not in parts)
    if missing and _rank() == 0:
        print(
            f"ftrun.restore_parts: step {step} of a world of {size} ranks: the parts of rank(s) "
            f"{', '.join(map(str, missing))} are not on this node",
            file=sys.stderr,
            flush=True,
        )
    name_start(step if not missing else None)
    return Parts(step, size, parts, missing)


def _world_of_step(here: Path, step: int) -> int:
    """The size of the world the step was taken in, as any of its files here says (0: none says)."""
    for found in (path_of(here, step, 0).parent, file.peer_path(here, step, 0).parent):
        for path in sorted(found.glob("rank-*.snap")):
            with contextlib.suppress(OSError, CorruptSnapshot):
                if (then := file.world_of(path)) is not None and then.size:
                    return then.size
    return 0


def read(path: Path) -> tuple[int, Any]:
    """A snapshot file's step and state (CPU tensors), once its checksums match."""
    return file.read(path, sys.modules.get("torch") or importlib.import_module("torch"))


def blocked_s() -> float:
    """How long snapshots held the job up so far (the copies at the call and the waits before a step)."""
    return _writer.blocked_s


def wait() -> None:
    """Until the snapshot in flight is written (the end of a job, a test)."""
    _writer.wait()


# --- inside ------------------------------------------------------------------------------------------


def _fits(step: int, size: int) -> bool:
    """Whether this rank keeps snapshots of ``size`` within its share of --snapshot-memory, and how many
    (:func:`snapshot_budget.keep_for`: fewer pins, then fewer steps, before none), said once each."""
    share = int(os.environ.get(ENV_MEMORY) or 0)
    keep = budget.keep_for(share, size, copies=copies_held())
    if keep is None:
        if not _writer.refused:
            _writer.refused = True
            least = budget.Keep(1, 0, copies_held())
            sys.stderr.write(
                f"ftrun.snapshot: no snapshots on rank {_rank()}: step {step}'s state takes {_gib(size)}, and even "
                f"{least.says()} need {_gib(least.files * size)}, over this rank's share of --snapshot-memory "
                f"({_gib(share)}); raise --snapshot-memory or snapshot less\n"
            )
            sys.stderr.flush()
        return False
    if keep != _writer.keep:  # the node's mirror keeps as many copies: the same rule, the same size
        if not keep.full and (_writer.keep is None or keep.files < _writer.keep.files):
            usual = budget.keep_for(0, size, copies=copies_held())
            assert usual is not None
            sys.stderr.write(
                f"ftrun.snapshot: rank {_rank()} keeps {keep.says()}, not {usual.says()}: step {step}'s state "
                f"takes {_gib(size)}, and this rank's share of --snapshot-memory is {_gib(share)}\n"
            )
            sys.stderr.flush()
        _writer.keep = keep
    return True


def _no_room(step: int, size: int, error: OSError) -> None:
    """Said once per run of a worker: a snapshot that /dev/shm had no room for; the job goes on without it."""
    if not _writer.no_room:
        _writer.no_room = True
        sys.stderr.write(
            f"ftrun.snapshot: rank {_rank()} skipped step {step}'s snapshot ({_gib(size)}): "
            f"{error.strerror or error} in {os.environ.get(ENV_DIR)}; the job goes on, and a restore takes the newest "
            "step whole on every rank, or the job's own checkpoint (said once)\n"
        )
        sys.stderr.flush()


def copies_held() -> bool:
    """Whether this node holds copies of the previous node's ranks' steps (the job has several nodes)."""
    return os.environ.get(ENV_COPIES) == "1"


def _whole_files(directory: Path, rank: int) -> list[Path]:
    """This rank's whole files, oldest step first."""
    return sorted(p for p in directory.glob(f"step-*/{path_of(directory, 0, rank).name}") if is_whole(p))


def _step_of(path: Path) -> int:
    """The step of a rank's file (``.../step-N/rank-R...``)."""
    return int(path.parent.name.removeprefix("step-"))


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB"


def name_start(restored: int | None) -> None:
    """Where this attempt starts, for lost work: the step after the one restored; with none, step 0 in a run's
    first attempt (a later attempt resumes from the job's own checkpoint, at a step ftrun does not know)."""
    in_place.phase("restored")
    if restored is not None:
        name_step(restored + 1)
    elif os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        name_step(0)


def name_step(step: int) -> None:
    """For lost work, where a monitor slot is there to write it into (always under ftrun; not in a test)."""
    if os.environ.get("FTRUN_MONITOR"):
        client.name_step(step)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world(replicated: bool) -> file.World:
    return file.World(int(os.environ.get("WORLD_SIZE", "1")), _rank(), replicated)


def _world_changed(step: int, then: file.World) -> None:
    """Said once, by rank 0: the snapshot's world and this one differ, so nothing is restored."""
    if _rank() == 0:
        print(
            f"ftrun.restore: step {step} was snapshotted in a world of {then.size} ranks, this one has "
            f"{_world(False).size}: not restored, since a rank's part may depend on the world (load your own "
            "checkpoint; ftrun.snapshot(..., replicated=True) says any rank's part serves any world)",
            file=sys.stderr,
            flush=True,
        )


def _copy(view: mmap.mmap, at: int, tensor: Any, nbytes: int, torch: Any) -> None:
    """The tensor's bytes into the file (torch copies without the GIL). The view on the file is gone when
    this returns, so the file can be closed."""
    if nbytes:
        torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=at).copy_(tensor.reshape(-1).view(torch.uint8))


@dataclass(slots=True)
class _Staged:
    """GPU tensors on their way to the file: (slice of the pinned buffer, offset in the file, size) each, the
    events that say the copies into the buffer are done, and the copies' sources, kept alive until then."""

    parts: list[tuple[Any, int, int]]
    events: list[Any]
    sources: list[Any]


def _stage(on_gpu: list[tuple[Any, int, int]], torch: Any) -> _Staged:
    """Each GPU tensor's bytes into the pinned staging buffer, on each device's copy stream, as they are now.
    The job's stream is not held: the small
    tensors, which the next forward may change, are cloned in it first (on the GPU), the big ones are changed by
    the optimizer alone, which waits for the copies (:meth:`_Writer.before_step`)."""
    total = sum(n + file.ALIGN for _, _, n in on_gpu)
    if _writer.pinned is None or _writer.pinned.numel() < total:
        _writer.pinned = None
        _writer.pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    staged, at_pinned = _Staged([], [], []), 0
    by_device: dict[Any, list[tuple[Any, Any]]] = {}
    for t, at, nbytes in on_gpu:
        source = t.clone() if nbytes < AT_ONCE_BYTES else t
        staged.sources.append(source)
        part = _writer.pinned[at_pinned : at_pinned + nbytes]
        by_device.setdefault(t.device, []).append((source, part))
        staged.parts.append((part, at, nbytes))
        at_pinned += nbytes + -nbytes % file.ALIGN
    for device, pairs in by_device.items():
        stream = _writer.streams.get(device) or _writer.streams.setdefault(device, torch.cuda.Stream(device))
        stream.wait_stream(torch.cuda.current_stream(device))  # the values as of this call
        with torch.cuda.stream(stream):
            for source, part in pairs:
                if part.numel():
                    part.copy_(source.reshape(-1).view(torch.uint8), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        _writer.gpu_copied.append((device, event))
        staged.events.append(event)
    return staged


def _finish(
    view: mmap.mmap,
    late: list[tuple[Any, int, int]],
    staged: _Staged,
    data_end: int,
    path: Path,
    torch: Any,
) -> None:
    try:
        for t, at, nbytes in late:
            _copy(view, at, t, nbytes, torch)
        _writer.copied.set()
        for event in staged.events:
            event.synchronize()
        staged.sources.clear()
        for part, at, nbytes in staged.parts:
            _copy(view, at, part, nbytes, torch)
        file.seal(view, data_end)
        _prune(path.parent.parent, _rank())
    except BaseException as e:  # told at the next step, in the job's own thread
        _writer.error = e
    finally:
        _writer.copied.set()
        with contextlib.suppress(BufferError):
            view.close()


def _prune(directory: Path, rank: int) -> None:
    """This rank's parts of the steps the budget prunes (all but the newest kept, less the pinned: their copy is
    on its way to the next node, or the one a lost node's meets); the oldest is kept as the spare the next
    snapshot writes again (memory is what snapshots cost)."""
    mine = {_step_of(p): p for p in _whole_files(directory, rank)}
    if mine:
        _drop_an_old_world(directory, max(mine))
    pinned = {step for step, p in mine.items() if file.is_pinned(p.parent)}
    for old in (mine[step] for step in budget.to_prune(mine, pinned, _writer.keep or budget.FULL)):
        with contextlib.suppress(OSError):  # the agent may have pruned it first
            if old in _writer.restored:
                old.unlink()  # its pages stay the restored tensors' until they go
            else:
                old.replace(file.spare_of(directory, rank))
        with contextlib.suppress(OSError):  # the other ranks' parts may still be there
            old.parent.rmdir()


def _drop_an_old_world(directory: Path, newest: int) -> None:
    """The files here of ranks this node runs no more (a world before this attempt's, its restore done), of the
    steps before ``newest``, this rank's newest whole: this world's own steps are the restore from now on, and
    they are what the share holds."""
    here = {int(r) for r in os.environ.get(ENV_RANKS, "").split(",") if r.isdigit()}
    if not here:
        return
    for step, step_dir in file.step_dirs(directory).items():
        if step >= newest:
            continue
        for part in step_dir.glob("rank-*.snap"):
            rank = part.stem.removeprefix("rank-")
            if rank.isdigit() and int(rank) not in here:
                part.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # this world's files of the step, or a mark: kept, pruned as usual
            step_dir.rmdir()


def _hook_optimizer(torch: Any) -> None:
    """The job's next optimizer step, which changes the tensors being copied, waits for the copy."""
    if not _writer.hooked:
        hooks = importlib.import_module("torch.optim.optimizer")
        hooks.register_optimizer_step_pre_hook(lambda *_: _writer.before_step(torch))
        _writer.hooked = True
