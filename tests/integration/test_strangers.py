"""Strangers on the network cannot take a job down: every port an agent listens on (the embedded store, the
liveness listener, the metrics and probes) is opened many times over by connections that never speak, more than
the agent may open files, or sent malformed input; then a worker is SIGKILLed: the agent lives, restarts it, and
says each flood once."""

from __future__ import annotations

import contextlib
import random
import re
import resource
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ftrun.rendezvous.liveness import GREETING, Liveness
from tests.integration.harness import CONF, WAIT_S, LiveFtrun, ftrun_argv

JOB = """
import os, sys, time, pathlib
here = pathlib.Path(sys.argv[1])
rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"up rank={rank} restart={restart}", flush=True)
while not (here / "done").exists():
    if rank == 1 and restart == 0 and (here / "crash").exists():
        os.kill(os.getpid(), 9)
    time.sleep(0.05)
"""
AGENT_FILES = 1024  # the agent's limit on open files, soft and hard: a flood of more must not reach it
FLOOD = 1200  # idle connections to each port


@pytest.fixture
def held() -> Iterator[list[socket.socket]]:
    """The strangers' connections, closed at the end; this test process may open enough of them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    conns: list[socket.socket] = []
    try:
        yield conns
    finally:
        for c in conns:
            c.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def listening(pid: int) -> list[int]:
    return sorted({c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN})


def flood(port: int, count: int, into: list[socket.socket]) -> None:
    """Open ``count`` connections to ``port`` that never speak, all at once (none waits for the others)."""
    for _ in range(count):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(OSError):
            s.connect_ex(("127.0.0.1", port))
        into.append(s)


def training(tmp_path: Path, live: list[LiveFtrun]) -> LiveFtrun:
    """An agent hosting the job's store, with its liveness listener and its metrics, its 2 workers up."""
    (tmp_path / "job.py").write_text(JOB)
    agent = LiveFtrun(
        tmp_path, "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-conf", CONF,
        "--metrics-port", "127.0.0.1:0", "--nproc-per-node", "2", "--max-restarts", "2", "job.py", str(tmp_path),
    )  # fmt: skip
    live.append(agent)
    agent.wait_for_lines(r"up rank=\d restart=0", 2)
    return agent


def test_idle_strangers_at_every_port_cannot_take_the_agent_down(
    tmp_path: Path, live: list[LiveFtrun], held: list[socket.socket]
) -> None:
    agent = training(tmp_path, live)
    psutil.Process(agent.proc.pid).rlimit(psutil.RLIMIT_NOFILE, (AGENT_FILES, AGENT_FILES))
    ports = listening(agent.proc.pid)
    assert len(ports) >= 3, ports  # the store, the liveness listener, the metrics and probes
    for port in ports:
        flood(port, FLOOD, held)
    time.sleep(2)  # the kernel completes their handshakes; the agent accepts what it will
    assert len(held) > AGENT_FILES  # more than the agent could ever hold
    (tmp_path / "crash").touch()
    agent.wait_for_lines(r"up rank=\d restart=1", 2)  # restarted: spawned, pipes and logs opened, reported
    (tmp_path / "done").touch()
    assert agent.wait(WAIT_S) == 0, agent.stderr()
    said = agent.stderr()
    assert "Too many open files" not in said
    refusals = re.findall(r"ftrun: (.+) on port (\d+): refusing connections", said)
    assert {what for what, _ in refusals} >= {"the store", "the liveness listener", "the metrics and probes"}, said
    told = [int(port) for _, port in refusals]
    assert len(told) == len(set(told)), said  # each flood said once, not per connection
    assert set(told) <= set(ports)


