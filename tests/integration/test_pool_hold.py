"""A zygote still preloading stands still while a restart is under way, with real zygote processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftrun.testing.clock import FakeClock
from ftrun.warm.pool import WarmPool
from tests.integration.harness import until

# Preloading this takes as long as the test needs: it says it started, then sleeps in its import.
SLOW_MODULE = """
import os, pathlib, time
pathlib.Path(os.environ["SLOW_STARTED"]).write_text("started")
time.sleep(600)
"""


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2 :].split()[0].decode()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pool(tmp_path: Path, clock: FakeClock) -> Iterator[WarmPool]:
    (tmp_path / "slowmod.py").write_text(SLOW_MODULE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SLOW_STARTED": str(tmp_path / "started")}
    p = WarmPool(sys.executable, ["slowmod"], env, auto=False, standbys=1, clock=clock)
    p.start(tmp_path / "pool.log", lambda text: None, lambda info: None, lambda text: None)
    try:
        yield p
    finally:
        p.close()


def test_a_zygote_still_preloading_stands_still_from_a_failure_to_the_refill(
    pool: WarmPool, tmp_path: Path, clock: FakeClock
) -> None:
    until((tmp_path / "started").exists, "the zygote started preloading")
    base, preloading = sorted(pool._zygotes, key=lambda z: len(z.preload))
    until(base.poll, "the base zygote is ready")

    pool.hold()
    assert pool.holding
    until(lambda: state(preloading.proc.pid) == "T", "the preloading zygote stopped")
    assert state(base.proc.pid) != "T"  # a ready zygote forks the restart's workers: never held

    pool.workers_started()
    pool.tend()
    assert state(preloading.proc.pid) == "T"  # not before the refill
    assert pool.holding
    refill = pool.seconds_to_refill()
    assert refill is not None
    clock.advance(refill)
    pool.tend()
    assert not pool.holding
    until(lambda: state(preloading.proc.pid) != "T", "the preloading zygote went on")


def test_a_hold_ends_when_the_agent_waits_with_nothing_to_start(pool: WarmPool, tmp_path: Path) -> None:
    """An elastic job waits for its rendezvous between the stop and the start: preloading goes on meanwhile."""
    until((tmp_path / "started").exists, "the zygote started preloading")
    preloading = max(pool._zygotes, key=lambda z: len(z.preload))
    pool.hold()
    until(lambda: state(preloading.proc.pid) == "T", "the preloading zygote stopped")
    pool.go_on()
    assert not pool.holding
    until(lambda: state(preloading.proc.pid) != "T", "the preloading zygote went on")


def test_no_zygote_is_retired_while_a_restart_is_under_way(tmp_path: Path, clock: FakeClock) -> None:
    """A bigger zygote that is ready replaces the smaller ones, but not before the refill: the teardown of a
    zygote takes a core for milliseconds."""
    p = WarmPool(sys.executable, ["json"], dict(os.environ), auto=False, standbys=1, clock=clock)
    p.start(tmp_path / "pool.log", lambda text: None, lambda info: None, lambda text: None)
    try:
        base, bigger = sorted(p._zygotes, key=lambda z: len(z.preload))
        until(lambda: base.poll() and bigger.poll(), "both zygotes are ready")
        p.hold()
        p.workers_started()
        p.tend()
        assert p._zygotes == [base, bigger]
        clock.advance(p.seconds_to_refill() or 0.0)
        p.tend()
        assert p._zygotes == [bigger]
    finally:
        p.close()


@pytest.mark.parametrize("spare", [False, True])
def test_after_cold_spawns_a_preloading_zygote_waits_for_the_first_step_unless_a_core_is_spare(
    tmp_path: Path, clock: FakeClock, spare: bool
) -> None:
    """Restarted workers that started without a preloaded zygote import what it imports: on a node with no core
    to spare it stands still past the refill, until the agent sees the attempt's first step (go_on)."""
    (tmp_path / "slowmod.py").write_text(SLOW_MODULE)
    (tmp_path / "w.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SLOW_STARTED": str(tmp_path / "started")}
    cores = len(os.sched_getaffinity(0))
    p = WarmPool(sys.executable, ["slowmod"], env, auto=False, standbys=1, workers=0 if spare else cores, clock=clock)
    p.start(tmp_path / "pool.log", lambda text: None, lambda info: None, lambda text: None)
    try:
        until((tmp_path / "started").exists, "the zygote started preloading")
        preloading = max(p._zygotes, key=lambda z: len(z.preload))
        p.workers_started()  # the first attempt's: beside it the zygotes must get ready, for the restarts
        p.hold()  # a restart
        with open(os.devnull, "wb") as out:
            handle = p.spawn([sys.executable, "-u", str(tmp_path / "w.py")], env, tmp_path, out.fileno(), out.fileno())
        assert not getattr(handle, "warm", False)  # the base zygote's, or fresh: cold
        p.workers_started()
        clock.advance(p.seconds_to_refill() or 0.0)
        p.tend()
        assert p.holding is not spare
        if not spare:
            # SIGSTOP is delivered when the zygote is next scheduled: on a loaded machine it shows R a moment more
            until(lambda: state(preloading.proc.pid) == "T", "the preloading zygote stands still")
            p.go_on()  # the agent saw the first step
        until(lambda: state(preloading.proc.pid) != "T", "the preloading zygote went on")
        handle.reap()
    finally:
        p.close()


# Run in a process of its own: forked workers are adopted by a child subreaper, as the agent is (pytest is not).
HEARD_LATE = """
import json, os, select, sys, time
from pathlib import Path
from ftrun.procs import proctree
from ftrun.testing.clock import FakeClock
from ftrun.warm.pool import WarmPool

def state(pid):
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rfind(b")") + 2 :].split()[0].decode()

def until(check):
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)

proctree.become_subreaper()
tmp = Path(sys.argv[1])
p = WarmPool(sys.executable, ["json"], dict(os.environ), auto=False, standbys=1, clock=FakeClock())
p.start(tmp / "pool.log", print, lambda info: None, print)
bigger = max(p._zygotes, key=lambda z: len(z.preload))
until(lambda: select.select([bigger._sock], [], [], 0)[0])  # it said it is ready
time.sleep(0.2)  # and forked its standby
p.hold()  # the failure: the agent has not read that yet
until(lambda: state(bigger.proc.pid) == "T")
warm = []
with open(os.devnull, "wb") as out:
    for _ in range(2):  # more workers than standbys forked ahead: the zygote must fork one now
        h = p.spawn([sys.executable, "-u", str(tmp / "w.py")], dict(os.environ), tmp, out.fileno(), out.fileno())
        warm.append(getattr(h, "warm", False))
        h.reap()
kept = bigger in p._zygotes
print(json.dumps({"warm": warm, "kept": kept, "state": state(bigger.proc.pid) if kept else "gone"}))
p.close()
"""


def test_a_zygote_ready_but_not_yet_heard_from_is_not_held_and_serves_the_restart(tmp_path: Path) -> None:
    """Seen on an H100: the zygote's "ready" sat unread in its socket when a failure came, so the hold stopped
    it (SIGSTOP); the restart then read "ready", asked the stopped zygote for a second worker, waited 10 s for
    the fork and dropped it: both workers started cold, 10 s late. A zygote heard to be ready goes on."""
    (tmp_path / "w.py").write_text("")
    done = subprocess.run(
        [sys.executable, "-c", HEARD_LATE, str(tmp_path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"warm": [True, True], "kept": True, "state": "S"}, done.stdout
