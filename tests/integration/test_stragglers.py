"""Stragglers named with no code change: real DDP jobs (gloo, CPU) that never import ftrun, one rank slowed by
a CPU spin before its forward pass; a balanced job, with one slow checkpoint step and an evaluation pause, stays
silent."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import CONF, WAIT_S, LiveFtrun, run_ftrun, until

pytestmark = pytest.mark.torch

# A DDP job that never imports ftrun. It trains until rank 0 sees `done` (or DURATION seconds pass); the ranks
# agree to stop through an all-reduce, so that none is left alone in a collective. Each step's compute waits
# 3 ms, as a GPU job's CPU waits on its device (the straggler watch times a rank's compute by the clock, so a
# wait is compute to it; a busy loop would hold a core of a loaded test machine for the whole run). SLOW_RANK
# (or every rank of a node started with SLOW_NODE=1) takes SLOW_MS longer; PAUSE_RANK sleeps PAUSE_S once at
# step 30 (a checkpoint); every rank pauses 1 s at step 60 (an evaluation).
DDP_JOB = """
import os, sys, time, pathlib
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"up rank={rank} world={dist.get_world_size()}", flush=True)
torch.manual_seed(0)
torch.set_num_threads(1)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
env = lambda k, d: type(d)(os.environ.get(k, d))
slow_rank, slow_ms = env("SLOW_RANK", -1), env("SLOW_MS", 0.0)
pause_rank, pause_s, duration = env("PAUSE_RANK", -1), env("PAUSE_S", 0.0), env("DURATION", 600.0)
done = pathlib.Path(sys.argv[1]) / "done"
x = torch.randn(64, 256)
started, step = time.monotonic(), 0
while True:
    if step % 10 == 0:
        stop = torch.tensor([float(rank == 0 and (done.exists() or time.monotonic() - started > duration))])
        dist.all_reduce(stop)
        if stop.item():
            break
    time.sleep(0.003 + (slow_ms / 1000 if rank == slow_rank or os.environ.get("SLOW_NODE") else 0.0))
    if step == 30 and rank == pause_rank:
        time.sleep(pause_s)
    if step == 60:
        time.sleep(1.0)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
print(f"rank {rank} trained {step} steps", flush=True)
dist.destroy_process_group()
"""


def ranks_of(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {r["rank"]: r for r in json.loads((run_dir / "status.json").read_text())["ranks"]}


def stragglers(events: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in events if e["kind"] == "straggler"]


def test_a_slow_rank_is_named_with_its_cost_in_every_place(tmp_path: Path, live: list[LiveFtrun]) -> None:
    (tmp_path / "job.py").write_text(DDP_JOB)
    slow = {"SLOW_RANK": "2", "SLOW_MS": "8"}
    agent = LiveFtrun(tmp_path, "--nproc-per-node", "3", "job.py", str(tmp_path), env=slow)
    live.append(agent)
    agent.wait_for_stderr(r"straggler: rank 2 \(node [^)]+\) computes [0-9.]+ ms longer per step")
    ranks = until(lambda: (rs := ranks_of(agent.run_dir))[2]["straggler"] and rs, "rank 2 a straggler in status.json")
    assert ranks[2]["straggler"]
    assert ranks[2]["straggler_score"] > 0.05
    assert not ranks[0]["straggler"]
    assert not ranks[1]["straggler"]
    scores = json.loads((agent.run_dir / "attempt_0" / "stragglers.json").read_text())
    assert max(scores, key=lambda r: scores[r]) == "2"  # what ftrun.stragglers() reads
    (tmp_path / "done").touch()
    assert agent.wait() == 0, agent.stderr()
    [named] = stragglers([json.loads(line) for line in (agent.run_dir / "events.jsonl").read_text().splitlines()])
    assert named["rank"] == 2
    assert 0 < float(named["cost"]) < 1
    assert float(named["extra_s"]) > 0.004  # type: ignore[arg-type]  # most of the 8 ms spin
    assert "  straggler: rank 2" in agent.stderr()  # the run's summary


@pytest.mark.slow
def test_a_balanced_job_with_a_slow_checkpoint_and_an_evaluation_names_nobody(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(DDP_JOB)
    r = run_ftrun(
        tmp_path, "--nproc-per-node", "2", "job.py", str(tmp_path),
        env={"PAUSE_RANK": "1", "PAUSE_S": "2", "DURATION": "24"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert stragglers(r.events()) == [], r.stderr
    assert "straggler" not in r.stderr
    ranks = json.loads((r.run_dir / "status.json").read_text())["ranks"]
    assert all(rank["straggler_score"] is not None for rank in ranks)  # windows were judged: the silence is a verdict


@pytest.mark.slow
def test_no_stragglers_times_nothing(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(DDP_JOB)
    r = run_ftrun(
        tmp_path, "--nproc-per-node", "2", "--no-stragglers", "job.py", str(tmp_path),
        env={"SLOW_RANK": "1", "SLOW_MS": "8", "DURATION": "14"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert stragglers(r.events()) == []
    assert not (r.run_dir / "attempt_0" / "stragglers.json").exists()
    ranks = json.loads((r.run_dir / "status.json").read_text())["ranks"]
    assert all(rank["straggler_score"] is None for rank in ranks)


ASKING_JOB = """
import os, sys, time
import torch
import ftrun

