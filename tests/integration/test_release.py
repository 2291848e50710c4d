"""A stopped worker that is certain to end is not waited for (the kernel takes tens of ms to free a big one).

After a failure ftrun stops the other workers with SIGTERM; one that does not handle it can run no more of its
own code from that moment, and the next attempt starts beside its teardown. Not where the next workers may
need what it still holds (an accelerator's memory, a port of its own) and never for a worker that handles
SIGTERM (its grace period is the job's). Real processes throughout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ftrun.node.devices import accelerators_visible
from ftrun.procs import proctree
from ftrun.procs.logs import RankPaths
from ftrun.procs.workers import Worker, frees_its_ports
from tests.integration.harness import WriteScript, run_ftrun

# Rank 1 fails once rank 0 has written its line (a FIFO: no timing); rank 0 then waits to be stopped.
JOB = """
import os, socket, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
mode, fifo, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if rank == 0 and mode == "port":  # a port of its own, outside the ephemeral range, in every attempt
    memory = b"x" * (400 << 20)  # the kernel takes tens of ms to free it: the port stays bound meanwhile
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
if attempt == 1:
    print(f"started {time.time()}", flush=True)
    sys.exit(0)
if rank == 1:
    open(fifo).read()
    sys.exit(3)
if mode == "handler":
    def save(*_):
        time.sleep(0.3)  # a checkpoint being written
        print(f"saved {time.time()}", flush=True)
        sys.exit(0)
    import signal
    signal.signal(signal.SIGTERM, save)
print("RuntimeError: peer gone", file=sys.stderr, flush=True)
with open(fifo, "w") as f:
    f.write("go")
time.sleep(60)
"""


def run(tmp_path: Path, script: WriteScript, mode: str, *flags: str, port: int = 0) -> tuple[dict[str, object], object]:
    script("w.py", JOB)
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", *flags, "w.py", mode, str(fifo), str(port))
    assert r.returncode == 0, r.stderr
    exits = [e for e in r.events() if e["kind"] == "worker_exited" and e["attempt"] == 0 and e["rank"] == 0]
    assert len(exits) == 1, exits
    return exits[0], r


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_worker_ended_by_the_signal_is_released_with_what_it_wrote(
    tmp_path: Path, script: WriteScript, warm: bool
) -> None:
    stopped, r = run(tmp_path, script, "plain", *([] if warm else ["--no-warm"]))
    assert stopped["released"] is True
    assert (stopped["state"], stopped["signal"]) == ("stopped", "SIGTERM")
    report = r.report(0)  # type: ignore[attr-defined]
    [rank0] = report["stopped_by_ftrun"]
    assert rank0["signal"] == "SIGTERM"
    assert rank0["last_error"] == "RuntimeError: peer gone"  # copied from its pipe before the report
    assert "RuntimeError: peer gone" in r.log(0, 0, "stderr")  # type: ignore[attr-defined]


def test_a_worker_that_handles_sigterm_gets_its_grace_period_before_the_next_start(
    tmp_path: Path, script: WriteScript
) -> None:
    stopped, r = run(tmp_path, script, "handler")
    assert stopped["released"] is False
    assert stopped["exit_code"] == 0
    saved = float(r.log(0, 0).split("saved ")[1])  # type: ignore[attr-defined]
    started = float(r.log(1, 0).split("started ")[1])  # type: ignore[attr-defined]
    assert saved < started


def own_port() -> int:
    """A free port outside the kernel's ephemeral range (as a job's own fixed port would be)."""
    ephemeral = proctree.ephemeral_ports()
    for port in range(20000, 21000):
        if port in ephemeral:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 20000..20999")


def test_a_worker_listening_on_its_own_port_is_gone_before_the_next_one_binds_it(
    tmp_path: Path, script: WriteScript
) -> None:
    stopped, r = run(tmp_path, script, "port", port=own_port())
    assert stopped["released"] is False
    assert "started" in r.log(1, 0)  # type: ignore[attr-defined]


def test_a_worker_holding_a_port_a_new_worker_may_ask_for_is_not_released() -> None:
    mine = own_port()
    with socket.socket() as fixed, socket.socket() as ephemeral:
        fixed.bind(("127.0.0.1", mine))
        ephemeral.bind(("127.0.0.1", 0))
        me = Worker(0, 0, 0, RankPaths.under(Path("/nonexistent"), 0), [], {}, handle=Handle(os.getpid()))
        ephemeral.listen()
        assert frees_its_ports(None)(me)  # gloo's ports, a fresh MASTER_PORT
        assert not frees_its_ports(ephemeral.getsockname()[1])(me)  # --master-port
        fixed.listen()
        assert not frees_its_ports(None)(me)


def test_with_an_accelerator_visible_every_stopped_worker_is_gone_before_the_next_start(
    tmp_path: Path, script: WriteScript, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the agent counts it; the job never touches a GPU
    stopped, _ = run(tmp_path, script, "plain")
    assert stopped["released"] is False


def test_accelerators_are_seen_from_the_environment_and_device_files(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    assert not accelerators_visible({}, dev)
    assert accelerators_visible({"CUDA_VISIBLE_DEVICES": "0,1"}, dev)
    assert not accelerators_visible({"CUDA_VISIBLE_DEVICES": ""}, dev)
    (dev / "kfd").touch()  # ROCm
    assert accelerators_visible({}, dev)


class Handle:
    def __init__(self, pid: int) -> None:
        self.pid = pid


SLEEPER = """
import signal, socket, sys, time
if sys.argv[1] == "handler":
    signal.signal(signal.SIGTERM, lambda *_: None)
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("handles", [False, True], ids=["default", "handler"])
def test_ending_tells_a_process_the_signal_kills_from_one_that_handles_it(handles: bool) -> None:
    mode = "handler" if handles else "default"
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, mode], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        assert proctree.listening_ports(proc.pid) == {port}
        assert port in proctree.ephemeral_ports()
        assert proctree.ending(proc.pid, signal.SIGTERM) is None  # running
        os.kill(proc.pid, signal.SIGTERM)  # not Popen's: it may reap the process first
        # Known the moment kill() returns: the kernel marks the whole process as exiting before any thread runs.
        assert proctree.ending(proc.pid, signal.SIGTERM) == (None if handles else -signal.SIGTERM)
        os.kill(proc.pid, signal.SIGKILL)
        assert proctree.ending(proc.pid, signal.SIGTERM) == (-signal.SIGKILL if handles else -signal.SIGTERM)
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == (-signal.SIGKILL if handles else -signal.SIGTERM)


