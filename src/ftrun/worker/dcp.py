"""torch.distributed.checkpoint's door to ftrun's snapshots: a job that uses DCP changes one argument.

    dcp.save(state, storage_writer=ftrun.SnapshotWriter(path, step))     # every step, or as often as it likes
    reader = ftrun.SnapshotReader(path)
    dcp.load(state, storage_reader=reader)                                 # reader.step: the step restored

Under ftrun the writer puts the checkpoint into the run's snapshot directory in shared memory
(``step-<step>/dcp/``), not at ``path``: torch's own files (FileSystemWriter's, with no fsync: memory is the
point), and beside them, as each rank's part of the step, the checksums of the files it wrote (the
coordinator's with the metadata's). So the agent counts, agrees on, prunes and frees a DCP step as any
snapshot. The reader reads the step the agent names once every file's checksum matches (one that does not
raises CorruptSnapshot and marks the step bad: the next restart takes the step before), and the job's own
checkpoint at ``path`` where there is none. Outside ftrun both are torch's FileSystemWriter and
FileSystemReader at ``path``: the writer saves there, the reader reads from there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from crc32c import crc32c
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

from ftrun.worker import snapshot
from ftrun.worker.snapshot_file import BAD_MARK, DCP_DIR, STEP_DIR, CorruptSnapshot

METADATA_SUFFIX = ".metadata"
CHUNK = 16 << 20


class SnapshotWriter(FileSystemWriter):
    def __init__(self, path: str | os.PathLike[str], step: int, **kwargs: Any) -> None:
        """``path``: where the checkpoint goes outside ftrun; ``step``: the step it holds (the job resumes at
        the next); ``kwargs``: FileSystemWriter's."""
        directory = os.environ.get(snapshot.ENV_DIR)
        self.step = step
        self._inside = bool(directory)
        if directory:
            path = Path(directory) / STEP_DIR.format(step) / DCP_DIR
            kwargs.setdefault("sync_files", False)
        super().__init__(path, **kwargs)
        self._coordinator = False
        self._mine: list[str] = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._coordinator = is_coordinator

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        if self._inside:
            self._mine = sorted({r.storage_data.relative_path for r in written.wait()})  # written when it returns
            if not self._coordinator:
                self._seal(self._mine)
        return written

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        if self._inside and self._coordinator:
            self._seal(self._mine + sorted(p.name for p in Path(self.path).glob(f"*{METADATA_SUFFIX}")))

    def _seal(self, names: list[str]) -> None:
        snapshot.write_now(self.step, {DCP_DIR: {name: _crc(Path(self.path) / name) for name in names}})


class SnapshotReader(FileSystemReader):
    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        """Reads the snapshot the agent names for this attempt, verified, or else the checkpoint at ``path``;
        ``step`` says which snapshot it was (None: ``path``)."""
        self.step: int | None = None
        directory, step = os.environ.get(snapshot.ENV_DIR), snapshot.restore_step()
        if directory and step is not None:
            step_dir = Path(directory) / STEP_DIR.format(step)
            if (step_dir / DCP_DIR).is_dir():
                verify(step_dir)
                path, self.step = step_dir / DCP_DIR, step
        if directory:
            snapshot.name_start(self.step)
        super().__init__(path, **kwargs)


def verify(step_dir: Path) -> None:
    """Every rank's files of a DCP step against the checksums that rank wrote; raises CorruptSnapshot (and marks
    the step bad) for one that does not match or is missing."""
    try:
        for part in sorted(step_dir.glob("rank-*.snap")):
            _, sums = snapshot.read(part)
            for name, crc in sums.get(DCP_DIR, {}).items():
                if _crc(step_dir / DCP_DIR / name) != crc:
                    raise CorruptSnapshot(f"{step_dir / DCP_DIR / name}: its checksum does not match")
    except (CorruptSnapshot, OSError) as e:
        (step_dir / BAD_MARK).touch()
        raise CorruptSnapshot(f"{e}; ftrun restores an older snapshot at the next restart") from None


def _crc(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            crc = crc32c(chunk, crc)
    return crc
