"""The executor with the real local group, pretend workers (FakeSpawner) and a FakeClock.

Static and elastic drivers run through the same loop; the elastic ones against a
real rendezvous on an in-memory store. No process is started and nothing sleeps:
pretend workers exit at once, or when signalled.
"""

from __future__ import annotations

import io
import itertools
import json
import signal
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from ftrun.agent import elastic, static
from ftrun.agent.executor import Executor
from ftrun.agent.launch import NodeParts, node_id, rendezvous_for, static_plan
from ftrun.agent.narrator import Narrator
from ftrun.agent.pool_pacing import NoPacing
from ftrun.cli import main as cli
from ftrun.config import LaunchConfig
from ftrun.job.link import JobLink
from ftrun.procs.logs import Console
from ftrun.procs.signals import SignalWakeup
from ftrun.store.memory import MemoryStore
from ftrun.testing.clock import FakeClock
from ftrun.testing.spawner import EXIT_0, RUNS, STUBBORN, Behaviour, FakeProcess, FakeSpawner, Script

PORTS = itertools.count(40000)


class Node:
    """One agent's parts: config, fake spawner and clock, the local group, and what it said."""

    def __init__(self, tmp_path: Path, script: Script, *flags: str, name: str = "node", on_spawn: Any = None) -> None:
        (tmp_path / "w.py").write_text("")
        argv = ["--log-dir", str(tmp_path / name), "--rdzv-id", "t", "--no-warm", *flags, "w.py"]
        self.config: LaunchConfig = cli.parse(argv, {}, tmp_path)
        self.clock = FakeClock()
        self.spawner = FakeSpawner(script, on_spawn or (lambda p: None))
        self.stderr = io.BytesIO()
        self.narrator = Narrator.open(self.config, Console(io.BytesIO(), self.stderr), self.clock, name)
        self.wakeup = SignalWakeup.install()
        parts = NodeParts(self.config, self.narrator, self.spawner, self.clock, self.wakeup, NoPacing(), lambda r: None)
        self.group = parts.group(JobLink(None, lambda: b"key", self.clock))
        self.narrator.run_started()

    def close(self) -> None:
        self.group.close()
        self.narrator.close()
        self.wakeup.close()  # the signal handlers it found, back

    def run_static(self) -> int:
        state = static.initial(static_plan(self.config))
        return Executor(static.step, state, self.group, clock=self.clock, fresh_port=lambda: next(PORTS)).run()

    def run_elastic(self, store: MemoryStore) -> int:
        rdzv = rendezvous_for(
            self.config, store, clock=self.clock, me=node_id("h"), addr="127.0.0.1", log=self.group.narrator.say
        )
        try:
            rdzv.start()
            executor = Executor(
                elastic.step,
                elastic.initial(),
                self.group,
                clock=self.clock,
                fresh_port=lambda: next(PORTS),
                rendezvous=rdzv,
            )
            return executor.run()
        finally:
            rdzv.close(leave=True)

    def said(self) -> str:
        return self.stderr.getvalue().decode()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.group.run_dir / "events.jsonl").read_text().splitlines()]

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.events()]

    def report(self, attempt: int) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(
            (self.group.run_dir / f"attempt_{attempt}" / "failure_report.json").read_text()
        )
        return doc


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[Node]]:
    made: list[Node] = []
    yield made
    for n in reversed(made):  # each group restores the signal handlers it found: the last one first
        n.close()


def start(nodes: list[Node], tmp_path: Path, script: Script, *flags: str, **kw: Any) -> Node:
    node = Node(tmp_path, script, *flags, **kw)
    nodes.append(node)
    return node


def first_attempt_rank_fails(code: int | None, rank: int | None = 1) -> Script:
    """Rank ``rank`` (None: every rank) exits ``code`` in the first attempt (None: never); the others run until
    stopped; later attempts succeed."""

    def script(env: Mapping[str, str]) -> Behaviour:
        if env["TORCHELASTIC_RESTART_COUNT"] != "0":
            return EXIT_0
        return Behaviour(code) if code is not None and rank in (None, int(env["RANK"])) else RUNS

    return script


def by_attempt(spawned: list[FakeProcess]) -> dict[int, list[FakeProcess]]:
    found: dict[int, list[FakeProcess]] = {}
    for p in spawned:
        found.setdefault(p.restart_count, []).append(p)
    return found


# --- static ----------------------------------------------------------------------------------


