"""In-process restart (@ftrun.restartable, examples/restartable_ddp.py): the ranks that did not fail keep their
process, the failed one is replaced, and the job ends as one that never failed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftrun.testing.etcd import EtcdHarness
from tests.integration.harness import CONF, WAIT_S, LiveFtrun, WriteScript, clean_run, run_ftrun, until

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "restartable_ddp.py")
STARTED = re.compile(r"rank (\d+) attempt (\d+) pid (\d+) from step (\d+)")
HOLDS = re.compile(r"rank 0 attempt (\d+) holds rss (\d+) threads (\d+) fds (\d+) groups (\d+)")


def pids(stdout: str) -> dict[tuple[int, int], int]:
    """(rank, attempt) -> the pid that ran it."""
    return {(int(r), int(a)): int(p) for r, a, p, _ in STARTED.findall(stdout)}


def checksum(stdout: str) -> str:
    found: list[str] = re.findall(r"checksum (\w+)", stdout)
    assert len(found) == 1, stdout[-2000:]
    return found[0]


def lose_the_machine(agent: LiveFtrun) -> None:
    """The machine goes: its workers SIGKILLed first, its agent (stopped meanwhile, so that it cannot tell
    anyone) a moment later."""
    os.kill(agent.proc.pid, signal.SIGSTOP)
    for e in agent.events():
        if e["kind"] == "worker_spawned":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(e["pid"]), signal.SIGKILL)
    agent.proc.kill()


@pytest.mark.slow
def test_a_crash_on_one_node_keeps_every_other_ranks_process_and_ends_as_a_clean_run(
    tmp_path: Path, live: list[LiveFtrun], own_tcp_server: str, shared_dir: Path
) -> None:
    """2 nodes x 2 ranks; rank 3 exits at step 20: ranks 0, 1 and 2 go on in the processes they had, rank 3 is a
    new one; every rank restores step 19, and the weights end as in the same job restarted as processes."""
    job = [EXAMPLE, "--steps", "40", "--crash-at", "20", "--crash-rank", "3", "--step-time", "0.05"]
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", own_tcp_server, "--rdzv-conf", "is_host=false",
             "--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "2", "--local-addr", "127.0.0.1"]  # fmt: skip
    a, b = (LiveFtrun(tmp_path, *flags, *job, name=n, run_id="in-place") for n in "ab")
    live.extend([a, b])
    assert [a.wait(WAIT_S), b.wait(WAIT_S)] == [0, 0], a.stderr() + b.stderr()
    out = "\n".join(a.lines + b.lines)  # every rank's output (each node's console)
    ran = pids(out)
    assert [ran[rank, 0] == ran[rank, 1] for rank in range(4)] == [True, True, True, False], ran
    restored = {int(r): int(s) for r, at, _, s in STARTED.findall(out) if at == "1"}
    assert sorted(restored) == [0, 1, 2, 3], restored
    assert len(set(restored.values())) == 1, restored  # one step agreed on every rank
    assert restored[0] == 20, restored  # step 19's copy was over when rank 3 exited: nothing lost
    spawned = [e for f in (a, b) for e in f.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1]
    assert {e["rank"]: e["in_place"] for e in spawned} == {0: True, 1: True, 2: True, 3: False}, spawned
    for f in (a, b):
        assert "1 restart (in place)" in f.stderr(), f.stderr()
    # What a person sees: `ftrun status` marks the ranks that went on in place, `ftrun report` names them.
    status = [json.loads((f.run_dir / "status.json").read_text()) for f in (a, b)]
    assert {r["rank"]: r["in_place"] for s in status for r in s["ranks"]} == {0: True, 1: True, 2: True, 3: False}
    told = [subprocess.run([sys.executable, "-m", "ftrun", "report", str(f.run_dir)], capture_output=True,
                           text=True, timeout=60, check=True).stdout for f in (a, b)]  # fmt: skip
    assert re.search(r"in place: rank\(s\) 0, 1 kept their process; interrupted in [\d.]+ s", "".join(told)), told
    assert re.search(r"in place: rank\(s\) 2 kept their process; new process: rank\(s\) 3;", "".join(told)), told
    phases = r"then handed its attempt [\d.]+ s, met its peers [\d.]+ s, restored [\d.]+ s, first step [\d.]+ s after"
    assert all(re.search(phases, t) for t in told), told  # each phase's time, from the kept ranks' notes
    assert "interrupted; its process restarts in place" in a.stderr() + b.stderr()
    # With 4 ranks DDP's first step after any restart sums in another order than an uninterrupted run's: the
    # reference is the same fault restarted as processes (step 19's copy is over when rank 3 exits).
    processes = clean_run(shared_dir, "--nproc-per-node", "4", "--max-restarts", "2", *job, "--process-restart")
    assert "1 restart (warm)" in processes.stderr, processes.stderr
    assert checksum(out) == checksum(processes.stdout)


@pytest.mark.slow
def test_a_node_that_joins_and_is_lost_leaves_the_first_nodes_ranks_in_their_processes(
    tmp_path: Path, live: list[LiveFtrun], etcd_server: EtcdHarness
) -> None:
    """--nnodes 1:2 on etcd: node a trains alone, node b joins (the job scales up to 4 ranks), then b is lost (its
    workers SIGKILLed, its agent with them). Node a's ranks 0 and 1 go through both restarts in the processes
    they started in: the new round, then their collectives broken by the lost node."""
    timeline = tmp_path / "timeline.jsonl"
    endpoint = etcd_server.url.removeprefix("etcd://")
    flags = ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-conf", "last_call_timeout=1",
             "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3", "--local-addr", "127.0.0.1",
             EXAMPLE, "--steps", "120", "--step-time", "0.05", "--timeline", str(timeline)]  # fmt: skip
    a = LiveFtrun(tmp_path, *flags, name="a", run_id="lost")
    live.append(a)
    a.wait_for_lines(r"rank 0 attempt 0 pid", 1)
    b = LiveFtrun(tmp_path, *flags, name="b", run_id="lost")
    live.append(b)

    def four_ranks_stepped() -> bool:
        lines = [json.loads(line) for line in timeline.read_text().splitlines()] if timeline.exists() else []
        return any(x["rank"] == 3 and "step" in x and not x.get("restored") for x in lines)  # a step done

    until(four_ranks_stepped, "the job trains on 4 ranks")
    lose_the_machine(b)
    assert a.wait(WAIT_S) == 0, a.stderr()
    starts = [(int(r), int(p)) for r, _, p, _ in STARTED.findall("\n".join(a.lines))]  # each call's rank, pid
    for rank in (0, 1):
        ran = [p for r, p in starts if r == rank]
        assert len(ran) == 3, starts  # alone, with b, alone again (a scale-up spends no restart: its count stays)
        assert len(set(ran)) == 1, starts  # one process throughout
    assert "2 restarts (in place)" in a.stderr(), a.stderr()


@pytest.mark.slow
def test_a_node_lost_is_replaced_by_a_spare_and_the_survivor_keeps_its_process(
    tmp_path: Path, live: list[LiveFtrun], own_tcp_server: str, shared_dir: Path
) -> None:
    """2 nodes x 1 rank and a hot spare; the node of rank 1 is lost (its worker SIGKILLed, its agent a moment
    later). Rank 0 goes on in the process it started in; the spare's new worker takes rank 1 and restores the
    step both agree on from the copy of rank 1's snapshots that rank 0's node holds; the weights end as in a
    run that never failed."""
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", own_tcp_server, "--rdzv-conf", f"{CONF},is_host=false",
             "--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "2", "--local-addr", "127.0.0.1",
             EXAMPLE, "--steps", "70", "--step-time", "0.1"]  # fmt: skip
    a, b = (LiveFtrun(tmp_path, *flags, name=n, run_id="spare") for n in "ab")
    live.extend([a, b])
    head = a if "group rank 0" in a.wait_for_stderr(r"round 1: group rank") else b
    lost = b if head is a else a
    lost.wait_for_stderr(r"round 1: group rank")
    spare = LiveFtrun(tmp_path, *flags, name="spare", run_id="spare")
    live.append(spare)
    spare.wait_for_stderr("hot spare")
    copies = Path("/dev/shm") / f"ftrun-snapshots-{os.geteuid()}"
    until(lambda: bool(list(copies.glob(f"{head.proc.pid}-*/peer/step-*/rank-1.snap"))),
          "rank 1's snapshot of a step reaches the node of rank 0")  # fmt: skip
    lose_the_machine(lost)
    assert [head.wait(WAIT_S), spare.wait(WAIT_S)] == [0, 0], head.stderr() + spare.stderr()
    ran = pids("\n".join(head.lines))
    assert len({pid for (rank, _), pid in ran.items() if rank == 0}) == 1, ran  # one process throughout
    assert "1 restart (in place)" in head.stderr(), head.stderr()
    assert re.search(r"rank 1's snapshot of step \d+ fetched from the node holding its copy", spare.stderr())
    restored = {int(r): int(s) for r, at, _, s in STARTED.findall("\n".join(head.lines + spare.lines)) if at == "1"}
    assert sorted(restored) == [0, 1], restored
    assert restored[0] == restored[1] > 0, restored  # one step, agreed
    never = clean_run(shared_dir, "--nproc-per-node", "2", EXAMPLE, "--steps", "70")  # shared with others
    assert checksum("\n".join(head.lines)) == checksum(never.stdout)


@pytest.mark.slow
def test_fifty_restarts_in_place_in_a_row_leave_nothing_behind(tmp_path: Path, shared_dir: Path) -> None:
    """Rank 1 exits in each of 50 attempts, a step later each time; rank 0 restarts in place every time. What
    rank 0 holds as each attempt starts (threads, descriptors, process groups) is the same from the first
    restart to the 50th, its RSS grows by no more than 5% meanwhile, and the weights end as in a run that never
    failed (2 ranks: every sum in one order)."""
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "50", EXAMPLE, "--steps", "70",
                  "--crash-at", "10", "--crashes", "50", "--leaks", timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    said = [line for line in r.stderr.splitlines() if "restarts (" in line or "its collectives broke" in line]
    assert "50 restarts (in place)" in r.stderr, said
    logs = "".join(p.read_text() for p in sorted(r.run_dir.glob("attempt_*/*/stdout.log")))
    ran = pids(logs)
    assert len({ran[0, attempt] for attempt in range(51)}) == 1, ran  # one process for rank 0 throughout
    assert len({ran[1, attempt] for attempt in range(51)}) == 51, ran  # rank 1 a new one each time
    holds = {int(at): tuple(map(int, rest)) for at, *rest in HOLDS.findall(logs)}
    assert sorted(holds) == list(range(51)), sorted(holds)
    # The first restart adds what a restore keeps (its verification thread, the restored file's mapping); from
    # then on nothing grows: the same threads (the process's own, torch's and gloo's), descriptors and groups.
    first, last = holds[1], holds[50]
    assert last[0] <= first[0] * 1.05, (first, last)  # RSS
    assert {h[1:] for at, h in holds.items() if at >= 1} == {first[1:]}, holds
    never = clean_run(shared_dir, "--nproc-per-node", "2", EXAMPLE, "--steps", "70")
    assert checksum(logs) == checksum(never.stdout)


def test_a_hung_rank_is_replaced_and_the_ranks_waiting_for_it_restart_in_place(tmp_path: Path) -> None:
    """Rank 1 hangs at step 8 (asleep): rank 0 waits in its all_reduce. ftrun finds the hang, ends rank 1, and
    rank 0, its collective broken, parks and goes on in its own process."""
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "--heartbeat-timeout", "3",
                  EXAMPLE, "--steps", "20", "--hang-at", "8")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ran = pids(r.log(0, 0) + r.log(1, 0) + r.log(0, 1) + r.log(1, 1))
    assert (ran[0, 0] == ran[0, 1], ran[1, 0] == ran[1, 1]) == (True, False), ran
    assert "1 restart (in place)" in r.stderr
    assert "ROOT CAUSE  rank 1" in r.stderr


HANGS_LATER = """
import os, time, torch, torch.distributed as dist
import ftrun

