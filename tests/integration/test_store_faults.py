"""Store faults with real servers: restarts, dead clients, bad tokens, garbage, many connections."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftrun.errors import StoreAuthError, StoreUnavailable, WatchLost
from ftrun.store import wire
from ftrun.store.base import EventType
from ftrun.store.factory import open_store
from ftrun.store.greeting import OPENING
from ftrun.store.tcp import TcpStoreClient
from ftrun.store.tcp_server import RECONNECT_GRACE_S, TcpStoreServer
from ftrun.testing.etcd import EtcdHarness

WAIT_S = 20.0
TOKEN = "fault-test-token"


@pytest.fixture
def server() -> Iterator[TcpStoreServer]:
    s = TcpStoreServer(token=TOKEN).start()
    yield s
    s.stop()


@pytest.fixture
def client(server: TcpStoreServer) -> Iterator[TcpStoreClient]:
    c = TcpStoreClient("127.0.0.1", server.port, token=TOKEN, retry_deadline_s=10)
    yield c
    c.close()


def test_tcp_server_restart_client_reconnects_and_watch_is_lost(server: TcpStoreServer) -> None:
    c = TcpStoreClient("127.0.0.1", server.port, token=TOKEN, retry_deadline_s=10)
    try:
        c.put("/a", b"1")
        watch = c.watch("/", 0)
        server.stop()
        again = TcpStoreServer(port=server.port, token=TOKEN).start()
        try:
            assert c.get("/a") is None  # reconnected by itself, to a store that restarted empty
            c.put("/b", b"2")
            with pytest.raises(WatchLost, match="restarted"):
                watch.get(WAIT_S)
            watch.close()
        finally:
            again.stop()
    finally:
        c.close()


def test_etcd_restart_watch_resumes_without_losing_events(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ftrun.store")
    with EtcdHarness() as etcd:
        writer, reader = open_store(etcd.url), open_store(etcd.url)
        try:
            r1 = writer.put("/job/a", b"1")
            watch = reader.watch("/job/", r1)
            first = watch.get(WAIT_S)
            assert first is not None
            assert first.revision == r1
            etcd.restart()
            r2 = writer.put("/job/b", b"2")  # while the watch's stream is broken
            r3 = writer.put("/job/c", b"3")
            got = [watch.get(WAIT_S), watch.get(WAIT_S)]
            assert [(e.key, e.revision) for e in got if e] == [("/job/b", r2), ("/job/c", r3)]
            watch.close()
            resumed = [r.getMessage() for r in caplog.records if "resuming in" in r.getMessage()]
            assert resumed, "a broken watch is resumed after a pause, and says so"
            assert "etcd watch on '" in resumed[0]
        finally:
            writer.close()
            reader.close()


KEEPER = """
import sys, threading, time
from ftrun.store.factory import open_store
url, token, ttl = sys.argv[1], sys.argv[2] or None, float(sys.argv[3])
store = open_store(url, token=token)
lease = store.grant_lease(ttl)
store.put("/alive/me", b"x", lease=lease)
print("ready", flush=True)
while True:
    store.keep_alive(lease)
    time.sleep(0.5)
"""


def _kill_keeper_and_see_its_key_vanish(url: str, token: str | None, ttl_s: float = 2.0) -> None:
    observer = open_store(url, token=token)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KEEPER), url, token or "", str(ttl_s)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        kvs, revision = observer.list_prefix("/alive/")
        assert [kv.key for kv in kvs] == ["/alive/me"]
        with observer.watch("/alive/", revision + 1) as watch:
            proc.send_signal(signal.SIGKILL)
            proc.wait(WAIT_S)
            event = watch.get(WAIT_S)
        assert event is not None
        assert (event.type, event.key) == (EventType.DELETE, "/alive/me")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
        assert proc.stdout is not None
        proc.stdout.close()
        observer.close()


def test_killed_client_lease_expires_tcp(server: TcpStoreServer) -> None:
    _kill_keeper_and_see_its_key_vanish(f"tcp://127.0.0.1:{server.port}", TOKEN)


def test_a_killed_clients_lease_ends_with_its_connection_not_its_ttl_tcp(server: TcpStoreServer) -> None:
    """The embedded store ties a lease to the connection it was granted or kept alive on: the kernel closes a
    dead process's socket, so its keys go at once (a TTL of 10 min could not have expired within the wait)."""
    _kill_keeper_and_see_its_key_vanish(f"tcp://127.0.0.1:{server.port}", TOKEN, ttl_s=600)


