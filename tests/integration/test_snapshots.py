"""Lose at most one step: ftrun.snapshot / ftrun.restore in a real DDP job (gloo, 2 ranks) under a real agent.
A worker crash restores the newest snapshot whole on every rank; a snapshot whose checksum no longer matches is
never restored: the job falls back to the step before, and says so. The weights end as in a run never failed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftrun.agent.snapshots import snapshot_root
from ftrun.job.snapshot_mirror import held
from ftrun.testing.etcd import EtcdHarness
from ftrun.worker import snapshot_file as file
from tests.integration.harness import CONF, LiveFtrun, clean_run, run_ftrun

pytestmark = pytest.mark.torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "snapshot_ddp.py"

# The example, and just before rank 1 crashes a byte of its newest snapshot flipped (memory that went bad).
CORRUPTING = f"""
import os, runpy, sys
from pathlib import Path
from ftrun.worker import snapshot

real_exit = os._exit
def corrupt_then_exit(code):
    snapshot.wait()
    part = snapshot.path_of(Path(os.environ[snapshot.ENV_DIR]), 29, 1)
    raw = bytearray(part.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    part.write_bytes(raw)
    print("rank 1 flipped a byte of its step 29", flush=True)
    real_exit(code)
os._exit = corrupt_then_exit
sys.argv = [{str(EXAMPLE)!r}, *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def checksum(text: str) -> str:
    [found] = re.findall(r"checksum ([0-9a-f]{16})", text)  # torchrun's stdout: a line may run into another
    return found


def snapshot_dirs() -> set[str]:
    """The agents' snapshot directories ("PID-..."), but those of agents alive now (other tests')."""
    base = Path("/dev/shm") / f"ftrun-snapshots-{os.geteuid()}"
    return {d.name for d in base.iterdir() if not alive(d.name.split("-")[0])} if base.is_dir() else set()


def alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


@pytest.mark.slow
def test_a_worker_crash_restores_the_newest_snapshot_and_loses_at_most_a_step(tmp_path: Path, shared_dir: Path) -> None:
    before = snapshot_dirs()
    crashed = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", str(EXAMPLE), "--crash-at", "30")
    assert crashed.returncode == 0, crashed.stderr
    # Rank 1 died at the top of step 30, its step 29 still being written, perhaps: 29 or 28 is whole on both.
    [named] = re.findall(r"the workers restore the snapshot of step (\d+), whole on every rank", crashed.stderr)
    assert int(named) in (28, 29), crashed.stderr  # at most one finished step done again
    for rank in (0, 1):
        assert f"rank {rank} restored step {named} (attempt 1)" in crashed.log(1, rank)
    # The snapshots name the steps: the work the crash cost is known (steps redone x step time), with no heartbeat
    [goodput] = re.findall(r"^ftrun: goodput .*$", crashed.stderr, re.M)
    assert "lost work unknown" not in goodput, goodput
    report = subprocess.run([sys.executable, "-m", "ftrun", "report", str(crashed.run_dir)], capture_output=True,
                            text=True, timeout=60, check=True).stdout  # fmt: skip
    redone = 29 - int(named)  # the crash came at the top of step 30: steps after the one restored, done again
    assert re.search(rf"lost work: [\d.]+ s, {redone} step\(s\) done again", report), report
    never = clean_run(shared_dir, "--nproc-per-node", "2", str(EXAMPLE))
    assert never.returncode == 0, never.stderr
    assert checksum(crashed.log(1, 0)) == checksum(never.log(0, 0))
    assert not snapshot_dirs() - before  # the run's snapshots freed with it (a dead agent's, left before, too)


@pytest.mark.slow
def test_a_corrupt_snapshot_is_never_restored_the_job_falls_back_and_says_so(tmp_path: Path, shared_dir: Path) -> None:
    (tmp_path / "corrupting.py").write_text(CORRUPTING)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "2", "corrupting.py", "--crash-at", "30")
    assert r.returncode == 0, r.stderr
    assert "rank 1 flipped a byte of its step 29" in r.log(0, 1)
    root = r.report(1)["root_cause"]
    assert isinstance(root, dict)
    said = str(root["error"] or "") + str(root["last_error"] or "") + "".join(root["stderr_tail"])
    assert "its checksum does not match" in said, root
    assert "ftrun restores an older snapshot at the next restart" in said
    assert "the workers restore the snapshot of step 28, whole on every rank" in r.stderr
    assert "rank 1 restored step 28 (attempt 2)" in r.log(2, 1)
    never = clean_run(shared_dir, "--nproc-per-node", "2", str(EXAMPLE))
    assert checksum(r.log(2, 0)) == checksum(never.log(0, 0))


@pytest.mark.parametrize("store", ["embedded", "etcd"])
def test_two_nodes_restore_one_step_agreed_through_the_store(
    tmp_path: Path, store: str, request: pytest.FixtureRequest, live: list[LiveFtrun], shared_dir: Path
) -> None:
    """2 agents (separate processes) x 1 rank; rank 1 crashes at step 30: a new round, in which the nodes agree
    on the newest step both have whole, restore it, and end with the weights of a run that never failed."""
    if store == "etcd":
        etcd: EtcdHarness = request.getfixturevalue("etcd_server")
        flags = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.url.removeprefix("etcd://"), "--rdzv-conf", CONF]
    else:
        endpoint: str = request.getfixturevalue("tcp_server")
        flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-conf", f"{CONF},is_host=false"]
    flags += ["--local-addr", "127.0.0.1", "--nnodes", "2", "--nproc-per-node", "1"]
    flags += ["--max-restarts", "1", str(EXAMPLE), "--crash-at", "30"]
    agents = [LiveFtrun(tmp_path, *flags, name=name, run_id=f"snap-{store}") for name in ("a", "b")]
    live.extend(agents)
    for agent in agents:
        assert agent.wait() == 0, agent.stderr()
    named = [re.findall(r"the workers restore the snapshot of step (\d+)", agent.stderr()) for agent in agents]
    assert named[0] == named[1], named  # one step for every rank of the job
    [step] = named[0]
    assert int(step) in (28, 29), named
    after = {int(p.parent.name): p.read_text() for a in agents for p in a.run_dir.glob("attempt_1/*/stdout.log")}
    for rank in (0, 1):  # the ranks' log directories are named by global rank
        assert f"rank {rank} restored step {named[0][0]} (attempt 1)" in after[rank]
    never = clean_run(shared_dir, "--nproc-per-node", "2", str(EXAMPLE))
    assert never.returncode == 0, never.stderr
    assert checksum(after[0]) == checksum(never.log(0, 0))


