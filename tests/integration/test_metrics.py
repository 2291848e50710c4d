"""``--metrics-port``: /metrics scraped with a real HTTP client while a job crashes, hangs and recovers."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import WAIT_S, LiveFtrun, PortTaken, run_ftrun, with_free_port

# Attempt 0: rank 1 crashes once the test says so; attempt 1: rank 1 stops beating (a hang) when told;
# attempt 2 runs until the test says done.
JOB = """
import os, sys, time, pathlib
import ftrun
rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
here = pathlib.Path(sys.argv[1])
print(f"up rank={rank} restart={restart}", flush=True)
beaten = False
while not (here / "done").exists():
    if rank == 1 and restart == 0 and (here / "crash").exists():
        sys.exit(3)
    if rank == 1 and restart == 1 and (here / "hang").exists():
        time.sleep(600)
    ftrun.heartbeat()
    if not beaten:
        print(f"beating rank={rank} restart={restart}", flush=True)
        beaten = True
    time.sleep(0.05)
"""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample of ``name`` with ``labels`` (and this job's run id and node: this machine's name)."""
    want = {"run_id": "t", "node": socket.gethostname(), **labels}
    return samples.get((name, tuple(sorted(want.items()))))


def until(port: int, wanted: Callable[[Samples], bool], what: str) -> Samples:
    """Scrape until ``wanted`` holds (Prometheus polls; so does this test), at most WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        samples = scrape(port)
        if wanted(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen in {WAIT_S} s; last scrape: {samples}")
        time.sleep(0.1)


def test_metrics_follow_a_crash_and_a_hang(tmp_path: Path, live: list[LiveFtrun]) -> None:
    (tmp_path / "job.py").write_text(JOB)

    def start(port: int) -> tuple[LiveFtrun, int]:
        agent = LiveFtrun(
            tmp_path, "--metrics-port", f"127.0.0.1:{port}", "--nproc-per-node", "2", "--max-restarts", "3",
            "--heartbeat-timeout", "2", "job.py", str(tmp_path),
        )  # fmt: skip
        live.append(agent)
        try:
            agent.wait_for_stderr(r"Prometheus metrics at|cannot serve metrics")
        finally:
            if "cannot serve metrics" in agent.stderr():
                raise PortTaken(agent.stderr())
        return agent, port

    agent, port = with_free_port(start)
    agent.wait_for_lines(r"up rank=\d restart=0", 2)
    first = until(port, lambda s: value(s, "ftrun_workers_running") == 2, "two workers running")
    assert value(first, "ftrun_restarts_total") == 0
    assert value(first, "ftrun_hangs_total") == 0
    assert value(first, "ftrun_world_size") == 2
    for path, said in (("/readyz", "running"), ("/livez", "alive"), ("/healthz", "alive")):  # ready: workers run
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            assert (reply.status, reply.read().decode()) == (200, f"{said}\n")
    until(port, lambda s: value(s, "ftrun_heartbeat_age_seconds", rank="1") is not None, "rank 1's heartbeat age")

    (tmp_path / "crash").touch()
    agent.wait_for_lines(r"up rank=\d restart=1", 2)
    crashed = until(
        port, lambda s: value(s, "ftrun_restarts_total") == 1 and value(s, "ftrun_workers_running") == 2, "restart"
    )
    assert value(crashed, "ftrun_attempt") == 1
    assert (value(crashed, "ftrun_downtime_seconds_total") or 0) > 0

    # Rank 1 must have beaten in this attempt before it hangs: an age exists only after a first beat.
    agent.wait_for_lines(r"beating rank=1 restart=1", 1)
    (tmp_path / "hang").touch()
    stale = until(
        port, lambda s: (value(s, "ftrun_heartbeat_age_seconds", rank="1") or 0) > 1.0, "rank 1's age growing"
    )
    assert (value(stale, "ftrun_heartbeat_age_seconds", rank="0") or 0) < 1.0  # rank 0 still beats
    hung = until(port, lambda s: value(s, "ftrun_hangs_total") == 1, "the hang")
    assert value(hung, "ftrun_restarts_total") in (1, 2)
    until(port, lambda s: value(s, "ftrun_restarts_total") == 2 and value(s, "ftrun_workers_running") == 2, "back")
    (tmp_path / "done").touch()
    assert agent.wait() == 0, agent.stderr()


def test_a_port_that_cannot_be_served_fails_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "w.py").write_text("print('ran')\n")
        r = run_ftrun(tmp_path, "--metrics-port", f"127.0.0.1:{port}", "w.py")
    assert r.returncode == 2  # bad input, as the README says
    assert f"--metrics-port: cannot serve metrics on 127.0.0.1:{port}" in r.stderr
    assert "ran" not in r.stdout
    assert not (tmp_path / "logs").exists()  # no run started: no logs, no workers
    bad = run_ftrun(tmp_path, "--metrics-port", "70000", "w.py")
    assert bad.returncode == 2
    assert "--metrics-port: 70000 is not a TCP port" in bad.stderr
