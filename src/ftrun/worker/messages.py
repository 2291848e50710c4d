"""JSON messages between the agent's side and a process waiting for it (the zygote, a standby, a rank parked for
an in-place restart), over a SOCK_SEQPACKET socket: one message per packet, descriptors passed beside it (a
worker's stdout and stderr). Both ends are ftrun's own."""

from __future__ import annotations

import array
import json
import socket
from collections.abc import Sequence
from typing import Any

MAX_MESSAGE = 1 << 20
MAX_FDS = 8
Message = dict[str, Any]


def send(sock: socket.socket, message: Message, fds: Sequence[int] = ()) -> None:
    """Raises OSError when the other end is gone."""
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sock.sendmsg([json.dumps(message).encode()], rights)


def receive(sock: socket.socket) -> tuple[Message | None, list[int]]:
    """The next message and the descriptors passed with it; None when the other end closed."""
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    if not data:
        return None, list(fds)
    message: Message = json.loads(data)
    return message, list(fds)
