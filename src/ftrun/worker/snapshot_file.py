"""A snapshot's file: where each rank's part of a step lives, how it is laid out, and how it is checked.

One file per rank and step, ``step-<step>/rank-<rank>.snap`` under the run's snapshot directory::

    head     magic, the skeleton's length, the data's end; then (step, rank, tensor table, pickled skeleton)
    data     each tensor's raw bytes, aligned (the skeleton holds a placeholder where each was)
    table    a CRC-32C of each CHUNK of everything before it
    foot     a CRC-32C of the table, b"DONE": written last, so a file with it is one its writer finished

Chunked checksums let a reader check a big file on several cores at once (:func:`read`); a part that does not
match is never trusted. CRC-32C (the crc32c package: the CPU's own instruction, 11 GB/s a core here against
zlib's CRC-32 at 2-3 GB/s), because checksumming was half the CPU time of a snapshot.
"""

from __future__ import annotations

import errno
import mmap
import os
import pickle
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from crc32c import crc32c

STEP_DIR = "step-{:012d}"
BAD_MARK = "BAD"  # in a step's directory: a restore found a part of it corrupt
PIN_MARK = "PINNED"  # in a step's directory: the nodes copy this step to each other; kept until newer ones are
MAGIC = b"FTSNAP3\n"
HEAD = struct.Struct("<8sQQ")  # magic, head's length, data's end
FOOT = struct.Struct("<I4s")  # CRC-32C of the chunks' table, b"DONE"
CRC = struct.Struct("<I")
ALIGN = 64
CHUNK = 16 << 20
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


class CorruptSnapshot(ValueError):
    """A snapshot that is incomplete or whose checksum does not match: never restored."""


@dataclass(frozen=True, slots=True)
class TensorAt:
    """Where a tensor's bytes are in the file (its placeholder in the pickled skeleton)."""

    index: int


def path_of(directory: Path, step: int, rank: int) -> Path:
    return directory / STEP_DIR.format(step) / f"rank-{rank}.snap"


PEER_DIR = "peer"  # the previous node's snapshots, copied here (ftrun.job.snapshot_mirror)


def peer_path(directory: Path, step: int, rank: int) -> Path:
    """Where this node keeps its copy of another node's rank's file of a step."""
    return path_of(directory / PEER_DIR, step, rank)


def spare_of(directory: Path, rank: int) -> Path:
    """A rank's pruned file, kept to be written again: its memory is already the file's (writing a new file
    of 1 GiB in /dev/shm took 1.1-1.6 s here, writing it again 0.35 s)."""
    return directory / f"spare-rank-{rank}.snap"


def is_whole(path: Path) -> bool:
    """Whether the file's writer finished it (its foot is there; whether it verifies is the reader's job)."""
    try:
        with path.open("rb") as f:
            f.seek(-FOOT.size, os.SEEK_END)
            return f.read(FOOT.size)[-4:] == b"DONE"
    except OSError:
        return False


def is_pinned(step_dir: Path) -> bool:
    return (step_dir / PIN_MARK).exists()


def step_dirs(directory: Path) -> dict[int, Path]:
    """Each step's directory (:data:`STEP_DIR`) under ``directory``, by step; anything else there is ignored."""
    found = {}
    for step_dir in directory.glob("step-*"):
        step = step_dir.name.removeprefix("step-")
        if step.isdigit():
            found[int(step)] = step_dir
    return found


def pinned_steps(directory: Path) -> set[int]:
    """The steps a node keeps for the copies between nodes (:func:`ftrun.job.snapshot_mirror.pin`)."""
    return {step for step, d in step_dirs(directory).items() if is_pinned(d)}


def bad_steps(directory: Path) -> set[int]:
    """The steps a restore found a part of corrupt (:data:`BAD_MARK`)."""
    return {step for step, d in step_dirs(directory).items() if (d / BAD_MARK).exists()}


def whole_steps(directory: Path, ranks: Sequence[int]) -> set[int]:
    """The steps every one of ``ranks`` wrote whole, none of them found corrupt by a restore."""
    return {
        step
        for step, d in step_dirs(directory).items()
        if ranks and not (d / BAD_MARK).exists() and all(is_whole(path_of(directory, step, r)) for r in ranks)
    }


def layout(start: int, sizes: list[int]) -> tuple[list[int], int]:
    """Each tensor's offset (aligned), and where the data ends."""
    offsets, at = [], start
    for n in sizes:
        at += -at % ALIGN
        offsets.append(at)
        at += n
    return offsets, at


