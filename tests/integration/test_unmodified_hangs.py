"""Every kind of hang in a real DDP job that never imports ftrun: found, blamed on the rank that hung with its
stack, restarted from the job's checkpoint, and ending with the same model as a run without the fault."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import POOL, WAIT_S, LiveFtrun, Result, WriteScript, clean_run, restarted_warm, run_ftrun

pytestmark = pytest.mark.torch

DDP = """
import ctypes, hashlib, os, signal, sys, threading, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

kind, checkpoint = sys.argv[1], sys.argv[2]
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
faulty = attempt == 0 and rank == 1

def stuck_in_c_holding_the_gil():
    ctypes.PyDLL(None).sleep(120)  # libc's sleep, called without releasing the GIL

def stuck_before_the_first_step():
    time.sleep(120)

def asleep_between_steps():
    time.sleep(120)

def sigterm_sets_a_flag(*_):  # as Lightning's handler does: the loop stops at its next step
    stopping.append(True)

def sigterm_writes_then_exits(*_):  # a handler that saves something before it ends the process
    with open(f"{checkpoint}.{rank}.{attempt}.calls", "a") as f:
        f.write("called\\n")
    with open(f"{checkpoint}.{rank}.{attempt}.on-sigterm", "w") as f:
        for piece in range(16):
            f.write(f"{piece:4096d}")
            f.flush()
            time.sleep(0.25)
    os._exit(7)

stopping = []
if kind == "flag_handler":
    signal.signal(signal.SIGTERM, sigterm_sets_a_flag)
if kind == "writing_handler":
    signal.signal(signal.SIGTERM, sigterm_writes_then_exits)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
if os.path.exists(checkpoint):
    state = torch.load(checkpoint)
    model.module.load_state_dict(state["model"])
    start = state["step"]
if faulty and kind == "before_first_step":
    stuck_before_the_first_step()
for step in range(start, 30):
    if faulty and kind == "in_c" and step == 12:
        stuck_in_c_holding_the_gil()
    if faulty and kind in ("sleeps", "flag_handler", "writing_handler") and step == 12:
        asleep_between_steps()
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(2 * step + rank))
    opt.zero_grad()
    model(data).sum().backward()
    opt.step()
    if rank == 0 and step % 5 == 4:
        torch.save({"model": model.module.state_dict(), "step": step + 1}, checkpoint + ".tmp")
        os.replace(checkpoint + ".tmp", checkpoint)
    time.sleep(0.02)
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("checksum", hashlib.sha256(weights).hexdigest()[:16], flush=True)
dist.destroy_process_group()
if faulty and kind == "at_exit":
    threading.Thread(target=time.sleep, args=(120,)).start()  # the interpreter waits for it, forever
