"""The agent hosting the embedded store lost at any moment: real agents, each its own process and node.

The store lives in the agent on the endpoint's machine (`c10d`, the default). Its host is lost while the job
trains (test_elastic), and here: while a round is open, with the successor lost during its takeover, before
any round closed, and two hosts one after the other. Every survivor must train again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from ftrun.observe.timeline import COLORS
from tests.integration.harness import LiveFtrun, PortTaken, WriteScript, wait_gone, with_free_port
from tests.integration.screenshot import colors, hex_rgb, screenshot

WORKER = """
import os, time
e = os.environ
print(f"up rank={e['RANK']} world={e['WORLD_SIZE']} group={e['GROUP_RANK']} "
      f"restart={e['TORCHELASTIC_RESTART_COUNT']} pid={os.getpid()}", flush=True)
time.sleep(600)
"""
UP = r"up rank=(\d+) world=({world}) group=(\d+) restart=(\d+) pid=(\d+)"
# A round stays open 3 s after its last registration (nobody waits for a lease's TTL: 10 min here).
CONF = "last_call_timeout=3,keep_alive_interval=60,keep_alive_max_attempt=10,join_timeout=600"


class Job:
    """Agents of one job on one endpoint, started in turn: the first binds it and hosts the store."""

    def __init__(self, tmp_path: Path, live: list[LiveFtrun], port: int, nnodes: str) -> None:
        self.tmp_path, self.live, self.port = tmp_path, live, port
        self.flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", CONF]
        self.flags += ["--nnodes", nnodes, "--max-restarts", "5", "--local-addr", "127.0.0.1", "--no-warm"]
        self.flags += ["--nproc-per-node", "1", "w.py"]

    def start(self, name: str) -> LiveFtrun:
        agent = LiveFtrun(self.tmp_path, *self.flags, name=f"{name}-{self.port}")
        self.live.append(agent)
        return agent


def first_agents(tmp_path: Path, live: list[LiveFtrun], nnodes: str, count: int) -> tuple[Job, list[LiveFtrun]]:
    """``count`` agents; the first one hosts the store (on a port free when the test began)."""

    def attempt(port: int) -> tuple[Job, list[LiveFtrun]]:
        job = Job(tmp_path, live, port, nnodes)
        host = job.start("a")
        if "hosting" not in host.wait_for_stderr("hosting the rendezvous store|joining|the port is held by"):
            host.close()
            raise PortTaken(str(port))
        return job, [host] + [job.start(name) for name in "bcdefg"[: count - 1]]

    return with_free_port(attempt)


def group_of(agent: LiveFtrun, world: int) -> int:
    """The group rank of the agent's node in the last round of ``world`` ranks it trained in (one worker each)."""
    return int(agent.wait_for_lines(UP.format(world=world), 1)[-1].group(3))


def worker_pid(agent: LiveFtrun, world: int) -> int:
    return int(agent.wait_for_lines(UP.format(world=world), 1)[-1].group(5))


def kill(*agents: LiveFtrun) -> None:
    for agent in agents:
        agent.proc.kill()
    for agent in agents:
        agent.wait()


def test_the_host_lost_while_the_next_round_is_open(tmp_path: Path, script: WriteScript, live: list[LiveFtrun]) -> None:
    """A GPU fault kills the node's workers first, the node a moment later: the host's worker is SIGKILLed,
    round 2 opens, and the host's agent dies before it closes. The survivor takes over from the open round
    (which carries the last closed round's successors) and trains alone."""
    script("w.py", WORKER)
    _, (host, other) = first_agents(tmp_path, live, "1:3", 2)
    survivor_worker = worker_pid(other, 2)
    host_worker = worker_pid(host, 2)
    os.kill(host_worker, signal.SIGKILL)
    other.wait_for_stderr(r"round 2 is open")
    kill(host)
    assert other.wait_for_lines(UP.format(world=1), 1)  # a new round: the survivor alone
    said = other.stderr()
    assert re.search(r"the store's host \S+ is lost \(the store tcp://127\.0\.0\.1:\d+ is gone", said), said
    assert "this node hosts the store now" in said
    assert wait_gone([survivor_worker]) == []


