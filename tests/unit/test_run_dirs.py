"""Run directories: named after the script and its start when the run has torchrun's default id; the default
log directory keeps the newest runs, and says what it removed; a --log-dir of one's own keeps everything."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

from ftrun.cli import main as cli
from ftrun.procs.logs import KEEP_RUNS, open_run_dir


@pytest.fixture
def default_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path / f"ftrun-{os.geteuid()}"


def old_runs(base: Path, count: int, hours_ago: float) -> list[Path]:
    base.mkdir(mode=0o700, exist_ok=True)
    runs = []
    for i in range(count):
        run = base / f"old-{i}"
        run.mkdir()
        (run / "events.jsonl").write_text("{}\n")
        stamp = time.time() - hours_ago * 3600 - i  # old-0 the newest
        os.utime(run / "events.jsonl", (stamp, stamp))
        runs.append(run)
    return runs


def test_a_run_without_an_id_is_named_after_its_script_and_start(default_logs: Path) -> None:
    run_dir, said = open_run_dir(cli.parse(["train.py"], {}, default_logs.parent))
    assert run_dir.parent == default_logs
    assert run_dir.name.startswith("train-")
    assert run_dir.name[6:].replace("-", "").isdigit()
    assert said == ""


def test_the_default_log_directory_keeps_the_newest_runs_and_says_what_it_removed(default_logs: Path) -> None:
    runs = old_runs(default_logs, KEEP_RUNS + 3, hours_ago=2)
    running = default_logs / "still-going"  # started a day ago, still writing its status
    running.mkdir()
    (running / "events.jsonl").write_text("{}\n")
    os.utime(running / "events.jsonl", (time.time() - 86400, time.time() - 86400))
    (running / "status.json").write_text("{}")  # rewritten every second while it runs
    _, said = open_run_dir(cli.parse(["train.py"], {}, default_logs.parent))
    assert said == f"removed 4 old run(s) from {default_logs} (it keeps the {KEEP_RUNS} newest; --log-dir keeps all)"
    assert [r.exists() for r in runs] == [True] * (KEEP_RUNS - 1) + [False] * 4  # the oldest go
    assert running.exists()  # the newest by its status: one of the 20


def test_a_log_dir_of_ones_own_keeps_every_run(default_logs: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    runs = old_runs(mine, KEEP_RUNS + 3, hours_ago=2)
    _, said = open_run_dir(cli.parse(["--log-dir", str(mine), "train.py"], {}, tmp_path))
    assert said == ""
    assert all(r.exists() for r in runs)
