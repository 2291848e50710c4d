"""Restarts and failure reports with real worker processes."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from tests.integration.harness import WriteScript, run_ftrun

CRASH_FIRST_ATTEMPT = """
import json, os, sys
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"]
keys += ["TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"]
print(json.dumps({k: os.environ[k] for k in keys}), flush=True)
# Rank 1 fails only after rank 0 has printed: opening a FIFO blocks until both ends are open.
if attempt == 0 and os.environ["RANK"] == "1":
    open("both-printed", "rb").close()
    sys.exit(3)
if attempt == 0:
    printed = open("both-printed", "wb")
    import time; time.sleep(60)  # rank 0 is busy when rank 1 fails: ftrun must stop it
"""


def test_crash_of_one_rank_restarts_all_then_succeeds(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", CRASH_FIRST_ATTEMPT)
    os.mkfifo(tmp_path / "both-printed")
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "2", "--term-timeout", "10", "w.py")
    assert r.returncode == 0, r.stderr
    envs = {(a, rank): json.loads(r.log(a, rank)) for a in (0, 1) for rank in (0, 1)}
    assert {e["TORCHELASTIC_RESTART_COUNT"] for (a, _), e in envs.items() if a == 1} == {"1"}
    # a fresh MASTER_PORT for the new attempt: nothing stale from the last one
    assert envs[0, 0]["MASTER_PORT"] == envs[0, 1]["MASTER_PORT"] != envs[1, 0]["MASTER_PORT"]
    assert envs[1, 1]["TORCHELASTIC_ERROR_FILE"].endswith("attempt_1/1/error.json")
    report = r.report(0)
    assert report["root_cause"]["rank"] == 1  # type: ignore[index]
    assert report["root_cause"]["exit_code"] == 3  # type: ignore[index]
    assert [o["rank"] for o in report["stopped_by_ftrun"]] == [0]  # type: ignore[union-attr]
    assert "ROOT CAUSE  rank 1" in r.stderr
    assert "STOPPED BY FTRUN rank 0" in r.stderr
    kinds = [e["kind"] for e in r.events()]
    for kind in (
        "run_started",
        "worker_spawned",
        "worker_exited",
        "group_stopping",
        "group_stopped",
        "failure",
    ):
        assert kind in kinds
    assert kinds.count("attempt_started") == 2
    assert kinds.count("restart") == 1
    assert kinds[-1] == "run_finished"
    assert "run succeeded (exit 0) after 2 attempt(s), 1 restart" in r.stderr


def test_budget_spent_exits_1_with_one_report_per_failure(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", "import os, sys\nsys.exit(4 if os.environ['RANK'] == '1' else 0)\n")
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py")
    assert r.returncode == 1
    for attempt in (0, 1):
        assert r.report(attempt)["root_cause"]["rank"] == 1  # type: ignore[index]
        assert r.report(attempt)["will_restart"] is (attempt == 0)
    assert r.stderr.count("ROOT CAUSE") == 2
    # torchrun's fields, as it spells them: scripts that parse its root cause block find them
    assert re.search(r"\n  time      : \d{4}-\d\d-\d\d_\d\d:\d\d:\d\d\n  host      : \S+\n", r.stderr), r.stderr
    assert "\n  rank      : 1 (local_rank: 1)\n  exitcode  : 4 (pid: " in r.stderr
    assert "\n  error_file: <N/A>\n" in r.stderr
    assert "not restarting" in r.stderr
    assert "run failed (exit 1)" in r.stderr


def test_success_needs_no_restart(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", "import os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])\n")
    r = run_ftrun(tmp_path, "--nproc-per-node", "3", "w.py")
    assert r.returncode == 0, r.stderr
    assert sorted(line for line in r.stdout.splitlines()) == [f"rank {i} of 3" for i in range(3)]
    assert not (r.run_dir / "attempt_1").exists()


def test_death_by_signal_is_named(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    r = run_ftrun(tmp_path, "w.py")
    assert r.returncode == 1
    assert "killed by SIGSEGV" in r.stderr
    assert r.report(0)["root_cause"]["signal"] == "SIGSEGV"  # type: ignore[index]


def test_port_taken_when_workers_bind_it_is_reported(tmp_path: Path, script: WriteScript) -> None:
    """Taken after ftrun chose it (a --master-port taken before is refused at start: test_cli)."""
    script(
        "w.py",
        """
        import os, socket
        port = int(os.environ["MASTER_PORT"])
        squatter = socket.socket()
        squatter.bind(("127.0.0.1", port))  # someone else, between ftrun's choice and the bind
        squatter.listen()
        s = socket.socket()
        s.bind(("127.0.0.1", port))  # what TCPStore does on rank 0
        """,
    )
    r = run_ftrun(tmp_path, "w.py")
    assert r.returncode == 1
    [started] = [e for e in r.events() if e["kind"] == "attempt_started"]
    assert f"MASTER_PORT {started['master_port']} was already in use" in r.stderr


MISSING_MODULE = "import no_such_module_for_ftrun_tests\n"
# Steps (heartbeats, no step named), then fails alike at every attempt: a long job's sporadic fault.
FAILS_AFTER_STEPPING = """
import sys, time
import ftrun
for _ in range(3):
    ftrun.heartbeat()
    time.sleep(0.05)
sys.exit(5)
"""


def test_the_same_failure_three_times_before_the_first_step_stops_the_restarts(
    tmp_path: Path, script: WriteScript
) -> None:
    """A crash loop (a missing module) does not burn the whole budget: after the same failure 3 times in a row
    ftrun says so, with the error, and stops; the summary's root causes keep the error."""
    script("w.py", MISSING_MODULE)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "10", "w.py")
    assert r.returncode == 1
    attempts = [e for e in r.events() if e["kind"] == "attempt_started"]
    assert len(attempts) == 3, r.stderr
    assert "the same failure 3 times in a row (exit code 1: ModuleNotFoundError: No module named" in r.stderr
    assert "before the first step): not restarting" in r.stderr
    assert "root cause: rank 0 (local rank 0" in r.stderr
    assert r.stderr.count("exit code 1: ModuleNotFoundError: No module named") >= 4  # the verdict and summary


def test_without_a_crash_loop_limit_the_budget_is_spent_as_under_torchrun(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", MISSING_MODULE)
    r = run_ftrun(tmp_path, "--nproc-per-node", "1", "--max-restarts", "4", "--crash-loop-limit", "0", "w.py")
    assert r.returncode == 1
    assert len([e for e in r.events() if e["kind"] == "attempt_started"]) == 5
    assert "restart budget spent" in r.stderr


def test_failures_alike_after_the_first_step_at_no_named_step_are_not_a_crash_loop(
    tmp_path: Path, script: WriteScript
) -> None:
    script("w.py", FAILS_AFTER_STEPPING)
    r = run_ftrun(tmp_path, "--nproc-per-node", "1", "--max-restarts", "4", "w.py")
    assert r.returncode == 1
    assert len([e for e in r.events() if e["kind"] == "attempt_started"]) == 5
    assert "times in a row" not in r.stderr
