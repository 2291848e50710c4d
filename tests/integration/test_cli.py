"""The ftrun command itself: bad input, entry points, console script."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import LiveFtrun, WriteScript, run_ftrun


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--bogus", "w.py"], "--bogus"),
        (["--nproc-per-node", "0", "w.py"], "--nproc-per-node"),
        (["--nnodes", "3:1", "w.py"], "--nnodes"),
        (["missing.py"], "SCRIPT"),
        (["--no-python", "./not-exec.sh"], "--no-python"),
        (["--rdzv-conf", "join_timeout=abc", "w.py"], "--rdzv-conf join_timeout"),
        (["--nnodes", "2:4", "w.py"], "--nnodes"),
        (["--log-dir", "/proc/ftrun-logs", "w.py"], "--log-dir"),  # a directory nobody can make
        (["--log-dir", "a-file/logs", "w.py"], "--log-dir"),  # under a file
        (["--nproc-per-node", "2", "w.py"], "PET_MAX_RESTARTS (for --max-restarts)"),  # torchrun's variables named
        (["--master-port", "70000", "w.py"], "--master-port"),
        (["--rdzv-backend", "c10d", "--nnodes", "1:2", "--rdzv-endpoint", "host:abc", "w.py"], "--rdzv-endpoint"),
        (["--snapshot-memory", "10XB", "w.py"], "--snapshot-memory"),
        (["--hang-timeout", "-5", "w.py"], "--hang-timeout"),
        (["--config", "missing.toml", "w.py"], "--config"),
        (["--config", "bad.toml", "w.py"], "hang_timeout in"),  # the key and the file named
        (["--config", "a-file", "w.py"], "--config"),  # not TOML
        (["-m", "no.such.module"], "--module"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, script: WriteScript, args: list[str], flag: str) -> None:
    script("w.py", "open('started', 'w').close()\n")
    (tmp_path / "not-exec.sh").write_text("#!/bin/sh\n")
    (tmp_path / "a-file").write_text("this is not TOML\n")
    (tmp_path / "bad.toml").write_text('hang_timeout = "abc"\n')
    r = run_ftrun(tmp_path, *args, env={"PET_MAX_RESTARTS": "-1"} if flag.startswith("PET_") else None)
    assert r.returncode == 2
    assert r.stderr.startswith(f"ftrun: error: {flag}")
    assert len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "logs").exists()
    assert not (tmp_path / "started").exists()


def test_a_store_host_that_does_not_resolve_is_waited_for_then_named_with_exit_2(
    tmp_path: Path, script: WriteScript
) -> None:
    """Said at once (a store's pod may not be in DNS yet: waited for up to join_timeout), then one error line.
    ".invalid" never resolves (RFC 2606)."""
    script("w.py", "open('started', 'w').close()\n")
    endpoint = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "no-such-host.invalid:29400"]
    r = run_ftrun(tmp_path, "--nnodes", "2", *endpoint, "--rdzv-conf", "join_timeout=1", "w.py")
    assert r.returncode == 2, r.stderr
    waiting = [ln for ln in r.stderr.splitlines() if "no-such-host.invalid does not resolve" in ln]
    assert len(waiting) == 2, r.stderr  # the wait said once, and the error
    assert waiting[0].startswith("ftrun: the store's host")
    assert "join_timeout" in waiting[0]
    assert waiting[1].startswith("ftrun: error: --rdzv-endpoint: the store's host no-such-host.invalid")
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "started").exists()


def test_a_wait_for_a_store_host_that_does_not_resolve_ended_by_a_signal_says_how_long_it_waited(
    tmp_path: Path, script: WriteScript
) -> None:
    script("w.py", "open('started', 'w').close()\n")
    endpoint = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "no-such-host.invalid:29400"]
    live = LiveFtrun(tmp_path, "--nnodes", "2", *endpoint, "--rdzv-conf", "join_timeout=600", "w.py")
    try:
        live.wait_for_stderr("waiting up to 600 s")
        live.proc.send_signal(signal.SIGTERM)
        assert live.wait() == 2
    finally:
        live.close()
    [error] = [ln for ln in live.stderr().splitlines() if ln.startswith("ftrun: error: --rdzv-endpoint")]
    waited = re.search(r"waited (\d+) s", error)
    assert waited is not None, error
    assert int(waited.group(1)) < 60, error  # not the 600 s it would have waited


@pytest.mark.parametrize("nodes", [[], ["--nnodes", "2", "--rdzv-backend", "static", "--node-rank", "0"]])
def test_a_master_port_in_use_is_named_before_anything_starts(
    tmp_path: Path, script: WriteScript, nodes: list[str]
) -> None:
    """Else every attempt's rank 0 fails on EADDRINUSE, and the restarts are spent in vain."""
    script("w.py", "open('started', 'w').close()\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_ftrun(tmp_path, *nodes, "--max-restarts", "2", "--master-port", str(port), "w.py")
    assert r.returncode == 2
    assert r.stderr.startswith(f"ftrun: error: --master-port: {port} is already in use on this machine")
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "started").exists()


def test_module_entrypoint(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("VALUE = 42\n")
    (pkg / "train.py").write_text("import sys\nfrom .helper import VALUE\nprint(__name__, VALUE, sys.argv[1:])\n")
    r = run_ftrun(tmp_path, "-m", "pkg.train", "--x", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "__main__ 42 ['--x', '1']"


def test_no_python_entrypoint(tmp_path: Path) -> None:
    exe = tmp_path / "job.sh"
    exe.write_text('#!/bin/sh\necho "shell rank $RANK of $WORLD_SIZE: $1"\n')
    exe.chmod(0o755)
    r = run_ftrun(tmp_path, "--no-python", "--nproc-per-node", "2", "./job.sh", "hi")
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["shell rank 0 of 2: hi", "shell rank 1 of 2: hi"]


def test_run_path_entrypoint(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", "import sys\nprint(__name__, sys.argv)\n")
    r = run_ftrun(tmp_path, "--run-path", "w.py", "a")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"__main__ ['{tmp_path / 'w.py'}', 'a']"


def test_console_script_and_help() -> None:
    # Next to the interpreter, where pip installs console scripts (a pyenv shim may not exist yet).
    exe = Path(sys.executable).parent / "ftrun"
    assert exe.is_file(), "pip install -e . installs the ftrun command"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    for flag in ("--nproc-per-node", "--max-restarts", "--term-timeout", "--rdzv-conf", "--tee"):
        assert flag in out
    mod = subprocess.run([sys.executable, "-m", "ftrun", "--help"], capture_output=True, text=True, timeout=60)
    assert mod.returncode == 0
