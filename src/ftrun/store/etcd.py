"""etcd v3 backend, through etcd's HTTP/JSON gateway with the ``etcd3gw`` client.

This is the only module that imports an etcd client. Keys live under the
URL's prefix; revisions are etcd's own. Unary calls go through
``etcd3gw``'s session (TLS and auth configured once); a watch is a streaming
request read by a thread of its own, resumed from the revision after its last
event when the stream breaks (etcd keeps history, so nothing is lost unless it
was compacted: then :class:`~ftrun.errors.WatchLost`).

Install with ``pip install ftrun[etcd]``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import threading
from typing import Any

from ftrun.errors import (
    ConfigError,
    LeaseExpired,
    StoreAuthError,
    StoreConnectionLost,
    StoreError,
    StoreRequestError,
    WatchLost,
)
from ftrun.store.base import EventType, KeyValue, WatchEvent, check_key, check_value, prefix_end
from ftrun.store.retry import RETRYABLE, RETRYABLE_UNSENT, RequestNotSent, RetryPolicy
from ftrun.store.url import StoreUrl, read_token_file
from ftrun.store.watchqueue import QueuedWatch

log = logging.getLogger("ftrun.store")
# A broken watch stream is resumed after a pause that grows while it keeps breaking (etcd restarting,
# a proxy cutting streams): never a tight loop against a server that is down.
RESUME_FIRST_S = 0.05
RESUME_MAX_S = 2.0

try:
    import etcd3gw
    from etcd3gw import exceptions as etcd_errors
except ImportError as e:  # pragma: no cover - depends on the install
    raise ConfigError("--rdzv-backend etcd", "the etcd client is not installed", "pip install 'ftrun[etcd]'") from e

_RETRYABLE_TEXT = ("leader changed", "no leader", "timed out", "timeout", "unavailable", "too many requests")
_AUTH_TEXT = ("invalid auth token", "permission denied", "authentication failed", "user name is empty")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


class EtcdStore:
    """Implements :class:`ftrun.store.base.Store` on etcd (3.4 or newer)."""

    def __init__(self, url: StoreUrl, *, retry_deadline_s: float = 30.0, read_timeout_s: float = 10.0) -> None:
        self.endpoint = url.display
        self._root = f"/{url.prefix}" if url.prefix else ""
        self._retry = RetryPolicy(deadline_s=retry_deadline_s)
        self._timeout = read_timeout_s
        tls = url.scheme == "etcds" or any(url.option(o) for o in ("cacert", "cert", "key"))
        self._clients = [
            etcd3gw.client(
                host=host,
                port=port,
                protocol="https" if tls else "http",
                ca_cert=url.option("cacert"),
                cert_key=url.option("key"),
                cert_cert=url.option("cert"),
                timeout=read_timeout_s,
                api_path="/v3/",
            )
            for host, port in url.endpoints
        ]
        if url.option("cacert"):
            for c in self._clients:
                # requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE override a session's CA file;
                # the CA the user named for etcd must win.
                c.session.trust_env = False
        self._current = 0
        self._lock = threading.Lock()
        self._user = url.option("user") or url.user
        self._password = url.password
        password_file = url.option("password_file")
        if password_file:
            self._password = read_token_file(password_file)
        self._authenticated = False
        self._watches: set[_EtcdWatch] = set()

    # --- plumbing ----------------------------------------------------------------------------------

    def _client(self) -> Any:
        with self._lock:
            return self._clients[self._current]

    def _failover(self, client: Any) -> None:
        """Move to the next endpoint after a connection failure on ``client``."""
        with self._lock:
            if self._clients[self._current] is client:
                self._current = (self._current + 1) % len(self._clients)

    def _post_once(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        client = self._client()
        self._authenticate(client)
        try:
            result: dict[str, Any] = client.post(client.get_url(path), json=payload)
            return result
        except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError) as e:
            self._failover(client)
            # requests names a refused connect "NewConnectionError": the request never left.
            unsent = "NewConnectionError" in str(e) or "Connection refused" in str(e)
            raise (RequestNotSent if unsent else StoreConnectionLost)(f"{self.endpoint}: {type(e).__name__}") from e
        except etcd_errors.Etcd3Exception as e:
            raise self._translate(e) from e

    def _post(self, path: str, payload: dict[str, Any], *, idempotent: bool = True) -> dict[str, Any]:
        retry_on = RETRYABLE if idempotent else RETRYABLE_UNSENT
        return self._retry.run(self.endpoint, lambda: self._post_once(path, payload), retry_on=retry_on)

    def _translate(self, e: Any) -> StoreError:
        text = str(getattr(e, "detail_text", "") or e)
        lowered = text.lower()
        if "lease not found" in lowered:
            return LeaseExpired(f"{self.endpoint}: lease not found (expired, revoked, or never granted)")
        if "compacted" in lowered:
            return WatchLost(f"{self.endpoint}: revision compacted: {text}")
        if any(t in lowered for t in _AUTH_TEXT):
            self._authenticated = False
            return StoreAuthError(f"{self.endpoint}: {text}; check the etcd user and password")
        if any(t in lowered for t in _RETRYABLE_TEXT) or isinstance(e, etcd_errors.InternalServerError):
            return StoreConnectionLost(f"{self.endpoint}: {text}")
        return StoreRequestError(f"{self.endpoint}: {text}")

    def _authenticate(self, client: Any) -> None:
        if self._user is None or self._authenticated:
            return
        try:
            answer = client.post(
                client.get_url("/auth/authenticate"), json={"name": self._user, "password": self._password or ""}
            )
        except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError) as e:
            raise StoreConnectionLost(f"{self.endpoint}: {type(e).__name__}") from e
        except etcd_errors.Etcd3Exception as e:
            raise StoreAuthError(f"{self.endpoint}: etcd refused user {self._user!r}: {e.detail_text}") from e
        for c in self._clients:
            c.session.headers["Authorization"] = answer["token"]
        self._authenticated = True

    def _key(self, key: str) -> str:
        check_key(key)
        return self._root + key

    def _kv(self, raw: dict[str, Any]) -> KeyValue:
        key = _unb64(raw["key"]).decode()[len(self._root) :]
        return KeyValue(key, _unb64(raw.get("value")), int(raw.get("mod_revision", 0)), int(raw.get("lease", 0)))

    # --- the Store protocol ----------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        kvs = self._post("/kv/range", {"key": _b64(self._key(key).encode())}).get("kvs", [])
        return self._kv(kvs[0]) if kvs else None

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        check_value(value)
        payload = {"key": _b64(self._key(key).encode()), "value": _b64(bytes(value)), "lease": lease}
        return int(self._post("/kv/put", payload)["header"]["revision"])

    def compare_and_set(self, key: str, value: bytes, expected_revision: int, *, lease: int = 0) -> tuple[bool, int]:
        check_value(value)
        full = _b64(self._key(key).encode())
        txn = {
            "compare": [{"key": full, "target": "MOD", "result": "EQUAL", "mod_revision": expected_revision}],
            "success": [{"request_put": {"key": full, "value": _b64(bytes(value)), "lease": lease}}],
            "failure": [{"request_range": {"key": full}}],
        }
        answer = self._post("/kv/txn", txn, idempotent=False)
        if answer.get("succeeded"):
            return True, int(answer["header"]["revision"])
        kvs = answer["responses"][0]["response_range"].get("kvs", [])
        return False, int(kvs[0].get("mod_revision", 0)) if kvs else 0

    def delete(self, key: str, *, expected_revision: int | None = None) -> bool:
        full = _b64(self._key(key).encode())
        if expected_revision is None:
            return int(self._post("/kv/deleterange", {"key": full}).get("deleted", 0)) > 0
        txn = {
            "compare": [{"key": full, "target": "MOD", "result": "EQUAL", "mod_revision": expected_revision}],
            "success": [{"request_delete_range": {"key": full}}],
        }
        answer = self._post("/kv/txn", txn, idempotent=False)
        deleted = answer.get("responses", [{}])[0].get("response_delete_range", {}).get("deleted", 0)
        return bool(answer.get("succeeded")) and int(deleted) > 0

    def list_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        full = self._root + prefix
        answer = self._post("/kv/range", {"key": _b64(full.encode()), "range_end": _b64(prefix_end(full).encode())})
        return [self._kv(raw) for raw in answer.get("kvs", [])], int(answer["header"]["revision"])

    def add(self, key: str, delta: int) -> int:
        while True:  # optimistic: read, then write only if nobody wrote in between
            current = self.get(key)
            try:
                value = (int(current.value) if current else 0) + delta
            except ValueError:
                raise ValueError(f"key {key!r} does not hold an integer counter") from None
            ok, _ = self.compare_and_set(
                key, str(value).encode(), current.revision if current else 0, lease=current.lease if current else 0
            )
            if ok:
                return value

    def grant_lease(self, ttl_s: float) -> int:
        if not ttl_s > 0:
            raise ValueError(f"a lease TTL must be > 0 seconds, got {ttl_s}")
        # etcd counts whole seconds (and raises very short TTLs to its minimum, about 2 s).
        answer = self._post("/lease/grant", {"TTL": max(1, math.ceil(ttl_s)), "ID": 0}, idempotent=False)
        return int(answer["ID"])

    def keep_alive(self, lease: int) -> None:
        result = self._post("/lease/keepalive", {"ID": lease}).get("result", {})
        if int(result.get("TTL", 0)) <= 0:
            raise LeaseExpired(f"{self.endpoint}: lease {lease:x} expired or was revoked")

    def revoke_lease(self, lease: int) -> None:
        with contextlib.suppress(LeaseExpired):
            self._post("/kv/lease/revoke", {"ID": lease})

    def watch(self, prefix: str, start_revision: int) -> QueuedWatch:
        watch = _EtcdWatch(self, self._root + prefix, start_revision)
        self._watches.add(watch)
        watch.start()
        return watch.queue

    def close(self) -> None:
        for watch in list(self._watches):
            watch.queue.close()
        for c in self._clients:
            c.session.close()

    # used by _EtcdWatch
    def _stream(self, payload: dict[str, Any]) -> Any:
        client = self._client()
        self._authenticate(client)
        try:
            return client.session.post(
                client.get_url("/watch"), json=payload, stream=True, timeout=(self._timeout, None)
            )
        except Exception as e:  # requests' connection errors: retryable
            self._failover(client)
            raise StoreConnectionLost(f"{self.endpoint}: watch stream: {type(e).__name__}") from e


class _EtcdWatch:
    """One watch: a thread reads etcd's event stream into a QueuedWatch, resuming after breaks."""

    def __init__(self, store: EtcdStore, full_prefix: str, start_revision: int) -> None:
        self._store = store
        self._prefix = full_prefix
        self._next = start_revision  # 0: from now on
        self._response: Any = None
        self._closed = threading.Event()
        self._opened = threading.Event()
        self._open_error: StoreError | None = None
        self._delivered = False  # events arrived since the stream was last resumed
        self.queue = QueuedWatch(on_close=self._close)

    def start(self) -> None:
        threading.Thread(target=self._run, name="ftrun-etcd-watch", daemon=True).start()
        self._opened.wait()
        if self._open_error is not None:
            raise self._open_error

    def _run(self) -> None:
        pause = RESUME_FIRST_S
        while not self._closed.is_set():
            try:
                self._store._retry.run(self._store.endpoint, self._open)
                self._opened.set()
                try:
                    self._read()
                finally:
                    with contextlib.suppress(Exception):
                        self._response.close()
            except StoreConnectionLost as e:  # the stream ended or broke: resume after the last event seen
                why = str(e)
            except StoreError as e:
                if not self._opened.is_set():
                    self._open_error = e
                    self._opened.set()
                    return
                self.queue.fail(e)
                return
            except Exception as e:  # the stream broke (etcd restarted, connection reset): resume
                why = f"{type(e).__name__}: {e}"
                self._opened.set()
            if self._closed.is_set():
                return
            if self._delivered:  # it worked for a while: the next break is resumed quickly again
                pause, self._delivered = RESUME_FIRST_S, False
            # One break is routine (etcd or a proxy ends long streams); breaking again at once is news.
            level = logging.INFO if pause == RESUME_FIRST_S else logging.WARNING
            log.log(level, "etcd watch on %r broke (%s); resuming in %.2f s", self._prefix, why, pause)
            self._closed.wait(pause)
            pause = min(pause * 2, RESUME_MAX_S)

    def _open(self) -> None:
        request: dict[str, Any] = {
            "key": _b64(self._prefix.encode()),
            "range_end": _b64(prefix_end(self._prefix).encode()),
        }
        if self._next > 0:
            request["start_revision"] = self._next
        response = self._store._stream({"create_request": request})
        lines = response.iter_lines()
        head = next(lines, None)
        if head is None:
            response.close()
            raise StoreConnectionLost(f"{self._store.endpoint}: the watch stream closed before it was created")
        first = json.loads(head).get("result", {})
        if not first.get("created"):
            response.close()
            raise StoreConnectionLost(f"{self._store.endpoint}: watch not created: {first}")
        if self._next <= 0:  # "from now on": pin "now", so a resumed stream does not skip events
            self._next = int(first.get("header", {}).get("revision", 0)) + 1
        self._response, self._lines = response, lines

    def _read(self) -> None:
        for line in self._lines:
            if self._closed.is_set():
                return
            if not line:
                continue
            result = json.loads(line).get("result", {})
            if result.get("canceled") or result.get("compact_revision"):
                raise WatchLost(
                    f"{self._store.endpoint}: history before revision {result.get('compact_revision')} was compacted"
                )
            events = []
            for raw in result.get("events", []):
                kv = raw["kv"]
                key = _unb64(kv["key"]).decode()[len(self._store._root) :]
                kind = EventType.DELETE if raw.get("type") == "DELETE" else EventType.PUT
                events.append(WatchEvent(kind, key, _unb64(kv.get("value")), int(kv["mod_revision"])))
            if events:
                self._next = events[-1].revision + 1
                self._delivered = True
                self.queue.push(events)
        raise StoreConnectionLost("watch stream ended")  # resumed by _run

    def _close(self, queue: QueuedWatch) -> None:
        self._closed.set()
        self._store._watches.discard(self)
        if self._response is not None:
            # Unblock the reader thread's recv; it closes the response itself. (Closing it from
            # here would wait for the reader, which may wait for etcd forever.)
            with contextlib.suppress(Exception):
                self._response.raw.shutdown()