def file_size(data_end: int) -> int:
    return data_end + CRC.size * _chunks(data_end) + FOOT.size


@dataclass(frozen=True, slots=True)
class Planned:
    """A rank's file for a step, laid out before it is made: its size is known (:func:`begin`)."""

    step: int
    rank: int
    body: bytes  # the head after HEAD: (step, rank, tensor table, skeleton, world), pickled
    offsets: list[int]  # each tensor's
    data_end: int

    @property
    def size(self) -> int:
        return file_size(self.data_end)

    def make(self, directory: Path) -> mmap.mmap:
        """The file (the rank's spare written again where there is one), sized, mapped, its head written; the
        writer copies the tensors in, then :func:`seal`."""
        fd, reused = open_sized(path_of(directory, self.step, self.rank), self.size, spare_of(directory, self.rank))
        try:  # a spare's pages are there: mapped at once (1 GiB copied in 0.30 s here, 0.53 s faulting them in)
            view = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | (_POPULATE if reused else 0))
        finally:
            os.close(fd)
        view[: HEAD.size + len(self.body)] = HEAD.pack(MAGIC, len(self.body), self.data_end) + self.body
        return view


@dataclass(frozen=True, slots=True)
class World:
    """The world a snapshot was taken in: its size, the rank that took it, and whether the job said its state
    does not depend on the world (any rank's part serves any world)."""

    size: int
    rank: int
    replicated: bool = False


def begin(step: int, table: list[tuple[str, tuple[int, ...], int]], skeleton: bytes, world: World) -> Planned:
    """The file of ``world.rank``'s ``step``, laid out: its head records the world it is taken in."""
    head = (step, world.rank, table, skeleton, (world.size, world.rank, world.replicated))
    body = pickle.dumps(head, protocol=pickle.HIGHEST_PROTOCOL)
    offsets, data_end = layout(HEAD.size + len(body), [n for _, _, n in table])
    return Planned(step, world.rank, body, offsets, data_end)


def seal(view: mmap.mmap, data_end: int) -> None:
    """Writes the chunks' checksums (on several cores: crc32c lets the GIL go), then the foot, last."""
    with memoryview(view) as whole:
        crcs = list(_pool().map(lambda i: _crc(whole, i, data_end), range(_chunks(data_end))))
    table = b"".join(CRC.pack(c) for c in crcs)
    view[data_end : data_end + len(table)] = table
    view[data_end + len(table) : data_end + len(table) + FOOT.size] = FOOT.pack(crc32c(table), b"DONE")


def read(path: Path, torch: Any) -> tuple[int, Any]:
    """A snapshot file's step and state (CPU tensors on the file's pages), once every checksum matches. The head
    is checked first, the rest on several cores while the tensors are made."""
    with path.open("rb") as f:
        try:  # mapped, not read: nothing is copied (a GPU job's copy to its device reads the page cache)
            raw: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError:  # an empty file
            raw = b""
    with memoryview(raw) as whole:
        data_end, crcs = _table(whole, path)
        _, head_len, _ = HEAD.unpack_from(whole)
        checks = [_pool().submit(_crc, whole, i, data_end) for i in range(_chunks(data_end))]
        try:
            for i in range(_head_chunks(head_len)):
                _check(checks[i].result(), crcs[i], path)  # the head, before it is unpickled
            step, _, table, skeleton, *_ = pickle.loads(whole[HEAD.size : HEAD.size + head_len])  # noqa: S301 - own
            offsets, _ = layout(HEAD.size + head_len, [n for _, _, n in table])
            tensors = [_mapped(torch, raw, entry, at) for entry, at in zip(table, offsets, strict=True)]
            for i, check in enumerate(checks):
                _check(check.result(), crcs[i], path)
        finally:
            wait(checks)  # none still reads the map when it closes
    return step, fill(pickle.loads(skeleton), tensors)  # noqa: S301 - its own file


