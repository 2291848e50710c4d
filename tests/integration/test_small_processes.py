"""Unit-sized tests that need a real process of their own (tests/unit starts none): the worker API outside
ftrun, a worker process writing its monitor slot without pause, a process the agent did not parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ftrun.monitor.table import MonitorTable
from ftrun.warm.zygotes import AdoptedHandle
from ftrun.worker.layout import SlotView
from tests.unit.test_monitor_client import read_or_why, table  # noqa: F401 - table: the fixture


@pytest.mark.alone  # its writer spins on a core: beside 3 other tests on 2 cores it outran all 300 reads (ci21)
@pytest.mark.parametrize("confirm", [False, True], ids=["total-store-order", "confirmed-by-a-second-copy"])
def test_another_process_writing_all_the_time_is_read_whole(table: MonitorTable, confirm: bool) -> None:  # noqa: F811
    """A worker process opening and closing a section as fast as it can: every copy the agent keeps is whole,
    read as x86 reads (one copy between equal sequence numbers) and as weakly ordered CPUs do (ARM)."""
    writer = subprocess.Popen(
        [
            sys.executable, "-c",
            "import ftrun, sys\nftrun.heartbeat(); sys.stdout.write('up\\n'); sys.stdout.flush()\n"
            "while True:\n    ftrun.start_section('s'); ftrun.end_section('s')",
        ],
        env={**os.environ, "FTRUN_MONITOR": str(table.path), "FTRUN_MONITOR_SLOT": "1"},
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline() == b"up\n"
        # A writer that never pauses may outrun a read now and then ("kept changing": the agent reads again at
        # its next check); what matters is that every copy kept is whole, and that most reads succeed.
        tries = [read_or_why(table, confirm=confirm) for _ in range(300)]
        views = [v for v in tries if isinstance(v, SlotView)]
    finally:
        writer.kill()
        writer.communicate()
    assert len(views) >= 100  # a third at least: on 2 busy cores the spinning writer outran 184 of 300 once
    assert all(v.pid == writer.pid for v in views)
    assert {len(v.sections) for v in views} <= {0, 1}
    assert all(name == "s" for v in views for name, _ in v.sections)


def test_a_process_that_is_not_the_agents_child_has_no_status_to_reap() -> None:
    """AdoptedHandle.reap on a process this one did not parent: None (unknown), not a made-up code."""
    # A grandchild: its parent (sh) exits at once, so it is re-parented to init, never this process's child.
    out = subprocess.run(["sh", "-c", "sleep 5 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True)
    pid = int(out.stdout)
    try:
        handle = AdoptedHandle(pid, warm=True)
        assert handle.reap() is None
    finally:
        os.kill(pid, signal.SIGKILL)


def test_outside_ftrun_every_call_is_a_no_op_with_one_warning() -> None:
    code = (
        "import warnings, ftrun\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    ftrun.heartbeat(); ftrun.heartbeat()\n"
        "    with ftrun.section('step'):\n"
        "        ftrun.heartbeat()\n"
        "    print(ftrun.calculate_timeouts()['heartbeat'], len(w), w[0].message)\n"
        "    ftrun.load_monitor_state(ftrun.monitor_state())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert out.stdout.startswith("None 1 ftrun: not running under ftrun")