def test_socket_diagnostics_and_the_proc_tables_agree_on_what_listens() -> None:
    with socket.socket() as v4, socket.socket(socket.AF_INET6) as v6:
        v4.bind(("127.0.0.1", 0))
        v6.bind(("::1", 0))
        v4.listen()
        v6.listen()
        ports = {v4.getsockname()[1], v6.getsockname()[1]}
        fast = proctree._listening_tcp()
        slow = proctree._listening_from_proc(f"/proc/{os.getpid()}/task/{os.getpid()}")
        assert ports <= set(fast.values())
        assert {i: p for i, p in fast.items() if p in ports} == {i: p for i, p in slow.items() if p in ports}


# Rank 1 raises on the first attempt. Its interpreter's finalization then flushes a file it never closed (what a
# kill would lose) and, with "slow", takes long (a __del__ that sleeps, as a torch teardown can); with "stuck",
# forever (a teardown that hangs).
RAISES = """
import os, signal, subprocess, sys, time
rank, attempt, teardown = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"]), sys.argv[1]
if attempt == 0 and rank == 1:
    if "held" in sys.argv:  # the agent held up for 2 s as the script fails (a busy node)
        agent = int(os.environ["FTRUN_AGENT_PID"])
        os.kill(agent, signal.SIGSTOP)
        subprocess.Popen(["sh", "-c", f"sleep 2; kill -CONT {agent}"])
    log = open("unclosed.log", "w")
    log.write("flushed by the finalization")  # buffered: only the interpreter's teardown writes it

    class Teardown:  # its defaults keep what it needs: the finalization clears the module's names
        def __del__(self, sleep=time.sleep, touch=open, seconds=3600 if teardown == "stuck" else 1.0):
            sleep(seconds)
            touch("teardown-done", "w").close()

    keep = Teardown()
    raise RuntimeError("failed at step 10")
print(f"rank {rank} attempt {attempt} done", flush=True)
if attempt == 0:
    time.sleep(600)  # rank 0 waits to be stopped
"""


def test_a_raise_restarts_beside_the_failed_workers_teardown_and_loses_nothing(
    tmp_path: Path, script: WriteScript
) -> None:
    """Once its script failed (traceback printed), the failed warm worker counts as exited (released) and the
    next attempt starts; its interpreter finishes its teardown meanwhile, unkilled: what it flushes is kept."""
    script("w.py", RAISES)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "--preload", "json", "w.py", "slow")
    assert r.returncode == 0, r.stderr
    [failed] = [e for e in r.events() if e["kind"] == "worker_exited" and e["state"] == "failed"]
    assert (failed["rank"], failed["exit_code"], failed["released"]) == (1, 1, True)
    assert "RuntimeError: failed at step 10" in r.stderr  # the report's root cause
    assert (tmp_path / "unclosed.log").read_text() == "flushed by the finalization"
    assert (tmp_path / "teardown-done").exists()  # waited for at the run's end, never killed
    assert {"rank 0 attempt 1 done", "rank 1 attempt 1 done"} <= set(r.stdout.splitlines())


def test_a_teardown_that_hangs_after_a_raise_is_ended_after_the_teardown_timeout(
    tmp_path: Path, script: WriteScript
) -> None:
    script("w.py", RAISES)
    flags = ["--nproc-per-node", "2", "--max-restarts", "1", "--preload", "json", "--teardown-timeout", "1"]
    r = run_ftrun(tmp_path, *flags, "w.py", "stuck")
    assert r.returncode == 0, r.stderr
    assert "teardown still going --teardown-timeout after its script failed; ended" in r.stderr, r.stderr
    assert not (tmp_path / "teardown-done").exists()