def test_a_successor_lost_during_its_takeover_is_passed_over_for_the_next(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    """Three nodes; the host and the node next in line die together. The third finds the host gone, goes to
    the successor, finds its agent dead too (its listener refuses), and takes the store over itself."""
    script("w.py", WORKER)
    _, agents = first_agents(tmp_path, live, "1:3", 3)
    by_group = sorted(agents, key=lambda a: group_of(a, 3))
    host = agents[0]
    successor, last = [a for a in by_group if a is not host][:2]
    kill(host, successor)
    assert last.wait_for_lines(UP.format(world=1), 1)
    said = last.stderr()
    assert re.search(r"never answered, and its host's agent is gone", said), said
    assert "this node hosts the store now" in said


def test_two_hosts_lost_one_after_the_other(tmp_path: Path, script: WriteScript, live: list[LiveFtrun]) -> None:
    """The host is lost, the successor takes over and the job re-forms; then the successor is lost too."""
    script("w.py", WORKER)
    _, agents = first_agents(tmp_path, live, "1:3", 3)
    for agent in agents:
        agent.wait_for_lines(UP.format(world=3), 1)
    host = agents[0]
    kill(host)
    survivors = [a for a in agents if a is not host]
    for agent in survivors:
        agent.wait_for_lines(UP.format(world=2), 1)
    new_host = next(a for a in survivors if "this node hosts the store now" in a.stderr())
    kill(new_host)
    last = next(a for a in survivors if a is not new_host)
    assert last.wait_for_lines(UP.format(world=1), 1)
    # (The first loss it may have met as the store restarting empty: every agent here shares one address.)
    assert "this node hosts the store now" in last.stderr()


def test_the_host_lost_before_any_round_closed_the_others_wait_for_a_store_at_the_endpoint(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    """Nothing to go on (no round closed: no successor named): the survivor waits at the endpoint, as a node
    that starts early does, and says so; once a store is there again the job forms."""
    script("w.py", WORKER)
    job, (host, other) = first_agents(tmp_path, live, "3", 2)  # 3 nodes needed: round 1 stays open
    other.wait_for_stderr(r"registered for round 1")
    host.wait_for_stderr(r"waiting for nodes: 2 of 3 needed")  # the host leads: both are in
    kill(host)
    other.wait_for_stderr(r"waiting for a store at")
    assert "before any round closed: no successor is known" in other.stderr()
    newcomers = [job.start("c"), job.start("d")]
    for agent in [other, *newcomers]:
        assert agent.wait_for_lines(UP.format(world=3), 1)


def test_the_report_names_the_lost_host_not_the_survivors_echo(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    """After the takeover the root cause is the node that was lost (which, that it hosted the store, in which
    state, who took over), in the console's report, failure_report.json, the summary and `ftrun report`; the
    survivor's own workers are listed as stopped for it."""
    script("w.py", WORKER)
    _, (host, other) = first_agents(tmp_path, live, "1:2", 2)
    lost = re.search(r"node (\S+) joining", host.wait_for_stderr(r"node \S+ joining")).group(1)  # type: ignore[union-attr]
    worker_pid(other, 2)
    killed_at = time.time()
    kill(host)
    other.wait_for_lines(UP.format(world=1), 1)
    said = other.stderr()
    assert re.search(rf"ROOT CAUSE  node {lost} lost: the store's host {lost} was lost in round 1; \S+ hosts", said)
    assert re.search(r"STOPPED FOR IT rank \d", said), said
    assert "STOPPED BY FTRUN" not in said.split("ROOT CAUSE  node")[1].split("=" * 78)[0]  # that rank, told once
    report = json.loads((other.run_dir / "attempt_0" / "failure_report.json").read_text())
    assert report["elsewhere"]["lost"] == [lost]
    failure = next(e for e in other.events() if e["kind"] == "failure")
    assert str(failure["root_cause"]["summary"]).startswith(f"node {lost} lost")  # the summary's root cause
    text = subprocess.run(
        [sys.executable, "-m", "ftrun", "report", str(other.run_dir)], capture_output=True, text=True, timeout=60
    ).stdout
    assert f"ROOT CAUSE  node {lost} lost" in text
    assert "(round 1, 2 node(s))" in text  # each attempt's round and node count, the change named
    assert "1 node(s), node(s) lost or gone: was 2)" in text
    # The takeover's downtime: from the host's loss (dated no earlier than the kill) to the next attempt.
    restarted = next(e for e in other.events() if e["kind"] == "attempt_started" and e["attempt"] == 1)
    down = re.search(r"down: ([\d.]+) s from the failure to attempt 1's start", text)
    assert down, text
    assert 0.0 < float(down.group(1)) <= restarted["wall"] - killed_at, text
    page = (other.run_dir / "timeline.html").read_text()
    assert f"lost {lost}" in page  # written on the chart, not only in a hover
    assert "-1 node(s): 1" in page
    seen = colors(screenshot(other.run_dir / "timeline.html", tmp_path / "timeline.png"))
    legend = 60  # pixels of each colour's square in the legend, at most
    for what in ("startup", "failure", "node"):  # the bars (this job never steps), the mark, the lost node
        assert seen.get(hex_rgb(COLORS[what]), 0) > legend, (what, sorted(seen.items(), key=lambda kv: -kv[1])[:8])
