"""Tracebacks reach the failure report with ftrun's @record, torch's @record, or no decorator at all."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import WriteScript, run_ftrun

BODIES = {
    "plain": "def main():\n    raise ValueError('bad batch 7')\n\nmain()\n",
    "ftrun": "import ftrun\n\n@ftrun.record\ndef main():\n    raise ValueError('bad batch 7')\n\nmain()\n",
    "torch": (
        "from torch.distributed.elastic.multiprocessing.errors import record\n\n"
        "@record\ndef main():\n    raise ValueError('bad batch 7')\n\nmain()\n"
    ),
}
SOURCES = {"plain": "last ", "ftrun": "from ftrun error file", "torch": "from torch error file"}


@pytest.mark.parametrize("decorator", ["plain", "ftrun", pytest.param("torch", marks=pytest.mark.torch)])
def test_exception_traceback_in_report(tmp_path: Path, script: WriteScript, decorator: str) -> None:
    script("w.py", BODIES[decorator])
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "w.py")
    assert r.returncode == 1
    root = r.stderr[r.stderr.index("ROOT CAUSE") :]
    assert SOURCES[decorator] in root
    assert "ValueError: bad batch 7" in root
    assert "raise ValueError('bad batch 7')" in root
    assert ", in main" in root
    if decorator != "plain":
        assert r.report(0)["root_cause"]["error"]["exc_type"] == "ValueError"  # type: ignore[index]


def test_the_report_has_torchruns_root_cause_words(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", BODIES["plain"])
    r = run_ftrun(tmp_path, "w.py")
    lines = r.stderr.splitlines()
    at = lines.index("Root Cause (first observed failure):")  # what scripts written for torchrun look for
    assert lines[at + 1].startswith("ROOT CAUSE  rank 0")


def test_a_segfault_leaves_its_python_stack_in_the_report(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", "import ctypes\n\ndef crash_here():\n    ctypes.string_at(0)\n\ncrash_here()\n")
    r = run_ftrun(tmp_path, "w.py")
    assert r.returncode == 1
    root = r.stderr[r.stderr.index("ROOT CAUSE") :]
    assert "killed by SIGSEGV" in root
    assert "Fatal Python error: Segmentation fault" in root
    assert "in crash_here" in root  # the fault handler's stack, with no code change in the script


KEYBOARD = """
import os, ftrun

@ftrun.record
def main():
    raise KeyboardInterrupt

main()
"""


def test_keyboard_interrupt_is_not_recorded_as_the_jobs_error(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", KEYBOARD)
    r = run_ftrun(tmp_path, "w.py")
    assert r.returncode == 1
    assert not (r.run_dir / "attempt_0" / "0" / "error.json").exists()


HANDLER = """
import json, os, ftrun

class Handler:
    def initialize(self):
        print("initialized", flush=True)

    def record_exception(self, e):
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": f"mine: {e}", "extraInfo": {"py_callstack": "", "timestamp": "0"}}}, f)

@ftrun.record(error_handler=Handler())
def main():
    raise ValueError("bad batch 7")

main()
"""


def test_record_takes_an_error_handler_as_torchs_does(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", HANDLER)
    r = run_ftrun(tmp_path, "w.py")
    assert r.returncode == 1
    assert r.log(0, 0) == "initialized\n"
    assert "mine: bad batch 7" in r.stderr


def test_the_root_cause_goes_to_the_launchers_own_error_file(
    tmp_path: Path, script: WriteScript, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler or a nested launcher that gave ftrun a TORCHELASTIC_ERROR_FILE reads the first failure."""
    script("w.py", BODIES["ftrun"])
    own = tmp_path / "launcher-error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(own))
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "w.py")
    assert r.returncode == 1
    doc = json.loads(own.read_text())
    assert "ValueError: bad batch 7" in doc["message"]["message"]
    assert "raise ValueError('bad batch 7')" in doc["message"]["extraInfo"]["py_callstack"]
    assert doc["errorCode"] == 1
    # ...and the failed worker still wrote its own file, not the launcher's (both ranks raise; the other may be
    # stopped before it does)
    root = r.report(0)["root_cause"]["rank"]  # type: ignore[index]
    assert (r.run_dir / "attempt_0" / str(root) / "error.json").exists()


# An excepthook installed after ftrun's that holds what Python prints and writes it once the inner hooks returned,
# as torch.distributed's does (it prefixes each line with "[rankN]:"), slowly: as on a node whose cores are busy.
HOLDS_THE_TRACEBACK = """
import io, sys, time
inner = sys.excepthook
def holding(*args):
    real, sys.stderr = sys.stderr, io.StringIO()
    try:
        inner(*args)
    finally:
        held, sys.stderr = sys.stderr.getvalue(), real
    time.sleep(1.0)
    sys.stderr.write("".join("[held]: " + line for line in held.splitlines(keepends=True)))
sys.excepthook = holding
def main():
    raise ValueError('bad batch 7')
main()
"""