def world_of(path: Path) -> World | None:
    """The world a snapshot file was taken in, from its head alone (verified); None for a file that does not
    say (written before snapshots recorded it). Raises CorruptSnapshot as :func:`read` does."""
    with path.open("rb") as f:
        try:
            raw: mmap.mmap | bytes = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file
            raw = b""
    try:
        with memoryview(raw) as whole:
            data_end, crcs = _table(whole, path)
            _, head_len, _ = HEAD.unpack_from(whole)
            for i in range(_head_chunks(head_len)):
                _check(_crc(whole, i, data_end), crcs[i], path)
            head = pickle.loads(whole[HEAD.size : HEAD.size + head_len])  # noqa: S301 - its own file
    finally:
        if isinstance(raw, mmap.mmap):
            raw.close()
    return World(*head[4]) if len(head) > 4 else None


def strip(value: Any, tensors: list[Any], torch: Any) -> Any:
    """``value`` with its tensors replaced by placeholders (collected in ``tensors``)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().contiguous())
        return TensorAt(len(tensors) - 1)
    return _rebuilt(value, lambda v: strip(v, tensors, torch))


def fill(value: Any, tensors: list[Any]) -> Any:
    if isinstance(value, TensorAt):
        return tensors[value.index]
    return _rebuilt(value, lambda v: fill(v, tensors))


# --- inside ------------------------------------------------------------------------------------------


def open_sized(path: Path, size: int, spare: Path) -> tuple[int, bool]:
    """``path`` opened for writing, ``size`` bytes long, and whether it is ``spare`` written again (its foot
    wiped: never whole before it is written again) rather than a new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _reused(spare, path)
    reused = fd is not None
    if fd is None:
        # A new file's pages are taken as they are written through the map: on a full /dev/shm that write would
        # be a SIGBUS. The room is looked at first (taking the pages now, posix_fallocate, costs the step
        # 1.3 s a GiB here; another writer may still take the room meanwhile).
        room = os.statvfs(path.parent)
        if room.f_bavail * room.f_frsize < size:
            raise OSError(errno.ENOSPC, f"{room.f_bavail * room.f_frsize >> 20} MiB free, {size >> 20} MiB needed")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd, reused


def _reused(spare: Path, path: Path) -> int | None:
    """The spare, its foot wiped (never whole before it is written again), moved to ``path``, opened."""
    try:
        fd = os.open(spare, os.O_RDWR)
    except FileNotFoundError:
        return None
    size = os.fstat(fd).st_size
    if size >= FOOT.size:
        os.pwrite(fd, bytes(FOOT.size), size - FOOT.size)
    os.rename(spare, path)
    return fd


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


def _mapped(torch: Any, raw: mmap.mmap, entry: tuple[str, tuple[int, ...], int], at: int) -> Any:
    """The tensor on the file's pages, not copied: the map is private, so the job's writes copy the pages they
    change and never reach the file; the file must not be written again while the tensor lives
    (:func:`ftrun.worker.snapshot.restore` sees to it)."""
    dtype, shape, n = entry
    if not n:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(raw, dtype=torch.uint8, count=n, offset=at).view(getattr(torch, dtype)).reshape(shape)


def _chunks(data_end: int) -> int:
    return -(-data_end // CHUNK)


def _crc(whole: memoryview, i: int, data_end: int) -> int:
    with whole[i * CHUNK : min((i + 1) * CHUNK, data_end)] as part:
        return crc32c(part)


def _table(whole: memoryview, path: Path) -> tuple[int, list[int]]:
    """The data's end and the chunks' checksums, once the file is whole and its table matches its foot."""
    if len(whole) < HEAD.size + FOOT.size or bytes(whole[:8]) != MAGIC:
        raise CorruptSnapshot(f"{path}: not a whole snapshot ({len(whole)} bytes)")
    crc, done = FOOT.unpack_from(whole, len(whole) - FOOT.size)
    if done != b"DONE":
        raise CorruptSnapshot(f"{path}: incomplete (its writer never finished)")
    _, _, data_end = HEAD.unpack_from(whole)
    table = whole[data_end : len(whole) - FOOT.size]
    if file_size(data_end) != len(whole) or crc32c(table) != crc:
        raise CorruptSnapshot(f"{path}: its checksum does not match: a byte changed since it was written")
    return data_end, [CRC.unpack_from(table, i * CRC.size)[0] for i in range(_chunks(data_end))]


def _head_chunks(head_len: int) -> int:
    """The chunks the head lies in: checked before it is unpickled."""
    return (HEAD.size + head_len) // CHUNK + 1


def _check(crc: int, expected: int, path: Path) -> None:
    if crc != expected:
        raise CorruptSnapshot(f"{path}: its checksum does not match: a byte changed since it was written")


@cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="ftrun-snapshot-crc")