@ftrun.restartable
def train():
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    t = torch.ones(16)
    for step in range(40):
        if rank == 1 and attempt == 0 and step == 5:
            raise RuntimeError("rank 1 fails at step 5")
        if rank == 1 and attempt == 1 and step == 30:
            print("rank 1 hangs at step 30", flush=True)
            time.sleep(3600)
        dist.all_reduce(t)
        time.sleep(0.02)
    print(f"rank {rank} attempt {attempt} done", flush=True)
    dist.destroy_process_group()

train()
"""


@pytest.mark.slow
def test_a_hang_after_a_restart_in_place_is_found_by_the_collective(tmp_path: Path, script: WriteScript) -> None:
    """Both ranks restart in place at step 5 (rank 1 raised while rank 0 waited in all_reduce #6); in the next
    attempt rank 1 sleeps before all_reduce #31, no hang flag. Rank 0's recorder still holds the first attempt's
    default group, under its id 0 and the name "0" that the new default group (id 1) has too, and #6, cut off,
    never retired: the watch read them as the new group's (seen: no hang found within 150 s)."""
    script("w.py", HANGS_LATER)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "2", "--hang-timeout", "6", "w.py", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    [hang] = [e for e in r.events() if e["kind"] == "hang"]
    assert (hang["attempt"], hang["rank"], hang["timeout"]) == (1, 1, "collective")
    root = r.report(1)["root_cause"]
    assert isinstance(root, dict)
    assert re.search(r"rank 1 never entered all_reduce #31 \(default_pg, 64 B\) that rank 0 entered", root["hang"])
    assert "rank 0 attempt 2 done" in r.log(2, 0)


def test_a_rank_whose_function_raised_restarts_in_place_with_its_traceback_as_the_root_cause(
    tmp_path: Path, shared_dir: Path
) -> None:
    """Rank 1 raises at step 10, then at step 11: its process is sound, so it restarts in place as rank 0 does,
    twice; each time the root cause is its exception with its traceback, as if uncaught (the log, the error
    file); the weights end as a run's that never failed (2 ranks)."""
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "2",
                  EXAMPLE, "--steps", "70", "--crash-at", "10", "--crashes", "2", "--crash-by", "raise")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ran = pids("".join(r.log(attempt, rank) for attempt in range(3) for rank in range(2)))
    assert [len({ran[rank, attempt] for attempt in range(3)}) for rank in range(2)] == [1, 1], ran
    assert "2 restarts (in place)" in r.stderr, r.stderr[-3000:]
    for attempt, step in ((0, 10), (1, 11)):
        said = f"raised RuntimeError: rank 1 failed at step {step}; it restarts in place"
        assert said in r.stderr, r.stderr[-3000:]
        root = r.report(attempt)["root_cause"]
        assert isinstance(root, dict)
        assert root["rank"] == 1, root
        assert root["error"]["message"] == f"rank 1 failed at step {step}", root  # the error file
        assert "in train" in root["error"]["traceback"], root
        assert "Traceback (most recent call last)" in r.log(attempt, 1, "stderr")
    never = clean_run(shared_dir, "--nproc-per-node", "2", EXAMPLE, "--steps", "70")
    assert checksum(r.log(2, 0)) == checksum(never.stdout)


