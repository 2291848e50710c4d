"""The warm pool knows what to preload before the first crash, with no help from the job, and never costs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import POOL, WAITS_FOR_THE_POOL, Result, WriteScript, run_ftrun


def kinds(r: Result, kind: str) -> list[dict[str, Any]]:
    return [e for e in r.events() if e["kind"] == kind]


def cached(tmp_path: Path) -> list[str]:
    [entry] = list((tmp_path / "ftrun-cache" / "warm").glob("*.json"))  # FTRUN_CACHE_DIR, set by tests/conftest.py
    modules: list[str] = json.loads(entry.read_text())["modules"]
    return modules


IMPORTS_THEN_DIES = (
    WAITS_FOR_THE_POOL
    + """
import os, signal, sys
import decimal, fractions
import statistics  # never calls ftrun
import torch.distributed as dist
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    wait_for_the_pool()  # this test's story is what the pool preloads, not whether it is ready before a failure
    dist.init_process_group("gloo")  # the job meets its peers: its imports have settled
    os.kill(os.getpid(), signal.SIGKILL)  # before its first step, and no report at exit
print("restarted", flush=True)
os._exit(0)  # no report at exit: all that is learned comes from attempt 0
"""
)


@pytest.mark.torch
def test_imports_are_known_before_a_worker_is_killed_and_kept_for_the_next_run(
    tmp_path: Path, script: WriteScript
) -> None:
    script("w.py", IMPORTS_THEN_DIES)
    r = run_ftrun(tmp_path, "--max-restarts", "1", "w.py", timeout=240)
    assert r.returncode == 0, r.stderr
    # Before any worker ran, the entry script's top-level imports were being preloaded.
    assert "statistics" in cached(tmp_path)
    learned = cached(tmp_path)
    assert {"decimal", "fractions", "statistics"} <= set(learned)
    # Everything the worker imported, not only the script's own lines: its report, written as it met its peers.
    assert "numbers" in learned  # fractions imports it
    assert "torch.distributed.distributed_c10d" in learned
    # A rerun of the same job starts its preloading zygote with what the last run learned.
    again = run_ftrun(tmp_path, "--log-dir", str(tmp_path / "again"), "--max-restarts", "1", "w.py", timeout=240)
    again.run_dir = tmp_path / "again" / "t"
    assert again.returncode == 0, again.stderr
    preloads = [e["preload"] for e in kinds(again, "pool_ready")]
    assert max(preloads) >= len(learned), preloads


TORCH_THREADS = (
    WAITS_FOR_THE_POOL
    + """
import os, sys
import torch
print(torch.get_num_threads(), flush=True)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    if os.environ.get("WAIT_FOR_POOL"):
        wait_for_the_pool()
    sys.exit(3)
"""
)


@pytest.mark.torch
def test_one_worker_with_torch_restarts_warm_with_its_own_threads(
    tmp_path: Path, script: WriteScript, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker per node leaves OMP_NUM_THREADS unset: the pool must stay safe to fork, and the worker must
    get torch's own default, not the pool's pinned single thread."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script("w.py", TORCH_THREADS)
    threads = {}
    for name, flags in (("warm", []), ("cold", ["--no-warm"])):
        env = POOL if name == "warm" else {}
        r = run_ftrun(tmp_path, "--log-dir", str(tmp_path / name), "--max-restarts", "1", *flags, "w.py", env=env)
        r.run_dir = tmp_path / name / "t"
        assert r.returncode == 0, r.stderr
        assert "warm pool off" not in r.stderr
        restarted = [e["warm"] for e in kinds(r, "worker_spawned") if e["attempt"] == 1]
        assert restarted == [name == "warm"]
        assert f"1 restart ({name})" in r.stderr  # the summary says which
        threads[name] = (r.log(0, 0), r.log(1, 0))
    assert threads["warm"] == threads["cold"]


def test_no_pool_when_no_restart_can_come(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", "import json\nprint('ran')\n")
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "w.py")  # --max-restarts 0, a static job
    assert r.returncode == 0, r.stderr
    assert not kinds(r, "pool_ready")
    assert [e["warm"] for e in kinds(r, "worker_spawned")] == [False, False]
    assert "warm pool" not in r.stderr


IMPORTS_LAZILY = """
import os, signal
import ftrun
for step in range(1, 20):
    if step == 3:
        import fractions  # a lazy import after the first steps (DDP's, the optimizer's, torch._dynamo are such)
    ftrun.heartbeat(step=step)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and step == 10:
        os.kill(os.getpid(), signal.SIGKILL)  # no report at exit
os._exit(0)  # nor here: all that is learned comes from attempt 0's steps
"""


def test_what_the_job_imports_after_its_first_step_is_learned_before_a_crash(
    tmp_path: Path, script: WriteScript
) -> None:
    script("w.py", IMPORTS_LAZILY)
    r = run_ftrun(tmp_path, "--max-restarts", "1", "w.py")
    assert r.returncode == 0, r.stderr
    assert "fractions" in cached(tmp_path)


GROWS = """
import json, os, pathlib, signal, sys, time
import torch
import ftrun
events = pathlib.Path(os.environ["TORCHELASTIC_ERROR_FILE"]).parents[2] / "events.jsonl"
for step in range(1, 4):
    ftrun.heartbeat(step=step)
    if step == 2:
        import torch.distributed.checkpoint  # a lazy import of many modules, after the first step
print("restart", os.environ["TORCHELASTIC_RESTART_COUNT"], "has", "torch.distributed.checkpoint" in sys.modules)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    deadline = time.monotonic() + 60
    while not any(json.loads(line).get("grown_from") for line in events.read_text().splitlines()):
        assert time.monotonic() < deadline, "no zygote grown in 60 s"
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.torch
def test_the_zygote_for_what_the_workers_imported_grows_from_the_one_with_the_scripts_imports(
    tmp_path: Path, script: WriteScript
) -> None:
    """The zygote preloading what the workers reported is forked from the ready one that preloaded the script's
    imports, and imports only the rest: torch is imported once on the node, not once per zygote. The restart
    forks from it, with everything preloaded."""
    script("w.py", GROWS)
    r = run_ftrun(tmp_path, "--max-restarts", "1", "w.py", timeout=180)
    assert r.returncode == 0, r.stderr
    ready = {e["pid"]: e for e in kinds(r, "pool_ready")}
    [grown] = [e for e in ready.values() if e.get("grown_from")]
    parent = ready[grown["grown_from"]]
    assert "torch" in cached(tmp_path)
    assert grown["preload"] > parent["preload"] > 0, ready
    assert grown["loaded"] > parent["loaded"], ready  # its parent's modules are counted as its own
    assert [e["warm"] for e in kinds(r, "worker_spawned") if e["attempt"] == 1] == [True]
    assert "restart 1 has True" in r.log(1, 0)  # preloaded: imported before the script ran