def test_static_success(nodes: list[Node], tmp_path: Path) -> None:
    n = start(nodes, tmp_path, lambda env: EXIT_0, "--nproc-per-node", "3")
    assert n.run_static() == 0
    assert sorted(p.rank for p in n.spawner.spawned) == [0, 1, 2]
    assert {p.env["WORLD_SIZE"] for p in n.spawner.spawned} == {"3"}
    assert n.kinds()[-1] == "run_finished"
    assert n.events()[-1]["outcome"] == "succeeded"


def test_notices_about_accepted_flags_are_said_at_start(nodes: list[Node], tmp_path: Path) -> None:
    n = start(nodes, tmp_path, lambda env: EXIT_0, "--rdzv-conf", "use_libuv=true")
    assert "ftrun: --rdzv-conf use_libuv has no effect" in n.said()


def test_static_failure_stops_the_others_reports_and_restarts(nodes: list[Node], tmp_path: Path) -> None:
    n = start(nodes, tmp_path, first_attempt_rank_fails(3), "--nproc-per-node", "2", "--max-restarts", "1")
    assert n.run_static() == 0
    attempts = by_attempt(n.spawner.spawned)
    [survivor] = [p for p in attempts[0] if p.rank == 0]
    assert survivor.signals[:1] == [signal.SIGTERM]  # stopped, SIGTERM first
    assert {p.env["MASTER_PORT"] for p in attempts[0]} != {p.env["MASTER_PORT"] for p in attempts[1]}
    root = n.report(0)["root_cause"]
    assert (root["rank"], root["exit_code"]) == (1, 3)
    assert n.report(0)["will_restart"] is True
    assert n.kinds().count("attempt_started") == 2
    assert "restart 1 of 1" in n.said()


def test_static_budget_spent_exits_1(nodes: list[Node], tmp_path: Path) -> None:
    n = start(nodes, tmp_path, lambda env: Behaviour(5), "--max-restarts", "1")
    assert n.run_static() == 1
    assert len(n.spawner.spawned) == 2
    assert n.report(1)["will_restart"] is False
    assert "budget spent" in n.said()


