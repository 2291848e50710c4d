"""No orphans: signals to ftrun, SIGKILL of ftrun, stubborn workers and grandchildren."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import pytest

from tests.integration.harness import LiveFtrun, WriteScript, processes_of, run_ftrun, wait_gone

SLEEPER = """
import os, signal, sys, time
def on_signal(signum, frame):
    print(f"rank {os.environ['RANK']} got {signal.Signals(signum).name}", flush=True)
    sys.exit(0)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(s, on_signal)
print(f"ready {os.getpid()}", flush=True)
time.sleep(600)
"""

STUBBORN = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"ready {os.getpid()}", flush=True)
time.sleep(600)
"""

WITH_GRANDCHILDREN = """
import os, subprocess, sys, time
same_group = subprocess.Popen(["sleep", "600"])
own_session = subprocess.Popen(["sleep", "601"], start_new_session=True)
print(f"ready {os.getpid()} {same_group.pid} {own_session.pid}", flush=True)
# Rank 1 fails only after rank 0 has printed: opening a FIFO blocks until both ends are open.
if os.environ["RANK"] == "1":
    open("both-ready", "rb").close()
    sys.exit(1)
ready = open("both-ready", "wb")
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_to_ftrun_is_handed_on_to_the_workers(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun], sig: int
) -> None:
    script("w.py", SLEEPER)
    f = LiveFtrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "3", "w.py")
    live.append(f)
    pids = [int(m.group(1)) for m in f.wait_for_lines(r"ready (\d+)", 2)]
    f.proc.send_signal(sig)
    assert f.wait() == 128 + sig
    name = signal.Signals(sig).name
    f.wait_for_lines(rf"rank \d got {name}", 2)  # the workers saw ftrun's signal (as torchrun's), not SIGKILL
    assert wait_gone(pids) == []
    events = [json.loads(line) for line in (f.run_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["kind"] == "run_finished"
    assert events[-1]["exit_code"] == 128 + sig
    assert "restart" not in [e["kind"] for e in events]  # a signal is not a failure to restart from


def test_slurms_preemption_warning_reaches_the_script(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    """``--signal=USR1@90``: with SIGUSR1 among --signals-to-handle the workers get it, and may checkpoint."""
    script("w.py", SLEEPER)
    f = LiveFtrun(tmp_path, "--nproc-per-node", "2", "--signals-to-handle", "SIGTERM,SIGUSR1", "w.py")
    live.append(f)
    f.wait_for_lines(r"ready (\d+)", 2)
    f.proc.send_signal(signal.SIGUSR1)
    assert f.wait() == 128 + signal.SIGUSR1
    f.wait_for_lines(r"rank \d got SIGUSR1", 2)


def test_a_signal_ftrun_does_not_hand_on_still_ends_it_cleanly(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    """SIGUSR1 is not among the default --signals-to-handle: the workers get SIGTERM, and the run ends with
    its events and summary (it used to kill ftrun without a word)."""
    script("w.py", SLEEPER)
    f = LiveFtrun(tmp_path, "--nproc-per-node", "2", "w.py")
    live.append(f)
    f.wait_for_lines(r"ready (\d+)", 2)
    f.proc.send_signal(signal.SIGUSR1)
    assert f.wait() == 128 + signal.SIGUSR1
    f.wait_for_lines(r"rank \d got SIGTERM", 2)
    assert "SIGUSR1 is not in --signals-to-handle" in f.stderr()
    assert "run interrupted" in f.stderr()


def test_sigkill_of_ftrun_leaves_no_worker(tmp_path: Path, script: WriteScript, live: list[LiveFtrun]) -> None:
    script("w.py", STUBBORN)
    f = LiveFtrun(tmp_path, "--nproc-per-node", "2", "w.py")
    live.append(f)
    pids = [int(m.group(1)) for m in f.wait_for_lines(r"ready (\d+)", 2)]
    f.proc.kill()
    f.wait()
    assert wait_gone(pids) == []  # the parent-death signal is immediate; the bound is only a bound


def terminate_a_stubborn_worker(tmp_path: Path, script: WriteScript, live: list[LiveFtrun], *flags: str) -> LiveFtrun:
    """ftrun with ``flags`` and one worker that ignores SIGTERM, sent SIGTERM once the worker is ready."""
    script("w.py", STUBBORN)
    f = LiveFtrun(tmp_path, *flags, "w.py")
    live.append(f)
    f.wait_for_lines(r"ready (\d+)", 1)
    f.proc.terminate()
    return f


def test_worker_ignoring_sigterm_is_killed_after_term_timeout(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    f = terminate_a_stubborn_worker(tmp_path, script, live, "--term-timeout", "0.5")
    assert f.wait() == 143
    events = [json.loads(line) for line in (f.run_dir / "events.jsonl").read_text().splitlines()]
    exits = [e for e in events if e["kind"] == "worker_exited"]
    assert [(e["signal"], e["state"]) for e in exits] == [("SIGKILL", "stopped")]


def test_a_second_signal_cuts_the_grace_short_and_says_so(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    """`timeout` sends SIGINT twice: the second one skips the workers' grace period, and the user is told."""
    f = terminate_a_stubborn_worker(tmp_path, script, live, "--shutdown-timeout", "600")
    f.wait_for_stderr("SIGTERM; stopping the workers")
    f.proc.send_signal(signal.SIGINT)
    assert f.wait() == 143  # well within the grace of 600 s: the second signal ended it
    assert "a second signal (SIGINT): SIGKILL now, no more --shutdown-timeout" in f.stderr()


