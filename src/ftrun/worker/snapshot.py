"""In-memory snapshots of the job's state, written where the worker's death does not free them.

``ftrun.snapshot(step, state)`` takes the state the job already has (model and optimizer state dicts, the step,
the data position, RNG states: any picklable structure whose big parts are CPU tensors) and writes it into a
file of its own under the directory the agent gives (``FTRUN_SNAPSHOT_DIR``, in shared memory: the file
outlives the worker, the agent keeps and prunes it). The copy is cheap where it has to be: tensors under
:data:`AT_ONCE_BYTES` (BatchNorm's running statistics, which a forward pass changes in place) are copied at the
call; the big ones by a thread of its own while the job goes on, and the job's next optimizer step, the first
thing that changes them, waits for that copy to end (torch's global optimizer step pre-hook). Only that wait
and the small copies block the job (:func:`blocked_s`).

A snapshot is complete once its checksum (CRC-32 of everything before it) is written last; ``restore()`` reads
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
import struct
import sys
import threading
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_DIR = "FTRUN_SNAPSHOT_DIR"
ENV_RESTORE = "FTRUN_RESTORE_STEP"
STEP_DIR = "step-{:012d}"
BAD_MARK = "BAD"  # in a step's directory: a restore found a part of it corrupt
KEEP = 2  # of its own steps, a worker keeps the newest whole ones
AT_ONCE_BYTES = 1 << 20
MAGIC = b"FTSNAP1\n"
HEAD = struct.Struct("<8sQQ")  # magic, skeleton length, data length
FOOT = struct.Struct("<I4s")  # CRC-32 of what precedes, b"DONE"
ALIGN = 64


class CorruptSnapshot(ValueError):
    """A snapshot that is incomplete or whose checksum does not match: never restored."""


@dataclass(frozen=True, slots=True)
class _Tensor:
    """Where a tensor's bytes are in the file (a placeholder in the pickled skeleton)."""

    index: int


def path_of(directory: Path, step: int, rank: int) -> Path:
    return directory / STEP_DIR.format(step) / f"rank-{rank}.snap"


def is_whole(path: Path) -> bool:
    """Whether the file's writer finished it (its footer is there; whether it verifies is the reader's job)."""
    try:
        with path.open("rb") as f:
            f.seek(-FOOT.size, os.SEEK_END)
            return f.read(FOOT.size)[-4:] == b"DONE"
    except OSError:
        return False


class _Writer:
    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.blocked_s = 0.0
        self.hooked = False

    def wait(self) -> None:
        """Until the snapshot in flight is written (the job's next optimizer step waits here)."""
        if self.thread is not None:
            started = time.perf_counter()
            self.thread.join()
            self.thread = None
            self.blocked_s += time.perf_counter() - started
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"ftrun.snapshot: the last snapshot could not be written: {error!r}") from error


_writer = _Writer()


def snapshot(step: int, state: Mapping[str, Any]) -> None:
    """Snapshot ``state`` at ``step`` (see the module's doc); outside ftrun, nothing."""
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return
    _writer.wait()  # one in flight at a time
    started = time.perf_counter()
    torch = sys.modules["torch"]
    tensors: list[Any] = []
    skeleton = pickle.dumps(_strip(state, tensors, torch), protocol=pickle.HIGHEST_PROTOCOL)
    table = [(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size()) for t in tensors]
    head = pickle.dumps((step, _rank(), table, skeleton), protocol=pickle.HIGHEST_PROTOCOL)
    offsets, size = _layout(HEAD.size + len(head), [n for _, _, n in table])
    path = path_of(Path(directory), step, _rank())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size + FOOT.size)
        view = mmap.mmap(fd, size + FOOT.size)
    finally:
        os.close(fd)
    view[: HEAD.size + len(head)] = HEAD.pack(MAGIC, len(head), size) + head
    late = []
    for t, at, (_, _, nbytes) in zip(tensors, offsets, table, strict=True):
        if nbytes < AT_ONCE_BYTES:
            _copy(view, at, t, nbytes, torch)  # small, and perhaps changed by the next forward: now
        else:
            late.append((t, at, nbytes))
    _writer.blocked_s += time.perf_counter() - started
    _hook_optimizer()
    _writer.thread = threading.Thread(target=_finish, args=(view, late, size, path, torch), name="ftrun-snapshot")
    _writer.thread.start()


def restore() -> tuple[int, Any] | None:
    """The step and the state of the newest snapshot complete on every rank, verified; None outside ftrun or
    when there is none (then load your own checkpoint). Raises CorruptSnapshot for one that does not verify."""
    directory, step = os.environ.get(ENV_DIR), os.environ.get(ENV_RESTORE)
    if not directory or not step:
        return None
    path = path_of(Path(directory), int(step), _rank())
    try:
        return read(path)
    except CorruptSnapshot as e:
        (path.parent / BAD_MARK).touch()  # the agent restores the step before at the next restart
        raise CorruptSnapshot(f"{e}; ftrun restores an older snapshot at the next restart") from None