GROUP_OUTSIDE = """
import os, torch, torch.distributed as dist, ftrun

dist.init_process_group("gloo")  # before the decorated function: a restart in place could not make it again
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

@ftrun.restartable
def train():
    t = torch.ones(4)
    for step in range(10):
        if dist.get_rank() == 1 and attempt == 0 and step == 5:
            raise RuntimeError("rank 1 failed")
        dist.all_reduce(t)
    print(f"rank {dist.get_rank()} attempt {attempt} pid {os.getpid()} done {t[0].item():g}", flush=True)

train()
dist.destroy_process_group()
"""


def test_a_job_that_makes_its_group_outside_the_function_restarts_as_processes_and_is_told_why(
    tmp_path: Path, script: WriteScript
) -> None:
    """init_process_group at the script's top, the training function decorated: the ranks restart as new
    processes (each made its group at its top), the console says why and what to move, and the job ends well
    (before: every call after the first failed with torch's "Default process group has not been initialized"
    until the restart budget was spent)."""
    script("outside.py", GROUP_OUTSIDE)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "2", "outside.py")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 restart (warm)" in r.stderr, r.stderr[-3000:]
    assert "the default process group was made before the function was called" in r.stderr, r.stderr[-3000:]
    assert "Call init_process_group (and make what uses the group" in r.stderr
    assert [f"rank {n} attempt 1" in r.log(1, n) and "done 1024" in r.log(1, n) for n in range(2)] == [True, True]