def _reset(port: int) -> None:
    """Reset every TCP connection to the store's port from the client side (``ss -K``, as a middlebox would)."""
    subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{port}"], capture_output=True, timeout=10)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ss") is None, reason="ss -K needs root and iproute2")
def test_a_reset_connection_is_not_a_dead_node(server: TcpStoreServer, client: TcpStoreClient) -> None:
    """A client whose connection is reset connects again at once and keeps its lease and keys (the store waits
    RECONNECT_GRACE_S for it), and says so; a dead client's keys still go with its connection (test above)."""
    told: list[str] = []
    client.on_reconnect = told.append
    lease = client.grant_lease(600.0)  # a TTL that cannot expire within the test: only the connection matters
    client.put("/alive/me", b"x", lease=lease)
    observer = TcpStoreClient("127.0.0.1", server.port, token=TOKEN, retry_deadline_s=10)
    try:
        _, revision = observer.list_prefix("/alive/")
        with client.watch("/", revision + 1), observer.watch("/alive/", revision + 1) as seen:
            _reset(server.port)
            until_reconnected = time.monotonic() + WAIT_S
            while not told and time.monotonic() < until_reconnected:
                client.get("/alive/me")  # a call finds the connection gone (the watch's reader may be first)
            assert told, "the client never said it connected again"
            assert "broke" in told[0]
            assert seen.get(2 * RECONNECT_GRACE_S + 1.0) is None  # no DELETE: the grace passed, the lease held
        assert observer.get("/alive/me") is not None
        client.keep_alive(lease)
    finally:
        observer.close()


def test_killed_client_lease_expires_etcd() -> None:
    with EtcdHarness() as etcd:
        _kill_keeper_and_see_its_key_vanish(etcd.url, None)


def test_wrong_or_missing_token_is_refused(server: TcpStoreServer, client: TcpStoreClient) -> None:
    for token in ("wrong", None):
        bad = TcpStoreClient("127.0.0.1", server.port, token=token, retry_deadline_s=2)
        with pytest.raises(StoreAuthError):
            bad.get("/x")
        bad.close()
    client.put("/still", b"serving")
    assert client.get("/still") is not None


def test_a_client_with_a_token_never_talks_to_a_store_that_cannot_prove_it() -> None:
    """No downgrade: a squatter that holds the endpoint with a store of its own (no token) is refused before any
    request reaches it."""
    squatter = TcpStoreServer().start()
    try:
        c = TcpStoreClient("127.0.0.1", squatter.port, token=TOKEN, retry_deadline_s=2)
        with pytest.raises(StoreAuthError, match="does not ask for the token"):
            c.put("/ftrun/job/n/me", b"my address")
        c.close()
        watcher = TcpStoreClient("127.0.0.1", squatter.port)
        assert watcher.list_prefix("/")[0] == []  # nothing was written there
        watcher.close()
    finally:
        squatter.stop()


