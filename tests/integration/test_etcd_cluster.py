"""A job on a 3-member etcd cluster (real etcd processes) outlives any minority of its members, the leader too."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftrun.rendezvous.records import Keys
from ftrun.store.factory import open_store
from ftrun.testing.etcd import EtcdCluster, EtcdHarness
from tests.integration.harness import LiveFtrun, until

TRAINS = """
import json, os, sys, time
while not os.path.exists(sys.argv[2]):
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps({"t": time.time(), "port": os.environ["MASTER_PORT"], "rank": os.environ["RANK"],
                            "world": os.environ["WORLD_SIZE"]}) + "\\n")
    time.sleep(0.05)
"""


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(3) as c:
        yield c


def lines(log: Path) -> list[dict[str, str]]:
    return [json.loads(x) for x in log.read_text().splitlines() if x.endswith("}")] if log.exists() else []


def test_losing_the_etcd_leader_restarts_nothing(tmp_path: Path, live: list[LiveFtrun], cluster: EtcdCluster) -> None:
    (tmp_path / "w.py").write_text(TRAINS)
    log, stop = tmp_path / "train.log", tmp_path / "stop"
    endpoint = cluster.url.removeprefix("etcd://")
    flags = ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--nnodes", "2:2", "--nproc-per-node", "1",
             "--local-addr", "127.0.0.1", "--max-restarts", "3", "w.py", str(log), str(stop)]  # fmt: skip
    agents = [LiveFtrun(tmp_path, *flags, name=n, run_id=f"{tmp_path.name}-etcd") for n in ("a", "b")]
    live.extend(agents)
    until(lambda: {x["rank"] for x in lines(log)} == {"0", "1"}, "both ranks train")
    cluster.leader().kill()
    killed = time.time()
    until(lambda: {x["rank"] for x in lines(log) if float(x["t"]) > killed + 5.0} == {"0", "1"}, "training went on")
    stop.touch()
    for agent in agents:
        assert agent.wait() == 0, agent.stderr()
    assert len({x["port"] for x in lines(log)}) == 1  # one round throughout: no restart
    kinds = [e["kind"] for a in agents for e in a.events()]
    assert "run_finished" in kinds  # the events are read
    assert "restart" not in kinds


@pytest.mark.parametrize("lost", ["leader", "member"])
def test_on_etcd_a_lost_agent_is_noticed_without_waiting_for_its_lease(
    tmp_path: Path, live: list[LiveFtrun], etcd_server: EtcdHarness, lost: str
) -> None:
    """An agent SIGKILLed with its worker: the connection the agents hold to each other ends at once, so the
    survivor re-forms the job alone long before the lease (TTL 10 min here) could lapse; the lost agent may
    be the rendezvous leader (the survivor takes over) or not (the leader removes it)."""
    (tmp_path / "w.py").write_text(TRAINS)
    log, stop = tmp_path / "train.log", tmp_path / "stop"
    run_id = f"{tmp_path.name}-{lost}"
    slow = "last_call_timeout=0.5,keep_alive_interval=60,keep_alive_max_attempt=10,join_timeout=600"
    flags = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.url.removeprefix("etcd://"), "--rdzv-conf",
             slow, "--nnodes", "1:2", "--nproc-per-node", "1", "--local-addr", "127.0.0.1", "--max-restarts", "3",
             "w.py", str(log), str(stop)]  # fmt: skip
    agents = [LiveFtrun(tmp_path, *flags, name=n, run_id=run_id) for n in ("a", "b")]
    live.extend(agents)
    until(lambda: {x["rank"] for x in lines(log)} == {"0", "1"}, "both ranks train")
    store = open_store(etcd_server.url)
    try:
        found = store.get(Keys.of(run_id).leader)
        assert found is not None
        leader = found.value.decode()
    finally:
        store.close()
    is_leader = [leader in a.stderr() for a in agents]
    assert sorted(is_leader) == [False, True]
    victim = agents[is_leader.index(lost == "leader")]
    survivor = agents[1 - agents.index(victim)]
    os.killpg(victim.proc.pid, signal.SIGKILL)
    killed = time.time()
    until(lambda: any(x["world"] == "1" and float(x["t"]) > killed for x in lines(log)), "the survivor trains alone")
    assert "is gone (its agent's connection to this one ended)" in survivor.stderr()
    stop.touch()
    assert survivor.wait() == 0, survivor.stderr()