rank = int(os.environ["RANK"])
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 64)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    if rank == 1:
        end = time.perf_counter() + 0.004
        while time.perf_counter() < end:
            pass
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    scores = ftrun.stragglers()
    if scores.get(1, 0) > 0.05:
        print(f"rank {rank} sees scores {sorted(scores.items())}", flush=True)
        break
    time.sleep(0.002)
"""


def test_a_job_can_ask_for_the_scores(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(ASKING_JOB)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "job.py", timeout=WAIT_S * 2)
    assert r.returncode == 0, r.stderr
    assert "rank 0 sees scores [(0, " in r.stdout
    assert "rank 1 sees scores [(0, " in r.stdout


@pytest.mark.slow
def test_exclude_a_straggler_node_for_a_hot_spare(tmp_path: Path, live: list[LiveFtrun], own_tcp_server: str) -> None:
    """Three agents, two nodes wanted: the slow node leaves at its next step, the spare takes its place."""
    (tmp_path / "job.py").write_text(DDP_JOB)
    flags = [
        "--rdzv-backend", "c10d", "--rdzv-endpoint", own_tcp_server, "--rdzv-conf", f"{CONF},is_host=false",
        "--local-addr", "127.0.0.1", "--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "2",
        "--straggler-action", "exclude", "job.py", str(tmp_path),
    ]  # fmt: skip

    def start(name: str, **env: str) -> LiveFtrun:
        agent = LiveFtrun(tmp_path, *flags, name=name, run_id="slow", env={"SLOW_MS": "8", **env})
        live.append(agent)
        return agent

    slow, fast = start("slow", SLOW_NODE="1"), start("fast")
    for agent in (slow, fast):
        agent.wait_for_lines(r"up rank=\d world=2", 1)
    spare = start("spare")
    spare.wait_for_stderr(r"hot spare")
    assert slow.wait(WAIT_S) == 3, slow.stderr()  # excluded, as exclude_this_node() would
    assert re.search(
        r"rank \d is a straggler and a spare node waits: \S+ leaves the job at its next step", slow.stderr()
    )
    assert "is a straggler (" in slow.stderr()
    assert "and a spare can take its place" in slow.stderr()
    spare.wait_for_lines(r"up rank=\d world=2", 1)  # in the slow node's place
    fast.wait_for_lines(r"up rank=\d world=2", 2)
    (tmp_path / "done").touch()
    assert fast.wait(WAIT_S) == 0, fast.stderr()
    assert spare.wait(WAIT_S) == 0, spare.stderr()
    assert "leaves the job" not in fast.stderr()