def test_a_rank_that_raises_past_the_budget_ends_the_run_with_its_exception(tmp_path: Path) -> None:
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1",
                  EXAMPLE, "--steps", "20", "--crash-at", "5", "--crashes", "9", "--crash-by", "raise")  # fmt: skip
    assert r.returncode != 0, r.stderr[-3000:]
    assert "ROOT CAUSE  rank 1" in r.stderr, r.stderr[-3000:]
    root = r.report(1)["root_cause"]
    assert isinstance(root, dict)
    assert root["error"]["message"] == "rank 1 failed at step 6", root


PARKED_DEAF = """
import os, signal
import torch.distributed as dist
import ftrun

signal.signal(signal.SIGTERM, lambda *_: None)  # as Lightning's: a flag the loop reads at its next step

@ftrun.restartable
def train():
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 failed after rank 0 finished")
    dist.destroy_process_group()

train()
"""


def test_a_rank_parked_when_the_run_ends_exits_whatever_its_sigterm_handler(
    tmp_path: Path, script: WriteScript
) -> None:
    """Rank 1 raises past the budget and parks at the agent's door, as a rank restarted in place does; the run
    ends, and the job's SIGTERM handler swallows the stop's signal: the parked process is let go at once (it ran
    no code of the job's there). Before, the stop waited the whole --shutdown-timeout (600 s) for it."""
    script("parked.py", PARKED_DEAF)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "0", "--shutdown-timeout", "600", "parked.py",
                  timeout=120)  # fmt: skip
    assert r.returncode != 0, r.stderr[-3000:]
    root = r.report(0)["root_cause"]
    assert isinstance(root, dict)
    assert root["rank"] == 1, root
    assert root["error"]["message"] == "rank 1 failed after rank 0 finished", root


DEAF = """
import os, signal, time
import torch.distributed as dist
import ftrun

signal.signal(signal.SIGTERM, lambda *_: None)  # as Lightning's: a flag the loop reads at its next step

@ftrun.restartable
def train():
    dist.init_process_group("gloo")
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"rank {dist.get_rank()} attempt {attempt} pid {os.getpid()} from step 0", flush=True)
    dist.barrier()  # both groups made: rank 1 leaving while rank 0's init connects would fail that init instead
    if attempt == 0 and dist.get_rank() == 1:
        os._exit(3)
    if attempt == 0:  # rank 0 cannot be interrupted: the signal never reaches Python
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN + 5])
        time.sleep(3600)
    dist.barrier()  # gloo's init may return on one rank before the other's connections are made: ending the
    dist.destroy_process_group()  # group then broke the other's ("Connection closed by peer"), a second failure

train()
"""


