"""The public namespace is the worker API only, and it stays deliberate."""

from __future__ import annotations

import subprocess
import sys

import ftrun


def test_public_surface() -> None:
    assert sorted(ftrun.__all__) == [
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
    for name in ftrun.__all__:
        assert hasattr(ftrun, name)


def test_importing_ftrun_loads_neither_the_launcher_nor_torch() -> None:
    code = "import sys, ftrun; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    modules = out.stdout.split()
    assert "torch" not in modules
    assert not [m for m in modules if m.startswith("ftrun.agent")]
