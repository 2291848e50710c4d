"""Goodput checked against a job that notes its own timings, and ``ftrun report`` with its timeline."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import WAIT_S, LiveFtrun, run_ftrun

# Each rank notes when it took each step (CLOCK_MONOTONIC, the agent's clock too). Attempt 0: rank 1 fails
# after step 6 (the others wait for it); attempt 1 resumes from the job's checkpoint at step 4 and runs to step 9.
JOB = """
import json, os, sys, time, pathlib
import ftrun
rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
marks = pathlib.Path(sys.argv[1]) / f"marks-{restart}-{rank}.json"
noted = {"steps": []}
time.sleep(0.3)  # start-up: data loading, say
for step in range(0 if restart == 0 else 4, 10):
    ftrun.heartbeat(step=step)
    noted["steps"].append([step, time.monotonic()])
    marks.with_suffix(".tmp").write_text(json.dumps(noted))
    marks.with_suffix(".tmp").replace(marks)  # whole, even when the agent stops this rank mid-write
    time.sleep(0.1)
    if restart == 0 and rank == 1 and step == 6:
        print("step 6 went wrong", flush=True)
        sys.exit(3)
if restart == 0:
    time.sleep(60)  # attempt 0 ends with rank 1's failure, however late rank 1 started (the agent stops us)
"""
TOLERANCE_S = 0.25  # the job's marks against what the agent saw (process exits, scheduling on 2 busy cores)


def marks(tmp_path: Path, attempt: int) -> list[list[float]]:
    """Every (step, time) the ranks of ``attempt`` noted."""
    return [s for f in sorted(tmp_path.glob(f"marks-{attempt}-*.json")) for s in json.loads(f.read_text())["steps"]]


def test_goodput_matches_the_jobs_own_timings(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(JOB)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "job.py", str(tmp_path))
    assert r.returncode == 0, r.stderr
    events = r.events()
    kinds = {e["kind"]: e for e in reversed(events)}  # the first of each kind
    failed_at = next(e["mono"] for e in events if e["kind"] == "worker_exited" and e["state"] == "failed")
    ended_at = kinds["run_finished"]["mono"]
    first = [min(t for _, t in marks(tmp_path, a)) for a in (0, 1)]
    assert [e["first_mono"] for e in events if e["kind"] == "first_step"] == pytest.approx(first, abs=0.02)
    assert [e["step"] for e in events if e["kind"] == "first_step"] == [0, 4]

    status = json.loads((r.run_dir / "status.json").read_text())
    g: dict[str, Any] = status["goodput"]
    assert g["training_s"] == pytest.approx((failed_at - first[0]) + (ended_at - first[1]), abs=TOLERANCE_S)
    assert g["wall_s"] == pytest.approx(ended_at - kinds["run_started"]["mono"], abs=0.01)
    parts = g["startup_s"] + g["training_s"] + g["detection_s"] + g["recovery_s"] + g["ending_s"]
    assert parts == pytest.approx(g["wall_s"], abs=0.01)  # every second is accounted for once
    assert g["startup_s"] >= 0.3  # the job's own start-up sleep
    # Lost: the steps attempt 1 did again (from 4 up to the furthest attempt 0 got), at attempt 0's pace,
    # plus the step in progress when it failed.
    steps0 = marks(tmp_path, 0)
    last_step, last_beat = max(s for s, _ in steps0), max(t for _, t in steps0)
    per_step = (last_beat - first[0]) / last_step
    lost = (last_step - 4) * per_step + (failed_at - last_beat)
    assert g["lost_s"] == pytest.approx(lost, abs=TOLERANCE_S)
    assert g["fraction"] == pytest.approx((g["training_s"] - g["lost_s"]) / g["wall_s"], abs=0.001)
    assert re.search(r"goodput \d+\.\d%: \d+\.\d s training of \d+\.\d s; start-up", r.stderr)

    report = subprocess.run(
        [sys.executable, "-m", "ftrun", "report", str(r.run_dir)], capture_output=True, text=True, timeout=WAIT_S
    )
    assert report.returncode == 0, report.stderr
    out = report.stdout
    assert "attempt 0:" in out
    assert "attempt 1:" in out
    assert out.index("ROOT CAUSE  rank 1") < out.index("down:") < out.index("attempt 1:")
    assert "step 6 went wrong" in out  # its last words, on stdout: stderr was empty
    assert "goodput" in out
    page = (r.run_dir / "timeline.html").read_text()
    assert (r.run_dir / "timeline.html").stat().st_mode & 0o777 == 0o600  # as every file of a run
    assert page.count("attempt 0: training") == 1
    assert page.count("attempt 1: training") == 1
    assert "attempt 0 failed: rank 1 (local rank 1" in page


def test_report_draws_every_node_of_a_multi_node_job(
    tmp_path: Path, live: list[LiveFtrun], own_tcp_server: str
) -> None:
    (tmp_path / "job.py").write_text(JOB)
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", own_tcp_server, "--rdzv-conf", "is_host=false",
             "--rdzv-id", "multi", "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1",
             "--local-addr", "127.0.0.1"]  # fmt: skip
    agents = [LiveFtrun(tmp_path, *flags, "job.py", str(tmp_path), name=n, run_id="multi") for n in "ab"]
    live.extend(agents)
    assert [a.wait() for a in agents] == [0, 0], [a.stderr() for a in agents]
    out = subprocess.run(
        [sys.executable, "-m", "ftrun", "report", *(str(a.run_dir) for a in agents), "--timeline",
         str(tmp_path / "t.html")],
        capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("run multi on ") == 2
    page = (tmp_path / "t.html").read_text()
    assert page.count("attempt 0: start-up") == 2  # a row per node
    assert page.count("attempt 1: training") == 2
    assert page.count("attempt 0 failed: rank 1") == 2  # both nodes tell the same root cause
    for a in agents:  # two nodes on one host: each row named by its agent too, its whole name on hover
        assert f"(agent {a.proc.pid})" in page, page
        assert f"(agent {a.proc.pid}): {a.run_dir}</title>" in page


# Two nodes of one rank each, in step through gloo; rank 0 keeps a checkpoint every 5 steps.
GLOO_JOB = """
import os, sys, time, pathlib
import torch, torch.distributed as dist
import ftrun
dist.init_process_group("gloo")
rank = dist.get_rank()
saved = pathlib.Path(sys.argv[1]) / "resume-at"
start = int(saved.read_text()) if saved.exists() else 0
print(f"up rank={rank} pid={os.getpid()} at={start}", flush=True)
t = torch.ones(1)
for step in range(start, 30):
    ftrun.heartbeat(step=step)
    dist.all_reduce(t)
    print(f"step {step}", flush=True)
    if rank == 0 and step % 5 == 4:
        saved.with_suffix(".tmp").write_text(str(step + 1))
        saved.with_suffix(".tmp").replace(saved)
    time.sleep(0.1)
