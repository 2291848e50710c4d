"""Hang detection with real workers: each kind of hang is found, its stacks shown, and the job restarted."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from ftrun.monitor import stacks
from ftrun.monitor.hangs import HangWatch
from ftrun.monitor.table import MonitorTable
from ftrun.worker.signals import STACK_SIGNAL
from tests.integration.harness import POOL, LiveFtrun, Result, WriteScript, restarted_warm, run_ftrun, until

# Rank 1 hangs in the first attempt, in the way argv[1] names, inside stuck_here(); the second attempt
# finishes. Rank 0 keeps beating until rank 1 is found (it is not blamed).
HANGS = """
import ctypes, os, sys, time
import ftrun

mode = sys.argv[1]
rank = int(os.environ["RANK"])
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
for _ in range(5):
    with ftrun.section("step"):
        ftrun.heartbeat()
        time.sleep(0.01)

def stuck_here():
    if mode == "no-heartbeat":
        time.sleep(120)
    elif mode == "in-section":
        with ftrun.section("step"):
            time.sleep(120)
    elif mode == "out-of-section":
        time.sleep(120)
    elif mode == "gil":
        ctypes.CDLL(None).sleep(120)  # in C, holding the GIL: no Python signal handler can run

if first and rank == 1:
    print("rank 1 hangs now", flush=True)
    stuck_here()
if first and rank == 0:
    for _ in range(3000):  # busy and healthy for up to 30 s
        with ftrun.section("step"):
            ftrun.heartbeat()
            time.sleep(0.01)
print(f"rank {rank} done", flush=True)
"""

TIMERS = {
    "no-heartbeat": (["--heartbeat-timeout", "1.5"], "heartbeat"),
    "in-section": (["--section-timeout", "step=1.5"], "section 'step'"),
    "out-of-section": (["--out-of-section-timeout", "1.5"], "out of section"),
    "gil": (["--heartbeat-timeout", "1.5"], "heartbeat"),
}


def hang_events(r: Result) -> list[dict[str, Any]]:
    return [e for e in r.events() if e["kind"] == "hang"]


@pytest.mark.parametrize("mode", list(TIMERS))
def test_a_hung_rank_is_found_shown_and_restarted(tmp_path: Path, script: WriteScript, mode: str) -> None:
    script("w.py", HANGS)
    flags, timer = TIMERS[mode]
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", *flags, "w.py", mode)
    assert r.returncode == 0, r.stderr
    [hang] = hang_events(r)
    assert (hang["rank"], hang["timeout"], hang["limit_s"]) == (1, timer, 1.5)
    root: dict[str, Any] = r.report(0)["root_cause"]  # type: ignore[assignment]
    assert root["rank"] == 1
    assert root["hang"].startswith(f"hang: {timer} timeout of 1.5 s exceeded")
    assert "stuck_here" in root["stacks"]  # all threads' stacks, the hung frame among them
    stopped: list[dict[str, Any]] = r.report(0)["stopped_by_ftrun"]  # type: ignore[assignment]
    assert [o["rank"] for o in stopped] == [0]
    assert "stuck_here" in r.log(0, 1, "stderr")  # and in the rank's log
    assert f"ROOT CAUSE  rank 1 (local rank 1, pid {root['pid']})" in r.stderr
    assert "rank 0 done" in r.log(1, 0)
    assert "rank 1 done" in r.log(1, 1)


def test_the_hang_signal_goes_to_the_hung_rank_first(tmp_path: Path, script: WriteScript) -> None:
    script(
        "w.py",
        """
import os, signal, sys, time, ftrun
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append("got SIGUSR1"))
signal.signal(signal.SIGTERM, lambda *a: got.append("got SIGTERM"))
ftrun.heartbeat()
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    while "got SIGTERM" not in got:
        time.sleep(0.1)
    print("\\n".join(sorted(got)), flush=True)