def test_a_fake_store_that_asks_for_a_token_but_cannot_prove_it_is_refused() -> None:
    """A squatter that claims to want a token (to be sent a proof) still has to prove the token itself."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        c = TcpStoreClient("127.0.0.1", port, token=TOKEN, retry_deadline_s=2)

        def fake() -> list[bytes]:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(wire.encode({"v": wire.VERSION, "store_id": "fake", "nonce": b"n" * 16, "auth": True}))
                assert wire.read_exactly(conn, len(OPENING)) == OPENING
                wire.read_frame(conn)  # the client's nonce and proof
                conn.sendall(wire.encode({"ok": True, "proof": b"\0" * 32}))
                conn.settimeout(2)
                try:
                    return [conn.recv(65536)]
                except OSError:
                    return []

        with ThreadPoolExecutor(1) as pool:
            heard = pool.submit(fake)
            with pytest.raises(StoreAuthError, match="could not prove"):
                c.get("/x")
            c.close()
            assert heard.result(timeout=WAIT_S) in ([], [b""])  # no request followed the handshake


def test_unreachable_store_names_endpoint_and_time() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        c = TcpStoreClient("127.0.0.1", port, retry_deadline_s=0.5)
        with pytest.raises(StoreUnavailable, match=rf"tcp://127.0.0.1:{port} unavailable after") as caught:
            c.get("/x")
    assert caught.value.waited_s >= 0.5  # it kept trying until its deadline (how much longer is the machine's)


def _raw_exchange(port: int, payload: bytes) -> None:
    """Send ``payload`` on a fresh connection and read whatever comes back until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except OSError:
            pass  # the server may reset a connection it refuses


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(max_size=512))
def test_garbage_frames_never_hurt_the_server(server: TcpStoreServer, client: TcpStoreClient, junk: bytes) -> None:
    _raw_exchange(server.port, junk)
    _raw_exchange(server.port, wire.HEADER.pack(len(junk)) + junk)
    _raw_exchange(server.port, OPENING + wire.HEADER.pack(len(junk)) + junk)  # past the opening, to the handshake
    assert client.put("/alive", junk[:16]) > 0


def test_oversized_and_malformed_frames_after_auth(server: TcpStoreServer, client: TcpStoreClient) -> None:
    unauth = TcpStoreServer().start()  # no token: the frames below reach the request parser
    try:
        _raw_exchange(unauth.port, OPENING + wire.HEADER.pack(wire.MAX_FRAME + 1))
        hello_reply = OPENING + wire.encode({"nonce": b"0" * wire.NONCE_BYTES})
        for body in (b"\xc1", wire.encode({"id": "x", "op": 1})[4:], wire.encode({"id": 1, "op": "get"})[4:]):
            _raw_exchange(unauth.port, hello_reply + wire.HEADER.pack(len(body)) + body)
        good = TcpStoreClient("127.0.0.1", unauth.port)
        assert good.put("/ok", b"1") > 0
        good.close()
    finally:
        unauth.stop()
    assert client.get("/nothing") is None


def test_a_thousand_concurrent_connections(server: TcpStoreServer) -> None:
    async def one(i: int) -> object:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(OPENING)
            hello = wire.decode(await reader.readexactly(wire.frame_length(await reader.readexactly(4))))
            mine = wire.new_nonce()
            writer.write(wire.encode({"nonce": mine, "proof": wire.proof(TOKEN, b"client", hello["nonce"], mine)}))
            verdict = wire.decode(await reader.readexactly(wire.frame_length(await reader.readexactly(4))))
            assert verdict["ok"]
            writer.write(wire.encode({"id": 1, "op": "add", "key": "/count", "delta": 1}))
            answer = wire.decode(await reader.readexactly(wire.frame_length(await reader.readexactly(4))))
            return answer["r"]
        finally:
            writer.close()

    async def all_at_once() -> list[object]:
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(1000))), 120)

    results = asyncio.run(all_at_once())
    assert sorted(results) == list(range(1, 1001))  # type: ignore[type-var]


def test_a_crash_of_the_store_server_after_start_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    server = TcpStoreServer()

    async def broken() -> None:
        assert server._server is not None
        server._server.close()
        raise RuntimeError("something inside the store went wrong")

    server._wait_stopped = broken  # type: ignore[method-assign]
    server.start()  # it bound its port: start() succeeds; then the serving part fails
    assert server._thread is not None
    server._thread.join(WAIT_S)
    assert isinstance(server.crashed, RuntimeError)
    err = capsys.readouterr().err
    assert f"the embedded store on 127.0.0.1:{server.port} crashed" in err
    assert "something inside the store went wrong" in err


def test_watches_per_connection_are_bounded(client: TcpStoreClient) -> None:
    from ftrun.errors import StoreRequestError
    from ftrun.store.tcp_server import MAX_WATCHES

    watches = [client.watch(f"/w{i}/", 0) for i in range(MAX_WATCHES)]
    with pytest.raises(StoreRequestError, match=f"at most {MAX_WATCHES} watches"):
        client.watch("/one-too-many/", 0)
    for w in watches:
        w.close()
    client.watch("/after/", 0).close()  # closing watches gives the room back