DCP_EXAMPLE = EXAMPLE.with_name("snapshot_dcp.py")


@pytest.mark.slow
def test_a_dcp_job_changes_one_argument_and_restores_the_newest_step_verified(tmp_path: Path) -> None:
    """torch.distributed.checkpoint through ftrun.SnapshotWriter / SnapshotReader: a crash restores the newest
    step whole on both ranks (nothing at --checkpoint: it is in memory); under torchrun the same job saves to
    --checkpoint. The weights end as in a run that never failed."""
    crashed = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", str(DCP_EXAMPLE),
                        "--checkpoint", "ckpt", "--crash-at", "30")  # fmt: skip
    assert crashed.returncode == 0, crashed.stderr
    [named] = re.findall(r"the workers restore the snapshot of step (\d+), whole on every rank", crashed.stderr)
    assert int(named) in (28, 29), crashed.stderr
    for rank in (0, 1):
        assert f"rank {rank} restored step {named} (attempt 1)" in crashed.log(1, rank)
    assert not (tmp_path / "ckpt").exists()
    [goodput] = re.findall(r"^ftrun: goodput .*$", crashed.stderr, re.M)
    assert "lost work unknown" not in goodput, goodput
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(DCP_EXAMPLE),
         "--checkpoint", str(tmp_path / "plain")],  # --standalone: a free port, not 29500, which another may hold
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert (tmp_path / "plain" / ".metadata").is_file()  # outside ftrun: torch's own checkpoint at the path
    assert checksum(crashed.log(1, 0)) == checksum(plain.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("job", [[EXAMPLE], [DCP_EXAMPLE, "--checkpoint", "ckpt"]], ids=["snapshot", "dcp"])
def test_a_node_lost_restores_its_rank_on_a_spare_from_the_copy_a_survivor_holds(
    tmp_path: Path, etcd_server: EtcdHarness, live: list[LiveFtrun], job: list[str | Path], shared_dir: Path
) -> None:
    """2 nodes x 1 rank and a hot spare: each node's snapshots are copied to the other; a node is SIGKILLed;
    the spare takes its rank, fetches that rank's snapshot from the survivor, and both restore one step. The
    weights end as in a run that never failed. The same for a DCP job (nothing at its --checkpoint)."""
    flags = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.url.removeprefix("etcd://"), "--rdzv-conf", CONF]
    flags += ["--local-addr", "127.0.0.1", "--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "2"]
    flags += [*map(str, job), "--steps", "80", "--step-time", "0.1"]

    def agent(name: str) -> LiveFtrun:
        started = LiveFtrun(tmp_path, *flags, name=name, run_id=f"snap-spare-{Path(str(job[0])).stem}")
        live.append(started)
        return started

    a, b = agent("a"), agent("b")
    head = a if "group rank 0" in a.wait_for_stderr(r"round 1: group rank") else b
    other = b if head is a else a
    other.wait_for_stderr(r"round 1: group rank")
    spare = agent("spare")
    spare.wait_for_stderr("hot spare")
    copies = Path("/dev/shm") / f"ftrun-snapshots-{os.geteuid()}"
    deadline = time.monotonic() + 60
    while not list(copies.glob(f"{head.proc.pid}-*/peer/step-*/rank-1.snap")):  # the survivor holds rank 1's
        assert time.monotonic() < deadline, "rank 1's snapshot of a step never reached the node of rank 0"
        time.sleep(0.1)
    # Rank 1 stopped, then its node copies on the newest step it has whole of those rank 0's node paced (the
    # ring copies the steps the pacing node began to copy, pinned on both: with steps faster than the copies'
    # pace some are passed over); once the survivor holds that step the node is lost, so that no step is lost
    # to the race between the copy and the kill.
    [worker] = [e["pid"] for e in other.events() if e["kind"] == "worker_spawned"]
    os.kill(worker, signal.SIGSTOP)
    [own] = copies.glob(f"{other.proc.pid}-*")
    [survivor] = copies.glob(f"{head.proc.pid}-*")
    deadline = time.monotonic() + 60

    def paced() -> int:  # rank 1's newest step whole on its node that the survivor's node paced (-1: none)
        return max(file.whole_steps(own, [1]) & file.pinned_steps(survivor), default=-1)

    while paced() not in held(survivor).get(1, ()):
        assert time.monotonic() < deadline, f"rank 1's step {paced()} never reached the node of rank 0"
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    other.proc.kill()
    newest = max(held(survivor)[1])  # rank 1's newest step on a survivor when its node was lost
    assert head.wait() == 0, head.stderr()
    assert spare.wait() == 0, spare.stderr()
    # The killed agent's snapshots (up to its whole --snapshot-memory) do not hold RAM until some next agent
    # starts on the machine: its warden frees them and says so.
    deadline = time.monotonic() + 30
    while own.exists() or not re.search(r"its warden ended .* and freed \d+ MiB of its snapshots", other.stderr()):
        assert time.monotonic() < deadline, f"{own} outlived its agent: {other.stderr()[-500:]}"
        time.sleep(0.1)
    assert re.search(r"rank 1's snapshot of step \d+ fetched from the node holding its copy", spare.stderr())
    named = [re.findall(r"the workers restore the snapshot of step (\d+)", f.stderr()) for f in (head, spare)]
    assert named[0][-1:] == named[1][-1:] == [str(newest)], named  # after the loss: rank 1's newest, on both
    logs = sorted((int(p.parent.parent.name.removeprefix("attempt_")), int(p.parent.name), p)
                  for f in (head, spare) for p in f.run_dir.glob("attempt_*/*/stdout.log"))  # fmt: skip
    after = {rank: path.read_text() for _, rank, path in logs}  # each rank's latest attempt
    assert f"rank 1 restored step {named[1][-1]}" in after[1]
    never = clean_run(shared_dir, "--nproc-per-node", "2", *map(str, job), "--steps", "80")
    assert never.returncode == 0, never.stderr
    assert checksum(after[0]) == checksum(never.log(0, 0))
    assert not (tmp_path / "ckpt").exists()  # a DCP job's steps: in memory, on every node


@pytest.mark.slow
def test_a_dcp_job_on_two_nodes_restores_one_step_agreed_through_the_store(
    tmp_path: Path, tcp_server: str, live: list[LiveFtrun], shared_dir: Path
) -> None:
    """DCP spreads a step's files over the nodes (the coordinator's metadata on its node; each replicated tensor
    written by one rank): on several nodes each rank's part is its whole state, in memory, and each node's
    reader reads its own back; the weights end as in a run that never failed."""
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", tcp_server, "--rdzv-conf", f"{CONF},is_host=false"]
    flags += ["--local-addr", "127.0.0.1", "--nnodes", "2", "--nproc-per-node", "1"]
    flags += ["--max-restarts", "1", str(DCP_EXAMPLE), "--checkpoint", "ckpt", "--crash-at", "30"]
    agents = [LiveFtrun(tmp_path, *flags, name=name, run_id="snap-dcp") for name in ("a", "b")]
    live.extend(agents)
    for agent in agents:
        assert agent.wait() == 0, agent.stderr()
    named = [re.findall(r"the workers restore the snapshot of step (\d+)", agent.stderr()) for agent in agents]
    assert named[0] == named[1], named
    [step] = named[0]
    assert int(step) in (28, 29), named
    after = {int(p.parent.name): p.read_text() for a in agents for p in a.run_dir.glob("attempt_1/*/stdout.log")}
    for rank in (0, 1):
        assert f"rank {rank} restored step {step} (attempt 1)" in after[rank], after[rank]
    assert not (tmp_path / "ckpt").exists()  # every step in memory
    never = clean_run(shared_dir, "--nproc-per-node", "2", str(DCP_EXAMPLE), "--checkpoint", "ckpt")
    assert never.returncode == 0, never.stderr
    assert checksum(after[0]) == checksum(never.log(0, 0))


BIG_STATE = """
import os, sys, time
import torch
import ftrun
rank = int(os.environ["RANK"])
state = {"weights": torch.full((1 << 20,), float(rank))}  # 4 MiB per rank
for step in range(int(sys.argv[1])):
    state["weights"] += 1
    ftrun.snapshot(step, state)
    time.sleep(0.05)
print(f"rank {rank} done", flush=True)
"""
STATE = 4 << 20


def node_bytes(agent: LiveFtrun) -> int:
    """The memory an agent's snapshot directory holds in /dev/shm now: its ranks' files and the peer copies."""
    seen: dict[int, int] = {}  # inode -> bytes: a file renamed as the walk goes (a spare written as a step,
    # a step pruned to the spare) is met twice, in the place it left and the one it came to
    for directory in snapshot_root().glob(f"{agent.proc.pid}-*"):
        for where, _, names in os.walk(directory):  # files and directories come and go as it walks: skipped
            for name in names:
                with contextlib.suppress(OSError):
                    st = os.stat(os.path.join(where, name))
                    seen[st.st_ino] = st.st_blocks * 512
    return sum(seen.values())


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [2, 3])
@pytest.mark.parametrize(("files", "keeps"), [(3, None), (4, "1 step and no older ones"),
                                              (6, "2 steps and no older ones"), (8, None)])  # fmt: skip
