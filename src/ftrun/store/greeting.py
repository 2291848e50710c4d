"""How a connection to the embedded store opens, on both sides.

The client speaks first, with one line (:data:`OPENING`): whatever else holds the port then answers at once
with what it is (a web server's error page, an SSH banner) and is named so, instead of leaving the client
waiting for a greeting that never comes. An ftrun store greets every connection as it accepts it: a frame
with the wire version, the store's id, the job whose agent hosts it and a nonce. Then the token's
challenge-response: each side proves it knows the token with an HMAC over both nonces (the token never
crosses the wire). The client names its job too, so a store that two jobs share knows who still uses it.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from dataclasses import dataclass
from typing import Any

from ftrun.errors import StoreAuthError, StoreError, StoreProtocolError
from ftrun.store import wire
from ftrun.store.retry import RequestNotSent

OPENING = b"FTRUN/%d\r\n" % wire.VERSION  # a line: line-based servers (HTTP, SMTP, Redis) answer one at once
MAX_NAME = 128  # a client id or a job's name


@dataclass(frozen=True)
class Greeting:
    """What a store says of itself before anyone proved anything."""

    store_id: str
    job: str  # the job whose agent hosts the store ("": `ftrun store`, or one a test serves)
    nonce: bytes
    auth: bool  # whether it asks for the token


# --- the client's side -------------------------------------------------------------------------------------


def greet(sock: Any, endpoint: str) -> Greeting:
    """Open the conversation on a connected socket (plain, or TLS wrapped) and read the store's greeting.

    Raises StoreProtocolError when something that is not an ftrun store answers, RequestNotSent when nothing
    does (retried: a store may be busy greeting a whole job, and a proxy may close before its backend is up).
    """
    try:
        sock.sendall(OPENING)
        first = sock.recv(wire.HEADER.size)
    except TimeoutError as e:
        raise RequestNotSent(
            f"{endpoint} accepted the connection but said nothing in {sock.gettimeout():g} s (an ftrun store "
            "greets at once: something else listens there?)"
        ) from e
    except OSError as e:
        raise RequestNotSent(f"{endpoint}: handshake failed: {e}") from e
    if not first:
        raise RequestNotSent(
            f"{endpoint} closed the connection without a greeting (an ftrun store greets every connection: "
            "something else holds the port, or a proxy found nothing behind it)"
        ) from EOFError("connection closed")
    try:
        first += wire.read_exactly(sock, wire.HEADER.size - len(first))
        hello = wire.decode(wire.read_exactly(sock, wire.frame_length(first)))
    except StoreProtocolError:
        raise StoreProtocolError(f"{endpoint} is not an ftrun store: it answered {_shown(first, sock)}") from None
    except (OSError, EOFError) as e:
        raise RequestNotSent(f"{endpoint}: handshake failed: {e}") from e
    nonce, store_id, job = hello.get("nonce"), hello.get("store_id"), hello.get("job", "")
    if hello.get("v") != wire.VERSION or not isinstance(nonce, bytes) or not isinstance(store_id, str):
        raise StoreProtocolError(f"{endpoint} is not an ftrun store of this version (wire {hello.get('v')!r})")
    return Greeting(store_id, job if isinstance(job, str) else "", nonce, bool(hello.get("auth")))


def authenticate(sock: Any, endpoint: str, greeting: Greeting, token: str | None, client_id: str, job: str) -> None:
    """Prove the token (when the store asks for it), have the store prove it back, and name the client."""
    if greeting.auth and token is None:
        raise StoreAuthError(f"{endpoint} requires a token: pass --rdzv-token or set FTRUN_TOKEN")
    if token and not greeting.auth:  # no downgrade: whoever holds the endpoint proves the token
        raise StoreAuthError(
            f"{endpoint} does not ask for the token this node holds: it is not the job's store (another store, "
            "or something else squatting on the endpoint); nothing was sent to it"
        )
    mine = wire.new_nonce()
    answer = wire.proof(token, b"client", greeting.nonce, mine) if token else b""
    try:
        sock.sendall(wire.encode({"nonce": mine, "proof": answer, "client": client_id, "job": job}))
        verdict = wire.read_frame(sock)
    except (OSError, EOFError) as e:
        raise RequestNotSent(f"{endpoint}: handshake failed: {e}") from e
    if not verdict.get("ok"):
        raise StoreAuthError(f"{endpoint} refused the token: check --rdzv-token / FTRUN_TOKEN")
    if token and not wire.check_proof(wire.proof(token, b"server", mine, greeting.nonce), verdict.get("proof")):
        raise StoreAuthError(f"{endpoint} could not prove it knows the token")


def probe(host: str, port: int, timeout_s: float, tls: ssl.SSLContext | None = None) -> Greeting:
    """The greeting of whatever listens on ``host:port``, read within ``timeout_s``; the connection is then
    dropped (an ftrun store forgets a client that never authenticated). Raises StoreError naming what is
    there when it is not an ftrun store, OSError when nothing listens."""
    endpoint = f"{host}:{port}"
    with socket.create_connection((host, port), timeout=timeout_s) as raw:
        sock = tls.wrap_socket(raw, server_hostname=host) if tls is not None else raw
        try:
            return greet(sock, endpoint)
        except RequestNotSent as e:
            raise StoreError(str(e)) from None


def _shown(first: bytes, sock: Any) -> str:
    """The start of a stranger's answer, as a person would recognise it."""
    with contextlib.suppress(OSError):
        sock.settimeout(0.2)
        first += sock.recv(200)
    text = " ".join(first.decode("ascii", "replace").split())
    return repr(text[:80] + ("..." if len(text) > 80 else ""))


# --- the store's side --------------------------------------------------------------------------------------


def hello(store_id: str, job: str, nonce: bytes, auth: bool) -> dict[str, Any]:
    return {"v": wire.VERSION, "store_id": store_id, "job": job, "nonce": nonce, "auth": auth}


class WrongToken(StoreError):
    """The client does not know the token: told so, then disconnected."""

    verdict: dict[str, Any] = {"ok": False, "error": ["StoreAuthError", "wrong token"]}  # noqa: RUF012 - never changed


@dataclass(frozen=True)
class Introduction:
    """A client that passed the handshake: its name for itself (the same on each of its connections, "": none),
    its job ("": unnamed), and the verdict to send it."""

    client_id: str
    job: str
    verdict: dict[str, Any]


def introduce(reply: dict[str, Any], token: str | None, store_nonce: bytes) -> Introduction:
    """Check the client's answer to the greeting. Raises StoreError to refuse it; a wrong token is refused with
    its verdict sent first (:class:`WrongToken`)."""
    client_nonce = reply.get("nonce")
    if not isinstance(client_nonce, bytes) or len(client_nonce) != wire.NONCE_BYTES:
        raise StoreProtocolError("handshake without a valid nonce")
    client_id, job = reply.get("client", ""), reply.get("job", "")
    if not (isinstance(client_id, str) and isinstance(job, str)) or max(len(client_id), len(job)) > MAX_NAME:
        raise StoreProtocolError("handshake with an invalid client id or job")
    if token is None:
        return Introduction(client_id, job, {"ok": True})
    if not wire.check_proof(wire.proof(token, b"client", store_nonce, client_nonce), reply.get("proof")):
        raise WrongToken
    # Proven: a client that knows the token (a stranger cannot claim another's leases, or name a job).
    return Introduction(client_id, job, {"ok": True, "proof": wire.proof(token, b"server", client_nonce, store_nonce)})
