"""A job on a 3-member etcd cluster (real etcd processes) outlives any minority of its members, the leader too."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftrun.testing.etcd import EtcdCluster
from tests.integration.conftest import LiveFtrun, until

TRAINS = """
import json, os, sys, time
while not os.path.exists(sys.argv[2]):
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps({"t": time.time(), "port": os.environ["MASTER_PORT"], "rank": os.environ["RANK"]}) + "\\n")
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