def test_nodes_hold_no_more_snapshot_memory_than_they_are_given_at_any_moment(
    tmp_path: Path, live: list[LiveFtrun], tcp_server: str, nodes: int, files: int, keeps: str | None
) -> None:
    """Nodes of one rank each, a 4 MiB state snapshotted every step and copied to the next node, under a
    --snapshot-memory of ``files`` states: each node's /dev/shm, sampled while they train, copy, pin and write,
    never holds more than that. Under the usual count (8 files: 2 steps, 2 older pinned, the copies), a rank
    keeps fewer steps, down to one with its copies (4 files), said once by each worker; under that, none, said
    once. (A node lost mid-copy, the world re-formed, is not yet within it: the old world's parts and a write
    the stop cut stay until the next attempt.)"""
    (tmp_path / "w.py").write_text(BIG_STATE)
    memory = files * STATE + STATE // 2  # the files' heads, a few KiB each
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", tcp_server, "--rdzv-conf", f"{CONF},is_host=false"]
    flags += ["--local-addr", "127.0.0.1", "--nnodes", str(nodes), "--nproc-per-node", "1"]
    flags += ["--snapshot-memory", str(memory), str(tmp_path / "w.py"), "80"]
    names = "abc"[:nodes]
    agents = [LiveFtrun(tmp_path, *flags, name=n, run_id=f"shm-{nodes}-{files}") for n in names]
    live.extend(agents)
    most = 0
    while any(a.proc.poll() is None for a in agents):
        most = max([most, *(node_bytes(a) for a in agents)])
        time.sleep(0.02)  # sampling a quantity that changes with no event to wait on; bounded by the agents' end
    for agent in agents:
        assert agent.wait() == 0, agent.stderr()
    assert most <= memory, (most, memory)
    said = [a.stderr() for a in agents]
    refused = [a for a in said if "no snapshots on rank" in a]
    fewer = [a for a in said if "keeps " in a and ", not 2 steps and 2 older ones" in a]
    if files < 4:
        assert most == 0
        assert len(refused) == nodes
        assert all(a.count("no snapshots on rank") == 1 for a in said)
        return
    assert most > 2 * STATE, most  # its own steps and the other node's copies were there
    assert refused == []
    if keeps is None:
        assert fewer == []
    else:
        assert len(fewer) == nodes, said
        assert all(a.count(f"keeps {keeps}") >= 1 for a in said), said  # once by each worker


