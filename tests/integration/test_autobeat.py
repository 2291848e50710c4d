"""Hangs found in a job that never imports ftrun: every optimizer step is a heartbeat, in warm workers and in
fresh ones (which start through ftrun's sitecustomize)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import POOL, WAITS_FOR_THE_POOL, Result, WriteScript, run_ftrun

pytestmark = pytest.mark.torch

TRAINS = (
    WAITS_FOR_THE_POOL
    + """
import os, sys, time
import torch

rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
if attempt == "0" and os.environ.get("WAIT_FOR_POOL"):
    wait_for_the_pool()  # the restart is warm
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
)


def hangs(r: Result) -> list[dict[str, Any]]:
    return [e for e in r.events() if e["kind"] == "hang"]


@pytest.mark.parametrize("warm", ["--warm=auto", "--no-warm"])
def test_an_unmodified_script_that_stops_stepping_is_a_hang(tmp_path: Path, script: WriteScript, warm: str) -> None:
    script("w.py", TRAINS)
    flags = [warm, "--nproc-per-node", "2", "--max-restarts", "1", "--heartbeat-timeout", "2"]
    r = run_ftrun(tmp_path, *flags, "w.py", env=POOL if warm != "--no-warm" else {})
    assert r.returncode == 0, r.stderr
    [hang] = hangs(r)  # in fresh workers (the first attempt's)
    assert (hang["rank"], hang["timeout"]) == (1, "heartbeat")
    restarted = [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1]
    assert restarted == [warm != "--no-warm"] * 2
    assert r.log(1, 1).splitlines()[-1] == "done 1"


SEES = """
import json, os, sys
print(json.dumps({
    "pid": os.getpid(),
    "client_attached": "ftrun.worker.client" in sys.modules,
    "torch": "torch" in sys.modules,
    "pythonpath": os.environ.get("PYTHONPATH"),
    "ftrun_boot": [k for k in os.environ if k.startswith("FTRUN_BOOT")],
    "boot_on_path": [p for p in sys.path if p.endswith("boot")],
}))
"""

THEIR_SITECUSTOMIZE = """
import os
open(os.path.join(os.path.dirname(__file__), f"ran.{os.getpid()}"), "w").close()
"""


def test_a_fresh_worker_has_the_client_before_the_job_and_the_job_sees_its_own_environment(
    tmp_path: Path, script: WriteScript, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No pool (no restart can come): the client is attached before the script's first line, torch is not
    imported for it, and the job sees its PYTHONPATH as given, with the environment's sitecustomize run."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text(THEIR_SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(theirs))
    script("w.py", SEES)
    r = run_ftrun(tmp_path, "--heartbeat-timeout", "30", "w.py")
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.log(0, 0).splitlines()[-1])
    assert seen["client_attached"] is True
    assert seen["torch"] is False
    assert seen["pythonpath"] == str(theirs)
    assert seen["ftrun_boot"] == []
    assert seen["boot_on_path"] == []
    assert (theirs / f"ran.{seen['pid']}").exists()
    assert not [e for e in r.events() if e["kind"] == "worker_spawned" and e["warm"]]


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


# As most torchrun scripts are: main() under torch's @record, whose frame sits in torch/distributed/elastic in
# every rank's stack. The hung rank steps once more before it hangs: the rank waiting for it misses its deadline
# first, so only the stacks can name the right one.
DDP_HANG_RECORDED = """
import os, time
import torch, torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

def stuck_here():
    time.sleep(120)

@record
def main():
    rank, attempt = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(30):
        if attempt == "0" and rank == 1 and step == 10:
            opt.step()  # a heartbeat after rank 0's last one
            stuck_here()
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        time.sleep(0.05)
    print("done", rank, flush=True)
    dist.destroy_process_group()

main()
"""


@pytest.mark.parametrize("job", [DDP_HANG, DDP_HANG_RECORDED], ids=["plain", "recorded"])
def test_the_hung_rank_is_blamed_not_the_one_waiting_for_it(tmp_path: Path, script: WriteScript, job: str) -> None:
    """A DDP job that never imports ftrun: both ranks stop stepping; the stacks say which one hangs."""
    script("w.py", job)
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


EVALUATES = """
import sys, time
import torch
from torch.utils.data import DataLoader

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def train(steps):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        time.sleep(0.02)

def slow(batch):
    time.sleep(0.1)
    return torch.stack(batch)

train(30)  # the heartbeat timeout is learned after 10 steps: the 1 s floor
print("evaluating", flush=True)
with torch.no_grad():
    if sys.argv[1] == "loader":  # 3 s of batches: no optimizer step, but progress
        for batch in DataLoader(torch.randn(30, 4), batch_size=1, collate_fn=slow):
            model(batch)
    else:  # 3 s without a step or a batch
        time.sleep(3)
train(10)
print("done", flush=True)
"""


@pytest.mark.parametrize(("evaluation", "hung"), [("loader", False), ("sleep", True)])
def test_learned_timeouts_flag_a_stall_but_not_an_evaluation_that_fetches_batches(
    tmp_path: Path, script: WriteScript, evaluation: str, hung: bool
) -> None:
    script("w.py", EVALUATES)
    flags = ["--learn-timeouts", "10", "--learned-timeout-floor", "1", "--safety-factor", "5"]
    r = run_ftrun(tmp_path, *flags, "w.py", evaluation)
    learned = [e["heartbeat"] for e in r.events() if e["kind"] == "timeouts"]
    assert learned[0] == 1.0  # the floor: 5 x the longest gap between steps is well under it
    assert r.log(0, 0).startswith("evaluating\n")
    if hung:
        assert r.returncode == 1
        [hang] = hangs(r)
        assert hang["timeout"] == "heartbeat"
    else:
        assert r.returncode == 0, r.stderr
        assert hangs(r) == []
        assert r.log(0, 0).endswith("done\n")
