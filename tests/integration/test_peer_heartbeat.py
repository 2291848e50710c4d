"""Peer liveness: ranks check each other over their own side channel; a frozen rank is found with no hang timeout."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import WAIT_S, LiveFtrun, WriteScript, run_ftrun

pytestmark = pytest.mark.torch

DDP = """
import os, signal, sys
import torch, torch.distributed as dist
import ftrun
from torch.nn.parallel import DistributedDataParallel

frozen, before = int(sys.argv[1]), sys.argv[2] == "before"
if before:  # returns at once: the ring starts once the job's store exists
    ftrun.start_peer_heartbeat(period_s=0.2, timeout_s=2.0)
dist.init_process_group("gloo")
ftrun.start_peer_heartbeat(period_s=0.2, timeout_s=2.0)
ftrun.start_peer_heartbeat(period_s=0.2, timeout_s=2.0)  # idempotent
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
model = DistributedDataParallel(torch.nn.Linear(4, 1))
for step in range(20):
    if step == 10 and rank == frozen and attempt == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive to its agent, silent to its peers
    model(torch.ones(2, 4)).sum().backward()
print(f"rank {rank} attempt {attempt} done", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize(("frozen", "when"), [(0, "after"), (1, "after"), (1, "before")])
def test_a_frozen_rank_is_found_by_its_peer_and_the_job_restarts_naming_it(
    tmp_path: Path, script: WriteScript, frozen: int, when: str
) -> None:
    """Started after init_process_group, or before it (where it once blocked its caller for a minute)."""
    script("w.py", DDP)
    flags = ["--nproc-per-node", "2", "--max-restarts", "1"]
    r = run_ftrun(tmp_path, *flags, "w.py", str(frozen), f"{when}", timeout=180)
    assert r.returncode == 0, r.stderr
    [request] = [e for e in r.events() if e["kind"] == "request"]
    assert request["action"] == "peer_failed"
    assert request["rank"] == 1 - frozen  # its successor in the ring noticed
    root: dict[str, Any] = r.report(0)["root_cause"]  # type: ignore[assignment]
    assert root["rank"] == frozen
    assert "unresponsive to its peers" in root["hang"]
    assert root["signal"] == "SIGKILL"  # it could not handle SIGTERM: killed at once
    assert sorted(r.stdout.splitlines()) == ["rank 0 attempt 1 done", "rank 1 attempt 1 done"]


NO_TORCH = """
import os, signal, sys, time
import ftrun

frozen = int(sys.argv[1])
ftrun.start_peer_heartbeat(period_s=0.2, timeout_s=2.0)  # no torch.distributed, no init_process_group at all
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(200 if attempt == 0 else 5):
    if step == 10 and rank == frozen and attempt == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: alive to its agent, silent to its peers
    time.sleep(0.05)
print(f"rank {rank} attempt {attempt} done", flush=True)
"""


def test_a_job_without_init_process_group_gets_its_peers_checked(tmp_path: Path, script: WriteScript) -> None:
    """The addresses go through ftrun, not the job's store: a job that never makes a process group is covered."""
    script("w.py", NO_TORCH)
    r = run_ftrun(tmp_path, "--nproc-per-node", "3", "--max-restarts", "1", "w.py", "2", timeout=180)
    assert r.returncode == 0, r.stderr
    root: dict[str, Any] = r.report(0)["root_cause"]  # type: ignore[assignment]
    assert root["rank"] == 2
    assert "unresponsive to its peers (noticed by rank 0" in root["hang"]  # rank 0 follows rank 2 in the ring
    assert sorted(r.stdout.splitlines()) == [f"rank {n} attempt 1 done" for n in range(3)]


OUTSIDE = """
import ftrun
try:
    ftrun.start_peer_heartbeat(1, 0.5)
except ValueError as e:
    print("ValueError:", e)
"""


def test_bad_periods_are_a_value_error(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", OUTSIDE)
    r = run_ftrun(tmp_path, "w.py")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ValueError: need 0 < period_s < timeout_s, got period_s=1, timeout_s=0.5"


@pytest.mark.parametrize("job", ["ddp", "no-torch"])
def test_on_two_nodes_a_frozen_rank_is_found_across_them(
    tmp_path: Path, live: list[LiveFtrun], rdzv: list[str], job: str
) -> None:
    """Rank 1 (node b) freezes; rank 0 (node a) notices. Both nodes name rank 1 as the root cause, noticed by
    rank 0; with a job that never calls init_process_group too (the addresses cross nodes through ftrun)."""
    (tmp_path / "w.py").write_text(DDP if job == "ddp" else NO_TORCH)
    flags = [*rdzv, "--rdzv-id", f"{tmp_path.name}-peers", "--local-addr", "127.0.0.1", "--nnodes", "2:2"]
    flags += ["--nproc-per-node", "1", "--max-restarts", "1"]
    agents = [LiveFtrun(tmp_path, *flags, "--log-dir", str(tmp_path / n), str(tmp_path / "w.py"), "1", "after", name=n)
              for n in ("a", "b")]  # fmt: skip
    live.extend(agents)
    for agent in agents:
        assert agent.wait(WAIT_S * 2) == 0, agent.stderr()
    for name in ("a", "b"):
        [report_file] = (tmp_path / name).glob("*/attempt_0/failure_report.json")
        report = json.loads(report_file.read_text())
        # Rank 0's node names rank 1 on the other node (rank 0 only noticed); rank 1's node names its own rank.
        named = report["elsewhere"] if report["root_cause"]["rank"] == 0 else report["root_cause"]
        assert named["rank"] == 1, report
        assert "unresponsive to its peers (noticed by rank 0" in (named.get("what") or named.get("hang")), report
    said = "\n".join(a.stderr() for a in agents)
    assert "ROOT CAUSE  rank 1" in said
    assert "NOTICED IT rank 0" in said
    assert sorted(line for a in agents for line in a.lines if "done" in line) == [
        "rank 0 attempt 1 done",
        "rank 1 attempt 1 done",
    ]


def test_a_peer_out_of_step_is_reported_with_its_restart() -> None:
    """Two ring members on real loopback UDP sockets, one a restart behind: each reports the other."""
    import threading

    from ftrun.worker.peers import PeerHeartbeat

    book: dict[int, tuple[str, int]] = {}
    both = threading.Barrier(2, timeout=WAIT_S)
    reports: dict[int, tuple[int, str]] = {}
    done = threading.Event()

    def addresses(rank: int) -> Callable[[str], dict[int, tuple[str, int]]]:
        def exchange(mine: str) -> dict[int, tuple[str, int]]:
            host, _, port = mine.rpartition(":")
            book[rank] = (host, int(port))
            both.wait()
            return book

        return exchange

    def report(rank: int) -> Callable[[int, str], None]:
        def told(peer: int, why: str) -> None:
            reports[rank] = (peer, why)
            if len(reports) == 2:
                done.set()

        return told

    members: list[PeerHeartbeat] = []
    starters = [
        threading.Thread(
            target=lambda r=r: members.append(
                PeerHeartbeat(r, 2, r, 0.05, WAIT_S, addresses(r), report(r), bind_host="127.0.0.1").start()
            )
        )
        for r in (0, 1)
    ]
    for t in starters:
        t.start()
    for t in starters:
        t.join(WAIT_S)
    try:
        assert done.wait(WAIT_S)
    finally:
        for m in members:
            m.stop()
    assert reports[0] == (1, "its peer heartbeat says restart 1, this rank is in restart 0 (out of step)")
    assert reports[1] == (0, "its peer heartbeat says restart 0, this rank is in restart 1 (out of step)")


def test_a_datagram_not_signed_with_the_jobs_key_is_ignored() -> None:
    """Spoofed datagrams (unsigned, or signed with another key) that claim to come from the previous rank, out of
    step, change nothing; a signed one is heard (the control: the report names its restart, not the spoof's)."""
    import hashlib
    import hmac
    import socket
    import threading

    from ftrun.worker.peers import PeerHeartbeat

    key, reports, told = b"k" * 32, [], threading.Event()

    def report(peer: int, why: str) -> None:
        reports.append((peer, why))
        told.set()

    def signed(body: bytes, with_key: bytes) -> bytes:
        return hmac.new(with_key, body, hashlib.sha256).digest() + body

    spoofer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    me: PeerHeartbeat | None = None
    try:
        spoofer.bind(("127.0.0.1", 0))
        # Rank 0 of 2; its successor (rank 1) is the spoofer's socket, so rank 0's own beats go nowhere that matters.
        succ = ("127.0.0.1", spoofer.getsockname()[1])
        me = PeerHeartbeat(0, 2, 0, 0.05, WAIT_S, lambda mine: {1: succ}, report, bind_host="127.0.0.1", key=key)
        me.start()
        target = spoofer.recvfrom(512)[1]  # its first beat says where it listens
        spoof = json.dumps({"rank": 1, "restart": 5}).encode()
        for datagram in (spoof, signed(spoof, b"x" * 32), b"\0" * 40):
            for _ in range(10):
                spoofer.sendto(datagram, target)
        spoofer.sendto(signed(json.dumps({"rank": 1, "restart": 7}).encode(), key), target)
        assert told.wait(WAIT_S)
    finally:
        if me is not None:
            me.stop()
        spoofer.close()
    assert reports == [(1, "its peer heartbeat says restart 7, this rank is in restart 0 (out of step)")]
