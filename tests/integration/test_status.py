"""``ftrun status``: the live view in a real terminal (tmux), and --once / --json on live and finished runs,
one node through its run directory and several through the job's store (embedded and etcd)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.integration.harness import WAIT_S, LiveFtrun, until

T = TypeVar("T")

# Steps until the test says "done"; rank 1 crashes on the first attempt when the test says "crash".
JOB = """
import os, sys, time, pathlib
import ftrun
rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
here = pathlib.Path(sys.argv[1])
print(f"up rank={rank} restart={restart}", flush=True)
with ftrun.section("train"):
    step = 0
    while not (here / "done").exists():
        ftrun.heartbeat(step=step)
        if rank == 1 and restart == 0 and (here / "crash").exists():
            sys.exit(3)
        time.sleep(0.05)
        step += 1
"""


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftrun", "status", *args], capture_output=True, text=True, timeout=WAIT_S
    )


def snapshot(*args: str) -> dict[str, Any]:
    out = status(*args, "--json")
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def showing(read: Callable[[], T], wanted: Callable[[T], Any]) -> Callable[[], T | None]:
    """A check for :func:`until`: what ``read`` returns once ``wanted`` holds for it."""

    def check() -> T | None:
        found = read()
        return found if wanted(found) else None

    return check


@pytest.fixture
def job(tmp_path: Path, live: list[LiveFtrun]) -> LiveFtrun:
    (tmp_path / "job.py").write_text(JOB)
    agent = LiveFtrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "2", "job.py", str(tmp_path))
    live.append(agent)
    agent.wait_for_lines(r"up rank=\d restart=0", 2)
    return agent


@dataclass(frozen=True)
class Terminal:
    """A command's terminal: a fresh 150x40 tmux window, which stays when the command ends."""

    socket: str

    def screen(self, scrolled: int = 0) -> str:
        """What it shows, with the last ``scrolled`` lines that left its top."""
        out = subprocess.run(
            ["tmux", "-L", self.socket, "capture-pane", "-p", "-t", "view", "-S", str(-scrolled)],
            capture_output=True,
            text=True,
        )
        return out.stdout

    def ended(self) -> bool:
        out = subprocess.run(
            ["tmux", "-L", self.socket, "display", "-p", "-t", "view", "#{pane_dead}"], capture_output=True, text=True
        )
        return out.stdout.strip() == "1"


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Callable[..., Terminal]]:
    """``tmux(*command)`` runs command in a :class:`Terminal`."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    socket = f"ftrun-test-{os.getpid()}-{tmp_path.name}"

    def start(*command: str) -> Terminal:
        window = ["new-session", "-d", "-s", "view", "-x", "150", "-y", "40", *command]
        subprocess.run(
            ["tmux", "-L", socket, *window, ";", "set-option", "-t", "view", "remain-on-exit", "on"],
            check=True,
            timeout=WAIT_S,
            # The terminal's own size, not one a parent set (pytest-xdist's workers have COLUMNS=80, LINES=24).
            env={**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}, "TERM": "xterm-256color"},
        )
        return Terminal(socket)

    yield start
    subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, timeout=WAIT_S)


def test_the_live_view_in_a_terminal_follows_a_restart_to_the_end(
    tmp_path: Path, job: LiveFtrun, tmux: Callable[..., Terminal]
) -> None:
    terminal = tmux(sys.executable, "-m", "ftrun", "status", str(job.run_dir), "--interval", "0.2")
    screen = terminal.screen
    shown = until(showing(screen, lambda s: "running" in s and "train" in s), "two running ranks")
    assert "restarts 0" in shown
    assert "ftrun run t" in shown
    (tmp_path / "crash").touch()
    # Both ranks of the new attempt running, each with a heartbeat age (once its first beat is in the record).
    try:
        shown = until(showing(screen, lambda s: "restarts 1" in s and s.count(" s ago ") >= 2), "the restart")
    except AssertionError as e:
        raise AssertionError(f"{e}\nthe screen:\n{screen()}\nftrun's stderr:\n{job.stderr()}") from None
    assert shown.count(" running ") >= 2
    assert "failure 1: rank 1 (local rank 1" in shown
    assert "exit code 3" in shown
    (tmp_path / "done").touch()
    assert job.wait() == 0
    # The view ends with the run: its last view, then tmux's word, may scroll its head off the screen.
    shown = until(
        showing(lambda: terminal.screen(scrolled=50), lambda s: "finished: succeeded (exit 0)" in s), "the end"
    )
    assert "goodput" in shown
    until(terminal.ended, "the live view's own end, the run's last view left on the terminal")
    assert "finished: succeeded (exit 0)" in terminal.screen(scrolled=50)


def test_once_and_json_while_the_job_runs_and_after_it_ended(tmp_path: Path, job: LiveFtrun) -> None:
    def beating(d: dict[str, Any]) -> bool:
        ranks = d["nodes"][0]["ranks"]
        return len(ranks) == 2 and all(r["heartbeat_age_s"] is not None for r in ranks)

    running = until(showing(lambda: snapshot(str(job.run_dir)), beating), "two ranks beating")
    assert running["phase"] == "running"
    ranks = running["nodes"][0]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["state"] == "running" and r["pid"] > 0 for r in ranks)
    assert all(0 <= r["heartbeat_age_s"] < WAIT_S and r["step"] >= 0 for r in ranks)
    assert all(r.get("heartbeat_live") for r in ranks)  # read from the monitor table now, not the record's stamp
    assert all(r["sections"][0][0] == "train" for r in ranks)
    once = status(str(tmp_path / "logs"), "--once")  # the --log-dir finds its newest run
    assert once.returncode == 0, once.stderr
    assert "running" in once.stdout
    assert "train" in once.stdout
    (tmp_path / "done").touch()
    assert job.wait() == 0
    ended = snapshot(str(job.run_dir))
    assert ended["phase"] == "finished"
    assert ended["nodes"][0]["outcome"] == "succeeded"
    assert all(r["state"] == "succeeded" and r["heartbeat_age_s"] is None for r in ended["nodes"][0]["ranks"])
    assert ended["nodes"][0]["goodput"]["stepped"]
    once = status(str(job.run_dir), "--once")
    assert "finished: succeeded (exit 0)" in once.stdout


def test_status_piped_prints_once_and_ends(tmp_path: Path, job: LiveFtrun) -> None:
    """``ftrun status RUN_DIR | grep ...`` while the job runs: no live view, which never ended with no terminal
    to draw on and printed nothing (rich draws a non-terminal's view at its end)."""
    until(showing(lambda: snapshot(str(job.run_dir)), lambda d: d["phase"] == "running"), "the job running")
    piped = status(str(job.run_dir))  # its output a pipe; bounded by WAIT_S
    assert piped.returncode == 0, piped.stderr
    assert "ftrun run t  running" in piped.stdout, piped.stdout


def test_status_answers_from_the_events_before_the_first_status_record(tmp_path: Path, job: LiveFtrun) -> None:
    """On a loaded node the first status record can come seconds after the first events (a long rendezvous, a
    slow start): status answers from the events, never calling the run directory old. Replayed here with the
    real run's events as they stood at each moment, and no status record."""
    early = tmp_path / "early"
    early.mkdir()

    def events_say_running() -> list[str] | None:  # the status record can say so before the events do
        lines = (job.run_dir / "events.jsonl").read_text().splitlines()
        (early / "events.jsonl").write_text("\n".join(lines) + "\n")
        return lines if snapshot(str(early))["phase"] == "running" else None

    lines = until(events_say_running, "the job runs, as its events say")
    kinds = [json.loads(line)["kind"] for line in lines]
    spawned = max(i for i, k in enumerate(kinds) if k == "worker_spawned") + 1
    for upto, phase in ((1, "starting"), (spawned, "workers starting"), (len(lines), "running")):
        (early / "events.jsonl").write_text("\n".join(lines[:upto]) + "\n")
        d = snapshot(str(early))
        assert d["phase"] == phase, (upto, d)
    assert [r["rank"] for r in d["nodes"][0]["ranks"]] == [0, 1]
    (tmp_path / "done").touch()
    assert job.wait() == 0


def test_a_run_whose_agent_died_is_told_as_such_by_status_and_report(tmp_path: Path, job: LiveFtrun) -> None:
    """An agent SIGKILLed (a lost machine, an OOM kill): status says the agent is gone and no longer lists its
    ranks as running; report ends the run when the agent was last heard of, not "running to now"."""
    until(showing(lambda: snapshot(str(job.run_dir)), lambda d: d["phase"] == "running"), "the job runs")
    for kind in ("ready", "live"):  # Kubernetes' exec probes, with no port
        assert status(str(job.run_dir), "--probe", kind).returncode == 0
    # it trains (on a busy machine "running" may come before the agent noted the first step)
    until(lambda: any(e["kind"] == "first_step" for e in job.events()), "the agent notes the first step")
    job.proc.kill()
    job.wait()
    assert [status(str(job.run_dir), "--probe", kind).returncode for kind in ("ready", "live")] == [1, 1]
    assert status(str(job.run_dir), "--probe", "live").stdout == "agent gone\n"
    gone = snapshot(str(job.run_dir))
    assert gone["phase"] == "agent gone"
    assert [r["state"] for r in gone["nodes"][0]["ranks"]] == ["unknown (agent gone)"] * 2
    told = subprocess.run(
        [sys.executable, "-m", "ftrun", "report", str(job.run_dir)], capture_output=True, text=True, timeout=WAIT_S
    )
    assert told.returncode == 0, told.stderr
    assert "agent gone (last heard of at " in told.stdout
    assert "to now" not in told.stdout
    assert re.search(r"attempt 0: .*, first step after [\d.]+ s: cut off: its agent died", told.stdout), told.stdout
    assert "no step seen" not in told.stdout  # it trained until its agent died: measured until then
    assert re.search(r"goodput \d+\.\d%: [\d.]+ s training", told.stdout), told.stdout


def test_status_says_what_is_wrong_with_its_input(tmp_path: Path) -> None:
    out = status(str(tmp_path))
    assert out.returncode == 2
    assert "holds no ftrun run" in out.stderr
    out = status("--rdzv-endpoint", "127.0.0.1:1")
    assert out.returncode == 2
    assert "--rdzv-id" in out.stderr
    out = status("--probe", "ready")
    assert out.returncode == 2
    assert "--probe: needs the run's directory" in out.stderr


MULTI = """
import os, sys, time, pathlib
import ftrun
here = pathlib.Path(sys.argv[1])
print(f"up rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']}", flush=True)
step = 0
while not (here / "done").exists():
    ftrun.heartbeat(step=step)
    time.sleep(0.05)
    step += 1
"""


def test_a_multi_node_job_through_its_store_with_a_spare(
    tmp_path: Path, live: list[LiveFtrun], rdzv: list[str]
) -> None:
    (tmp_path / "multi.py").write_text(MULTI)
    run_id = f"{tmp_path.name}-st"
    flags = [*rdzv, "--rdzv-id", run_id, "--local-addr", "127.0.0.1", "--nnodes", "2:2", "--nproc-per-node", "1"]
    agents = [LiveFtrun(tmp_path, *flags, "multi.py", str(tmp_path), name=n, run_id=run_id) for n in "abc"]
    live.extend(agents)
    roles = {a: a.wait_for_stderr(r"round 1: group rank|hot spare") for a in agents}
    members = [a for a, line in roles.items() if "hot spare" not in line]
    for a in members:
        a.wait_for_lines(r"up rank=\d world=2", 1)
    store = ["--rdzv-backend", rdzv[1], "--rdzv-endpoint", rdzv[3], "--rdzv-id", run_id]

    def two_running() -> dict[str, Any] | None:
        d = snapshot(*store)
        ranks = [r for n in d["nodes"] for r in n["ranks"] if r["state"] == "running"]
        return d if len(ranks) == 2 and all(r["heartbeat_age_s"] is not None for r in ranks) else None

    job = until(two_running, "two nodes with a running rank each")
    assert job["world_size"] == 2
    assert job["round"] == 1
    assert len(job["spares"]) == 1
    assert sorted(r["rank"] for n in job["nodes"] for r in n["ranks"]) == [0, 1]
    once = status(*store, "--once")
    assert "spares:" in once.stdout
    assert "round 1" in once.stdout
    (tmp_path / "done").touch()
    for a in agents:
        a.wait()
    ended = snapshot(*store)  # each agent wrote its last record before it exited
    assert [n["phase"] for n in ended["nodes"]] == ["finished"] * 3
    assert {n["outcome"] for n in ended["nodes"] if n["ranks"]} == {"succeeded"}