def test_etcd_user_and_password(tmp_path: pytest.TempPathFactory) -> None:
    import etcd3gw

    with EtcdHarness() as etcd:
        admin = etcd3gw.client(host="127.0.0.1", port=etcd.client_port, api_path="/v3/")
        admin.post(admin.get_url("/auth/user/add"), json={"name": "root", "password": "rootpw"})
        admin.post(admin.get_url("/auth/user/grant"), json={"user": "root", "role": "root"})
        admin.post(admin.get_url("/auth/enable"), json={})
        password_file = f"{tmp_path}/pw"
        with open(password_file, "w") as f:
            f.write("rootpw\n")
        good = open_store(f"{etcd.url}/jobs?user=root&password_file={password_file}")
        assert good.put("/k", b"v") > 0
        kv = good.get("/k")
        assert kv is not None
        assert kv.value == b"v"
        good.close()
        bad = open_store(f"etcd://root:wrong@127.0.0.1:{etcd.client_port}", retry_deadline_s=2)
        with pytest.raises(StoreAuthError, match="root"):
            bad.get("/k")
        bad.close()


def test_etcd_over_tls_with_client_certificates() -> None:
    from ftrun.errors import StoreError

    with EtcdHarness(tls=True) as etcd:
        store = open_store(etcd.url)
        assert store.put("/tls", b"secret") > 0
        with store.watch("/tls", 0) as watch:
            store.put("/tls", b"again")
            event = watch.get(WAIT_S)
        assert event is not None
        assert event.value == b"again"
        store.close()
        ca = etcd.certs["ca.crt"]
        no_client_cert = open_store(f"etcds://127.0.0.1:{etcd.client_port}?cacert={ca}", retry_deadline_s=2)
        with pytest.raises(StoreError):
            no_client_cert.get("/tls")
        no_client_cert.close()


def test_a_wait_for_another_nodes_record_ends_when_a_signal_to_ftrun_comes(client: TcpStoreClient) -> None:
    """The board's cross-check waits up to 5 s for another node's verdict; a signal to ftrun ends it (the
    agent then acts on the signal) instead of being left until the wait is over."""
    from ftrun.clock import SystemClock
    from ftrun.job.board import JobBoard

    board = JobBoard(client, "run", "node-a", SystemClock())
    looks = []

    def interrupted() -> bool:
        looks.append(True)
        return len(looks) >= 3  # a signal came during the third look

    board.interrupted = interrupted
    assert board.suspect_elsewhere(1, timeout_s=600) is None  # nobody ever publishes: only the signal ends it
    assert len(looks) == 3


def test_an_agent_with_a_token_refuses_a_squatter_on_its_endpoint(tmp_path: Path) -> None:
    """The endpoint is taken by a store without the token (say, a squatter's): the agent says so and stops,
    before its worker could run with a master address the squatter chose."""
    (tmp_path / "w.py").write_text("print('worker ran')\n")
    squatter = TcpStoreServer().start()
    try:
        argv = [sys.executable, "-m", "ftrun", "--log-dir", str(tmp_path / "logs"), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{squatter.port}", "--rdzv-id", "squat", "--nnodes", "1:2",
                "--rdzv-token", TOKEN, str(tmp_path / "w.py")]  # fmt: skip
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    finally:
        squatter.stop()
    assert r.returncode == 1, r.stderr
    assert "does not ask for the token" in r.stderr
    assert "worker ran" not in r.stdout


@pytest.mark.parametrize(("endpoint", "token", "warned"), [("0.0.0.0:0", None, True), ("0.0.0.0:0", TOKEN, False),
                                                           ("127.0.0.1:0", None, False)])  # fmt: skip
def test_hosting_a_store_beyond_loopback_without_a_token_is_said_once(
    tmp_path: Path, endpoint: str, token: str | None, warned: bool
) -> None:
    (tmp_path / "w.py").write_text("print('worker ran')\n")
    argv = [sys.executable, "-m", "ftrun", "--log-dir", str(tmp_path / "logs"), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "open", "--nnodes", "1", str(tmp_path / "w.py")]  # fmt: skip
    r = subprocess.run([*argv[:-1], *(["--rdzv-token", token] if token else []), argv[-1]],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("has no token") == (1 if warned else 0), r.stderr
    if warned:
        assert "--rdzv-token-file" in r.stderr