@pytest.mark.alone  # timed by a bound (5 s to park); its 120 s hang beside 3 others: the script, then the stop (fixed)
def test_a_rank_that_cannot_be_interrupted_is_restarted_as_a_process_and_said(
    tmp_path: Path, script: WriteScript
) -> None:
    """Its SIGTERM handler cannot end it either (it sets a flag): it is not waited for once it shows no progress
    (--shutdown-timeout 600 here: longer than the test waits)."""
    script("deaf.py", DEAF)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "--shutdown-timeout", "600", "deaf.py")
    assert r.returncode == 0, r.stderr[-3000:]
    ran = pids(r.log(0, 0) + r.log(1, 0) + r.log(0, 1) + r.log(1, 1))
    assert ran[0, 0] != ran[0, 1], ran
    assert re.search(r"rank 0 \(local rank 0, pid \d+\): not interrupted within 5 s", r.stderr), r.stderr
    assert "(not interrupted: stuck outside Python): SIGKILL" in r.stderr, r.stderr
    assert "1 restart (warm)" in r.stderr or "1 restart (cold)" in r.stderr, r.stderr


STUCK_PEER = """
import os, pathlib, time
import torch, torch.distributed as dist
import ftrun

@ftrun.restartable
def train():
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    pair = dist.new_group([0, 1])
    print(f"rank {rank} attempt {attempt} pid {os.getpid()} from step 0", flush=True)
    inside = [pathlib.Path(f"rank-{r}-inside") for r in (0, 1)]
    if attempt == 0 and rank == 0:
        inside[0].touch()
        dist.all_reduce(torch.ones(1), group=pair)  # waits for rank 1, which never comes
    elif attempt == 0 and rank == 1:
        inside[1].touch()
        os.system("sleep 60")  # stuck in C (system() waits for its child whatever signal comes)
    elif attempt == 0:
        deadline = time.monotonic() + 60
        while not all(p.exists() for p in inside) and time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(3)  # the failure; rank 0's collective does not involve this rank
    dist.barrier()
    print(f"rank {rank} attempt {attempt} done", flush=True)
    dist.destroy_process_group()

train()
"""


def test_a_rank_waiting_in_a_collective_for_a_peer_stuck_outside_python_restarts_in_place(
    tmp_path: Path, script: WriteScript
) -> None:
    """Rank 0 waits in an all_reduce with rank 1, which is stuck in C; rank 2 exits. Python runs rank 0's
    interrupt handler only once its collective returns, which it would do only when rank 1's process ends: after
    the bound to park, when rank 0 too is past it. The interrupt's thread breaks the collective at once: rank 0
    restarts in place, rank 1 is replaced for not parking."""
    script("stuck.py", STUCK_PEER)
    r = run_ftrun(tmp_path, "--nproc-per-node", "3", "--max-restarts", "1", "stuck.py")
    assert r.returncode == 0, r.stderr[-3000:]
    logs = "".join(r.log(attempt, rank) for rank in range(3) for attempt in range(2))
    ran = pids(logs)
    assert (ran[0, 0] == ran[0, 1], ran[1, 0] == ran[1, 1], ran[2, 0] == ran[2, 1]) == (True, False, False), ran
    assert re.search(r"rank 1 \(local rank 1, pid \d+\): not interrupted within 5 s", r.stderr), r.stderr[-3000:]
    assert "rank 0 attempt 1 done" in r.log(1, 0)


RAISED_AS_THE_STOP_BEGAN = """
import os, pathlib, time
import torch.distributed as dist
import ftrun

@ftrun.restartable
def train():
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"rank {rank} attempt {attempt} pid {os.getpid()} from step 0", flush=True)
    waiting = pathlib.Path("rank-0-waiting")
    if attempt == 0 and rank == 0:
        try:
            waiting.touch()
            time.sleep(60)
        except ftrun.RestartInPlace:  # swallowed (the docs say: let it pass), then a failure of its own
            pass
        raise ValueError("rank 0 failed as the stop began")
    if attempt == 0:
        deadline = time.monotonic() + 60
        while not waiting.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os._exit(3)
    dist.barrier()
    dist.destroy_process_group()

train()
"""


def test_a_rank_whose_function_raises_while_the_stop_waits_for_it_is_a_failure_too(
    tmp_path: Path, script: WriteScript
) -> None:
    """Rank 1 exits; rank 0's function raises an exception of its own once interrupted, so its park is read while
    the stop waits for it: it restarts in place, and the report says its function raised (not "interrupted")."""
    script("w.py", RAISED_AS_THE_STOP_BEGAN)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py")
    assert r.returncode == 0, r.stderr[-3000:]
    ran = pids(r.log(0, 0) + r.log(0, 1) + r.log(1, 0) + r.log(1, 1))
    assert ran[0, 0] == ran[0, 1], ran
    assert re.search(r"rank 0 \(local rank 0, pid \d+\): its function raised; its process restarts in place", r.stderr)
    assert "ROOT CAUSE  rank 1" in r.stderr, r.stderr[-3000:]
    also = r"ALSO FAILED rank 0 .*: its function raised; its process restarts in place at 20\d\d-.*\n  ValueError"
    assert re.search(also, r.stderr), r.stderr[-3000:]  # when, from its error file, and what
    assert "ValueError: rank 0 failed as the stop began" in r.log(0, 0, "stderr")


