"""Hangs found in a job that never imports ftrun: every optimizer step is a heartbeat (warm workers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Result, WriteScript, run_ftrun

pytestmark = pytest.mark.torch

TRAINS = """
import os, sys, time
import torch

rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(40):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()  # a heartbeat, though this script never heard of ftrun
    time.sleep(0.05)
    if attempt == "0" and rank == "1" and step == 10:
        print("rank 1 hangs", flush=True)
        time.sleep(120)
print("done", rank, flush=True)
"""


def hangs(r: Result) -> list[dict[str, Any]]:
    return [e for e in r.events() if e["kind"] == "hang"]


def test_an_unmodified_script_that_stops_stepping_is_a_hang(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", TRAINS)
    flags = ["--nproc-per-node", "2", "--max-restarts", "1", "--heartbeat-timeout", "2"]
    r = run_ftrun(tmp_path, *flags, "w.py")
    assert r.returncode == 0, r.stderr
    [hang] = hangs(r)
    assert (hang["rank"], hang["timeout"]) == (1, "heartbeat")
    assert r.log(1, 1).splitlines()[-1] == "done 1"


IN_CHARGE = """
import os, time
import torch, ftrun

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ftrun.heartbeat()  # the job beats on its own from here: ftrun's automatic beats stop
for step in range(100):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    time.sleep(0.05)  # 5 s of steps without a heartbeat of its own
"""


def test_a_script_that_beats_on_its_own_keeps_control(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", IN_CHARGE)
    r = run_ftrun(tmp_path, "--max-restarts", "1", "--heartbeat-timeout", "1", "w.py")
    assert r.returncode == 1  # its own heartbeat stopped: a hang, twice
    assert [h["timeout"] for h in hangs(r)] == ["heartbeat", "heartbeat"]


DDP_HANG = """
import os, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

def stuck_here():
    time.sleep(120)

rank, attempt = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
dist.init_process_group("gloo")
model = DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(30):
    if attempt == "0" and rank == 1 and step == 10:
        stuck_here()  # rank 0 goes on into the next backward and waits there for rank 1
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    time.sleep(0.05)
print("done", rank, flush=True)
dist.destroy_process_group()
"""


def test_the_hung_rank_is_blamed_not_the_one_waiting_for_it(tmp_path: Path, script: WriteScript) -> None:
    """A DDP job that never imports ftrun: both ranks stop stepping; the stacks say which one hangs."""
    script("w.py", DDP_HANG)
    flags = ["--nproc-per-node", "2", "--max-restarts", "1", "--heartbeat-timeout", "3"]
    r = run_ftrun(tmp_path, *flags, "w.py")
    assert r.returncode == 0, r.stderr
    root: dict[str, Any] = r.report(0)["root_cause"]  # type: ignore[assignment]
    assert root["rank"] == 1
    assert "stuck_here" in root["stacks"]
    assert root["why"].startswith("not in a collective while rank(s) 0 waited in one")
    [waiting] = r.report(0)["stopped_by_ftrun"]  # type: ignore[misc]
    assert waiting["rank"] == 0
    assert "torch/autograd" in waiting["waiting_stacks"] or "torch/distributed" in waiting["waiting_stacks"]
    assert "it was waiting for its peers" in r.stderr
    assert {r.log(1, k).splitlines()[-1] for k in (0, 1)} == {"done 0", "done 1"}