def test_static_placement_comes_from_the_flags(nodes: list[Node], tmp_path: Path) -> None:
    flags = ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr", "node0"]
    n = start(nodes, tmp_path, lambda env: EXIT_0, *flags)
    assert n.run_static() == 0
    envs = [p.env for p in n.spawner.spawned]
    assert [e["RANK"] for e in envs] == ["2", "3"]
    assert {(e["WORLD_SIZE"], e["GROUP_RANK"], e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {
        ("4", "1", "node0", "29500")
    }


def test_a_stubborn_worker_is_killed_after_the_grace_period(nodes: list[Node], tmp_path: Path) -> None:
    def script(env: Mapping[str, str]) -> Behaviour:
        return Behaviour(1) if env["RANK"] == "1" else STUBBORN

    n = start(nodes, tmp_path, script, "--nproc-per-node", "2", "--term-timeout", "0")
    assert n.run_static() == 1
    [stubborn] = [p for p in n.spawner.spawned if p.rank == 0]
    assert stubborn.signals[0] == signal.SIGTERM
    assert stubborn.signals[-1] == signal.SIGKILL
    assert stubborn.returncode == -signal.SIGKILL


def test_a_signal_to_ftrun_stops_the_workers_and_exits_128_plus_it(nodes: list[Node], tmp_path: Path) -> None:
    def on_spawn(p: FakeProcess) -> None:
        if p.rank == 1:
            signal.raise_signal(signal.SIGTERM)  # ftrun's handler only wakes its select()

    n = start(nodes, tmp_path, lambda env: RUNS, "--nproc-per-node", "2", "--max-restarts", "3", on_spawn=on_spawn)
    assert n.run_static() == 128 + signal.SIGTERM
    assert all(p.signals[0] == signal.SIGTERM for p in n.spawner.spawned)
    assert "restart" not in n.kinds()
    assert n.events()[-1]["exit_code"] == 143


def test_a_hang_is_found_on_the_fake_clock_and_restarts(nodes: list[Node], tmp_path: Path) -> None:
    """Rank 0 never beats; the clock jumps 10 s while rank 1 is spawned: rank 0 is past its 5 s deadline."""
    clock: list[FakeClock] = []

    def on_spawn(p: FakeProcess) -> None:
        if p.rank == 1 and p.restart_count == 0:
            clock[0].advance(10)

    def script(env: Mapping[str, str]) -> Behaviour:
        return RUNS if env["TORCHELASTIC_RESTART_COUNT"] == "0" else EXIT_0

    flags = ["--nproc-per-node", "2", "--max-restarts", "1", "--initial-heartbeat-timeout", "5"]
    n = start(nodes, tmp_path, script, *flags, on_spawn=on_spawn)
    clock.append(n.clock)
    assert n.run_static() == 0
    [hang] = [e for e in n.events() if e["kind"] == "hang"]
    assert (hang["rank"], hang["timeout"]) == (0, "initial heartbeat")
    assert hang["lag_s"] == pytest.approx(5.0)  # the deadline passed 5 s before the (fake) now
    root = n.report(0)["root_cause"]
    assert root["rank"] == 0
    assert root["hang"].startswith("hang: initial heartbeat timeout of 5 s exceeded")
    hung = by_attempt(n.spawner.spawned)[0][0]
    assert hung.signals[0] == signal.SIGTERM  # --hang-signal, before the group is stopped


# --- elastic -----------------------------------------------------------------------------------

ELASTIC = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", "--local-addr", "127.0.0.1"]


def test_elastic_success_completes_the_round(nodes: list[Node], tmp_path: Path) -> None:
    n = start(nodes, tmp_path, lambda env: EXIT_0, *ELASTIC, "--nnodes", "1:1", "--nproc-per-node", "2")
    assert n.run_elastic(MemoryStore()) == 0
    [rdzv] = [e for e in n.events() if e["kind"] == "rendezvous"]
    assert (rdzv["round"], rdzv["group_rank"], rdzv["world_size"]) == (1, 0, 2)
    assert "round 1 succeeded" in n.said()


def test_elastic_failure_reports_then_restarts_in_a_new_round(nodes: list[Node], tmp_path: Path) -> None:
    flags = [*ELASTIC, "--nnodes", "1:1", "--nproc-per-node", "2", "--max-restarts", "1"]
    n = start(nodes, tmp_path, first_attempt_rank_fails(7), *flags)
    assert n.run_elastic(MemoryStore()) == 0
    assert [e["round"] for e in n.events() if e["kind"] == "rendezvous"] == [1, 2]
    assert n.report(0)["will_restart"] is True
    assert n.report(0)["root_cause"]["exit_code"] == 7
    assert {p.restart_count for p in n.spawner.spawned} == {0, 1}


def test_elastic_budget_spent_fails_every_node(nodes: list[Node], tmp_path: Path) -> None:
    n = start(nodes, tmp_path, lambda env: Behaviour(2), *ELASTIC, "--nnodes", "1:1", "--max-restarts", "0")
    assert n.run_elastic(MemoryStore()) == 1
    assert n.report(0)["will_restart"] is False
    assert n.events()[-1]["outcome"] == "failed"


def test_elastic_a_failure_on_one_node_restarts_both(nodes: list[Node], tmp_path: Path) -> None:
    """Two agents in two threads on one store: b's rank fails in round 1, both run round 2 and finish. Node a
    may see round 1 close only after b's failure reopened it (b's fake rank fails at once): then it goes to
    round 2 directly, starting no worker for round 1."""
    store = MemoryStore()
    flags = [*ELASTIC, "--nnodes", "2:2", "--nproc-per-node", "1", "--max-restarts", "1"]
    a = start(nodes, tmp_path, first_attempt_rank_fails(None), *flags, name="a")  # runs until stopped
    b = start(nodes, tmp_path, first_attempt_rank_fails(9, rank=None), *flags, name="b")
    codes: dict[str, int] = {}
    thread = threading.Thread(target=lambda: codes.setdefault("b", b.run_elastic(store)))
    thread.start()
    try:
        codes["a"] = a.run_elastic(store)
    finally:
        thread.join(60)
    assert codes == {"a": 0, "b": 0}
    assert [e["round"] for e in b.events() if e["kind"] == "rendezvous"] == [1, 2]
    assert [e["round"] for e in a.events() if e["kind"] == "rendezvous"] in ([1, 2], [2])
    assert b.report(0)["will_restart"] is True
    assert [p.restart_count for p in a.spawner.spawned][-1:] == [1]  # a's workers of round 2: the job's restart


def test_a_reaped_worker_is_never_signalled_again(nodes: list[Node], tmp_path: Path) -> None:
    """Its pid, and so its process group id, may be another process's once its exit was collected."""

    def script(env: Mapping[str, str]) -> Behaviour:
        return EXIT_0 if env["RANK"] == "0" else Behaviour(1)

    n = start(nodes, tmp_path, script, "--nproc-per-node", "2")
    assert n.run_static() == 1
    first = {p.rank: p for p in n.spawner.spawned}
    assert first[0].signals == []  # exited 0 and reaped before rank 1's failure stopped the group
    assert first[1].signals == []