RAISES_AS_IT_BEGINS = """
import os
import torch
import torch.distributed as dist
import ftrun


@ftrun.restartable
def train():
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"rank {rank} attempt {attempt} pid {os.getpid()} from step 0", flush=True)
    if rank == 1 and 1 <= attempt <= 5:
        raise ValueError(f"rank 1 fails as attempt {attempt} begins")
    dist.init_process_group("gloo")
    t = torch.ones(1)
    for step in range(5):
        dist.all_reduce(t)
        if rank == 1 and attempt == 0 and step == 3:
            raise ValueError("rank 1 fails at step 3")
    dist.destroy_process_group()


train()
"""


def test_a_rank_that_fails_as_each_attempt_begins_never_costs_its_peer_its_process(
    tmp_path: Path, script: WriteScript
) -> None:
    """Rank 1's function raises as soon as it is called, 5 attempts in a row: each time rank 0 is interrupted as
    its own call begins, or just before, and it keeps its process throughout (an interrupt heard before its
    call ran was lost: rank 0 then waited in init_process_group, was "not interrupted within 5 s", replaced)."""
    script("w.py", RAISES_AS_IT_BEGINS)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "6", "--crash-loop-limit", "0", "w.py")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "not interrupted" not in r.stderr, r.stderr[-3000:]
    ran = pids("".join(r.log(attempt, 0) for attempt in range(7)))  # interrupted before its call began: no line
    assert {0, 6} <= {attempt for rank, attempt in ran if rank == 0}, ran
    assert len({pid for (rank, _), pid in ran.items() if rank == 0}) == 1, ran
    assert "6 restarts (in place)" in r.stderr, r.stderr[-2000:]


REFUSED_END = """
import os
import torch.distributed as dist
import ftrun

graceful_end = dist.destroy_process_group


def refuse(group=None):  # as NCCL's graceful end of a communicator ftrun aborted: it raises, forgetting nothing
    raise RuntimeError("NCCL error: the communicator was aborted (finalize)")


@ftrun.restartable
def train():
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.destroy_process_group = refuse if attempt == 0 else graceful_end
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} attempt {attempt} pid {os.getpid()} from step 0", flush=True)
    dist.barrier()  # rank 0's group is made too (under load rank 1 could leave while rank 0's init connected)
    if attempt == 0 and rank == 1:
        os._exit(3)
    dist.barrier()  # attempt 0: rank 0 waits here for rank 1, gone
    print(f"rank {rank} met its peer", flush=True)
    dist.destroy_process_group()

train()
"""


def test_a_group_that_refuses_a_graceful_end_is_forgotten_and_made_again(tmp_path: Path, script: WriteScript) -> None:
    """The end of rank 0's group raises (as NCCL's does for a communicator aborted): torch's abort forgets it,
    so rank 0's next init_process_group makes a new default group rather than finding the old one there."""
    script("w.py", REFUSED_END)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py")
    assert r.returncode == 0, r.stderr[-3000:]
    ran = pids(r.log(0, 0) + r.log(0, 1) + r.log(1, 0) + r.log(1, 1))
    assert ran[0, 0] == ran[0, 1], ran
    assert "rank 0 met its peer" in r.log(1, 0)


LOADER_OUTSIDE = """
import os, sys, time
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
import ftrun


class Numbers(Dataset):
    def __len__(self):
        return 200

    def __getitem__(self, i):
        return torch.tensor([float(i)])


@ftrun.restartable
def train(loader):
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step, batch in enumerate(loader):
        if step == 0:
            print(f"rank {rank} attempt {attempt} loader workers {sorted(w.pid for w in loader._iterator._workers)}",
                  flush=True)
        total = batch.sum()
        dist.all_reduce(total)
        if attempt == 0 and rank == 1 and step == 10:
            os._exit(3)
        time.sleep(0.01)
    dist.destroy_process_group()


if __name__ == "__main__":
    train(DataLoader(Numbers(), batch_size=4, num_workers=2, persistent_workers=True,
                     multiprocessing_context=sys.argv[1]))
"""


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_made_outside_the_function_are_kept_with_the_survivors_process(
    tmp_path: Path, script: WriteScript, context: str
) -> None:
    """As the README says: a survivor's persistent DataLoader workers, made outside the function, are the same
    processes in the next call."""
    script("w.py", LOADER_OUTSIDE)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py", context, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 restart (in place)" in r.stderr, r.stderr[-2000:]
    workers = [re.findall(r"rank 0 attempt \d loader workers (\[.*\])", r.log(a, 0)) for a in (0, 1)]
    assert len(workers[0]) == 1, workers  # its first step in each attempt, in the same process
    assert workers[0] == workers[1], workers
    assert "killed by signal" not in r.log(1, 0, "stderr")


