"""The demo job really trains with torch DDP (gloo, CPU) and a crash loses nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ftrun.testing.etcd import EtcdHarness
from tests.integration.harness import CONF as ELASTIC_CONF
from tests.integration.harness import WAIT_S, LiveFtrun, clean_run, run_ftrun

pytestmark = pytest.mark.torch
DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py")
STEPS = ["--steps", "120", "--checkpoint-every", "10"]


def final_checksum(stdout: str, world: int = 2) -> str:
    found = re.findall(rf"final loss [0-9.]+ checksum ([0-9a-f]{{16}}) world {world}", stdout)
    assert len(found) == 1, stdout
    return str(found[0])


@pytest.fixture
def clean_checksum(shared_dir: Path) -> str:
    r = clean_run(shared_dir, "--nproc-per-node", "2", DEMO, *STEPS, "--checkpoint-dir", "ckpt")
    assert r.returncode == 0, r.stderr
    return final_checksum(r.stdout)


@pytest.mark.parametrize(
    ("fault", "pool"), [("--crash-at", "--warm=auto"), ("--raise-at", "--warm=auto"), ("--crash-at", "--no-warm")]
)
def test_fault_mid_run_recovers_with_identical_weights(
    tmp_path: Path, clean_checksum: str, fault: str, pool: str
) -> None:
    """Warm (the default) or cold, the job's result is the same as a run that never failed."""
    r = run_ftrun(
        tmp_path, "--nproc-per-node", "2", "--max-restarts", "2", pool, DEMO, *STEPS,
        "--checkpoint-dir", str(tmp_path / "ckpt"), fault, "55", "--crash-rank", "1",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    warm = [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1]
    assert warm == [pool != "--no-warm"] * 2
    assert "attempt 1: resumed from step 50" in r.stdout
    assert final_checksum(r.stdout) == clean_checksum
    root = r.report(0)["root_cause"]
    assert root["rank"] == 1  # type: ignore[index]
    if fault == "--crash-at":
        assert root["signal"] == "SIGKILL"  # type: ignore[index]
    else:
        assert "injected failure at step 55" in root["error"]["message"]  # type: ignore[index]


def test_a_hang_mid_run_is_found_and_recovers_with_identical_weights(tmp_path: Path, clean_checksum: str) -> None:
    """Rank 1 hangs between steps; rank 0 waits for it inside its "step" section (in the allreduce).
    Only rank 1 is out of section, so the out-of-section timeout names it, not the rank waiting for it.
    (Heartbeats alone cannot tell them apart: both stop at the same step.)"""
    r = run_ftrun(
        tmp_path, "--nproc-per-node", "2", "--max-restarts", "2", "--out-of-section-timeout", "2", DEMO, *STEPS,
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--hang-at", "55", "--crash-rank", "1",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "attempt 1: resumed from step 50" in r.stdout
    assert final_checksum(r.stdout) == clean_checksum
    root = r.report(0)["root_cause"]
    assert root["rank"] == 1  # type: ignore[index]  # not rank 0, stuck in the allreduce waiting for it
    assert root["hang"].startswith("hang: out of section timeout of 2 s exceeded")  # type: ignore[index]
    assert "inject_faults" in root["stacks"]  # type: ignore[index]


@pytest.mark.slow
def test_ddp_across_two_agents_survives_the_loss_of_one(tmp_path: Path, live: list[LiveFtrun]) -> None:
    """2 nodes x 2 workers on etcd plus a hot spare; one node is SIGKILLed mid-run; the weights still match.

    The spare keeps the world at 4 ranks, so the result must equal a clean 4-rank run bit for bit
    (a smaller world sums the gradients in another order: equal maths, other bits).
    """
    with EtcdHarness() as etcd:
        endpoint = etcd.url.removeprefix("etcd://")

        def agent(name: str, run_id: str) -> LiveFtrun:
            started = LiveFtrun(
                tmp_path, "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-conf", ELASTIC_CONF,
                "--rdzv-id", run_id, "--local-addr", "127.0.0.1", "--nnodes", "2:2", "--nproc-per-node", "2",
                "--max-restarts", "2", DEMO, *STEPS, "--step-time", "0.02", "--log-every", "10",
                "--checkpoint-dir", str(tmp_path / run_id), name=name,
            )  # fmt: skip
            live.append(started)
            return started

        clean = [agent("clean-a", "clean"), agent("clean-b", "clean")]
        for f in clean:
            assert f.wait(WAIT_S) == 0, f.stderr()
        expected = final_checksum("\n".join(clean[0].lines + clean[1].lines), world=4)

        a, b = agent("a", "faulty"), agent("b", "faulty")
        head = a if "group rank 0" in a.wait_for_stderr(r"round 1: group rank") else b
        b.wait_for_stderr(r"round 1: group rank")
        spare = agent("spare", "faulty")
        spare.wait_for_stderr("hot spare")
        other = b if head is a else a
        head.wait_for_lines(r"step 30 loss", 1)  # a checkpoint exists (every 10 steps)
        other.proc.kill()
        assert head.wait(WAIT_S) == 0, head.stderr()
        assert spare.wait(WAIT_S) == 0, spare.stderr()
        assert "resumed from step" in "\n".join(head.lines)
        assert final_checksum("\n".join(head.lines), world=4) == expected
