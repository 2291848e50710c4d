"""The embedded store's wire format, shared by its server and client.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack
(never pickle): a map with an ``id`` (ties a response to its request, so one
connection carries many calls and watches) and an ``op`` or a result. Frames
larger than :data:`MAX_FRAME` are refused before they are read.

How a connection opens (the client's first line, the store's greeting, the
token's challenge-response) is :mod:`ftrun.store.greeting`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import Any

import msgpack

from ftrun.errors import LeaseExpired, StoreAuthError, StoreError, StoreProtocolError, StoreRequestError, WatchLost

VERSION = 1
MAX_FRAME = 2 * 1024 * 1024  # a value is at most 1 MiB; the rest is headroom for keys and lists
HEADER = struct.Struct(">I")
NONCE_BYTES = 16

ERRORS: dict[str, type[StoreError]] = {
    "LeaseExpired": LeaseExpired,
    "WatchLost": WatchLost,
    "StoreRequestError": StoreRequestError,
    "StoreProtocolError": StoreProtocolError,
    "StoreAuthError": StoreAuthError,
}


def encode(message: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise StoreRequestError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte frame limit")
    return HEADER.pack(len(body)) + body


def read_frame(sock: Any) -> dict[str, Any]:
    """The next frame from a blocking socket (plain or TLS); EOFError when it closes first."""
    return decode(read_exactly(sock, frame_length(read_exactly(sock, HEADER.size))))


def read_exactly(sock: Any, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def frame_length(header: bytes) -> int:
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise StoreProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
    return int(length)


def decode(body: bytes) -> dict[str, Any]:
    """Parse one frame body; anything but a msgpack map with string keys is a protocol error."""
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises many types for garbage; all mean the same here
        raise StoreProtocolError(f"undecodable frame: {type(e).__name__}") from None
    if not isinstance(message, dict):
        raise StoreProtocolError(f"a frame must be a map, got {type(message).__name__}")
    return message


def error_message(request_id: int, error: StoreError | ValueError | TypeError) -> dict[str, Any]:
    kind = type(error).__name__ if type(error).__name__ in ERRORS else "StoreRequestError"
    return {"id": request_id, "ok": False, "error": [kind, str(error)]}


def raise_error(message: dict[str, Any]) -> None:
    """Raise the StoreError a server sent (``{"ok": False, "error": [type, text]}``)."""
    error = message.get("error")
    if not (isinstance(error, list) and len(error) == 2 and all(isinstance(x, str) for x in error)):
        raise StoreProtocolError(f"malformed error from the store: {error!r}")
    raise ERRORS.get(error[0], StoreRequestError)(error[1])


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: str, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token.encode(), role + first + second, hashlib.sha256).digest()


def check_proof(expected: bytes, got: object) -> bool:
    return isinstance(got, bytes) and hmac.compare_digest(expected, got)
