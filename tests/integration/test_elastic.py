"""Multi-node jobs on one host: several real agents, each its own process and node, on tcp and on a real etcd.

The store for the tcp runs is a separate `ftrun store` process, so that any agent
can be killed; one test has an agent host it, as torchrun's c10d does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
from pathlib import Path

import pytest

from ftrun.testing.etcd import EtcdHarness
from tests.integration.harness import (
    CONF,
    LiveFtrun,
    PortTaken,
    WriteScript,
    run_ftrun,
    wait_gone,
    with_free_port,
    write_gate,
)

# Fast detection for tests: a node is dead 1 s after its last keep-alive (etcd rounds TTLs up to its minimum).

WORKER = """
import os, sys, time
e = os.environ
print(f"up rank={e['RANK']} world={e['WORLD_SIZE']} group={e['GROUP_RANK']} "
      f"restart={e['TORCHELASTIC_RESTART_COUNT']} pid={os.getpid()}", flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else "forever"
restarted = e["TORCHELASTIC_RESTART_COUNT"] != "0"
open(f"up-{e['RANK']}-{e['TORCHELASTIC_RESTART_COUNT']}", "w").close()
if mode == "crash-once" and e["RANK"] == "3" and not restarted:
    deadline = time.monotonic() + 60  # once every rank of both nodes runs: the crash is the job's, not a start's
    while not all(os.path.exists(f"up-{r}-0") for r in range(4)) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(3)
if mode == "crash" and e["RANK"] == "3":
    sys.exit(3)
if mode == "hang-once" and e["RANK"] == "3" and not restarted:
    import ftrun
    ftrun.heartbeat()  # and never again: hung
if mode == "finish" or (mode in ("crash-once", "hang-once") and restarted):
    sys.exit(0)
time.sleep(600)
"""

UP = r"up rank=(\d+) world=(\d+) group=(\d+) restart=(\d+) pid=(\d+)"


class Nodes:
    """Agents of one job, started with the same flags, stopped at teardown."""

    def __init__(self, tmp_path: Path, live: list[LiveFtrun], flags: list[str]) -> None:
        self.tmp_path, self.live, self.flags = tmp_path, live, flags

    def start(self, name: str, *extra: str) -> LiveFtrun:
        # Every run id is the test's own: etcd keeps records across tests.
        run_id = f"{self.tmp_path.name}-{os.getpid()}"
        agent = LiveFtrun(
            self.tmp_path, *self.flags, "--rdzv-id", run_id, "--local-addr", "127.0.0.1", *extra, name=name
        )
        self.live.append(agent)
        return agent


@pytest.fixture
def nodes(tmp_path: Path, live: list[LiveFtrun], rdzv: list[str], script: WriteScript) -> Nodes:
    script("w.py", WORKER)
    return Nodes(tmp_path, live, rdzv)


def ups(agent: LiveFtrun, world: int, count: int) -> list[re.Match[str]]:
    """Wait until ``count`` workers of this agent came up in a world of ``world`` ranks."""
    return agent.wait_for_lines(rf"up rank=(\d+) world=({world}) group=(\d+) restart=(\d+) pid=(\d+)", count)


def pids(agent: LiveFtrun, world: int) -> list[int]:
    return [int(m.group(5)) for m in map(re.compile(UP).search, agent.lines) if m and m.group(2) == str(world)]


def test_two_of_1_3_train_then_one_dies_then_a_third_scales_up(nodes: Nodes) -> None:
    a = nodes.start("a", "--nnodes", "1:3", "--nproc-per-node", "2", "--max-restarts", "3", "w.py")
    b = nodes.start("b", "--nnodes", "1:3", "--nproc-per-node", "2", "--max-restarts", "3", "w.py")
    ups(a, 4, 2)
    ups(b, 4, 2)
    # a may have trained alone for a moment first (1:3 nodes: b came after a's last call, on a loaded machine)
    ranks = sorted(int(m.group(1)) for f in (a, b) for m in map(re.compile(UP).search, f.lines) if m and m[2] == "4")
    assert ranks == [0, 1, 2, 3]
    alone_before = len(pids(a, 2))
    b.proc.kill()  # SIGKILL: no goodbye, only the lapsed lease tells
    b.wait()
    ups(a, 2, alone_before + 2)  # the survivor trains alone
    assert wait_gone(pids(b, 4)) == []
    c = nodes.start("c", "--nnodes", "1:3", "--nproc-per-node", "2", "--max-restarts", "3", "w.py")
    ups(c, 4, 2)  # scale-up: a new round admits it
    found = ups(a, 4, 4)
    assert {m.group(3) for m in found[2:]} == {"0"}  # a keeps group rank 0
    assert "left round" in a.stderr()


def test_a_spare_replaces_a_lost_member(nodes: Nodes) -> None:
    flags = ["--nnodes", "2:2", "--nproc-per-node", "2", "--max-restarts", "3", "w.py"]
    a, b = nodes.start("a", *flags), nodes.start("b", *flags)
    ups(a, 4, 2)
    ups(b, 4, 2)
    spare = nodes.start("spare", *flags)
    spare.wait_for_stderr("hot spare")
    b.proc.kill()
    found = ups(spare, 4, 2)
    assert all(m.group(4) == "1" for m in found)  # one failure-caused round so far
    ups(a, 4, 4)


def test_a_worker_crash_on_one_node_restarts_every_node_then_the_job_succeeds(nodes: Nodes) -> None:
    flags = ["--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1", "w.py", "crash-once"]
    a, b = nodes.start("a", *flags), nodes.start("b", *flags)
    assert a.wait() == 0, a.stderr()
    assert b.wait() == 0, b.stderr()
    restarted = [m for f in (a, b) for m in map(re.compile(UP).search, f.lines) if m and m.group(4) == "1"]
    assert len(restarted) == 4  # every worker of both nodes ran again, as restart 1
    # Every node tells the same story: the root cause is rank 3, the other node's workers were stopped for it.
    for agent in (a, b):
        assert "ROOT CAUSE  rank 3" in agent.stderr(), agent.stderr()
    reports = [json.loads(f.read_text()) for f in nodes.tmp_path.glob("**/attempt_0/failure_report.json")]
    assert sorted(r["root_cause"]["rank"] for r in reports) == [3, 3]
    assert sorted(len(r["stopped_by_ftrun"]) for r in reports) == [1, 2]  # rank 2 on the failing node; 0, 1


def test_a_hang_on_one_node_restarts_every_node_then_the_job_succeeds(nodes: Nodes) -> None:
    flags = ["--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1", "--heartbeat-timeout", "1"]
    a, b = nodes.start("a", *flags, "w.py", "hang-once"), nodes.start("b", *flags, "w.py", "hang-once")
    assert a.wait() == 0, a.stderr()
    assert b.wait() == 0, b.stderr()
    restarted = [m for f in (a, b) for m in map(re.compile(UP).search, f.lines) if m and m.group(4) == "1"]
    assert len(restarted) == 4
    hung = a if "ROOT CAUSE  rank 3" in a.stderr() else b
    assert "hang: heartbeat timeout of 1 s exceeded" in hung.stderr()


def test_a_spent_budget_fails_every_node(nodes: Nodes) -> None:
    flags = ["--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "0", "w.py", "crash"]
    a, b = nodes.start("a", *flags), nodes.start("b", *flags)
    assert a.wait() == 1
    assert b.wait() == 1
    for f in (a, b):
        assert "restart budget spent" in f.stderr()


def test_a_crash_loop_on_one_node_stops_the_job_on_every_node(nodes: Nodes) -> None:
    """Rank 3 fails alike at every start: after 3 times in a row its node stops the job, and the other node
    ends with the same verdict, long before --max-restarts 10 is spent."""
    flags = ["--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "10", "w.py", "crash"]
    a, b = nodes.start("a", *flags), nodes.start("b", *flags)
    assert a.wait() == 1
    assert b.wait() == 1
    for f in (a, b):
        assert "the same failure 3 times in a row (exit code 3, before the first step)" in f.stderr(), f.stderr()
        assert "restart budget spent" not in f.stderr()


def test_a_lost_lease_stops_the_workers_and_the_node_rejoins(nodes: Nodes) -> None:
    flags = ["--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3", "w.py"]
    a, b = nodes.start("a", *flags), nodes.start("b", *flags)
    ups(a, 4, 2)
    ups(b, 4, 2)
    old = pids(b, 4)
    alone_before = len(pids(a, 2))  # a may have trained alone for a moment before b came (1:2 nodes)
    b.proc.send_signal(signal.SIGSTOP)  # partitioned: b cannot keep its lease alive
    try:
        ups(a, 2, alone_before + 2)  # the others moved on without b
    finally:
        b.proc.send_signal(signal.SIGCONT)
    assert wait_gone(old, timeout=30.0) == []  # b fenced its own workers when it woke
    ups(b, 4, 4)  # and came back in a later round
    assert "lease" in b.stderr()


def test_a_join_that_cannot_complete_says_how_many_came(nodes: Nodes) -> None:
    flags = ["--nnodes", "3", "--nproc-per-node", "1", "--rdzv-conf", "join_timeout=1", "w.py"]
    a = nodes.start("a", *flags)
    assert a.wait() == 1
    assert "1 node(s) came, 3 needed" in a.stderr()


def test_an_agent_hosts_the_store_and_a_late_agent_hears_the_job_finished(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    script("w.py", WORKER)

    def attempt(port: int) -> tuple[LiveFtrun, LiveFtrun]:
        flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", CONF]
        flags += ["--nnodes", "2", "--local-addr", "127.0.0.1", "--nproc-per-node", "2", "w.py", "finish"]
        tag = f"-{port}"  # a retry's agents and logs apart from the last try's
        agents = (LiveFtrun(tmp_path, *flags, name=f"a{tag}"), LiveFtrun(tmp_path, *flags, name=f"b{tag}"))
        live.extend(agents)
        said = [f.wait_for_stderr("hosting the rendezvous store|joining it|the port is held by") for f in agents]
        if not any("hosting" in line for line in said):  # someone else holds the port
            for f in agents:
                f.close()
            raise PortTaken(str(said))
        return agents

    a, b = with_free_port(attempt)
    assert b.wait() == 0, b.stderr()
    assert a.wait() == 0, a.stderr()
    hosts = [f for f in (a, b) if "hosting the rendezvous store" in f.stderr()]
    assert len(hosts) == 1
    assert "the job finished in round 1" in a.stderr() + b.stderr()
    assert "already finished" not in a.stderr() + b.stderr()  # no warning on a job that went well


def test_a_late_agent_exits_1_when_the_job_already_finished_as_under_torchrun(
    tmp_path: Path, script: WriteScript, etcd_server: EtcdHarness
) -> None:
    script("w.py", WORKER)
    flags = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.url.removeprefix("etcd://")]
    flags += ["--rdzv-conf", CONF, "--local-addr", "127.0.0.1", "--nnodes", "1", "--rdzv-id", tmp_path.name]
    flags += ["w.py", "finish"]
    r = run_ftrun(tmp_path, *flags)
    assert r.returncode == 0, r.stderr
    late = run_ftrun(tmp_path, *flags)
    assert late.returncode == 1, late.stderr  # torchrun's RendezvousClosedError ends it with 1
    assert "job already finished" in late.stderr
    assert "this node came too late to take part" in late.stderr
    assert "run late (exit 1)" in late.stderr
    assert "up rank" not in late.stdout


def test_read_timeout_is_how_long_a_store_call_retries(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # held, never listening: every connection is refused
        port = s.getsockname()[1]
        flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nnodes", "1:2"]
        r = run_ftrun(tmp_path, *flags, "--rdzv-conf", f"{CONF},is_host=false,read_timeout=3", "w.py")
    assert r.returncode == 1
    found = re.search(rf"store tcp://127.0.0.1:{port} unavailable after ([0-9.]+) s", r.stderr)
    assert found, r.stderr
    assert float(found.group(1)) >= 3.0  # not the 1 s of the keep-alive TTL that CONF would give


CALCULATES = """
import json, os, time
import ftrun
rank = os.environ["RANK"]
print(f"up rank={rank}", flush=True)
for _ in range(3):
    with ftrun.section("step"):
        time.sleep(0.05 if rank == "0" else 0.2)  # rank 1 (the other node) is slower
    ftrun.heartbeat()
ftrun.calculate_timeouts(safety_factor=200)
deadline = time.monotonic() + 120
while not os.path.exists("release") and time.monotonic() < deadline:  # until the test saw the nodes agree
    ftrun.heartbeat()  # alive: rank 0's own timeout (200 x 0.05 s: a busy machine's pauses) until it hears rank 1's
    time.sleep(0.01)
"""


def test_nodes_agree_on_calculated_timeouts_through_the_store(nodes: Nodes, script: WriteScript) -> None:
    script("c.py", CALCULATES)
    agents = [nodes.start(name, "--nnodes", "2", "--nproc-per-node", "1", "c.py") for name in "ab"]
    ranks = {int(a.wait_for_lines(r"up rank=(\d)", 1)[0].group(1)): a for a in agents}
    # The node of the fast rank hears the slow one's wider timeouts through the store.
    ranks[0].wait_for_stderr("the job's nodes calculated timeouts; in force now")
    (nodes.tmp_path / "release").touch()
    for a in agents:
        assert a.wait() == 0, a.stderr()
    in_force = [[e for e in a.events() if e["kind"] == "timeouts"][-1]["sections"] for a in agents]
    assert in_force[0] == in_force[1]
    assert in_force[0]["step"] >= 0.2 * 200


def test_agents_without_a_run_id_meet_as_under_torchrun(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun], own_tcp_server: str
) -> None:
    script("w.py", WORKER)
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", own_tcp_server, "--rdzv-conf", f"{CONF},is_host=false"]
    flags += ["--nnodes", "2", "--local-addr", "127.0.0.1", "w.py", "finish"]
    agents = [LiveFtrun(tmp_path, *flags, name=name, run_id=None) for name in "ab"]
    live.extend(agents)
    for a in agents:
        assert a.wait() == 0, a.stderr()
    assert sorted(int(m.group(1)) for a in agents for m in a.wait_for_lines(UP, 1)) == [0, 1]
    assert all(m.group(2) == "2" for a in agents for m in a.wait_for_lines(UP, 1))  # one world of two
    assert all("run (no --rdzv-id):" in a.stderr() for a in agents)  # torchrun's "none", not printed as a name


def test_c10d_with_no_endpoint_works_on_one_node_as_under_torchrun(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", WORKER)
    r = run_ftrun(tmp_path, "--rdzv-backend", "c10d", "--nproc-per-node", "2", "w.py", "finish")
    assert r.returncode == 0, r.stderr
    assert "hosting the rendezvous store on 127.0.0.1:29400" in r.stderr
    assert len(re.findall(UP, r.stdout)) == 2


def test_a_killed_agent_leaves_at_once_on_the_embedded_store(
    tmp_path: Path, live: list[LiveFtrun], tcp_server: str, script: WriteScript
) -> None:
    """The store ends a lease when its connection closes, and the kernel closes a killed agent's socket: the
    survivor goes on alone although the lease's TTL (10 min here) could not have passed within the wait."""
    script("w.py", WORKER)
    slow_ttl = "last_call_timeout=0.5,keep_alive_interval=60,keep_alive_max_attempt=10,join_timeout=60,is_host=false"
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", tcp_server, "--rdzv-conf", slow_ttl]
    nodes = Nodes(tmp_path, live, flags)
    a = nodes.start("a", "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3", "w.py")
    b = nodes.start("b", "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3", "w.py")
    ups(a, 4, 2)
    ups(b, 4, 2)
    alone_before = len(pids(a, 2))  # a may have trained alone for a moment before b came (1:2 nodes)
    b.proc.kill()
    b.wait()
    ups(a, 2, alone_before + 2)  # a new round without b
    assert "left round" in a.stderr()


LATE_FAILURE = """
import os, sys
if os.environ["RANK"] == "1":
    open(sys.argv[1]).read()  # a FIFO: the test opens it once rank 0's node has finished the job
    sys.exit(5)
"""


def test_a_node_whose_workers_fail_after_the_job_finished_fails_the_job_on_every_node(
    tmp_path: Path, live: list[LiveFtrun], rdzv: list[str], script: WriteScript
) -> None:
    """The exit barrier: rank 0's node finishes the job, waits for rank 1's node, whose worker then fails."""
    script("w.py", LATE_FAILURE)
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    nodes = Nodes(tmp_path, live, rdzv)
    flags = ["--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "0", "w.py", str(gate)]
    a, b = nodes.start("a", *flags), nodes.start("b", *flags)
    first = a if "group rank 0" in a.wait_for_stderr(r"round 1: group rank") else b
    other = b if first is a else a
    first.wait_for_stderr("the job finished in round 1")  # in the store: "every worker exited 0" comes before
    write_gate(gate, "fail now\n")
    assert other.wait() == 1, other.stderr()
    assert first.wait() == 1, first.stderr()
    assert "failed after this node's succeeded: the job failed" in first.stderr()


def _host_and_client(tmp_path: Path, live: list[LiveFtrun], nnodes: str, restarts: str) -> tuple[LiveFtrun, LiveFtrun]:
    """Two agents on one endpoint: the one that bound it hosts the store, the other is its client."""
    slow = "last_call_timeout=0.5,keep_alive_interval=60,keep_alive_max_attempt=10,join_timeout=600"

    def attempt(port: int) -> tuple[LiveFtrun, LiveFtrun]:
        flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", slow]
        flags += ["--nnodes", nnodes, "--max-restarts", restarts, "--local-addr", "127.0.0.1"]
        flags += ["--nproc-per-node", "2", "w.py"]
        tag = f"-{port}"
        agents = (LiveFtrun(tmp_path, *flags, name=f"a{tag}"), LiveFtrun(tmp_path, *flags, name=f"b{tag}"))
        live.extend(agents)
        said = [f.wait_for_stderr("hosting the rendezvous store|joining it|the port is held by") for f in agents]
        if not any("hosting" in line for line in said):
            for f in agents:
                f.close()
            raise PortTaken(str(said))
        return agents

    a, b = with_free_port(attempt)
    return (a, b) if "hosting the rendezvous store" in a.stderr() else (b, a)


def _kill_the_store_host(
    tmp_path: Path, live: list[LiveFtrun], nnodes: str, restarts: str
) -> tuple[LiveFtrun, list[int]]:
    """Two agents train together; the one hosting the store is SIGKILLed. Returns the other, and the pids of
    its workers of that round."""
    host, other = _host_and_client(tmp_path, live, nnodes, restarts)
    ups(other, 4, 2)
    workers = pids(other, 4)
    host.proc.kill()
    host.wait()
    return other, workers


def test_when_the_agent_hosting_the_store_dies_a_survivor_takes_over_and_trains_alone(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    """No single point of failure: the store's host is SIGKILLed (with its workers); the survivor, the first
    member left of the last round, hosts the store on the same port and the job re-forms without the lost
    node, long before the lease's TTL (10 min here) could pass. The output names who was lost and who took
    over."""
    script("w.py", WORKER)
    other, workers = _kill_the_store_host(tmp_path, live, "1:2", "3")
    ups(other, 2, 2)  # a new round, the survivor alone
    said = other.stderr()
    assert re.search(r"the store's host \S+ is lost \(the store tcp://127\.0\.0\.1:\d+ is gone", said), said
    assert "this node hosts the store now" in said
    assert wait_gone(workers) == []


def test_when_the_store_host_dies_and_the_budget_is_spent_the_survivor_stops(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    """The lost node counts against --max-restarts as any lost node does: with none left the survivor takes
    over, says the budget is spent, stops its workers and exits 1."""
    script("w.py", WORKER)
    other, workers = _kill_the_store_host(tmp_path, live, "2", "0")
    assert other.wait() == 1, other.stderr()
    assert re.search(r"the store tcp://127\.0\.0\.1:\d+ is gone", other.stderr())
    assert "restart budget spent" in other.stderr()
    assert wait_gone(workers) == []


def test_an_agent_stopped_by_a_signal_leaves_at_once_on_etcd(
    tmp_path: Path, live: list[LiveFtrun], etcd_server: EtcdHarness, script: WriteScript
) -> None:
    """etcd keeps a lease until its TTL (10 min here): an agent stopped by SIGTERM revokes its own first, so the
    survivor goes on alone at once."""
    script("w.py", WORKER)
    slow_ttl = "last_call_timeout=0.5,keep_alive_interval=60,keep_alive_max_attempt=10,join_timeout=60"
    endpoint = etcd_server.url.removeprefix("etcd://")
    nodes = Nodes(tmp_path, live, ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-conf", slow_ttl])
    a = nodes.start("a", "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3", "w.py")
    b = nodes.start("b", "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3", "w.py")
    ups(a, 4, 2)
    ups(b, 4, 2)
    alone_before = len(pids(a, 2))  # a may have trained alone for a moment before b came (1:2 nodes)
    b.proc.send_signal(signal.SIGTERM)
    assert b.wait() == 128 + signal.SIGTERM
    ups(a, 2, alone_before + 2)  # a new round without b