def test_an_agent_held_up_past_the_teardown_timeout_still_restarts_beside_the_failed_workers_teardown(
    tmp_path: Path, script: WriteScript
) -> None:
    """The agent wakes 2 s after the script failed, past --teardown-timeout: the teardown is that of a script that
    failed (the restart goes on beside it), not a stuck one (its stacks read first, the restart after it)."""
    script("w.py", RAISES)
    flags = ["--nproc-per-node", "2", "--max-restarts", "1", "--preload", "json", "--teardown-timeout", "1"]
    r = run_ftrun(tmp_path, *flags, "w.py", "stuck", "held")
    assert r.returncode == 0, r.stderr
    assert "teardown still going --teardown-timeout after its script failed; ended" in r.stderr, r.stderr
    assert "teardown is stuck" not in r.stderr, r.stderr


# Rank 1 fails on the first attempt with a helper process of its own, which its teardown ends (as a DataLoader's
# shutdown ends its workers), a second after its traceback: long after the agent stopped rank 0 and swept.
HELPER_ENDED_BY_TEARDOWN = """
import atexit, os, subprocess, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0 and rank == 1:
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    def shut_down_helper():
        time.sleep(1.0)
        helper.terminate()
        with open("helper-ended", "w") as f:
            f.write(f"helper ended with {helper.wait()}")  # -15: by the teardown; -9: killed under it

    atexit.register(shut_down_helper)
    raise RuntimeError("failed at step 10")
print(f"rank {rank} attempt {attempt} done", flush=True)
if attempt == 0:
    time.sleep(600)
"""


def test_a_failed_workers_teardown_ends_its_own_helpers_unkilled(tmp_path: Path, script: WriteScript) -> None:
    """The processes a failed worker started are its teardown's to end: the sweep that follows the stop leaves
    them while the worker finishes (killed under it, a DataLoader's workers raised into its teardown)."""
    script("w.py", HELPER_ENDED_BY_TEARDOWN)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "--preload", "json", "w.py")
    assert r.returncode == 0, r.stderr
    [failed] = [e for e in r.events() if e["kind"] == "worker_exited" and e["state"] == "failed"]
    assert failed["released"], failed  # the restart went on beside its teardown
    assert (tmp_path / "helper-ended").read_text() == "helper ended with -15"


# Rank 1 fails on the first attempt leaving a helper its teardown never ends; the next attempt's rank 0 looks for
# it until it is gone (or 20 s have passed).
HELPER_LEFT_BEHIND = """
import os, subprocess, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0 and rank == 1:
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open("helper.pid", "w") as f:
        f.write(str(helper.pid))
    raise RuntimeError("failed at step 10")
if attempt == 0:
    time.sleep(600)
if rank == 0:
    helper, deadline = int(open("helper.pid").read()), time.monotonic() + 20
    while os.path.exists(f"/proc/{helper}") and time.monotonic() < deadline:
        time.sleep(0.05)
    print("helper gone" if not os.path.exists(f"/proc/{helper}") else "helper alive", flush=True)
"""


def test_what_a_failed_workers_teardown_leaves_of_its_helpers_ends_with_it(tmp_path: Path, script: WriteScript) -> None:
    """Spared while the failed worker finishes, a helper it never ends is killed as the worker is reaped: it does
    not live on beside the next attempt."""
    script("w.py", HELPER_LEFT_BEHIND)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "--preload", "json", "w.py")
    assert r.returncode == 0, r.stderr
    assert "helper gone" in r.stdout.splitlines(), r.stdout


DATALOADER_IN_A_FAILED_RANK = """
import os
import torch
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor([float(i * i)])


if __name__ == "__main__":
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    loader = DataLoader(Squares(), batch_size=8, num_workers=2, persistent_workers=True,
                        multiprocessing_context="spawn")
    total = sum(float(b.sum()) for _ in range(2) for b in loader)
    if attempt == 0 and rank == 1:
        raise SystemExit("failed after loading")
    print(f"rank {rank} attempt {attempt} total {total}", flush=True)
"""


def test_a_failed_rank_with_spawned_dataloader_workers_ends_quietly(tmp_path: Path, script: WriteScript) -> None:
    """Its DataLoader's workers and multiprocessing's resource tracker end with its teardown, as under torchrun:
    nothing raised into it, no tracker started again complaining of segments it never knew."""
    script("w.py", DATALOADER_IN_A_FAILED_RANK)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py", timeout=180)
    assert r.returncode == 0, r.stderr
    assert {"rank 0 attempt 1 total 170688.0", "rank 1 attempt 1 total 170688.0"} <= set(r.stdout.splitlines())
    failed_log = r.log(0, 1, "stderr")
    for noise in ("could not mark the script's end", "killed by signal", "resource_tracker", "KeyError"):
        assert noise not in r.stderr, r.stderr
        assert noise not in failed_log, failed_log
