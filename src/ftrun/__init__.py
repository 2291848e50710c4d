"""ftrun: a fault-tolerant, elastic launcher for distributed training.

This namespace is the worker API only: what a training script calls. The
launcher itself is the ``ftrun`` command (:mod:`ftrun.cli.main`).
"""

from ftrun.worker.calculated import calculate_timeouts, load_monitor_state, monitor_state
from ftrun.worker.client import heartbeat
from ftrun.worker.errorfile import record
from ftrun.worker.in_place import restartable
from ftrun.worker.interrupt import RestartInPlace
from ftrun.worker.nvidia import RankMonitorClient
from ftrun.worker.pace import stragglers
from ftrun.worker.peers import start_peer_heartbeat
from ftrun.worker.sections import end_all_sections, end_section, section, start_section
from ftrun.worker.snapshot import CorruptSnapshot, restore, restore_parts, snapshot
from ftrun.worker.workload import exclude_this_node, request_restart, stop_job

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """SnapshotWriter and SnapshotReader (torch.distributed.checkpoint's door to snapshots), imported when first
    asked for: they import torch, which ``import ftrun`` does not."""
    if name in ("SnapshotReader", "SnapshotWriter"):
        from ftrun.worker import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module 'ftrun' has no attribute {name!r}")


__all__ = [
    "CorruptSnapshot",
    "RankMonitorClient",
    "RestartInPlace",
    "SnapshotReader",
    "SnapshotWriter",
    "__version__",
    "calculate_timeouts",
    "end_all_sections",
    "end_section",
    "exclude_this_node",
    "heartbeat",
    "load_monitor_state",
    "monitor_state",
    "record",
    "request_restart",
    "restartable",
    "restore",
    "restore_parts",
    "section",
    "snapshot",
    "start_peer_heartbeat",
    "start_section",
    "stop_job",
    "stragglers",
]
