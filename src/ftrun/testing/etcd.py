"""A real etcd for tests: Debian's ``etcd`` on free loopback ports with a temporary data dir.

Readiness is awaited on etcd's own log line, not by sleeping. ``restart()``
keeps the data dir (history survives, as in production); ``stop()`` is
bounded and escalates to SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from ftrun.node.ports import reserve_port
from ftrun.procs.proctree import die_with_parent_hook

READY_TEXT = b"ready to serve client requests"


START_TRIES = 3  # a port chosen free may be taken before etcd binds it: then new ports, again


def _free_port() -> int:
    """Free now, and kept off by every ftrun on this machine for a while (the shared port ledger)."""
    return reserve_port("127.0.0.1", time.time())


def make_certificates(directory: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate (openssl CLI)."""
    d = directory
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("openssl not found: install Debian's openssl to test etcd over TLS")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=ftrun-test-ca")
    # etcd 3.4's own HTTP gateway dials its gRPC port with the server certificate: it must allow clientAuth too.
    for name, usage in (("server", "serverAuth,clientAuth"), ("client", "clientAuth")):
        (d / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=ftrun-test-{name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")  # fmt: skip
    return {n: d / n for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


class EtcdHarness:
    """Debian's etcd on loopback. With ``tls=True`` it serves https and requires client certificates."""

    def __init__(
        self, binary: str = "etcd", start_timeout_s: float = 30.0, *, tls: bool = False, name: str = "ftrun-test"
    ) -> None:
        """``name``: this member's, in a cluster (:class:`EtcdCluster` sets ``initial_cluster``)."""
        self.name = name
        self.initial_cluster = ""  # NAME=PEER_URL,...: a member of a cluster; "" alone
        found = shutil.which(binary)
        if found is None:
            raise FileNotFoundError(
                f"{binary!r} not found: install Debian's etcd-server (scripts/test does: apt-get install etcd-server)"
            )
        self._binary = found
        self._timeout = start_timeout_s
        self.data_dir = Path(tempfile.mkdtemp(prefix="ftrun-etcd-"))
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._drain: threading.Thread | None = None
        self.log = b""
        self.certs = make_certificates(Path(tempfile.mkdtemp(prefix="ftrun-etcd-certs-"))) if tls else {}

    @property
    def pid(self) -> int:
        """The etcd server's process id (a benchmark measures its CPU)."""
        assert self._proc is not None, "not started"
        return self._proc.pid

    @property
    def url(self) -> str:
        if self.certs:
            c = self.certs
            query = f"cacert={c['ca.crt']}&cert={c['client.crt']}&key={c['client.key']}"
            return f"etcds://127.0.0.1:{self.client_port}?{query}"
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self) -> EtcdHarness:
        for tries_left in range(START_TRIES - 1, -1, -1):
            try:
                return self._start()
            except RuntimeError:
                self.stop()
                if not tries_left or b"address already in use" not in self.log:
                    raise
                self.client_port, self.peer_port, self.log = _free_port(), _free_port(), b""
        raise AssertionError("unreachable")

    def _start(self) -> EtcdHarness:
        scheme = "https" if self.certs else "http"
        client, peer = f"{scheme}://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        tls: list[str] = []
        if self.certs:
            c = self.certs
            tls = ["--cert-file", str(c["server.crt"]), "--key-file", str(c["server.key"]),
                   "--client-cert-auth", "--trusted-ca-file", str(c["ca.crt"])]  # fmt: skip
        self._proc = subprocess.Popen(
            [
                self._binary,
                "--name", self.name,
                "--data-dir", str(self.data_dir),
                "--listen-client-urls", client,
                "--advertise-client-urls", client,
                "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer,
                "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
                "--unsafe-no-fsync",
                *tls,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # If the tests are killed before they can stop it, etcd goes with them (no stray server).
            preexec_fn=die_with_parent_hook(),  # noqa: PLW1509 - only calls prctl
            start_new_session=True,
        )  # fmt: skip
        if not self.initial_cluster:  # a member waits for the others before it is ready: see EtcdCluster
            self._await_ready()
        return self

    def _await_ready(self) -> None:
        assert self._proc is not None
        assert self._proc.stderr is not None
        deadline = time.monotonic() + self._timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stderr, selectors.EVENT_READ)
            while READY_TEXT not in self.log:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    self.stop()
                    raise TimeoutError(f"etcd not ready after {self._timeout} s:\n{self.log[-2000:].decode()}")
                chunk = os.read(self._proc.stderr.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"etcd exited at start:\n{self.log[-2000:].decode()}")
                self.log += chunk

        # Keep draining etcd's log so it never blocks on a full pipe; the pipe ends (EOF) when etcd exits.
        def drain(stream: int) -> None:
            while os.read(stream, 65536):
                pass

        self._drain = threading.Thread(target=drain, args=(self._proc.stderr.fileno(),), daemon=True)
        self._drain.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
        if self._drain is not None:  # it reads the pipe's fd: close that only once it saw the end
            self._drain.join(timeout_s)
            self._drain = None
        if proc.stderr is not None:
            proc.stderr.close()

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def kill(self) -> None:
        """SIGKILL: a member lost without a word."""
        if self._proc is not None:
            self._proc.kill()
        self.stop()

    def restart(self) -> None:
        """Stop and start again on the same ports (clients reconnect to them)."""
        self.stop()
        self.log = b""
        self._start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        if self.certs:
            shutil.rmtree(self.certs["ca.crt"].parent, ignore_errors=True)

    def __enter__(self) -> EtcdHarness:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class EtcdCluster:
    """``size`` etcd members on loopback, one cluster; ``url`` names them all (the client fails over)."""

    def __init__(self, size: int = 3) -> None:
        self.members = [EtcdHarness(name=f"ftrun-m{i}") for i in range(size)]

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{m.client_port}" for m in self.members)

    def start(self) -> EtcdCluster:
        everyone = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = everyone
            m._start()  # all at once: a member is ready only once the cluster has a leader
        for m in self.members:
            m._await_ready()
        return self

    def leader(self) -> EtcdHarness:
        """The member that leads now (asked through etcd's HTTP gateway)."""
        for m in self.members:
            if m._proc is None:
                continue
            with contextlib.suppress(OSError, ValueError):
                status = _post_json(f"http://127.0.0.1:{m.client_port}/v3/maintenance/status", {})
                if status.get("leader") and status["leader"] == status.get("header", {}).get("member_id"):
                    return m
        raise RuntimeError("no etcd member says it leads")

    def close(self) -> None:
        for m in self.members:
            m.close()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _post_json(url: str, payload: dict[str, object]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST")  # noqa: S310
    with urllib.request.urlopen(request, timeout=5) as answer:  # noqa: S310 - a loopback URL of our own
        found: dict[str, Any] = json.loads(answer.read())
        return found