LEFT_IN_INIT = """
import datetime, os, time
import torch.distributed as dist
import ftrun

@ftrun.restartable
def train():
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"rank {rank} attempt {attempt} pid {os.getpid()} from step 0", flush=True)
    if attempt == 0 and rank == 1:
        time.sleep(1)
        os._exit(3)  # before it joined: rank 0's init waits for it, then fails
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2 if attempt == 0 else 60))
    dist.barrier()
    print(f"rank {rank} met its peer", flush=True)
    dist.destroy_process_group()

train()
"""


def test_a_rank_whose_init_failed_for_a_lost_peer_meets_the_new_one_in_place(
    tmp_path: Path, script: WriteScript
) -> None:
    """Rank 1 exits before joining; rank 0's init_process_group fails (its timeout) and it restarts in place.
    Torch had already named the group it never made: left so, its next group's name differs from the new
    rank's and both would wait in init for good."""
    script("w.py", LEFT_IN_INIT)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py")
    assert r.returncode == 0, r.stderr[-3000:]
    ran = pids(r.log(0, 0) + r.log(1, 0) + r.log(0, 1) + r.log(1, 1))
    assert ran[0, 0] == ran[0, 1], ran  # in place
    assert "1 restart (in place)" in r.stderr, r.stderr[-2000:]
    assert "rank 0 met its peer" in r.log(1, 0)
    assert "rank 1 met its peer" in r.log(1, 1)


def crashed_in_place_ends_as_a_clean_run(tmp_path: Path, shared_dir: Path, job: str) -> None:
    """``job --crash`` on 2 ranks: rank 1's exit restarts rank 0 in place, and rank 0's weights end as in ``job``
    run without the crash."""
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", job, "--crash")
    assert r.returncode == 0, r.stderr[-3000:]
    ran = pids(r.log(0, 0) + r.log(1, 0))
    assert ran[0, 0] == ran[0, 1], ran  # rank 0 kept its process
    assert "1 restart (in place)" in r.stderr, r.stderr[-2000:]
    never = clean_run(shared_dir, "--nproc-per-node", "2", job, files={job: (tmp_path / job).read_text()})
    assert checksum(r.log(1, 0)) == checksum(never.log(0, 0))


FRAMEWORK_JOB = """
import gc, hashlib, os, sys
import torch
from torch import nn
import ftrun
{set_up}

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
initial = {{"model": {{k: v.clone() for k, v in net.state_dict().items()}}, "opt": None}}


@ftrun.restartable
def train():
    rank, prepare, backward, finish = set_up()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    last, state = ftrun.restore() or (-1, initial)
    net.load_state_dict(state["model"])
    if state["opt"] is not None:
        opt.load_state_dict(state["opt"])
    model, optimizer = prepare(net, opt)
    print(f"rank {{rank}} attempt {{attempt}} pid {{os.getpid()}} from step {{last + 1}}", flush=True)
    for step in range(last + 1, 30):
        if "--crash" in sys.argv and rank == 1 and attempt == 0 and step == 12:
            os._exit(3)
        g = torch.Generator().manual_seed(step * 100 + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        optimizer.zero_grad()
        backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        ftrun.snapshot(step, {{"model": net.state_dict(), "opt": opt.state_dict()}})
    if rank == 0:
        weights = b"".join(t.numpy().tobytes() for t in net.state_dict().values())
        print("checksum", hashlib.sha256(weights).hexdigest()[:16], flush=True)
    del model, optimizer
    finish()


train()
"""
SET_UP = {
    "accelerate": """
from accelerate import Accelerator


def set_up():
    accelerator = Accelerator(cpu=True)

    def finish():  # as Accelerate's docs show; its references to the model first (DDP before its group)
        accelerator.free_memory()
        accelerator.end_training()

    return accelerator.process_index, accelerator.prepare, accelerator.backward, finish
""",
    "lightning_fabric": """
from lightning_fabric import Fabric


def set_up():
    fabric = Fabric(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp")
    fabric.launch()

    def finish():  # DDP before its group (freed after it, it can hang gloo's teardown: torch 2.13)
        gc.collect()
        torch.distributed.destroy_process_group()

    return fabric.global_rank, fabric.setup, fabric.backward, finish
""",
}