""",
    )
    r = run_ftrun(tmp_path, "--max-restarts", "1", "--heartbeat-timeout", "1", "--hang-signal", "SIGUSR1", "w.py")
    assert r.returncode == 0, r.stderr
    # The hung rank got --hang-signal, then the group stop's SIGTERM. (Sent in that order, within microseconds:
    # Python may run the second handler at the first one's entry, so the job cannot tell their order.)
    assert r.log(0, 0).splitlines() == ["got SIGTERM", "got SIGUSR1"]


CALCULATE = """
import json, os, sys, time
import ftrun

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(json.dumps(ftrun.monitor_state()), flush=True)
for _ in range(10):
    with ftrun.section("step"):
        time.sleep(0.02)
    ftrun.heartbeat()
if attempt == 0:
    ftrun.calculate_timeouts(safety_factor=20)
    sys.exit(3)  # a crash: the restarted workers must still have the timeouts
if attempt == 1:
    time.sleep(120)  # no flag sets a timeout: only the calculated one can catch this
"""


def test_calculated_timeouts_survive_a_restart(tmp_path: Path, script: WriteScript) -> None:
    import json

    script("w.py", CALCULATE)
    r = run_ftrun(tmp_path, "--max-restarts", "2", "w.py")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.log(0, 0).splitlines()[0])["timeouts"]["heartbeat"] is None
    handed = json.loads(r.log(1, 0).splitlines()[0])["timeouts"]
    assert handed["heartbeat"] is not None
    assert set(handed["sections"]) == {"step"}
    [hang] = hang_events(r)
    assert hang["attempt"] == 1
    # Both timers were calculated (the sleep is past the heartbeat and out of any section); either may fire.
    assert hang["timeout"] in ("heartbeat", "out of section")
    assert hang["limit_s"] == handed[hang["timeout"].replace(" ", "_")]  # the value the agent handed over
    assert "calculated timeouts; in force now" in r.stderr


STUCK = """
def stuck_here():
    print('up', flush=True)  # from inside: the dump that follows finds this frame
    time.sleep(60)
stuck_here()
"""


def test_faulthandler_dumps_stacks_without_py_spy(tmp_path: Path, script: WriteScript) -> None:
    """The fallback path: the client registered faulthandler; the agent signals and reads the file."""
    import subprocess
    import sys

    table = MonitorTable(1, tag="test")
    out = tmp_path / "stacks.txt"
    script("w.py", "import ftrun, time\nftrun.heartbeat()\n" + STUCK)
    env = {"FTRUN_MONITOR": str(table.path), "FTRUN_MONITOR_SLOT": "0", "FTRUN_STACKS_FILE": str(out)}
    proc = subprocess.Popen([sys.executable, "w.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "up\n"
        assert HangWatch.client_listens(table.read(0))
        text = stacks._faulthandler(proc.pid, out, STACK_SIGNAL)
        assert "stuck_here" in text
        assert proc.poll() is None  # dumping does not kill it
    finally:
        proc.kill()
        proc.communicate()
        table.close()


SYNC = """
import json, os, sys, time
import torch.distributed as dist
import ftrun

rank = int(os.environ["RANK"])
dist.init_process_group(sys.argv[1])  # cuda:gloo: no CPU backend; the agents agree without it
for _ in range(3):
    with ftrun.section("step"):
        time.sleep(0.05 * (rank + 1))  # rank 1's steps take twice as long
    ftrun.heartbeat()
