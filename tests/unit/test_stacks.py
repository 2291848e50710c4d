"""A warm worker's stacks read as a fresh process's: the pool's frames below the job's are left out."""

from __future__ import annotations

from ftrun.monitor.stacks import as_fresh

WARM_PY_SPY = """Process 9378: python -u /tmp/job.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 9378 (idle): "MainThread"
    step (job.py:7)
    <module> (job.py:11)
    run (ftrun/warm/zygote.py:429)
    stand_by (ftrun/warm/zygote.py:269)
    fork_standby (ftrun/warm/zygote.py:221)
    main (ftrun/warm/zygote.py:138)
    <module> (ftrun/warm/zygote.py:447)
    _run_code (<frozen runpy>:88)
    _run_module_as_main (<frozen runpy>:198)
Thread 9542 (idle): "ftrun-collectives"
    _run (ftrun/worker/collectives.py:99)
    Thread._bootstrap (threading.py:1002)"""

WARM_FAULTHANDLER = """Thread 0x00007f5a1b7fe640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f5a2c1a7740 (most recent call first):
  File "/tmp/job.py", line 11 in <module>
  File "/venv/lib/python3.11/site-packages/ftrun/warm/zygote.py", line 429 in run
  File "/venv/lib/python3.11/site-packages/ftrun/warm/zygote.py", line 138 in main
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main"""


def test_a_warm_workers_py_spy_stacks_end_at_the_jobs_module() -> None:
    fresh = as_fresh(WARM_PY_SPY)
    assert "zygote" not in fresh
    assert "runpy" not in fresh
    main = fresh.split('"MainThread"\n')[1].split("\nThread ")[0]
    assert main.splitlines() == ["    step (job.py:7)", "    <module> (job.py:11)"]
    assert "    _run (ftrun/worker/collectives.py:99)\n    Thread._bootstrap (threading.py:1002)" in fresh
    assert fresh.startswith("Process 9378: python -u /tmp/job.py\nPython v3.11.7")


def test_a_warm_workers_faulthandler_stacks_end_at_the_jobs_module() -> None:
    fresh = as_fresh(WARM_FAULTHANDLER)
    assert fresh.endswith('(most recent call first):\n  File "/tmp/job.py", line 11 in <module>')
    assert 'File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap\n\nCurrent thread' in fresh


def test_a_fresh_process_stacks_are_left_as_they_are() -> None:
    module_run = 'Thread 1 (idle): "MainThread"\n    <module> (pkg/train.py:3)\n    _run_code (<frozen runpy>:88)'
    assert as_fresh(module_run) == module_run  # python -m: runpy's frames are the fresh process's own
    script = 'Thread 1 (idle): "MainThread"\n    <module> (train.py:3)'
    assert as_fresh(script) == script


def test_pool_frames_with_the_jobs_own_below_them_are_kept() -> None:
    odd = 'Thread 1 (idle): "MainThread"\n    run (ftrun/warm/zygote.py:429)\n    <module> (train.py:3)'
    assert as_fresh(odd) == odd