@pytest.mark.slow
def test_two_agents_flooded_at_every_port_both_live_and_train_again_together(
    tmp_path: Path, live: list[LiveFtrun], held: list[socket.socket], own_tcp_server: str
) -> None:
    """Two agents (one rank each) and their store, every port of each flooded past the agents' file limit
    (liveness listener, snapshot copies' server, metrics and probes, the store); then rank 1 is SIGKILLed:
    both agents live, and both ranks are up again in the round after, world 2."""
    (tmp_path / "job.py").write_text(JOB)
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", own_tcp_server, "--rdzv-conf", f"{CONF},is_host=false"]
    flags += ["--local-addr", "127.0.0.1", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2"]
    flags += ["--metrics-port", "127.0.0.1:0", "job.py", str(tmp_path)]
    agents = [LiveFtrun(tmp_path, *flags, name=n, run_id="flooded") for n in ("a", "b")]
    live.extend(agents)
    for agent in agents:
        agent.wait_for_lines(r"up rank=\d restart=0", 1)
    ports = {int(own_tcp_server.rsplit(":", 1)[1])}
    for agent in agents:
        psutil.Process(agent.proc.pid).rlimit(psutil.RLIMIT_NOFILE, (AGENT_FILES, AGENT_FILES))
        mine = listening(agent.proc.pid)
        assert len(mine) >= 3, mine  # the liveness listener, the snapshot copies' server, the metrics and probes
        ports |= set(mine)
    for port in sorted(ports):
        flood(port, FLOOD, held)
    time.sleep(2)  # the kernel completes their handshakes; the agents accept what they will
    crashed = time.monotonic()
    (tmp_path / "crash").touch()
    for agent in agents:
        agent.wait_for_lines(r"up rank=\d restart=1", 1)  # the round after: spawned, piped, logged, reported
    print(f"both ranks up again {time.monotonic() - crashed:.2f} s after the crash, every port flooded")
    (tmp_path / "done").touch()
    for agent in agents:
        assert agent.wait(WAIT_S) == 0, agent.stderr()
        said = agent.stderr()
        assert "Too many open files" not in said
        assert "Traceback" not in said
        told = [int(port) for _, port in re.findall(r"ftrun: (.+) on port (\d+): refusing connections", said)]
        assert len(told) == len(set(told)), said  # each flood said once, not per connection


# Starts an agent as a node with a high file limit does: its soft limit at MANY_FILES, and IDLE descriptors of
# its own, held idle from the start, so that every descriptor it opens after (pipes, pidfds, sockets, logs) is
# numbered past select()'s 1,024.
HOLDING = """
import os, resource, sys
files, idle = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
for fd in [os.open(os.devnull, os.O_RDONLY) for _ in range(idle)]:
    os.set_inheritable(fd, True)
os.execv(sys.argv[3], sys.argv[3:])
"""
MANY_FILES, IDLE = 65_536, 1_100


@pytest.mark.slow
def test_two_agents_whose_descriptors_pass_1024_both_live_a_crash_and_train_again(
    tmp_path: Path, live: list[LiveFtrun], held: list[socket.socket], own_tcp_server: str
) -> None:
    """Two agents at a soft file limit of 65,536 (or the hard limit, where lower), as clusters set it: each
    holds more than 1,024 descriptors (idle files of its own from its start, and strangers at its ports, which
    that limit lets it accept); rank 1 is SIGKILLed: both agents live, and both ranks train again in the round
    after (select() takes no descriptor past 1,024: both agents died of it in the warm pool once)."""
    files = min(MANY_FILES, resource.getrlimit(resource.RLIMIT_NOFILE)[1])  # a container may cap it (20,000)
    if files < 4 * IDLE:
        pytest.skip(f"this machine's hard file limit ({files}) leaves no room past 1,024")
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "holding.py").write_text(HOLDING)
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", own_tcp_server, "--rdzv-conf", f"{CONF},is_host=false"]
    flags += ["--local-addr", "127.0.0.1", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2"]
    flags += ["--metrics-port", "127.0.0.1:0", "job.py", str(tmp_path)]
    wrapper = [sys.executable, str(tmp_path / "holding.py"), str(files), str(IDLE)]
    agents = [LiveFtrun(tmp_path, *flags, name=n, run_id="many-files", wrapper=wrapper) for n in ("a", "b")]
    live.extend(agents)
    for agent in agents:
        agent.wait_for_lines(r"up rank=\d restart=0", 1)
    for agent in agents:
        for port in listening(agent.proc.pid):
            flood(port, FLOOD, held)
    time.sleep(2)  # the kernel completes their handshakes; the agents accept what they will
    for agent in agents:
        me = psutil.Process(agent.proc.pid)
        assert me.rlimit(psutil.RLIMIT_NOFILE)[0] == files
        assert me.num_fds() > IDLE + FLOOD // 2, me.num_fds()  # its own idle files and the strangers it took
    (tmp_path / "crash").touch()
    for agent in agents:
        agent.wait_for_lines(r"up rank=\d restart=1", 1)  # the round after: spawned, piped, logged, reported
    (tmp_path / "done").touch()
    for agent in agents:
        assert agent.wait(WAIT_S) == 0, agent.stderr()
        said = agent.stderr()
        assert "out of range" not in said, said
        assert "Traceback" not in said, said


def test_the_agent_raises_its_file_limit_and_the_job_keeps_the_one_it_was_given(tmp_path: Path) -> None:
    """Room for strangers and its own work in the agent; the job runs under the limits it was given, as under
    torchrun (warm workers too: their zygote gets the given limits)."""
    (tmp_path / "w.py").write_text(
        "import resource\nprint('files', *resource.getrlimit(resource.RLIMIT_NOFILE), flush=True)\n"
    )
    argv = ftrun_argv(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py")
    r = subprocess.run(
        ["prlimit", "--nofile=1024:4096", "--", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=WAIT_S
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("files 1024 4096") == 2, r.stdout


def malformed() -> list[bytes]:
    """What strangers send: noise, a frame that claims 4 GiB, a cut header, a line with no end, HTTP garbage."""
    noise = bytes(random.Random(7).getrandbits(8) for _ in range(4096))
    return [
        noise,
        b"ftrun\n" + struct.pack(">I", 0xFFFFFFFF) + b"x" * 64,
        b"\x00\x00",
        b"{" * (1 << 20),
        b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n",
        b"POST /metrics HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n" + noise,
        b"ftrun liveness 1\n",  # the greeting alone, as it once sufficed
        b"ftrun liveness 2\n" + bytes(32),  # a forged proof of the job's key
    ]


def test_malformed_input_at_every_port_ends_and_steers_nothing(tmp_path: Path, live: list[LiveFtrun]) -> None:
    """Each port gets every malformed input, on a connection of its own, some sent a byte at a time; then a
    worker is SIGKILLed: the agent restarts it and the job finishes, its memory not grown by what it was sent."""
    agent = training(tmp_path, live)
    me = psutil.Process(agent.proc.pid)
    before = me.memory_info().rss
    for port in listening(agent.proc.pid):
        for i, data in enumerate(malformed()):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                if i % 3 == 0:  # slowly: a byte at a time, for a while
                    for b in data[:20]:
                        s.sendall(bytes([b]))
                        time.sleep(0.02)
                s.sendall(data)
                s.settimeout(0.5)
                with contextlib.suppress(OSError):
                    s.recv(65536)
    assert me.memory_info().rss - before < 64 << 20  # nothing it was sent is kept
    (tmp_path / "crash").touch()
    agent.wait_for_lines(r"up rank=\d restart=1", 2)
    (tmp_path / "done").touch()
    assert agent.wait(WAIT_S) == 0, agent.stderr()
    assert "Traceback" not in agent.stderr()


def test_the_liveness_listener_holds_only_connections_that_prove_the_jobs_key() -> None:
    """A stranger who knows the greeting but not the job's key is closed; an agent of the job is held, and
    the end of the connection tells the watcher the listener's agent is gone."""
    listener = Liveness(b"the job's key").start("127.0.0.1")
    watcher = Liveness(b"the job's key").start("127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", listener.port), timeout=WAIT_S) as stranger:
            nonce = stranger.recv(16)
            assert len(nonce) == 16
            stranger.sendall(GREETING + bytes(32))
            assert stranger.recv(1) == b""  # closed: a forged proof
        watcher.watch({"node-a": ("127.0.0.1", listener.port)})
        time.sleep(0.5)  # held, not gone (a proof the listener refused would end it at once)
        assert watcher.gone() == set()
        listener.close()  # its agent dies: the connection ends
        deadline = time.monotonic() + WAIT_S
        while not (gone := watcher.gone()):
            assert time.monotonic() < deadline, "the watcher never saw its peer's end"
            time.sleep(0.05)
        assert gone == {"node-a"}
    finally:
        watcher.close()
        listener.close()
