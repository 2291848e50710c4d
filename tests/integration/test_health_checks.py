"""Node health checks (--health-check): a node that fails one before joining stays out, and one that fails while
it trains leaves the job, the others going on; several agents (separate processes) on the embedded store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ftrun.testing import nvml_driver
from tests.integration.harness import CONF, WAIT_S, LiveFtrun, run_ftrun

JOB = """
import os, sys, time
env = os.environ
print(f"up rank={env['RANK']} world={env['WORLD_SIZE']} restart={env['TORCHELASTIC_RESTART_COUNT']}", flush=True)
time.sleep(600)
"""
SICK = "echo 'GPU 2: 3 uncorrectable ECC errors'; exit 1"


def events(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_a_node_that_fails_its_check_never_starts_a_worker(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text("print('ran', flush=True)\n")
    r = run_ftrun(
        tmp_path, "--health-check", "true", "--health-check", SICK, "--health-check-interval", "0.5",
        "--rdzv-conf", "join_timeout=2", "w.py",
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "ran" not in r.stdout
    assert f"failed its health check {SICK!r} before joining (exit 1):\nGPU 2: 3 uncorrectable ECC errors" in r.stderr
    assert "stays out of the job; its health checks run again in" in r.stderr
    assert f"did not join: health check {SICK!r} failed: GPU 2: 3 uncorrectable ECC errors" in r.stderr
    checks = [e for e in r.events() if e["kind"] == "health_check"]
    assert [e["healthy"] for e in checks[:2]] == [True, False]  # each round of checks: both, in order
    assert len(checks) >= 4  # checked again while it waited
    assert not [e for e in r.events() if e["kind"] == "attempt_started"]


def agents(tmp_path: Path, store: str) -> list[str]:
    (tmp_path / "w.py").write_text(JOB)
    return [
        "--rdzv-backend", "c10d", "--rdzv-endpoint", store,
        "--local-addr", "127.0.0.1", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2",
    ]  # fmt: skip


def test_a_sick_node_stays_out_and_the_healthy_one_trains_alone(
    tmp_path: Path, live: list[LiveFtrun], own_tcp_server: str
) -> None:
    flags = agents(tmp_path, own_tcp_server)
    conf = ["--rdzv-conf", f"{CONF},is_host=false"]
    healthy = LiveFtrun(tmp_path, *flags, *conf, "w.py", name="a", run_id="health")
    live.append(healthy)
    short = CONF.replace("join_timeout=60", "join_timeout=4")
    sick = LiveFtrun(
        tmp_path, *flags, "--rdzv-conf", f"{short},is_host=false", "--health-check", SICK,
        "--health-check-interval", "1", "w.py", name="b", run_id="health",
    )  # fmt: skip
    live.append(sick)
    assert sick.wait(WAIT_S) == 1, sick.stderr()
    assert "did not join" in sick.stderr()
    assert sick.lines == []  # no worker of its own
    healthy.wait_for_lines(r"up rank=0 world=1 restart=0", 1)
    assert not [line for line in healthy.lines if "world=2" in line]


def test_a_node_failing_its_check_while_training_leaves_and_the_other_goes_on(
    tmp_path: Path, live: list[LiveFtrun], own_tcp_server: str
) -> None:
    flags = [*agents(tmp_path, own_tcp_server), "--rdzv-conf", f"{CONF},is_host=false"]
    trigger = tmp_path / "nic-down"
    check = f"test ! -e {trigger} || {{ echo 'ib0: link down'; exit 1; }}"
    a = LiveFtrun(tmp_path, *flags, "w.py", name="a", run_id="health")
    b = LiveFtrun(
        tmp_path, *flags, "--health-check", check, "--health-check-interval", "0.5", "w.py", name="b",
        run_id="health",
    )  # fmt: skip
    live.extend([a, b])
    for agent in (a, b):
        agent.wait_for_lines(r"up rank=\d world=2", 1)
    trigger.touch()
    assert b.wait(WAIT_S) == 3, b.stderr()
    assert f"failed its health check {check!r} while training (exit 1):\nib0: link down" in b.stderr()
    report = json.loads(next(b.run_dir.glob("attempt_*/failure_report.json")).read_text())
    assert "ib0: link down" in report["root_cause"]["request"]
    failed = [e for e in events(b.run_dir) if e["kind"] == "health_check" and not e["healthy"]]
    assert [(e["when"], e["ended"]) for e in failed] == [("while training", "exit 1")]
    a.wait_for_lines(r"up rank=0 world=1", 1)  # the other goes on alone, in a new round


def test_a_wake_up_that_comes_after_the_agents_loop_does_not_end_it() -> None:
    """A health check's wake-up (a real-time signal) racing the end of the run killed the agent by the signal's
    default action: the run exited -40 instead of 1 (the test above, about one run in two)."""
    late = (
        "import os; from ftrun.procs.signals import SignalWakeup; from ftrun.worker.signals import REQUEST_SIGNAL\n"
        "SignalWakeup.install().close(); os.kill(os.getpid(), REQUEST_SIGNAL); print('still here')\n"
    )
    r = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True, timeout=WAIT_S)
    assert (r.returncode, r.stdout) == (0, "still here\n"), r.stderr


BREAKS = """
import os, sys, time
env = os.environ
print(f"up rank={env['RANK']} world={env['WORLD_SIZE']} restart={env['TORCHELASTIC_RESTART_COUNT']}", flush=True)
if env.get("NVML_STANDIN_STATE") and env["TORCHELASTIC_RESTART_COUNT"] == "0":  # the node whose GPU breaks
    time.sleep(1)
    with open(env["NVML_STANDIN_STATE"], "w") as f:
        f.write("ecc 1")
    sys.stderr.write(
        "[rank1]: torch.AcceleratorError: CUDA error: uncorrectable ECC error encountered\\n"
        "[rank1]: Search for `cudaErrorECCUncorrectable' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
        "group__CUDART__TYPES.html for more information.\\n"
    )
    sys.exit(1)
time.sleep(600)
"""


def test_a_gpu_that_breaks_keeps_its_node_out_of_the_next_round(
    tmp_path: Path, live: list[LiveFtrun], own_tcp_server: str
) -> None:
    """A worker's CUDA error says its GPU is in doubt (an uncorrectable ECC error): with no --health-check,
    its node checks the GPU through NVML (a stand-in driver here, which now counts the error) before the next
    attempt, fails, and leaves; the other node goes on alone."""
    reason = nvml_driver.available()
    if reason:
        pytest.skip(reason)
    nvml = nvml_driver.build(tmp_path / "nvml")
    flags = [*agents(tmp_path, own_tcp_server), "--rdzv-conf", f"{CONF},is_host=false"]
    (tmp_path / "w.py").write_text(BREAKS)
    a = LiveFtrun(tmp_path, *flags, "w.py", name="a", run_id="gpu")
    breaks = {"LD_LIBRARY_PATH": str(nvml), nvml_driver.STATE: str(tmp_path / "gpu-state")}
    b = LiveFtrun(tmp_path, *flags, "w.py", name="b", run_id="gpu", env=breaks)
    live.extend([a, b])
    assert b.wait(WAIT_S) == 3, b.stderr()
    said = b.stderr()
    assert "cuda      : CUDA error: uncorrectable ECC error encountered" in said
    assert "hint: the GPU may be unusable" in said
    assert "failed its health check 'builtin:gpu'" in said
    assert "GPU 0 has 1 uncorrectable ECC error(s) since the driver loaded" in said
    assert "leaves the job" in said
    a.wait_for_lines(r"up rank=0 world=1", 1)  # the other goes on alone, in a new round
