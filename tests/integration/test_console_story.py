"""What a person reads on the console: the root cause first, the echoes of a failure summarised, only what is
true. Scripts that never import ftrun, a real DDP job among them."""

from __future__ import annotations

import re
from pathlib import Path

from tests.integration.harness import LiveFtrun, WriteScript, run_ftrun

DDP_CRASH = """
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(6):
    if step == 3 and rank == 1 and restart == 0:
        raise ValueError("bad batch at step 3")
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)
dist.destroy_process_group()
"""


def test_a_ddp_crash_reads_root_cause_first_with_its_echoes_summarised(tmp_path: Path, script: WriteScript) -> None:
    script("ddp.py", DDP_CRASH)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "ddp.py", timeout=300)
    assert r.returncode == 0, r.stderr
    err = r.stderr
    assert "warm pool" not in err  # how ftrun works is said with --verbose: every line here is the job's story
    banner = err.index("ROOT CAUSE  rank 1")
    assert "ValueError: bad batch at step 3" in err[banner:]
    # Rank 0's "Connection closed by peer" is in its log, not on the console ahead of the report.
    assert "[rank0]: Traceback" not in err
    assert err.index("restart 1 of 1") > err.index("=" * 78, banner)  # the decision after the report it answers
    assert re.search(r"STOPPED BY FTRUN rank 0 \(local rank 0, pid \d+\)", err)
    echo = re.search(r"RuntimeError: .*Connection closed by peer", r.log(0, 0, "stderr"))
    if echo:  # rank 0 noticed before it was stopped: the report says so, in one line
        assert "a secondary error, after the root cause: RuntimeError: " in err


ECHO_FIRST = """
import os, pathlib, signal, sys, time, traceback
rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
said = pathlib.Path("rank0-said")
if restart == 0 and rank == 0:  # rank 1's crash reaches rank 0 first, as a reset connection does, and it raises
    try:
        raise ConnectionResetError("peer vanished (echo-7f3a)")
    except ConnectionResetError:
        traceback.print_exc()
    said.touch()
    time.sleep(60)
if restart == 0 and rank == 1:  # then the crash itself, which the agent sees after the echo
    while not said.exists():
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_peers_traceback_written_just_before_the_crash_it_echoes_stays_off_the_console(
    tmp_path: Path, script: WriteScript
) -> None:
    """A busy agent may see a crash after its peer's echo of it was written: the echo's traceback waits a
    moment before the console, and the crash seen meanwhile keeps it there, in the log only."""
    script("w.py", ECHO_FIRST)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py")
    assert r.returncode == 0, r.stderr
    assert re.search(r"ROOT CAUSE  rank 1 .*killed by SIGKILL", r.stderr), r.stderr
    assert "peer vanished (echo-7f3a)" in r.log(0, 0, "stderr")
    assert "Traceback (most recent call last)" not in r.stderr, r.stderr  # the report sums it up in a line


def test_a_traceback_no_failure_follows_is_shown_on_the_console(tmp_path: Path, script: WriteScript) -> None:
    script(
        "w.py",
        "import logging, time\ntry:\n    1 / 0\nexcept ZeroDivisionError:\n"
        "    logging.exception('handled, training goes on (shown-9c1d)')\ntime.sleep(1.0)\nprint('done', flush=True)\n",
    )
    r = run_ftrun(tmp_path, "w.py")
    assert r.returncode == 0, r.stderr
    assert "handled, training goes on (shown-9c1d)" in r.stderr, r.stderr
    assert "ZeroDivisionError: division by zero" in r.stderr, r.stderr


TICKING = """
import os, sys, time, traceback
try:
    raise KeyError("handled (tick-3e8b)")
except KeyError:
    traceback.print_exc()  # then the job goes on, writing to stderr without a pause
n = 0
while not os.path.exists("seen"):
    print(f"tick {n}", file=sys.stderr, flush=True)
    n += 1
    time.sleep(0.02)
"""


def test_a_traceback_in_a_stream_that_never_pauses_is_shown_once_its_wait_is_over(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    script("w.py", TICKING)
    live.append(f := LiveFtrun(tmp_path, "w.py"))
    f.wait_for_stderr(r"^tick \d+$", timeout=30)  # the held traceback, then the lines after it
    (tmp_path / "seen").touch()
    assert f.wait() == 0
    err = f.stderr()
    assert err.index("KeyError: 'handled (tick-3e8b)'") < err.index("tick 0"), err


def test_last_words_on_stdout_are_shown_when_stderr_is_empty(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", "import sys\nprint('checkpoint dir not found: /data/ckpt', flush=True)\nsys.exit(4)\n")
    r = run_ftrun(tmp_path, "w.py")
    assert r.returncode == 1
    assert "nothing on stderr; last 1 lines of stdout:\n    checkpoint dir not found: /data/ckpt" in r.stderr
    assert "wrote nothing" not in r.stderr


def test_a_sigkill_is_not_blamed_on_the_oom_killer_when_the_kernel_counted_none(
    tmp_path: Path, script: WriteScript
) -> None:
    script("w.py", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    before = _oom_kills()
    r = run_ftrun(tmp_path, "w.py")
    assert r.returncode == 1
    assert "killed by SIGKILL" in r.stderr
    if _oom_kills() == before:  # nothing on this machine was OOM-killed meanwhile
        assert "out-of-memory" not in r.stderr


def test_a_clean_run_and_a_failure_with_no_restart_say_only_what_is_true(tmp_path: Path, script: WriteScript) -> None:
    script("ok.py", "print('fine')\n")
    clean = run_ftrun(tmp_path, "ok.py")
    assert clean.returncode == 0
    assert "run succeeded (exit 0) after 1 attempt(s), 0 restarts\n" in clean.stderr
    assert "down" not in clean.stderr
    assert "goodput" not in clean.stderr  # no step and no failure: nothing to say
    script("bad.py", "raise SystemExit(5)\n")
    failed = run_ftrun(tmp_path, "--log-dir", str(tmp_path / "bad"), "bad.py")
    assert failed.returncode == 1
    assert "from the failure to the end" in failed.stderr
    assert "between failure and restart" not in failed.stderr


def _oom_kills() -> int | None:
    from ftrun.observe.reporting import oom_kills

    return oom_kills()
