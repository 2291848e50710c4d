"""Workload control: a worker excludes its node, stops the job, or asks for a restart, and it happens now.

Single node and several agents (separate processes) on the embedded store and on etcd.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.harness import WAIT_S, LiveFtrun, WriteScript, run_ftrun, write_gate

ASKS = """
import os, sys, time
import ftrun
action, rank = sys.argv[1], int(os.environ["RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"up rank={rank} world={os.environ['WORLD_SIZE']} restart={restart}", flush=True)
if rank == int(sys.argv[2]) and restart == 0:
    if len(sys.argv) > 4:
        open(sys.argv[4]).read()  # a FIFO: the test says when (e.g. once a hot spare waits)
    getattr(ftrun, action)("loss is NaN at step 7")
    time.sleep(600)  # the agent stops it: the request took effect now, not at the next failure
if len(sys.argv) > 3 and (sys.argv[3] == "forever" or (sys.argv[3] == "hold" and restart == 0)):
    time.sleep(600)  # "hold": the other ranks wait for the request to take effect
"""


def test_stop_job_stops_every_worker_and_nothing_restarts(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", ASKS)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "3", "w.py", "stop_job", "1", "forever")
    assert r.returncode == 1, r.stderr
    assert "rank 1 (local rank 1" in r.stderr
    assert "stopped the job: loss is NaN at step 7" in r.stderr
    [request] = [e for e in r.events() if e["kind"] == "request"]
    assert (request["rank"], request["action"], request["reason"]) == (1, "stop_job", "loss is NaN at step 7")
    assert not [e for e in r.events() if e["kind"] == "restart"]
    root = r.report(0)["root_cause"]
    assert root["rank"] == 1  # type: ignore[index]
    assert root["request"] == "stopped the job: loss is NaN at step 7"  # type: ignore[index]


def test_request_restart_restarts_now_and_counts_against_the_budget(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", ASKS)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py", "request_restart", "0")
    assert r.returncode == 0, r.stderr
    assert [e["restart_count"] for e in r.events() if e["kind"] == "restart"] == [1]
    assert "up rank=0 world=2 restart=1" in r.stdout
    spent = run_ftrun(
        tmp_path, "--log-dir", str(tmp_path / "spent"), "--nproc-per-node", "2", "--max-restarts", "0",
        "w.py", "request_restart", "0",
    )  # fmt: skip
    assert spent.returncode == 1, spent.stderr
    assert "asked for a restart: loss is NaN at step 7" in spent.stderr


@pytest.mark.slow
def test_exclude_this_node_on_a_single_node_ends_the_run_with_its_own_exit_code(
    tmp_path: Path, script: WriteScript
) -> None:
    script("w.py", ASKS)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "3", "w.py", "exclude_this_node", "0", "forever")
    assert r.returncode == 3, r.stderr
    assert "excluded its node from the job: loss is NaN at step 7" in r.stderr
    assert not [e for e in r.events() if e["kind"] == "restart"]


BAD = """
import ftrun
for call in (lambda: ftrun.stop_job(""), lambda: ftrun.stop_job(7), lambda: ftrun.request_restart("x" * 401)):
    try:
        call()
    except ValueError as e:
        print("ValueError:", e, flush=True)
"""


def test_bad_requests_are_a_value_error_in_the_worker(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", BAD)
    r = run_ftrun(tmp_path, "w.py")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "ValueError: give a reason: it is printed by every agent and kept in the reports",
        "ValueError: the reason must be a str, not int",
        "ValueError: the reason is 401 bytes of UTF-8; at most 400",
    ]
    assert not [e for e in r.events() if e["kind"] == "request"]


def test_outside_ftrun_a_request_raises_instead_of_doing_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}
    code = "import ftrun\ntry:\n    ftrun.stop_job('x')\nexcept RuntimeError as e:\n    print(e)\n"
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "nothing was done" in out.stdout
    assert "needs the ftrun launcher" in out.stdout


UP = r"up rank=(\d+) world=(\d+) restart=(\d+)"


def _agents(tmp_path: Path, rdzv: list[str], nnodes: str, *job: str) -> Callable[[str], LiveFtrun]:
    """Starts the agents of one job (each its own log directory, named ``name``); the caller tracks them."""
    (tmp_path / "w.py").write_text(ASKS)
    flags = [*rdzv, "--rdzv-id", f"{tmp_path.name}-ctl", "--local-addr", "127.0.0.1", "--nnodes", nnodes,
             "--nproc-per-node", "1", "--max-restarts", "2"]  # fmt: skip

    def start(name: str) -> LiveFtrun:
        return LiveFtrun(tmp_path, *flags, "--log-dir", str(tmp_path / name), str(tmp_path / "w.py"), *job, name=name)

    return start


def test_an_excluded_node_leaves_for_good_and_a_spare_takes_its_place(
    tmp_path: Path, live: list[LiveFtrun], rdzv: list[str]
) -> None:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    start = _agents(tmp_path, rdzv, "2:2", "exclude_this_node", "1", "forever", str(gate))
    agents = [start(n) for n in ("a", "b", "c")]
    live.extend(agents)
    roles = {agent: agent.wait_for_stderr(r"round 1: group rank|hot spare") for agent in agents}
    [spare] = [agent for agent, line in roles.items() if "hot spare" in line]
    members = [a for a in agents if a is not spare]
    for agent in members:
        agent.wait_for_lines(UP, 1)
    b, a = members if re.search(r"up rank=1", "\n".join(members[0].lines)) else reversed(members)
    write_gate(gate, "go\n")  # rank 1 excludes its node now, with the spare waiting
    assert b.wait(WAIT_S) == 3, b.stderr()  # rank 1 (on b) excluded its node
    assert "excluded its node from the job: loss is NaN at step 7" in b.stderr()
    spare.wait_for_lines(r"up rank=1 world=2", 1)  # the others went on in a new round, the spare in b's place
    a.wait_for_lines(r"up rank=0 world=2 restart=1", 1)
    # b's host is not readmitted under this run id (all agents here share one host: a new one is refused).
    again = start("again")
    live.append(again)
    assert again.wait(WAIT_S) == 3, again.stderr()
    assert "is not readmitted" in again.stderr()


def test_an_excluded_node_without_a_spare_leaves_the_others_going_on(
    tmp_path: Path, live: list[LiveFtrun], rdzv: list[str]
) -> None:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    start = _agents(tmp_path, rdzv, "1:2", "exclude_this_node", "1", "forever", str(gate))
    agents = [start(n) for n in ("a", "b")]
    live.extend(agents)
    for agent in agents:  # both in a round of two (maybe after one of one, until the other came)
        agent.wait_for_lines(r"up rank=\d world=2", 1)
    leaving, staying = agents if re.search(r"up rank=1 world=2", "\n".join(agents[0].lines)) else reversed(agents)
    write_gate(gate, "go\n")  # only now: rank 0 could otherwise be stopped before it said it was up
    assert leaving.wait(WAIT_S) == 3, leaving.stderr()
    alone = len([line for line in staying.lines if "world=1" in line]) + 1
    staying.wait_for_lines(r"up rank=0 world=1", alone)  # the other goes on alone, in a new round


def test_stop_job_on_one_node_stops_every_node_with_the_reason(
    tmp_path: Path, live: list[LiveFtrun], rdzv: list[str]
) -> None:
    start = _agents(tmp_path, rdzv, "2:2", "stop_job", "1", "forever")
    agents = [start(n) for n in ("a", "b")]
    live.extend(agents)
    for agent in agents:
        assert agent.wait(WAIT_S) == 1, agent.stderr()
        assert "stopped the job: loss is NaN at step 7" in agent.stderr()
        assert not re.search(r"restart=1", "\n".join(agent.lines))


@pytest.mark.parametrize("action", ["stop_job"])
def test_requests_are_events_on_the_node_that_made_them(tmp_path: Path, script: WriteScript, action: str) -> None:
    script("w.py", ASKS)
    r = run_ftrun(tmp_path, "--nproc-per-node", "1", "w.py", action, "0", "forever")
    assert [e["action"] for e in r.events() if e["kind"] == "request"] == [action]


def test_a_restart_request_on_one_node_restarts_every_node(
    tmp_path: Path, live: list[LiveFtrun], rdzv: list[str]
) -> None:
    start = _agents(tmp_path, rdzv, "2:2", "request_restart", "1", "hold")
    agents = [start(n) for n in ("a", "b")]
    live.extend(agents)
    for agent in agents:
        assert agent.wait(WAIT_S) == 0, agent.stderr()
    restarted = [line for agent in agents for line in agent.lines if re.search(r"restart=1", line)]
    assert sorted(restarted) == ["up rank=0 world=2 restart=1", "up rank=1 world=2 restart=1"]
    assert "asked for a restart: loss is NaN at step 7" in "".join(a.stderr() for a in agents)