print(json.dumps(ftrun.calculate_timeouts(safety_factor=40)), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.torch
@pytest.mark.parametrize("backend", ["gloo", "cuda:gloo"])
def test_calculated_timeouts_agree_across_ranks(tmp_path: Path, script: WriteScript, backend: str) -> None:
    """Each rank calculates its own; the agent applies the largest, with no collective of the job's."""
    import json

    script("w.py", SYNC)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--heartbeat-timeout", "600", "w.py", backend)
    assert r.returncode == 0, r.stderr
    rank0, rank1 = (json.loads(r.log(0, k).splitlines()[-1]) for k in (0, 1))
    assert rank0["sections"]["step"] < rank1["sections"]["step"]  # each its own observation
    in_force = [e for e in r.events() if e["kind"] == "timeouts"][-1]
    assert in_force["sections"]["step"] == rank1["sections"]["step"]  # the largest any rank saw
    assert in_force["sections"]["step"] >= 0.1 * 40


SLOW_START = """
import os, sys, time
import ftrun

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
time.sleep(2 if attempt == 0 else 4)  # imports, init_process_group; a restart also loads a checkpoint
for _ in range(5):
    time.sleep(0.1)
    ftrun.heartbeat()
if attempt == 0:
    ftrun.calculate_timeouts()
    sys.exit(3)  # a crash after the timeouts were calculated
print("attempt", attempt, "finished", flush=True)
"""


def test_a_restarted_worker_with_a_slow_start_is_not_a_false_hang(tmp_path: Path, script: WriteScript) -> None:
    """The start-up is measured from the spawn, as it is judged, and a calculated one keeps a margin."""
    script("w.py", SLOW_START)
    r = run_ftrun(tmp_path, "--max-restarts", "1", "w.py")
    assert r.returncode == 0, r.stderr
    assert not hang_events(r)
    assert "attempt 1 finished" in r.log(1, 0)
    [in_force] = [e for e in r.events() if e["kind"] == "timeouts"]
    assert in_force["initial_heartbeat"] >= 2 + 60  # at least the start-up seen plus the margin


STOPS = """
import os, signal, time
import ftrun

def stopped_here():
    os.kill(os.getpid(), signal.SIGSTOP)  # a rank that cannot run: a frozen container, a debugger, SIGSTOP

for step in range(30):
    ftrun.heartbeat()
    time.sleep(0.05)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1" and step == 5:
        stopped_here()
print("done", flush=True)
"""


def test_a_stopped_rank_is_a_hang_read_without_suspending_and_killed_at_once(
    tmp_path: Path, script: WriteScript
) -> None:
    script("w.py", STOPS)
    flags = ["--nproc-per-node", "2", "--max-restarts", "1", "--heartbeat-timeout", "1"]
    # A grace period longer than this test may take: waiting it out for the stopped rank would fail the test.
    r = run_ftrun(tmp_path, *flags, "--shutdown-timeout", "600", "w.py")
    assert r.returncode == 0, r.stderr
    [hang] = hang_events(r)
    assert hang["rank"] == 1
    exit1 = next(e for e in r.events() if e["kind"] == "worker_exited" and e["rank"] == 1 and e["attempt"] == 0)
    assert exit1["signal"] == "SIGKILL"  # it could not handle SIGTERM: killed at once
    root: dict[str, Any] = r.report(0)["root_cause"]  # type: ignore[assignment]
    assert "stopped_here" in root["stacks"]  # read without suspending it (py-spy --nonblocking)


@pytest.mark.parametrize("warm", ["--warm=auto", "--no-warm"])
def test_a_hang_in_an_import_has_stacks_without_py_spy(
    tmp_path: Path, script: WriteScript, monkeypatch: pytest.MonkeyPatch, warm: str
) -> None:
    """Before any heartbeat and with no py-spy on PATH: the worker's client was attached before the job's code
    (warm: by the zygote; fresh: by ftrun's sitecustomize), so its fault handler writes the stacks. Attempt 1
    hangs: under --warm=auto its workers are forked once the pool is ready."""
    script(
        "slow_module.py",
        """
        import os, time
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "1":
            def importing_forever():
                time.sleep(120)
            importing_forever()
        """,
    )
    script("w.py", restarted_warm("import slow_module\nprint('imported', flush=True)\n"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # py-spy sits beside the interpreter, not here
    flags = [warm, "--preload", "json", "--max-restarts", "2", "--initial-heartbeat-timeout", "5"]
    r = run_ftrun(tmp_path, *flags, "w.py", env=POOL if warm != "--no-warm" else {})
    assert r.returncode == 0, r.stderr
    assert [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1] == [
        warm != "--no-warm"
    ]
    root: dict[str, Any] = r.report(1)["root_cause"]  # type: ignore[assignment]
    assert root["stacks"].startswith("(faulthandler)")
    assert "importing_forever" in root["stacks"]
    assert "zygote" not in root["stacks"]  # a warm worker's stacks end where a fresh one's do
    assert r.log(2, 0) == "imported\n"


CORRUPTIONS = {
    "stuck-mid-write": ("struct.pack_into('<Q', m, base, 12345)", "stuck mid-write"),  # an odd sequence number
    "garbage": (
        "m[base + 8 : base + SLOT_SIZE] = os.urandom(SLOT_SIZE - 8); "
        "IDLE.pack_into(m, base + OFF_IDLE, 0.0, 2**32 - 1, 0)",
        "impossible values",
    ),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_monitor_slot_is_a_failure_with_a_report_not_an_unwatched_rank(
    tmp_path: Path, script: WriteScript, corruption: str
) -> None:
    """A job that writes over its slot can no longer be watched for hangs: ftrun fails that rank with a
    report and restarts (no timeout set: nothing else would ever catch it), and the agent goes on."""
    write, why = CORRUPTIONS[corruption]
    script(
        "w.py",
        f"""
import mmap, os, struct, time
import ftrun
from ftrun.worker.layout import IDLE, OFF_IDLE, SLOT_SIZE, slot_offset

ftrun.heartbeat()
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["LOCAL_RANK"] == "1":
    with open(os.environ["FTRUN_MONITOR"], "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        base = slot_offset(1)
        {write}
    print("slot overwritten", flush=True)
    time.sleep(120)
print("done", flush=True)
""",
    )
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py")
    assert r.returncode == 0, r.stderr
    root: dict[str, Any] = r.report(0)["root_cause"]  # type: ignore[assignment]
    assert root["rank"] == 1
    assert "monitor slot in shared memory is corrupt" in root["hang"]
    assert why in root["hang"]
    assert "ROOT CAUSE  rank 1" in r.stderr
    assert "done" in r.log(1, 1)


SLOW_PY_SPY = """#!/bin/sh
touch "{marker}.dumping"
exec sleep 60
"""


@pytest.fixture
def slow_py_spy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A py-spy that takes a minute (as the real one can on a busy node: it allows 10 s per rank); returns the
    marker path: ``<marker>.dumping`` appears when a dump starts. A hang is declared (event, blame) only once
    the stacks are in: what ftrun did before that, it did without waiting for the dump."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "py-spy"
    (bin_dir / "py-spy").write_text(SLOW_PY_SPY.format(marker=marker))
    (bin_dir / "py-spy").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return marker


def test_a_signal_to_ftrun_is_acted_on_while_stacks_are_being_dumped(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun], slow_py_spy: Path
) -> None:
    script("w.py", "import time, ftrun\nftrun.heartbeat()\ntime.sleep(120)\n")
    f = LiveFtrun(tmp_path, "--heartbeat-timeout", "1", "w.py")
    live.append(f)
    until(lambda: slow_py_spy.with_suffix(".dumping").exists(), "a stack dump started")
    f.proc.send_signal(signal.SIGTERM)
    assert f.wait(30) != 0
    assert "SIGTERM" in f.stderr()
    assert not [e for e in f.events() if e["kind"] == "hang"]  # it left before the dump was done


def test_a_worker_failing_while_stacks_are_being_dumped_is_acted_on_at_once(
    tmp_path: Path, script: WriteScript, slow_py_spy: Path
) -> None:
    """Rank 1 hangs; while its stacks are read, rank 0 fails: the restart comes at once, and the second attempt
    ends the run long before the dump would have."""
    script(
        "w.py",
        f"""
import os, sys, time, ftrun
ftrun.heartbeat()
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    if os.environ["RANK"] == "1":
        time.sleep(120)
    while not os.path.exists({str(slow_py_spy.with_suffix(".dumping"))!r}):
        ftrun.heartbeat()
        time.sleep(0.05)
    sys.exit("rank 0 fails during the dump")
print("done", flush=True)
""",
    )
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "--heartbeat-timeout", "1", "w.py")
    assert r.returncode == 0, r.stderr
    assert not hang_events(r)  # acted on before the dump was done: rank 0's failure is the root cause
    root: dict[str, Any] = r.report(0)["root_cause"]  # type: ignore[assignment]
    assert root["rank"] == 0
    assert "rank 0 fails during the dump" in r.stderr
    assert "done" in r.log(1, 0)