@pytest.mark.slow
@pytest.mark.parametrize("framework", sorted(SET_UP))
def test_a_framework_that_sets_up_the_group_itself_restarts_in_place(
    tmp_path: Path, shared_dir: Path, script: WriteScript, framework: str
) -> None:
    """The function sets up through a training framework (its own init_process_group, DDP, its backward), which
    Accelerate does once per process in a singleton: rank 1 exits at step 12, rank 0's second call sets up anew in
    the same process, and the weights end as in a run that never failed."""
    pytest.importorskip(framework)
    script("w.py", FRAMEWORK_JOB.format(set_up=SET_UP[framework]))
    crashed_in_place_ends_as_a_clean_run(tmp_path, shared_dir, "w.py")


HF_TRAINER_JOB = """
import hashlib, os, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
import ftrun


class Crash(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
        if "--crash" in sys.argv and first and os.environ["RANK"] == "1" and state.global_step == 6:
            os._exit(3)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


@ftrun.restartable
def train():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments("out", per_device_train_batch_size=4, max_steps=12, save_steps=4, report_to=[],
                             use_cpu=True, seed=0, ddp_backend="gloo", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Crash()])
    saved = os.path.isdir("out") and any(d.startswith("checkpoint-") for d in os.listdir("out"))
    print(f"rank {os.environ['RANK']} attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} pid {os.getpid()} "
          f"from step 0", flush=True)
    trainer.train(resume_from_checkpoint=saved or None)
    if os.environ["RANK"] == "0":
        weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        print("checksum", hashlib.sha256(weights).hexdigest()[:16], flush=True)


train()
"""


@pytest.mark.slow
def test_a_hugging_face_trainer_resuming_from_its_own_checkpoints_restarts_in_place(
    tmp_path: Path, shared_dir: Path, script: WriteScript
) -> None:
    """transformers' Trainer (Accelerate underneath, DDP on gloo), its own checkpoints every 4 steps and no
    ftrun.snapshot: rank 1 exits at step 6; rank 0's process makes its Trainer again and resumes from
    checkpoint-4 with the new rank 1; the weights end as in a run that never failed."""
    pytest.importorskip("transformers")
    script("w.py", HF_TRAINER_JOB)
    crashed_in_place_ends_as_a_clean_run(tmp_path, shared_dir, "w.py")


LIGHTNING_TRAINER_JOB = """
import hashlib, os, sys
import torch
from torch import nn
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
import ftrun


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, i):
        first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
        if "--crash" in sys.argv and first and self.global_rank == 1 and self.global_step == 7:
            os._exit(3)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 24  # 3 steps an epoch on 2 ranks

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.randn(4, generator=g)


def train():
    pl.seed_everything(0)
    model = Net()
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp",
                         max_steps=12, callbacks=[ModelCheckpoint(dirpath="ckpt", save_last=True)],
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    last = "ckpt/last.ckpt" if os.path.exists("ckpt/last.ckpt") else None
    print(f"rank {os.environ['RANK']} attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} pid {os.getpid()} "
          f"from step 0", flush=True)
    trainer.fit(model, torch.utils.data.DataLoader(Pairs(), batch_size=4), ckpt_path=last)
    if trainer.global_rank == 0:
        weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        print("checksum", hashlib.sha256(weights).hexdigest()[:16], flush=True)


(train if "--process-restart" in sys.argv else ftrun.restartable(train))()
"""


@pytest.mark.slow
def test_a_lightning_trainer_resuming_from_its_own_checkpoints_restarts_in_place_as_torchrun_restarts_it(
    tmp_path: Path,
) -> None:
    """PyTorch Lightning's Trainer (its own DDP set-up, its checkpoint at each epoch's end, its resume): rank 1
    exits in the third epoch; rank 0's process makes its Trainer again and resumes from the last checkpoint with
    the new rank 1. Lightning's resume from an epoch's end is not a clean run's (it runs a step of that epoch
    again): the weights end as when the same job is restarted as processes, as under torchrun (measured: the
    same checksum)."""
    pytest.importorskip("pytorch_lightning")
    ended = {}
    for how in ("in place", "process restart"):
        here = tmp_path / how.replace(" ", "-")
        here.mkdir()
        (here / "w.py").write_text(LIGHTNING_TRAINER_JOB)
        flags = ["--process-restart"] if how == "process restart" else []
        r = run_ftrun(here, "--nproc-per-node", "2", "--max-restarts", "1", "w.py", "--crash", *flags)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"1 restart ({'in place' if how == 'in place' else 'warm'})" in r.stderr, r.stderr[-2000:]
        ran = pids(r.log(0, 0) + r.log(1, 0))
        assert (ran[0, 0] == ran[0, 1]) == (how == "in place"), ran  # rank 0 kept its process, or not
        assert "Restored all states from the checkpoint" in r.log(1, 0, "stderr")  # Lightning's own resume
        ended[how] = checksum(r.log(1, 0))
    assert ended["in place"] == ended["process restart"], ended


def test_outside_ftrun_the_function_runs_once() -> None:
    code = "import ftrun\n@ftrun.restartable\ndef f(x):\n    return x * 2\nprint(f(21))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "42"