dist.destroy_process_group()
"""


def report_of(run_dir: Path) -> str:
    told = subprocess.run(
        [sys.executable, "-m", "ftrun", "report", str(run_dir)], capture_output=True, text=True, timeout=WAIT_S
    )
    assert told.returncode == 0, told.stderr
    return told.stdout


def test_a_lost_node_is_accounted_for_on_the_survivor_and_on_itself(
    tmp_path: Path, live: list[LiveFtrun], own_tcp_server: str
) -> None:
    """Node b's worker dies, then its agent a moment later (a lost machine): the survivor's worker fails in its
    collective by itself, and the survivor waits for a second node until b is started again. The survivor's
    failure is detected when ftrun acted on it, the wait is recovery, not detection, and the lost work is known;
    b's own report says it trained until its agent died."""
    (tmp_path / "job.py").write_text(GLOO_JOB)
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", own_tcp_server, "--rdzv-conf", "is_host=false",
             "--rdzv-id", "lost", "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "2", "--no-warm",
             "--local-addr", "127.0.0.1", "job.py", str(tmp_path)]  # fmt: skip
    a, b = (LiveFtrun(tmp_path, *flags, name=n, run_id="lost") for n in "ab")
    live.extend([a, b])
    b_worker = int(b.wait_for_lines(r"up rank=\d pid=(\d+) at=0", 1)[0].group(1))
    b.wait_for_lines(r"step 12", 1)
    os.kill(b.proc.pid, signal.SIGSTOP)  # the machine goes: its worker first, its agent a moment later
    os.kill(b_worker, signal.SIGKILL)
    a.wait_for_stderr(r"ROOT CAUSE")  # the survivor's worker failed in its all_reduce, by itself
    b.proc.kill()
    b.wait()
    b2 = LiveFtrun(tmp_path, *flags, name="b2", run_id="lost")  # the node back, as a requeued one is
    live.append(b2)
    assert [a.wait(WAIT_S), b2.wait(WAIT_S)] == [0, 0], a.stderr() + b2.stderr()

    events = a.events()
    stops = [e for e in events if e["kind"] == "group_stopping" and e["attempt"] == 0]
    assert len(stops) == 1, [e["kind"] for e in events]  # said once, though the worker had exited by itself
    stop = stops[0]
    assert stop["running"] == [], stop
    assert stop["last_step"] >= 12, stop
    exited = next(e for e in events if e["kind"] == "worker_exited" and e["state"] == "failed")
    restarted = next(e for e in events if e["kind"] == "attempt_started" and e["attempt"] == 1)
    g: dict[str, Any] = json.loads((a.run_dir / "status.json").read_text())["goodput"]
    assert g["detection_s"] <= stop["mono"] - exited["mono"] + TOLERANCE_S, g  # detection ends when ftrun acted
    assert g["recovery_s"] >= restarted["mono"] - stop["mono"], g  # the wait for a second node is recovery
    resumed = int(a.wait_for_lines(r"up rank=\d pid=\d+ at=(\d+)", 2)[1].group(1))  # the checkpoint's step
    assert [e["step"] for e in events if e["kind"] == "first_step"] == [0, resumed]
    redone = stop["last_step"] - resumed
    survivor = report_of(a.run_dir)
    assert re.search(rf"lost work: [\d.]+ s, {redone} step\(s\) done again", survivor), survivor
    assert "lost work unknown" not in survivor, survivor

    lost = report_of(b.run_dir)  # b's first life: its agent was killed
    assert re.search(r"attempt 0: .*, first step after [\d.]+ s: cut off: its agent died", lost), lost
    assert "no step seen" not in lost, lost
    trained = re.search(r"goodput \d+\.\d%: ([\d.]+) s training", lost)  # until it was last heard of (1 s)
    assert trained, lost
    assert float(trained.group(1)) > 0.0, lost