"""

FLAGS = ["--nproc-per-node", "2", "--max-restarts", "1", "--heartbeat-timeout", "3"]


def checksums(r: Result, attempt: int) -> set[str]:
    return {r.log(attempt, rank).splitlines()[-1] for rank in (0, 1)}


@pytest.fixture
def failure_free(shared_dir: Path) -> str:
    r = clean_run(shared_dir, *FLAGS, "w.py", "none", "ckpt.pt", files={"w.py": DDP})
    assert r.returncode == 0, r.stderr
    [line] = checksums(r, 0)
    return line


@pytest.mark.parametrize(
    ("kind", "stuck_in", "extra"),
    [
        ("in_c", "stuck_in_c_holding_the_gil", []),
        ("before_first_step", "stuck_before_the_first_step", ["--initial-heartbeat-timeout", "20"]),
    ],
)
def test_a_hung_rank_is_found_blamed_with_its_stack_and_the_job_ends_as_without_the_fault(
    tmp_path: Path, script: WriteScript, failure_free: str, kind: str, stuck_in: str, extra: list[str]
) -> None:
    script("w.py", DDP)
    r = run_ftrun(tmp_path, *FLAGS, *extra, "w.py", kind, str(tmp_path / "ckpt.pt"), timeout=240)
    assert r.returncode == 0, r.stderr
    [hang] = [e for e in r.events() if e["kind"] == "hang"]
    assert hang["rank"] == 1
    root: dict[str, Any] = r.report(0)["root_cause"]  # type: ignore[assignment]
    assert root["rank"] == 1
    assert stuck_in in root["stacks"]
    assert checksums(r, 1) == {failure_free}


def test_a_hung_rank_whose_sigterm_handler_leaves_it_hung_is_not_waited_for(
    tmp_path: Path, script: WriteScript, failure_free: str
) -> None:
    """Its SIGTERM handler sets a flag its hung loop never reads (as Lightning's does): it shows no progress after
    the signal, and is killed then, not after --shutdown-timeout (600 s here: longer than the test waits)."""
    script("w.py", DDP)
    r = run_ftrun(tmp_path, *FLAGS, "--shutdown-timeout", "600", "w.py", "flag_handler", str(tmp_path / "ckpt.pt"),
                  timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stderr
    [said] = [line for line in r.stderr.splitlines() if "(still hung): SIGKILL" in line]
    assert said.startswith("ftrun: rank 1 (local rank 1"), said
    [ended] = [e for e in r.events() if e["kind"] == "worker_exited" and (e["attempt"], e["rank"]) == (0, 1)]
    assert ended["signal"] == "SIGKILL", ended
    assert checksums(r, 1) == {failure_free}


def test_a_hung_rank_whose_sigterm_handler_writes_has_the_whole_grace(
    tmp_path: Path, script: WriteScript, failure_free: str
) -> None:
    """Its SIGTERM handler writes for 4 s, then ends the process: it moves, so it has all of --shutdown-timeout;
    and it is called once (the hang signal, then the stop's SIGTERM, called it again inside itself)."""
    script("w.py", DDP)
    r = run_ftrun(tmp_path, *FLAGS, "w.py", "writing_handler", str(tmp_path / "ckpt.pt"), timeout=240)
    assert r.returncode == 0, r.stderr
    assert "still hung" not in r.stderr, r.stderr
    assert (tmp_path / "ckpt.pt.1.0.on-sigterm").read_text() == "".join(f"{p:4096d}" for p in range(16))
    assert (tmp_path / "ckpt.pt.1.0.calls").read_text() == "called\n"  # the hung rank's handler, called once
    [ended] = [e for e in r.events() if e["kind"] == "worker_exited" and (e["attempt"], e["rank"]) == (0, 1)]
    assert (ended["exit_code"], ended["signal"]) == (7, None), ended
    assert checksums(r, 1) == {failure_free}


def test_a_rank_that_stops_at_exit_is_a_stuck_teardown_not_a_hang(
    tmp_path: Path, script: WriteScript, failure_free: str
) -> None:
    """Its script ended (a warm worker, which the zygote tells the agent of: attempt 1, once the pool is ready):
    the wait for a thread at exit is the interpreter's teardown, ended after --teardown-timeout with the
    script's own result; no restart. A fresh worker's end is known only at an uncaught exception."""
    script("w.py", restarted_warm(DDP.replace("faulty = attempt == 0 and", "faulty = attempt == 1 and")))
    flags = [*FLAGS, "--preload", "json", "--teardown-timeout", "2"]
    r = run_ftrun(tmp_path, *flags, "w.py", "at_exit", str(tmp_path / "ckpt.pt"), timeout=240, env=POOL)
    assert r.returncode == 0, r.stderr
    assert [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1] == [True, True]
    stuck = {(e["attempt"], e["rank"]): e for e in r.events() if e["kind"] == "teardown_stuck"}
    assert (1, 1) in stuck, stuck  # rank 1's thread at exit
    # Another rank at times too: its DDP, freed at the interpreter's end after destroy_process_group, can deadlock
    # in gloo's teardown (torch issue 56297; twice the one expected, once in the suite): a stuck teardown all the
    # same, ended with the script's result.
    assert [e["end_code"] for e in stuck.values()] == [0] * len(stuck), stuck
    assert [e for e in r.events() if e["kind"] == "hang"] == []
    assert checksums(r, 1) == {failure_free}


def test_on_two_nodes_each_agent_blames_the_rank_that_hung_on_the_other(
    tmp_path: Path, live: list[LiveFtrun], rdzv: list[str], failure_free: str
) -> None:
    """Two agents (separate processes, one rank each) on tcp and on etcd. Rank 1 sleeps between steps; rank 0
    waits for it in backward's all-reduce. Each agent reads only its own rank's stacks: rank 0's agent sees a
    rank that only waited, finds rank 1's agent's verdict in the store, and names rank 1, with its stack."""
    (tmp_path / "w.py").write_text(DDP)
    run_id = f"{tmp_path.name}-blame"
    flags = [*rdzv, "--rdzv-id", run_id, "--local-addr", "127.0.0.1", "--nnodes", "2:2", "--nproc-per-node", "1"]
    flags += ["--max-restarts", "1", "--heartbeat-timeout", "3"]
    job = [str(tmp_path / "w.py"), "sleeps", str(tmp_path / "ckpt.pt")]
    agents = [LiveFtrun(tmp_path, *flags, "--log-dir", str(tmp_path / n), *job, name=n) for n in ("a", "b")]
    live.extend(agents)
    for agent in agents:
        assert agent.wait(WAIT_S) == 0, agent.stderr()
    for name, agent in zip(("a", "b"), agents, strict=True):
        [report_file] = (tmp_path / name).glob("*/attempt_0/failure_report.json")
        report = json.loads(report_file.read_text())
        # Rank 0's agent names rank 1 either from its board verdict (its own rank only waited: "elsewhere"), or,
        # when rank 1's node stopped the round first (rank 0's stacks still being read), from that node's report.
        named = report["elsewhere"] if report["root_cause"]["rank"] == 0 else report["root_cause"]
        assert named is not None, json.dumps(report)[:3000] + agent.stderr()
        assert named["rank"] == 1, report
        assert "asleep_between_steps" in named["stacks"]
        assert "ROOT CAUSE  rank 1" in agent.stderr()
    assert {line for a in agents for line in a.lines if line.startswith("checksum")} == {failure_free}


RECORDED = """
import ctypes, os, sys, time
import torch, torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

kind, hung, fifo = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
faulty = attempt == 0 and rank == hung

def c_call_holding_the_gil():
    ctypes.PyDLL(None).sleep(120)  # libc's sleep, without releasing the GIL: no Python signal handler runs

def busy_python_loop():
    spins = 0
    while True:
        spins += 1

def blocked_reading_a_file():
    with open(fifo, "rb") as f:  # a FIFO nobody writes: the open blocks in the kernel
        f.read()

def asleep_in_c():
    time.sleep(120)

def stuck_fetching_a_sample():
    time.sleep(120)

class Samples(Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        if faulty and kind == "dataloader" and i == 12 * 4:
            stuck_fetching_a_sample()  # in the main thread (num_workers=0), inside the DataLoader's fetch
        return torch.full((8,), float(i % 7))

STUCK = {"gil": c_call_holding_the_gil, "loop": busy_python_loop, "file": blocked_reading_a_file, "sleep": asleep_in_c}

@record
def main():
    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, batch in enumerate(DataLoader(Samples(), batch_size=4)):
        if step == 25:
            break
        if faulty and step == 12 and kind in STUCK:
            STUCK[kind]()
        opt.zero_grad()
        model(batch).sum().backward()
        opt.step()
        time.sleep(0.02)
    print(f"rank {rank} attempt {attempt} done", flush=True)
    dist.destroy_process_group()

main()
"""


@pytest.mark.parametrize(
    ("kind", "hung", "stuck_in"),
    [
        ("sleep", 0, "asleep_in_c"),
        ("gil", 1, "c_call_holding_the_gil"),
        ("loop", 0, "busy_python_loop"),
        ("file", 1, "blocked_reading_a_file"),
        ("dataloader", 0, "stuck_fetching_a_sample"),
    ],
)
def test_a_recorded_script_blames_the_rank_that_hung_however_it_hung(
    tmp_path: Path, script: WriteScript, kind: str, hung: int, stuck_in: str
) -> None:
    """torch's @record wraps every rank's main in torch.distributed.elastic frames: blame reads what the main
    thread executes (its innermost frames), so the rank waiting in backward's all-reduce is never the one named,
    whichever rank hung and however (C, C holding the GIL, Python, a DataLoader fetch, file I/O)."""
    import os

    script("w.py", RECORDED)
    os.mkfifo(tmp_path / "fifo")
    r = run_ftrun(tmp_path, *FLAGS, "w.py", kind, str(hung), str(tmp_path / "fifo"), timeout=240)
    assert r.returncode == 0, r.stderr
    root: dict[str, Any] = r.report(0)["root_cause"]  # type: ignore[assignment]
    assert root["rank"] == hung, r.stderr
    assert stuck_in in root["stacks"]
    assert "cannot tell" not in (root.get("why") or "")
    [waited] = r.report(0)["stopped_by_ftrun"]  # type: ignore[misc]
    assert waited["rank"] == 1 - hung
    assert sorted(r.stdout.splitlines()) == ["rank 0 attempt 1 done", "rank 1 attempt 1 done"]
