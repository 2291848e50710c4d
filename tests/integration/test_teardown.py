"""A worker whose script ended but whose interpreter never does: a non-daemon thread that never returns, left
after "training complete" (as users report of uploaders, loggers, data prefetchers), fresh or warm. The run
ends within --teardown-timeout once the script ended, with the script's result; what was stuck is said, its
stacks in the rank's log, and in ``ftrun report``; no hang is blamed on a collective of the group the script
had destroyed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import POOL, WAIT_S, WriteScript, restarted_warm, run_ftrun

pytestmark = pytest.mark.torch

TRAINS_THEN_LEAVES_A_THREAD = """
import os, threading, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(2) * (dist.get_rank() + 1)
dist.all_reduce(t)
gathered = [torch.zeros(2) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, t)
dist.destroy_process_group()

def upload_forever():  # nobody ever stops it, and it is no daemon: Python joins it at exit, for ever
    while True:
        time.sleep(0.1)

if os.environ["RANK"] == "1":
    threading.Thread(target=upload_forever, name="uploader").start()
print(f"training complete: {t.tolist()}", flush=True)
"""


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_a_thread_left_after_training_complete_ends_within_the_bound_with_the_scripts_result(
    tmp_path: Path, script: WriteScript, warm: bool
) -> None:
    if warm:  # the first attempt fails once the pool is ready: the body runs warm at attempt 1
        script("w.py", restarted_warm(TRAINS_THEN_LEAVES_A_THREAD))
        flags, env, attempt = ["--preload", "json", "--max-restarts", "1"], POOL, 1
    else:
        script("w.py", TRAINS_THEN_LEAVES_A_THREAD)
        flags, env, attempt = ["--no-warm"], None, 0
    # A timeout on the run is the test's bound: before, a fresh worker's run still waited after 100 s.
    r = run_ftrun(tmp_path, *flags, "--nproc-per-node", "2", "--teardown-timeout", "2", "w.py", env=env, timeout=90)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("training complete: [3.0, 3.0]") == 2, r.stdout
    events = r.events()
    spawned = [e["warm"] for e in events if e["kind"] == "worker_spawned" and e["attempt"] == attempt]
    assert spawned == [warm, warm]
    stuck = [e for e in events if e["kind"] == "teardown_stuck"]
    assert [(e["rank"], e["end_code"]) for e in stuck] == [(1, 0)], stuck
    assert not [e for e in events if e["kind"] == "hang"], r.stderr  # no collective of a destroyed group blamed
    exits = {e["rank"]: e["state"] for e in events if e["kind"] == "worker_exited" and e["attempt"] == attempt}
    assert exits == {0: "succeeded", 1: "succeeded"}  # the script's result, not the kill's
    assert "rank 1" in r.stderr
    assert "the interpreter's teardown is stuck" in r.stderr
    log = r.log(attempt, 1, "stderr")
    assert "stuck in interpreter teardown" in log
    assert "upload_forever" in log  # the thread that held it, in its stacks
    report = subprocess.run(
        [sys.executable, "-m", "ftrun", "report", str(r.run_dir)], capture_output=True, text=True, timeout=WAIT_S
    )
    assert report.returncode == 0, report.stderr
    [said] = [line for line in report.stdout.splitlines() if "teardown:" in line]
    assert "rank 1: its script ended (exit code 0)" in said, report.stdout
    assert f"attempt_{attempt}/1/stderr.log" in said, said