def test_a_traceback_an_outer_excepthook_writes_late_is_in_the_root_cause(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", HOLDS_THE_TRACEBACK)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "w.py")
    assert r.returncode == 1
    assert "[held]: ValueError: bad batch 7" in r.report(0)["root_cause"]["stderr_tail"], r.stderr  # type: ignore[index]
    root = r.stderr[r.stderr.index("ROOT CAUSE") :]
    assert "[held]: ValueError: bad batch 7" in root.split("STOPPED BY FTRUN")[0], root


PLAIN_DDP_RAISES = """
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")  # torch.distributed's excepthook prefixes the traceback with "[rankN]:"
for step in range(40):
    t = torch.ones(4)
    dist.all_reduce(t)
    time.sleep(0.01)
    if step == 10 and dist.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise RuntimeError(f"injected failure at step {step}")
dist.destroy_process_group()
"""


@pytest.mark.alone  # it takes every core
@pytest.mark.torch
def test_a_plain_ddp_scripts_exception_is_in_the_root_cause_every_time_on_a_busy_node(
    tmp_path: Path, script: WriteScript
) -> None:
    """A script that never imports ftrun raises on rank 1 while every core is busy; the report names the
    exception in each of three runs, and counts the crash from the first attempt."""
    script("w.py", PLAIN_DDP_RAISES)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        for run in range(3):
            r = run_ftrun(tmp_path, "--log-dir", str(tmp_path / f"logs{run}"), "--nproc-per-node", "2",
                          "--max-restarts", "1", "w.py", timeout=180)  # fmt: skip
            r.run_dir = tmp_path / f"logs{run}" / "t"
            assert r.returncode == 0, r.stderr
            tail = r.report(0)["root_cause"]["stderr_tail"]  # type: ignore[index]
            assert "[rank1]: RuntimeError: injected failure at step 10" in tail, (run, tail)
    finally:
        for p in busy:
            p.kill()
            p.wait()


DDP_EXITS = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
def train():
    for step in range(100):
        dist.all_reduce(torch.ones(4))
        if step == 3 and dist.get_rank() == 1:
            EXIT
        time.sleep(0.05)
try:
    train()
finally:
    print("cleaned up", flush=True)
"""


@pytest.mark.torch
@pytest.mark.parametrize("how", ["sys.exit('config error: lr must be > 0')", "exit(2)"])
@pytest.mark.parametrize("pool", ["fresh", "warm"])
def test_a_rank_that_exits_is_the_root_cause_not_its_peers_echo(
    tmp_path: Path, script: WriteScript, how: str, pool: str
) -> None:
    """Rank 1 exits (a SystemExit) amid all-reduces: its interpreter's teardown, gloo's, takes 0.4 s, and rank 0
    raises "Connection closed by peer" within it; rank 1 is the root cause of each attempt."""
    script("w.py", DDP_EXITS.replace("EXIT", how))
    fresh = ["--no-warm"] if pool == "fresh" else []
    r = run_ftrun(tmp_path, *fresh, "--nproc-per-node", "2", "--max-restarts", "1", "w.py")
    assert r.returncode == 1, r.stderr
    warm = [e["warm"] for e in r.events() if e["kind"] == "worker_spawned"]
    assert warm == [False] * 4 if fresh else warm[2:] == [True, True]
    for attempt in (0, 1):
        root: Any = r.report(attempt)["root_cause"]
        assert root["rank"] == 1, (attempt, root)
        assert root["exit_code"] == (2 if how == "exit(2)" else 1)


FORKS_A_CHILD_THAT_EXITS = """
import os, sys, time
import torch, torch.distributed as dist
pid = os.fork()
if pid == 0:  # a child of the rank that ends through Python: its atexit handlers run, inherited
    sys.exit(3)
os.waitpid(pid, 0)
dist.init_process_group("gloo")
for step in range(20):
    dist.all_reduce(torch.ones(4))
    time.sleep(0.05)
print("rank", dist.get_rank(), "done", flush=True)
if dist.get_rank() == 0 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    raise RuntimeError("planned: the next attempt's ranks are warm")
dist.destroy_process_group()
"""


@pytest.mark.torch
def test_a_forked_child_that_exits_through_python_is_not_the_ranks_end(tmp_path: Path, script: WriteScript) -> None:
    """Each rank forks a child that calls sys.exit(3) (without the fix it told the agent the rank's script had
    ended with 3: released as failed, the root cause); fresh in attempt 0, warm in attempt 1."""
    script("w.py", FORKS_A_CHILD_THAT_EXITS)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py")
    assert r.returncode == 0, r.stderr
    root: Any = r.report(0)["root_cause"]
    assert (root["rank"], root["exit_code"]) == (0, 1), root
    assert [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1] == [True, True]
    assert all(f"rank {n} done" in r.log(1, n) for n in range(2))


UNEVEN = """
import time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
for step in range(100 if dist.get_rank() == 0 else 3):  # rank 1's data is shorter
    dist.all_reduce(torch.ones(4))
    time.sleep(0.05)
print("rank", dist.get_rank(), "done", flush=True)
"""


@pytest.mark.torch
def test_a_rank_that_ran_fewer_steps_than_its_peers_is_the_root_cause(tmp_path: Path, script: WriteScript) -> None:
    """Rank 1 ends its script at step 3; rank 0's next all-reduce raises "Connection closed by peer", the echo:
    the root cause, in the headline and in the fields, is rank 1 (cut in its teardown, or exited 0 before),
    fresh and warm."""
    script("w.py", UNEVEN)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py")
    assert r.returncode == 1, r.stderr
    for attempt in (0, 1):
        report: Any = r.report(attempt)
        assert (report["root_cause"]["rank"], report["root_cause"]["left"]) == (1, "rank 0"), report
        assert [o["rank"] for o in report["other_failures"]] == [0], report
        assert report["hint"].startswith("rank 0's error is the echo: it called a collective with rank 1"), report
    assert "Do all ranks run as many steps" in r.stderr
    assert re.search(r"ROOT CAUSE  rank 1 \(local rank 1, pid \d+\) on \S+: its script ended", r.stderr), r.stderr
    assert "  rank      : 1 (local_rank: 1)" in r.stderr
    assert "root cause: rank 1 (local rank 1" in r.stderr  # the run's last words


def test_a_sys_exit_the_script_caught_and_went_on_from_is_no_failure(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", "import sys\ntry:\n    sys.exit(3)\nexcept SystemExit:\n    pass\nprint('went on')\n")
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "w.py")
    assert r.returncode == 0, r.stderr
    assert "0 restarts" in r.stderr


H200 = Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "h200"
REPLAY = """
import os, signal, sys, time

rank, case = int(os.environ["RANK"]), sys.argv[1]
with open(os.path.join(case, f"rank{rank}.stderr")) as f:
    text = f.read()
if rank == int(sys.argv[2]):  # the rank that failed on the GPU, as it failed there
    time.sleep(0.5)
    sys.stderr.write(text)
    sys.stderr.flush()
    os.kill(os.getpid(), int(sys.argv[3])) if sys.argv[3] != "0" else os._exit(1)
sys.stderr.write(text)
sys.stderr.flush()
time.sleep(120)
"""
# case: (the rank that failed, how it ended: a signal or 0 for exit 1, the words its root cause names)
GPU_CASES = {
    "device-assert": (1, 0, "cuda      : a device-side assert in a CUDA kernel at IndexKernel.cu:111"),
    "illegal-address": (1, 0, "cuda      : an illegal memory access in a CUDA kernel"),
    "out-of-memory": (1, 0, "cuda      : CUDA out of memory on GPU 0: asked for 147.80 GiB with 128.93 GiB free"),
    "nccl-timeout": (0, 6, "nccl      : NCCL's watchdog timed out ALLREDUCE #11 (139792 elements): it ran 10.1 s"),
}


@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_cuda_and_nccl_errors_are_named_in_the_root_cause(tmp_path: Path, script: WriteScript, case: str) -> None:
    """What two NCCL ranks printed on an H200, replayed by two real processes: the rank that failed first is
    the root cause, its error named, and the NCCL error the other met after it is listed after it."""
    failed, how, named = GPU_CASES[case]
    script("replay.py", REPLAY)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "replay.py", str(H200 / case), str(failed), str(how))
    assert r.returncode == 1
    root = r.stderr[r.stderr.index("ROOT CAUSE") :]
    assert root.startswith(f"ROOT CAUSE  rank {failed} ")
    assert named in root
    report = r.report(0)
    assert report["root_cause"]["gpu_error"]["kind"] == case  # type: ignore[index]
    if case in ("device-assert", "illegal-address"):
        assert "hint: CUDA reports a kernel's error at the next synchronisation" in root
        assert "rerun with CUDA_LAUNCH_BLOCKING=1" in root
    if case != "nccl-timeout":
        stopped = root[root.index("STOPPED BY FTRUN rank 0") :]
        assert "after the root cause: NCCL remote error in ALLREDUCE #11" in stopped
    again = subprocess.run(
        [sys.executable, "-m", "ftrun", "report", str(r.run_dir)], capture_output=True, text=True, timeout=60
    )
    assert named in again.stdout  # the report read back from its file names it too
