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