def test_grandchildren_do_not_survive_a_failure(tmp_path: Path, script: WriteScript, live: list[LiveFtrun]) -> None:
    script("w.py", WITH_GRANDCHILDREN)
    os.mkfifo(tmp_path / "both-ready")
    f = LiveFtrun(tmp_path, "--nproc-per-node", "2", "w.py")
    live.append(f)
    found = f.wait_for_lines(r"ready (\d+) (\d+) (\d+)", 2)
    assert f.wait() == 1
    pids = [int(p) for m in found for p in m.groups()]
    assert wait_gone(pids) == []


def test_grandchildren_do_not_survive_success(tmp_path: Path, script: WriteScript) -> None:
    script(
        "w.py",
        """
        import subprocess
        p = subprocess.Popen(["sleep", "600"], start_new_session=True)
        print(p.pid, flush=True)
        """,
    )
    r = run_ftrun(tmp_path, "w.py")
    assert r.returncode == 0, r.stderr
    assert wait_gone([int(r.stdout.split()[0])]) == []


def test_workers_have_their_own_process_group(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", "import os\nprint(os.getpid(), os.getpgid(0), os.getsid(0), os.getppid())\n")
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "w.py")
    assert r.returncode == 0, r.stderr
    for line in r.stdout.splitlines():
        pid, pgid, sid, _ = map(int, line.split())
        assert pid == pgid == sid
    assert os.getpgid(0) not in {int(line.split()[1]) for line in r.stdout.splitlines()}


MEETS_ITS_PEERS = """
import torch.distributed as dist
dist.init_process_group("gloo")  # never imports ftrun
print("met", flush=True)
"""


@pytest.mark.torch
def test_a_static_job_whose_other_node_never_comes_says_what_it_waits_for(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    """torch waits 30 minutes in init_process_group without a word; ftrun says what the ranks wait for."""
    script("w.py", MEETS_ITS_PEERS)
    with socket.socket() as probe:  # a free port for the static job's rank 0 (the default may be taken here)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    flags = ["--nnodes", "2", "--rdzv-backend", "static", "--node-rank", "0", "--master-port", str(port)]
    f = LiveFtrun(tmp_path, *flags, "--nproc-per-node", "2", "--shutdown-timeout", "1", "w.py")
    live.append(f)  # (a rank in torch's C++ wait handles SIGINT only after it: SIGKILL comes after the grace)
    said = f.wait_for_stderr(r"rank\(s\) [0-9, ]+ waiting \d+ s in init_process_group for the other ranks")
    assert "a static job of 2 nodes starts training once every node runs ftrun with --nnodes 2" in said
    assert f"this is node 0), --master-addr 127.0.0.1 and --master-port {port}" in said
    f.proc.send_signal(signal.SIGINT)
    assert f.wait() == 130
    assert "met" not in f.lines


MEETS_AND_SAYS_WHERE = """
import os
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"met at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.torch
def test_a_static_job_meets_at_its_rdzv_endpoint_as_under_torchrun(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    """``torchrun --nnodes 2 --node-rank N --rdzv-endpoint HOST:PORT`` (the static backend, torchrun's default):
    the endpoint is the master's address and port. ftrun ignored it (the nodes met at --master-addr, 29500)."""
    script("w.py", MEETS_AND_SAYS_WHERE)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nodes = [
        LiveFtrun(tmp_path, "--nnodes", "2", "--node-rank", str(n), "--rdzv-endpoint", f"127.0.0.1:{port}",
                  "--nproc-per-node", "1", "w.py", name=str(n))
        for n in (0, 1)
    ]  # fmt: skip
    live.extend(nodes)
    for node in nodes:
        assert node.wait() == 0, node.stderr()
        assert f"met at 127.0.0.1:{port}" in node.lines, node.lines


def marks_of(pids: list[int]) -> str:
    """What the warden looks for in each process's environment (a failing test's clue)."""
    said = []
    for pid in pids:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError as e:
            said.append(f"{pid}: environment unreadable ({e})")
            continue
        said.append(f"{pid}: {[v.decode() for v in env if v.startswith(b'FTRUN_AGENT_PID=')] or 'no FTRUN_AGENT_PID'}")
    return "\n".join(said)


DETACHED = """
import os, subprocess, time
own_session = subprocess.Popen(["sleep", "601"], start_new_session=True)  # leaves the worker's process group
print(f"ready {os.getpid()} {own_session.pid}", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("containment", ["cgroup", "tree"])
def test_sigkill_of_ftrun_leaves_no_descendant_even_in_its_own_session(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun], monkeypatch: pytest.MonkeyPatch, containment: str
) -> None:
    """The parent-death signal reaches the workers only; the warden ends what they started in sessions of their
    own: by the agent's cgroup where the machine allows one, else by the tree it last saw and the environment."""
    from ftrun.procs.warden import MODE_ENV, _cgroup2_mount

    if containment == "cgroup" and _cgroup2_mount() is None:
        pytest.skip("no cgroup v2 on this machine")
    monkeypatch.setenv(MODE_ENV, containment)
    script("w.py", DETACHED)
    f = LiveFtrun(tmp_path, "--nproc-per-node", "2", "w.py")
    live.append(f)
    pids = [int(p) for m in f.wait_for_lines(r"ready (\d+) (\d+)", 2) for p in m.groups()]
    f.proc.kill()
    f.wait()
    left = wait_gone(pids)
    assert left == [], f"{processes_of(-1, left)}\n{marks_of(left)}\n{f.stderr()[-3000:]}"
    assert "its warden ended" in f.stderr()