PER_RANK = """
import os, pathlib, sys, time
import torch, ftrun
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
here, replicated = pathlib.Path(sys.argv[1]), sys.argv[2] == "replicated"
got = ftrun.restore()
print(f"start rank={rank} world={world} restored={got[0] if got else None}", flush=True)
for step in range(got[0] + 1 if got else 0, 100_000):
    ftrun.snapshot(step, {"part": torch.full((4,), float(rank)), "step": step}, replicated=replicated)
    time.sleep(0.05)
    if (here / "done").exists():
        break
"""


@pytest.mark.parametrize("how", ["per-rank", "replicated"])
def test_a_world_that_shrank_restores_no_half_state(
    tmp_path: Path, live: list[LiveFtrun], own_tcp_server: str, how: str
) -> None:
    """2 nodes x 1 rank, each snapshotting its own part; a node (agent and worker) is SIGKILLed and the survivor
    goes on at world 1. By default restore() gives it nothing (rank 1's part is gone: half a state is no state),
    and one console line says why; a job that says its state is replicated restores the step."""
    (tmp_path / "w.py").write_text(PER_RANK)
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", own_tcp_server, "--rdzv-conf", f"{CONF},is_host=false"]
    flags += ["--local-addr", "127.0.0.1", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2"]
    flags += ["w.py", str(tmp_path), how]
    a, b = (LiveFtrun(tmp_path, *flags, name=n, run_id=f"world-{how}") for n in ("a", "b"))
    live.extend([a, b])
    for agent in (a, b):
        agent.wait_for_lines(r"start rank=\d world=2 restored=None", 1)
    survivor, lost = (a, b) if "rank=0" in a.lines[0] else (b, a)
    deadline = time.monotonic() + 30
    while not file.whole_steps(next(snapshot_root().glob(f"{survivor.proc.pid}-*")), [0]):
        assert time.monotonic() < deadline, "no snapshot of rank 0 was taken"
        time.sleep(0.1)
    time.sleep(1)
    lost.proc.kill()  # its worker dies with it
    [again] = survivor.wait_for_lines(r"start rank=0 world=1 restored=(\w+)", 1)
    status = [sys.executable, "-m", "ftrun", "status", str(survivor.run_dir), "--json"]
    deadline = time.monotonic() + 30
    while "this one has 1" not in (shown := subprocess.run(status, capture_output=True, text=True, timeout=30).stdout):
        if how == "replicated" and "the workers restore the snapshot of step" in shown:
            break
        assert time.monotonic() < deadline, f"ftrun status never said what was restored: {shown}"
        time.sleep(0.2)
    (tmp_path / "done").touch()
    assert survivor.wait() == 0, survivor.stderr()
    said = survivor.stderr()
    changed = re.findall(r"step \d+ was snapshotted in a world of 2 ranks, this one has 1: not restored", said)
    told = re.findall(r"the snapshot of step \d+ was taken in a world of 2 ranks, this one has 1", said)
    report = subprocess.run([sys.executable, "-m", "ftrun", "report", str(survivor.run_dir)], capture_output=True,
                            text=True, timeout=60, check=True).stdout  # fmt: skip
    if how == "replicated":
        assert again.group(1).isdigit(), survivor.lines
        assert not changed
        assert not told  # the agent names the step it restores, as in any world
        assert f"  snapshots: the workers restore the snapshot of step {again.group(1)}, whole" in report, report
    else:
        assert again.group(1) == "None", survivor.lines
        assert len(changed) == 1, said
        assert len(told) == 1, said  # the agent says it too, not "restore ... whole on every rank"
        assert "  snapshots: the snapshot of step " in report, report  # the report says what was restored, and why
        assert "was taken in a world of 2 ranks, this one has 1" in report, report


@pytest.mark.parametrize("how", ["per-rank", "replicated"])
def test_a_world_that_grew_restores_a_replicated_state_on_the_new_rank_and_no_half_state(
    tmp_path: Path, live: list[LiveFtrun], own_tcp_server: str, how: str
) -> None:
    """Node a trains alone (world 1) and snapshots; node b joins (world 2). A state the job said serves any
    rank is restored on both ranks, rank 1 taking rank 0's file through the copies' servers; a per-rank state
    is restored on neither (rank 1 never had a part), and the agent says why."""
    (tmp_path / "w.py").write_text(PER_RANK)
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", own_tcp_server, "--rdzv-conf", f"{CONF},is_host=false"]
    flags += ["--local-addr", "127.0.0.1", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2"]
    flags += ["w.py", str(tmp_path), how]
    a = LiveFtrun(tmp_path, *flags, name="a", run_id=f"grow-{how}")
    live.append(a)
    a.wait_for_lines(r"start rank=0 world=1 restored=None", 1)
    deadline = time.monotonic() + 30
    while len(file.whole_steps(next(snapshot_root().glob(f"{a.proc.pid}-*")), [0])) < 2:
        assert time.monotonic() < deadline, "no snapshot of rank 0 was taken"
        time.sleep(0.1)
    b = LiveFtrun(tmp_path, *flags, name="b", run_id=f"grow-{how}")
    live.append(b)
    [on_a] = a.wait_for_lines(r"start rank=\d world=2 restored=(\w+)", 1)
    [on_b] = b.wait_for_lines(r"start rank=\d world=2 restored=(\w+)", 1)
    (tmp_path / "done").touch()
    for agent in (a, b):
        assert agent.wait() == 0, agent.stderr()
    if how == "replicated":
        assert on_a.group(1).isdigit(), a.lines
        assert on_b.group(1) == on_a.group(1), (a.lines, b.lines)  # the same step on both ranks
        assert "takes rank 0's snapshot of step" in b.stderr(), b.stderr()
    else:
        assert (on_a.group(1), on_b.group(1)) == ("None", "None"), (a.lines, b.lines)
        assert "a node new to the job has none" in a.stderr() + b.stderr()


# A table of as many slices as the first world has ranks, each rank owning the slices s with s % world == rank;
# each step adds (s + 1) * step to every slice it owns, and snapshots them (steps 0-29), then waits at step 30,
# in the first world, for the test.
RESHARDING = """
import json, os, pathlib, sys, time
import torch, ftrun
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
here, steps, slices = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
mine = [s for s in range(slices) if s % world == rank]
table, start = {s: torch.zeros(4) for s in mine}, 0
got = ftrun.restore_parts()
if got is not None:
    print(f"restored step {got.step} of a world of {got.world_size}: parts {sorted(got.parts)}, "
          f"missing {list(got.missing)}", flush=True)
    if got.whole:  # every old rank's part: take the slices this rank owns now, whoever owned them then
        table = {s: t for part in got.parts.values() for s, t in part["slices"].items() if s in mine}
        start = got.step + 1
print(f"start rank={rank} world={world} from={start}", flush=True)
for step in range(start, steps):
    for s in mine:
        table[s] += (s + 1) * step
    if step < 30:
        ftrun.snapshot(step, {"slices": table})
    while step == 30 and world == slices and not (here / "done").exists():
        time.sleep(0.05)
    time.sleep(0.02)
for s, t in table.items():
    (here / f"slice-{s}").write_text(json.dumps(t.tolist()))
"""


def copy_held(agent: LiveFtrun, rank: int, step: int) -> bool:
    """Whether the agent's node holds the copy of ``rank``'s snapshot of ``step``."""
    return step in held(next(snapshot_root().glob(f"{agent.proc.pid}-*"))).get(rank, set())


@pytest.mark.parametrize("nodes", [2, 3])
def test_a_job_that_reshards_gets_every_old_ranks_part_from_the_survivors_and_the_copies(
    tmp_path: Path, live: list[LiveFtrun], own_tcp_server: str, nodes: int
) -> None:
    """N nodes x 1 rank, each owning its slices of a table; the node of rank 1 is SIGKILLed once its last
    snapshot's copy reached the next node (and, with 3, rank 2's reached rank 0's). At world N-1,
    ftrun.restore_parts() gives each survivor every old part: its own, the copy it holds, and, with 3 nodes,
    the part only the other survivor holds (rank 1's copy is on rank 2's node, rank 2's own file there too):
    fetched from it. The job takes the slices and ends with the table of a run that never lost a node."""
    steps = 60
    (tmp_path / "w.py").write_text(RESHARDING)
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", own_tcp_server, "--rdzv-conf", f"{CONF},is_host=false"]
    flags += ["--local-addr", "127.0.0.1", "--nnodes", f"1:{nodes}", "--nproc-per-node", "1", "--max-restarts", "2"]
    flags += ["w.py", str(tmp_path), str(steps), str(nodes)]
    agents = [LiveFtrun(tmp_path, *flags, name=n, run_id="reshard") for n in "abc"[:nodes]]
    live.extend(agents)
    by_rank = {}
    for agent in agents:
        found = agent.wait_for_lines(rf"start rank=(\d) world={nodes} from=0", 1)[0]
        by_rank[int(found.group(1))] = agent
    deadline = time.monotonic() + 60
    while not (copy_held(by_rank[(1 + 1) % nodes], 1, 29) and copy_held(by_rank[0], nodes - 1, 29)):
        assert time.monotonic() < deadline, "the copies of step 29 never reached the next nodes"
        time.sleep(0.1)
    by_rank[1].proc.kill()  # its worker dies with it
    survivors = [agent for rank, agent in sorted(by_rank.items()) if rank != 1]
    for survivor in survivors:
        [restored] = survivor.wait_for_lines(r"restored step (\d+) of a world of (\d): parts (.*), missing (.*)", 1)
        assert restored.groups() == ("29", str(nodes), str(list(range(nodes))), "[]"), survivor.lines
        survivor.wait_for_lines(rf"start rank=\d world={nodes - 1} from=30", 1)
    if nodes == 3:  # each survivor lacked one part, held only by the other
        assert all("part of step 29 fetched from" in s.stderr() for s in survivors), [s.stderr() for s in survivors]
    (tmp_path / "done").touch()
    for survivor in survivors:
        assert survivor.wait() == 0, survivor.stderr()
    never_lost = {s: [float((s + 1) * steps * (steps - 1) // 2)] * 4 for s in range(nodes)}  # a run never failed
    assert {s: json.loads((tmp_path / f"slice-{s}").read_text()) for s in range(nodes)} == never_lost


SETTLED = 10  # snapshots after a world changed, by when its own steps and copies are all there


def newest_step(agents: list[LiveFtrun]) -> int:
    """The newest step any of the agents' ranks began to snapshot (-1: none yet)."""
    steps = [int(d.name.removeprefix("step-")) for a in agents for root in snapshot_root().glob(f"{a.proc.pid}-*")
             for d in root.glob("step-*") if d.name.removeprefix("step-").isdigit()]  # fmt: skip
    return max(steps, default=-1)


@pytest.mark.slow
@pytest.mark.parametrize("files", [8])  # at 4 (one step kept), one file over was sampled now and then: issue 70
def test_a_node_lost_mid_copy_leaves_the_others_within_their_snapshot_memory(
    tmp_path: Path, live: list[LiveFtrun], tcp_server: str, files: int
) -> None:
    """Three nodes, one rank each, under a --snapshot-memory of ``files`` states: the third node is SIGKILLed
    while the copies go on; the other two re-form (a world of 2, the old world's parts offered for a job that
    reshards) and train on. Each survivor's /dev/shm, sampled all along, is within the bound before the loss
    and again once the new world has snapshotted (the old world's files and the copies of a node that is no
    longer the previous one go as the new world's steps come; they stayed for the whole attempt before). Not
    yet within it: the moment between, when the old world's restored step is still there beside the new
    world's first file, as when a world grows."""
    (tmp_path / "w.py").write_text(BIG_STATE)
    memory = files * STATE + STATE // 2
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", tcp_server, "--rdzv-conf", f"{CONF},is_host=false"]
    flags += ["--local-addr", "127.0.0.1", "--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "3"]
    flags += ["--snapshot-memory", str(memory), str(tmp_path / "w.py"), "120"]
    agents = [LiveFtrun(tmp_path, *flags, name=n, run_id=f"shm-lost-{files}") for n in "abc"]
    live.extend(agents)
    for agent in agents:  # the first round may have had 2 of them: a world that grew, settling as one shrinks
        agent.wait_for_stderr(r"round \d+: group rank \d of 3")
    three_from = newest_step(agents[:2]) + SETTLED  # the world of 3's own snapshots written and copied
    before = after = 0
    lost_at = settled_from = None
    while any(a.proc.poll() is None for a in agents[:2]):
        now = [node_bytes(a) for a in agents[:2]]
        if newest_step(agents[:2]) < three_from:
            pass
        elif lost_at is None:
            before = max([before, *now])
            if node_bytes(agents[2]) > 3 * STATE:  # its own steps and copies in, more coming: lost
                os.killpg(agents[2].proc.pid, signal.SIGKILL)
                lost_at = time.monotonic()
        elif settled_from is None:
            if all(re.search(r"round \d+: group rank \d of 2", a.stderr()) for a in agents[:2]):
                settled_from = newest_step(agents[:2]) + SETTLED  # the new world's own, written and copied
        elif newest_step(agents[:2]) >= settled_from:
            after = max([after, *now])
        time.sleep(0.02)  # sampling a quantity that changes with no event to wait on; bounded by the agents' end
    for agent in agents[:2]:
        assert agent.wait() == 0, agent.stderr()
    assert lost_at is not None
    assert settled_from is not None
    assert before <= memory, (before, memory)
    assert 2 * STATE < after <= memory, (after, memory)
