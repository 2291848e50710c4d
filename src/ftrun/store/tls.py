"""TLS for the embedded store, with the standard library's ssl: the contexts, and a channel two threads can share.

The options are etcd's (``cacert``, ``cert``, ``key``, as torch's --rdzv-conf spells them). A client verifies the
store's certificate against ``cacert`` (else the system's CAs) and presents ``cert``/``key`` when given. The
store serves with ``cert``/``key``; with ``cacert`` it also requires each client's certificate (mutual TLS).

The client reads a connection from one thread while others send on it. OpenSSL allows one call at a time on
a connection (concurrent SSL_read and SSL_write corrupt it, as several projects found), so the channel makes
every call under a lock, on a non-blocking socket, and waits for the kernel outside the lock.
"""

from __future__ import annotations

import math
import select
import ssl
import threading
from collections.abc import Mapping

from ftrun.errors import ConfigError

OPTIONS = ("cacert", "cert", "key")


def client_context(options: Mapping[str, str]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=options.get("cacert") or None)
    _identity(ctx, options, "a client")
    return ctx


def server_context(options: Mapping[str, str]) -> ssl.SSLContext:
    if not options.get("cert") or not options.get("key"):
        raise ConfigError(
            "--rdzv-conf cert/key", "the node that hosts the store over TLS needs its certificate and key",
            "pass cert=FILE,key=FILE (and cacert=FILE to require the clients' certificates)",
        )  # fmt: skip
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    _identity(ctx, options, "the store")
    if options.get("cacert"):
        ctx.load_verify_locations(cafile=options["cacert"])
        ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: only clients with a certificate from that CA
    return ctx


def _identity(ctx: ssl.SSLContext, options: Mapping[str, str], who: str) -> None:
    cert, key = options.get("cert"), options.get("key")
    if bool(cert) != bool(key):
        raise ConfigError("--rdzv-conf cert/key", f"{who} needs both a certificate and its key", "pass both")
    if cert and key:
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError("--rdzv-conf cert/key", f"cannot load {cert} / {key}: {e}", "check the files") from None


class TlsChannel:
    """An ``ssl.SSLSocket`` shaped like the plain socket the client uses (recv, sendall, fileno, shutdown,
    close), safe to read from one thread while others send."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._lock = threading.Lock()
        self._buffer = b""  # read ahead by peer_closed()

    def fileno(self) -> int:
        return self._sock.fileno()

    def ready(self, timeout_s: float) -> bool:
        """Whether a recv() would find data now or within ``timeout_s`` (decrypted bytes the kernel cannot see
        count)."""
        if self._buffer or self._sock.pending():
            return True
        return _poll(self._sock.fileno(), select.POLLIN, timeout_s)

    def recv(self, n: int) -> bytes:
        """Up to ``n`` bytes, waiting for them; b"" when the store closed the connection."""
        while True:
            with self._lock:
                if self._buffer:
                    data, self._buffer = self._buffer[:n], self._buffer[n:]
                    return data
                try:
                    return self._sock.recv(n)
                except ssl.SSLWantReadError:
                    want = select.POLLIN
                except ssl.SSLWantWriteError:
                    want = select.POLLOUT
            _poll(self._sock.fileno(), want, None)

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            with self._lock:
                try:
                    view = view[self._sock.send(view) :]
                    continue
                except ssl.SSLWantWriteError:
                    want = select.POLLOUT
                except ssl.SSLWantReadError:
                    want = select.POLLIN
            _poll(self._sock.fileno(), want, None)

    def peer_closed(self) -> bool:
        """Whether an idle connection was closed by the store (what is read meanwhile is kept for recv)."""
        if not self.ready(0.0):
            return False
        with self._lock:
            try:
                data = self._sock.recv(1)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return False
            except OSError:
                return True
            self._buffer += data
            return data == b""

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)  # the raw socket's: wakes a reader waiting in poll

    def close(self) -> None:
        self._sock.close()


def _poll(fd: int, events: int, timeout_s: float | None) -> bool:
    poller = select.poll()
    poller.register(fd, events | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))))
