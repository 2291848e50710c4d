"""torch.distributed.checkpoint's door to ftrun's snapshots: a job that uses DCP changes one argument.

    dcp.save(state, storage_writer=ftrun.SnapshotWriter(path, step))     # every step, or as often as it likes
    reader = ftrun.SnapshotReader(path)
    dcp.load(state, storage_reader=reader)                                 # reader.step: the step restored

Under ftrun the writer makes each rank's part of the step an ftrun snapshot (:mod:`ftrun.worker.snapshot`): the
rank's whole state as DCP planned it (every item of its own plan, none left to another rank as DCP's files
would) with the metadata to read it back, nothing at ``path``. So a DCP step costs what ``ftrun.snapshot`` does
(the big tensors copied while the job goes on), and is checksummed, agreed on, copied to the next node, fetched
by a spare, pruned and freed as any snapshot; a rank reads its state back from its own part, on any node.
(DCP's own files would spread a step over the ranks that wrote them, the metadata on the coordinator's node:
no node could read a step back from its own memory.) The reader reads the step the agent names, verified (a
part that does not verify raises CorruptSnapshot and marks the step bad: the next restart takes the step
before), and the job's own checkpoint at ``path`` where there is none. Outside ftrun both are torch's
FileSystemWriter and FileSystemReader at ``path``: the writer saves there, the reader reads from there.

A step that would not fit --snapshot-memory (a rank's part, times the steps kept and the one being written,
against a rank's share) goes to ``path`` instead, for every rank alike (the coordinator decides from the plans it
gathers), and the job is told once: memory stays bounded, and the step is the job's own checkpoint. Such a step
still has its part on every rank, which names the path: the agent agrees on it as on any step, and the reader
reads it from there, so a newer step at ``path`` is never passed over for an older one in memory.
"""

from __future__ import annotations

import io
import math
import os
import sys
from dataclasses import dataclass, replace
from typing import Any

from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StoragePrefix
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ftrun.worker import snapshot
from ftrun.worker import snapshot_budget as budget

AT_PATH = "dcp_at_path"  # in a rank's part of a step written to the job's own path: that path
WHOLE = "dcp_whole"  # in a rank's part of a step in memory: its whole state, the metadata, the world's size


@dataclass
class _Whole:
    """A rank's plan under ftrun: its whole state, ``nbytes`` of tensors, goes into its own part."""

    nbytes: int


@dataclass
class _ToPath(_StoragePrefix):
    """A rank's plan whose step goes to the writer's ``path``: the step does not fit --snapshot-memory."""

    need: int = 0  # bytes of the step's parts kept at once (per rank, the largest)
    share: int = 0
    files: str = ""  # which files those are (snapshot_budget.Need.says)


def _bytes(plan: Any) -> int:
    """The tensors' bytes a rank's save plan writes (its other items, pickled objects, are small)."""
    total = 0
    for item in plan.items:
        data = getattr(item, "tensor_data", None)
        if data is not None:
            total += math.prod(data.size) * data.properties.dtype.itemsize
    return total


_said = False  # that the steps go to the job's own path (once per worker)


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.2f} MiB"


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE") or 1)


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class SnapshotWriter(FileSystemWriter):
    path: str | os.PathLike[Any]  # FileSystemWriter's (declared here for mypy where torch is not installed)

    def __init__(self, path: str | os.PathLike[str], step: int, **kwargs: Any) -> None:
        """``path``: where the checkpoint goes outside ftrun, or when it does not fit memory; ``step``: the step
        it holds (the job resumes at the next); ``kwargs``: FileSystemWriter's."""
        super().__init__(path, **kwargs)
        self.step = step
        self._inside = bool(os.environ.get(snapshot.ENV_DIR))  # under ftrun: the step has a part on every rank
        self._at_path = not self._inside  # the step's files at ``path``, not in memory
        self._coordinator = False
        self._local: Any = None  # this rank's plan as it made it, before DCP left replicated items to one rank

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._coordinator = is_coordinator

    def prepare_local_plan(self, plan: Any) -> Any:
        if not self._inside:
            return super().prepare_local_plan(plan)
        if not plan.usable:
            raise ValueError(
                "ftrun.SnapshotWriter: DCP's plan caching sent this rank's plan as unchanged, and under ftrun a "
                "rank's part is its whole plan; this torch keeps its cache where ftrun cannot forget it: save with "
                "a planner without enable_plan_caching"
            )
        self._local = plan
        return replace(plan, storage_data=_Whole(_bytes(plan)))

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        if not self._inside:
            outside: list[Any] = super().prepare_global_plan(plans)
            return outside
        share = int(os.environ.get(snapshot.ENV_MEMORY) or 0)
        copies = snapshot.copies_held()  # the coordinator decides for every rank: pinned steps at their most
        need = budget.need(max(p.storage_data.nbytes for p in plans), pinned=budget.PINNED if copies else 0,
                           copies=copies)  # fmt: skip
        if not share or need.bytes <= share:
            return plans
        named = super().prepare_global_plan([replace(p, storage_data=None) for p in plans])  # torch's file prefixes
        return [replace(p, storage_data=_ToPath(p.storage_data.prefix, need.bytes, share, need.says())) for p in named]

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self._inside:
            _plan_afresh_next_time(planner)
        if isinstance(plan.storage_data, _Whole):
            return self._write_whole(plan, planner)
        if isinstance(plan.storage_data, _ToPath):
            self._to_path(plan.storage_data)
        written = super().write_data(plan, planner)
        if self._inside and not self._coordinator:  # the coordinator's part once the metadata is written
            written.wait()
            snapshot.write_now(self.step, {AT_PATH: str(self.path)})
        return written

    def finish(self, metadata: Any, results: Any) -> None:
        if not self._at_path:
            return  # no global metadata: each rank's part has its own
        super().finish(metadata, results)
        if self._inside:
            snapshot.write_now(self.step, {AT_PATH: str(self.path)})

    def _write_whole(self, plan: Any, planner: Any) -> Future[list[Any]]:
        """This rank's whole state, every item of its own plan, as its part of the step, with the metadata that
        reads it back (ftrun.snapshot's copy: the big tensors while the job goes on)."""
        _, metadata = create_default_global_save_plan([self._local])
        metadata = replace(metadata, planner_data=self._local.planner_data, storage_data={})
        items = {}
        for item in self._local.items:
            data = planner.resolve_data(item)
            items[item.index] = data.getvalue() if isinstance(data, io.BytesIO) else data
        snapshot.snapshot(self.step, {WHOLE: {"metadata": metadata, "items": items, "world": _world()}})
        return _done([WriteResult(index=item.index, size_in_bytes=0, storage_data=None) for item in plan.items])

    def _to_path(self, why: _ToPath) -> None:
        """This step goes to the job's own checkpoint at ``path``."""
        _say(
            f"step {self.step}'s checkpoint needs {_size(why.need)} of memory per rank ({why.files}), over a "
            f"rank's share of --snapshot-memory ({_size(why.share)}): "
            f"written to {self.path} instead (the job's own checkpoint); raise --snapshot-memory to keep such "
            "steps in memory"
        )
        self.fs.mkdir(self.path)
        self._at_path = True


