"""The job's keys have one home (ftrun.store.keyspace): every key a real two-node run writes in the store, a
failure, a new round and a snapshot agreement included, falls under one of its parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrun.store import keyspace
from ftrun.store.factory import open_store
from ftrun.testing.etcd import EtcdHarness
from tests.integration.harness import CONF, LiveFtrun

pytestmark = pytest.mark.torch
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "snapshot_ddp.py"


def test_every_key_a_two_node_run_writes_falls_under_the_keyspace(tmp_path: Path, live: list[LiveFtrun]) -> None:
    with EtcdHarness() as etcd:  # its own: the history read below is this run's alone
        flags = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.url.removeprefix("etcd://"), "--rdzv-conf", CONF]
        flags += ["--local-addr", "127.0.0.1", "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1"]
        flags += [str(EXAMPLE), "--steps", "12", "--crash-at", "6"]
        agents = [LiveFtrun(tmp_path, *flags, name=name, run_id="ks") for name in ("a", "b")]
        live.extend(agents)
        for agent in agents:
            assert agent.wait() == 0, agent.stderr()
        store = open_store(etcd.url)
        written: set[str] = set()
        with store.watch("", 1) as watch:  # every change since the store began, deletions included
            while (event := watch.get(2.0)) is not None:
                written.add(event.key)
    outside = sorted(k for k in written if keyspace.part_of("ks", k) is None)
    assert not outside, outside
    parts = {keyspace.part_of("ks", k) for k in written}
    assert {"rdzv", "status", "failure", "exit", "snapshots", "snapshot-decision"} <= parts, parts