def read(path: Path) -> tuple[int, Any]:
    """A snapshot file's step and state, once its checksum matches."""
    torch = sys.modules.get("torch") or __import__("torch")
    raw = path.read_bytes()
    verify(raw, path)
    _, head_len, _ = HEAD.unpack_from(raw)
    step, _, table, skeleton = pickle.loads(raw[HEAD.size : HEAD.size + head_len])  # noqa: S301 - its own file
    offsets, _ = _layout(HEAD.size + head_len, [n for _, _, n in table])
    buffer = memoryview(raw)
    tensors = [
        torch.frombuffer(bytearray(buffer[at : at + n]), dtype=getattr(torch, dtype)).reshape(shape)
        if n
        else torch.empty(shape, dtype=getattr(torch, dtype))
        for (dtype, shape, n), at in zip(table, offsets, strict=True)
    ]
    return step, _fill(pickle.loads(skeleton), tensors)  # noqa: S301 - its own file


def verify(raw: bytes, path: Path) -> None:
    """Raises CorruptSnapshot unless ``raw`` is a whole snapshot whose checksum matches."""
    if len(raw) < HEAD.size + FOOT.size or raw[:8] != MAGIC:
        raise CorruptSnapshot(f"{path}: not a whole snapshot ({len(raw)} bytes)")
    crc, done = FOOT.unpack_from(raw, len(raw) - FOOT.size)
    if done != b"DONE":
        raise CorruptSnapshot(f"{path}: incomplete (its writer never finished)")
    with memoryview(raw) as whole, whole[: len(raw) - FOOT.size] as written:
        matches = zlib.crc32(written) == crc
    if not matches:
        raise CorruptSnapshot(f"{path}: its checksum does not match: a byte changed since it was written")


def blocked_s() -> float:
    """How long snapshots held the job up so far (the copies at the call and the waits before a step)."""
    return _writer.blocked_s


def wait() -> None:
    """Until the snapshot in flight is written (the end of a job, a test)."""
    _writer.wait()


# --- inside ------------------------------------------------------------------------------------------


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _strip(value: Any, tensors: list[Any], torch: Any) -> Any:
    """``value`` with its tensors replaced by placeholders (collected in ``tensors``)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().contiguous())
        return _Tensor(len(tensors) - 1)
    return _rebuilt(value, lambda v: _strip(v, tensors, torch))


def _fill(value: Any, tensors: list[Any]) -> Any:
    if isinstance(value, _Tensor):
        return tensors[value.index]
    return _rebuilt(value, lambda v: _fill(v, tensors))


def _rebuilt(value: Any, each: Any) -> Any:
    """A dict (a state dict's OrderedDict, its ``_metadata`` kept), list or tuple with ``each`` applied to its
    items; anything else as it is."""
    if isinstance(value, dict):
        new = type(value)((k, each(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            new._metadata = value._metadata  # type: ignore[attr-defined]  # torch's version record
        return new
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(each(v) for v in value)
    return value


def _layout(start: int, sizes: list[int]) -> tuple[list[int], int]:
    """Each tensor's offset (aligned), and where the data ends."""
    offsets, at = [], start
    for n in sizes:
        at += -at % ALIGN
        offsets.append(at)
        at += n
    return offsets, at


def _copy(view: mmap.mmap, at: int, tensor: Any, nbytes: int, torch: Any) -> None:
    """The tensor's bytes into the file (torch copies without the GIL). The view on the file is gone when
    this returns, so the file can be closed."""
    if nbytes:
        torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=at).copy_(tensor.reshape(-1).view(torch.uint8))


def _finish(view: mmap.mmap, late: list[tuple[Any, int, int]], size: int, path: Path, torch: Any) -> None:
    try:
        for t, at, nbytes in late:
            _copy(view, at, t, nbytes, torch)
        with memoryview(view) as whole, whole[:size] as written:
            crc = zlib.crc32(written)  # without the GIL
        view[size : size + FOOT.size] = FOOT.pack(crc, b"DONE")
        _prune(path.parent.parent, path.name)
    except BaseException as e:  # told at the next step, in the job's own thread
        _writer.error = e
    finally:
        with contextlib.suppress(BufferError):
            view.close()


def _prune(directory: Path, name: str) -> None:
    """This rank's parts of all but its KEEP newest whole steps (memory is what snapshots cost)."""
    mine = sorted(p for p in directory.glob(f"step-*/{name}") if is_whole(p))
    for old in mine[:-KEEP]:
        old.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the other ranks' parts may still be there
            old.parent.rmdir()


def _hook_optimizer() -> None:
    """The job's next optimizer step, which changes the tensors being copied, waits for the copy."""
    if not _writer.hooked:
        importlib.import_module("torch.optim.optimizer").register_optimizer_step_pre_hook(lambda *_: _writer.wait())
        _writer.hooked = True
