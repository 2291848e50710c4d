"""What a run writes is its user's alone: directories 0700, files 0600, nothing written through a planted symlink."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from ftrun.node import ports
from tests.integration.harness import WriteScript, run_ftrun

FAILS_ONCE = """
import os, sys
print("secret output", flush=True)
sys.exit(3 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" else 0)
"""


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


def test_a_runs_directories_and_the_files_ftrun_writes_are_private(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", FAILS_ONCE)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py")
    assert r.returncode == 0, r.stderr
    found = modes(r.run_dir)
    ours = {"events.jsonl", "status.json", "attempt_0/failure_report.json", "attempt_0/0/stdout.log",
            "attempt_1/1/stderr.log"}  # fmt: skip
    assert ours <= set(found), sorted(found)
    # Directories 0700, files 0600: the job wrote none here (a file the job writes keeps the job's own mode).
    loose = {name: oct(mode) for name, mode in found.items() if mode & 0o077}
    assert not loose
    assert {mode for name, mode in found.items() if (r.run_dir / name).is_dir()} == {0o700}


def run_in(tmp: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """ftrun with TMPDIR=``tmp`` and no --log-dir: its default log directory is there."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    argv = [sys.executable, "-m", "ftrun", "--rdzv-id", "private", *args]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_default_log_directory_is_the_users_own(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", "print('hello')\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = run_in(tmp, tmp_path, "w.py")
    assert r.returncode == 0, r.stderr
    base = tmp / f"ftrun-{os.geteuid()}"
    assert stat.S_IMODE(base.stat().st_mode) == 0o700
    assert (base / "private" / "attempt_0" / "0" / "stdout.log").read_text() == "hello\n"


def test_a_planted_symlink_for_the_default_log_directory_is_refused(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", "print('secret')\n")
    tmp, elsewhere = tmp_path / "tmp", tmp_path / "someone-elses"
    tmp.mkdir()
    elsewhere.mkdir()
    (tmp / f"ftrun-{os.geteuid()}").symlink_to(elsewhere)
    r = run_in(tmp, tmp_path, "w.py")
    assert r.returncode == 2, r.stderr
    assert "is a symbolic link" in r.stderr
    assert "--log-dir" in r.stderr
    assert list(elsewhere.iterdir()) == []  # nothing went there


def test_the_port_ledger_is_never_written_through_a_symlink(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    ledger = tmp_path / "ftrun-ports.json"
    ledger.symlink_to(precious)
    port = ports.reserve_port("127.0.0.1", 100.0, ledger)
    assert 0 < port < 65536  # the kernel's choice alone
    assert precious.read_text() == "keep me"