_PLAN_CACHES = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
                "_cached_final_save_plan")  # fmt: skip


def _plan_afresh_next_time(planner: Any) -> None:
    """DCP's plan caching (``enable_plan_caching``) sends a rank's plan once, then an empty one while it does not
    change, and has the rank write the plan cached, in which DCP left each replicated item to one rank. Under ftrun
    a rank's part is its whole own plan, planned on the rank: the next save is planned afresh (torch's caches,
    class-level, forgotten for this planner's key). Planning is small next to a step's copy."""
    key = getattr(planner, "_cached_plans_key", None)
    for name in _PLAN_CACHES:
        cache = getattr(SavePlanner, name, None)
        if isinstance(cache, dict):
            cache.pop(key, None)


def _say(what: str) -> None:
    """Once per worker (as ftrun.snapshot's refusal), by the job's first rank."""
    global _said  # noqa: PLW0603
    if not _said and os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"ftrun.SnapshotWriter: {what}\n")
    _said = True


class SnapshotReader(FileSystemReader):
    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        """Reads the snapshot the agent names for this attempt, verified, or else the checkpoint at ``path``;
        ``step`` says which snapshot it was (None: ``path``)."""
        self.step: int | None = None
        self._whole: dict[str, Any] | None = None  # this rank's part of the step: its state, the metadata
        inside, step = bool(os.environ.get(snapshot.ENV_DIR)), snapshot.restore_step()
        if inside and step is not None:
            part = _part()
            if AT_PATH in part:
                path, self.step = part[AT_PATH], step
            elif WHOLE in part and _readable_here(part[WHOLE], path):
                self._whole, self.step = part[WHOLE], step
        if inside:
            snapshot.name_start(self.step)
        super().__init__(path, **kwargs)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._whole is None:
            return super().read_metadata(*args, **kwargs)
        metadata = self._whole["metadata"]
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        if self._whole is None:
            return super().read_data(plan, planner)
        items = self._whole["items"]
        for want in plan.items:
            data = items[want.storage_index]
            if want.type == LoadItemType.BYTE_IO:
                planner.load_bytes(want, io.BytesIO(data))
            else:
                into = planner.resolve_tensor(want).detach()
                into.copy_(_narrowed(data, want.storage_offsets, want.lengths))
                planner.commit_tensor(want, into)
        return _done(None)


def _narrowed(tensor: Any, offsets: Any, lengths: Any) -> Any:
    """The part of a saved tensor a read asks for (all of it, unless the job's shards are cut otherwise)."""
    for dim, (at, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, at, length)
    return tensor


def _part() -> dict[str, Any]:
    """This rank's part of the step the agent names, verified (a corrupt one is marked bad, and raises)."""
    restored = snapshot.restore()
    state = restored[1] if restored is not None else None
    return state if isinstance(state, dict) else {}


def _readable_here(whole: dict[str, Any], path: str | os.PathLike[str]) -> bool:
    """Whether this rank can read its state back from its own part: always, unless the state is sharded (FSDP: a
    tensor only part of which is this rank's) and the world is no longer the one that wrote it; then the job's
    own checkpoint is read, as every rank of a sharded job decides alike."""
    sharded = any(
        isinstance(md, TensorStorageMetadata) and sum(math.prod(c.sizes) for c in md.chunks) < math.prod(md.size)
        for md in whole["metadata"].state_dict_metadata.values()
    )
    if not sharded or whole["world"] == _world():
        return True
    _say(
        f"this rank's snapshot holds its shards of a world of {whole['world']} ranks, and the world is now "
        f"{_world()}: reading the job's own checkpoint at {path} instead"
    )
    return False
