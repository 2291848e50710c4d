"""The embedded store served by the agent (c10d-style) and by `ftrun store`."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftrun.errors import StoreProtocolError
from ftrun.store.tcp import TcpStoreClient
from tests.integration.harness import (
    CONF,
    WAIT_S,
    LiveFtrun,
    PortTaken,
    Result,
    WriteScript,
    run_ftrun,
    with_free_port,
    write_gate,
)

USES_STORE = """
import os, sys
from ftrun.store.factory import open_store
store = open_store(sys.argv[1], token=open(sys.argv[2]).read().strip())
store.add("/ranks-seen", 1)
print("rank", os.environ["RANK"], "saw the store", flush=True)
"""


def test_agent_hosts_the_store_when_the_endpoint_is_local(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", USES_STORE)
    (tmp_path / "token").write_text("s3cret\n")

    def attempt(port: int) -> tuple[Result, int]:
        r = run_ftrun(
            tmp_path, "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-token-file", "token", "w.py", f"tcp://127.0.0.1:{port}", "token",
        )  # fmt: skip
        if "cannot host the store" in r.stderr:
            shutil.rmtree(r.run_dir)  # the next try's logs go where the Result looks
            raise PortTaken(r.stderr)
        return r, port

    r, port = with_free_port(attempt)
    assert r.returncode == 0, r.stderr
    assert f"hosting the rendezvous store on 127.0.0.1:{port}" in r.stderr
    assert sorted(r.stdout.splitlines()) == ["rank 0 saw the store", "rank 1 saw the store"]
    assert any(e["kind"] == "store_hosted" for e in r.events())


def test_ftrun_store_command(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftrun", "store", "--port", "0", "--token-file", str(tmp_path / "token")],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        found = re.search(r"serving on 127\.0\.0\.1:(\d+)", line)
        assert found, line
        client = TcpStoreClient("127.0.0.1", int(found.group(1)), token="tok")
        assert client.put("/x", b"1") > 0
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        assert proc.stderr is not None
        proc.stderr.close()


WAITS_FOR_GATE = """
import os, sys
print(os.environ["TORCHELASTIC_RUN_ID"], "waiting", flush=True)
open(sys.argv[1]).read()
print(os.environ["TORCHELASTIC_RUN_ID"], "done", flush=True)
"""


def test_two_jobs_share_an_endpoint_and_the_hosts_agent_serves_on_until_the_other_ends(
    tmp_path: Path, script: WriteScript, live: list[LiveFtrun]
) -> None:
    """Job A's agent hosts the store, job B joins it on the same endpoint: both are told at the start, and when
    A ends first its agent keeps serving B's store until B ends (before, B lost its store with A's agent)."""
    script("w.py", WAITS_FOR_GATE)
    for job in "ab":
        os.mkfifo(tmp_path / f"gate-{job}")

    def start(job: str, port: int) -> LiveFtrun:
        agent = LiveFtrun(
            tmp_path, "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-conf", CONF, "w.py", f"gate-{job}", name=job, run_id=job,
        )  # fmt: skip
        live.append(agent)
        return agent

    def host_a(port: int) -> tuple[LiveFtrun, int]:
        a = start("a", port)
        line = a.wait_for_stderr("hosting the rendezvous store|cannot host the store")
        if "cannot host" in line:
            raise PortTaken(line)
        return a, port

    a, port = with_free_port(host_a)
    a.wait_for_lines("a waiting", 1)
    b = start("b", port)
    assert "this job shares it" in b.wait_for_stderr(f"the store on 127.0.0.1:{port} belongs to job 'a'")
    b.wait_for_lines("b waiting", 1)
    a.wait_for_stderr(r"job 'b' \(from 127\.0\.0\.1:\d+\) uses the store this agent hosts too")

    write_gate(tmp_path / "gate-a", "go")
    a.wait_for_stderr(r"job\(s\) 'b' still use the store this agent hosts")
    assert a.proc.poll() is None, "A's agent left while B still used its store"

    write_gate(tmp_path / "gate-b", "go")
    assert b.wait() == 0, b.stderr()
    assert a.wait() == 0, a.stderr()
    assert "b done" in b.lines
    assert "the other jobs left the store" in a.stderr()


@pytest.fixture
def web_server() -> Iterator[tuple[int, int]]:
    """A real web server on a free loopback port: (its port, its pid)."""
    web = subprocess.Popen(
        [sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert web.stdout is not None
        served = re.search(r"port (\d+)", web.stdout.readline())
        assert served, "http.server did not say its port"
        yield int(served.group(1)), web.pid
    finally:
        web.terminate()
        web.wait(WAIT_S)
        assert web.stdout is not None
        web.stdout.close()


def test_a_port_held_by_something_else_is_named_at_once(
    tmp_path: Path, script: WriteScript, web_server: tuple[int, int]
) -> None:
    """A web server, or a listener that never speaks, on the endpoint's port here: named with its process, exit
    2, before any handshake would have timed out (15 s)."""
    script("w.py", "print('never runs')\n")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        for port, what, holder in (
            (web_server[0], "answered '<!DOCTYPE HTML>", web_server[1]),
            (silent.getsockname()[1], "said nothing", os.getpid()),
        ):
            r = run_ftrun(
                tmp_path, "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "w.py", timeout=12,
            )  # fmt: skip
            assert r.returncode == 2, r.stderr
            assert what in r.stderr
            assert f"the port is held by process {holder} (" in r.stderr
            assert "never runs" not in r.stdout


def test_a_client_names_a_web_server_on_the_stores_endpoint_without_retrying(web_server: tuple[int, int]) -> None:
    """Elsewhere (another node's view of the endpoint) the client's opening line has a web server answer at once."""
    client = TcpStoreClient("127.0.0.1", web_server[0], retry_deadline_s=WAIT_S)
    with pytest.raises(StoreProtocolError, match="is not an ftrun store: it answered '<!DOCTYPE HTML>"):
        client.get("/x")  # not retried: retries would end as StoreUnavailable, a minute later
    client.close()
