"""How ftrun's interrupt reaches a restartable rank's function, wherever its main thread is (see worker.in_place).

The signal's Python handler raises :class:`RestartInPlace` in the main thread, but Python runs a handler only when
that thread comes back to Python: one blocked in C (a gloo collective waiting for a peer, a CUDA sync behind an
NCCL kernel waiting for one) would wait until the collective's timeout, minutes, where the peer is lost or stuck
outside Python itself. So a thread hears the signal too (Python's C-level handler writes each signal's number to
the wakeup fd at once, whatever the main thread does) and breaks what the main thread may be waiting in: the
NCCL communicators are aborted (their kernels end, a sync behind them returns) and the TCP connections the
function opened are shut (a gloo wait fails), again after 0.1 s, 0.2 s, 0.4 s... until the main thread is out
(torch's store client connects again by itself). The main thread gets out of C with an error, then the
handler's exception follows.

An interrupt is never lost, nor taken for the wrong call. One that comes after the next attempt was handed over
and before the function runs (a peer failed at once) makes the call end as it begins: the agent says, as it
hands an attempt over, how many it had sent before, and the handler counts those it hears. One for the call
that ended, which the thread reads late (a busy node), is read before the next call runs: each call waits for
the thread to have read every byte written before it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time

from ftrun.worker.signals import INTERRUPT_SIGNAL


class RestartInPlace(BaseException):
    """Raised in the wrapped function when ftrun restarts the job in place. A BaseException, so that the job's
    ``except Exception`` does not swallow it; let it pass."""


_heard = 0  # the interrupts this process has heard (real-time signals: each one counted)
_past = 0  # of those, how many the agent sent for attempts that ended (it says so as it hands one over)
_before: set[str] = set()  # the sockets open before the function began: not its own, never shut
_breaking = threading.Lock()  # held while the thread breaks the function's collectives
# Set while the wrapped function does not run (or is on its way out): only while it runs does the interrupt raise
# in it, or break anything.
_out = threading.Event()
_out.set()
AGAIN_S = 0.1  # while the main thread stays in C the thread breaks again after this, then twice as long...
BREAK_FOR_S = 10.0  # and for this long at most (the agent stops a rank that has not parked within 5 s)
_told: socket.socket | None = None  # the wakeup fd's socket (Python's C handler writes to it), once per process
_listener: threading.Thread | None = None
_fenced = threading.Event()  # the thread read the fence: every byte written before it
FENCE = 0  # written to the wakeup fd by enter(): no signal's number
FENCE_WAIT_S = 2.0  # a thread that cannot read within this long is not waited for (the call goes on)


def arm() -> None:
    """Take the interrupt (in the main thread), and hear it from a thread (once per process)."""
    global _told, _listener  # noqa: PLW0603 - one listener per process
    signal.signal(INTERRUPT_SIGNAL, _raise_in_function)
    if _told is not None:
        return
    heard, told = socket.socketpair()
    told.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(told.fileno(), warn_on_full_buffer=False)
    except ValueError:  # another thread than the main one: the handler alone, as before
        heard.close()
        told.close()
        return
    _told = told
    _listener = threading.Thread(target=_listen, args=(heard, previous), name="ftrun-interrupt", daemon=True)
    _listener.start()


def handed(past: int | None) -> None:
    """The next attempt was handed over; ``past``: how many interrupts the agent had sent this process until then,
    for attempts that ended (None: as many as it heard). Counted, not cleared: one of those may be heard after
    this, one of the new attempt's before it."""
    global _past  # noqa: PLW0603
    _past = _heard if past is None else past


def enter(before: set[str]) -> None:
    """The function is about to run (``before``: the sockets open before it, never shut by a break). Raises
    :class:`RestartInPlace` when its interrupt came already."""
    global _before, _past  # noqa: PLW0603 - one wrapped function runs per process, in the main thread
    _before = before
    _wait_for_the_thread()
    _out.clear()
    if _heard > _past:
        _out.set()
        _past = _heard
        raise RestartInPlace("ftrun restarts the job in place (interrupted before the function began)")


def _wait_for_the_thread() -> None:
    """Until the thread read every byte written to the wakeup fd before now: one of the call that ended, read
    after this one began, would break this one's collectives."""
    if _told is None or _listener is None or not _listener.is_alive():
        return
    _fenced.clear()
    try:
        _told.send(bytes([FENCE]))
    except OSError:  # full: the thread is not reading
        return
    _fenced.wait(FENCE_WAIT_S)


def leave() -> None:
    """The function returned or raised: the interrupt no longer reaches it. A break under way ends first: the main
    thread lets go of what it breaks only after it."""
    _out.set()
    with _breaking:
        pass


def _raise_in_function(signum: int, frame: object) -> None:
    global _heard  # noqa: PLW0603
    _heard += 1  # one not raised here is for the next call, unless the agent sent it for the attempt that ended
    if not _out.is_set():
        _out.set()  # once: the wrapper's own handling and its park are never interrupted
        raise RestartInPlace("ftrun restarts the job in place")


def _listen(heard: socket.socket, previous: int) -> None:
    """The wakeup fd's reader: breaks the function's collectives when the interrupt comes while it runs; passes
    every signal's byte on to a wakeup fd set before ftrun's (whoever set it reads them as before)."""
    while True:
        try:
            got = heard.recv(256)
        except InterruptedError:
            continue
        except OSError:
            return
        if not got:
            return
        signals = got.replace(bytes([FENCE]), b"")
        if previous != -1 and signals:
            with contextlib.suppress(OSError):
                os.write(previous, signals)
        if INTERRUPT_SIGNAL in signals:
            with _breaking:
                _break_until_out()
        if FENCE in got:
            _fenced.set()


def _break_until_out() -> None:
    """Break the function's collectives, and again while its main thread stays in C: torch's store client,
    its connection shut, connects again by itself (until its timeout, half an hour) and waits on the new one, as
    a rank in init_process_group does when its peer failed as the attempt began."""
    deadline = time.monotonic() + BREAK_FOR_S
    again = AGAIN_S
    while not _out.is_set():
        break_collectives(_before)
        if _out.wait(again) or time.monotonic() > deadline:
            return
        again *= 2


def break_collectives(before: set[str]) -> None:
    """End every collective of the function's, here and, where it can, at its peers: the NCCL communicators
    aborted, then the TCP connections opened since ``before`` shut (see :func:`_shut_connections`). From the
    thread at the interrupt, and from the main thread as it lets go of the attempt (a rank whose own exception
    ended the function: a graceful end of an NCCL group would wait for the collectives its peers still wait in)."""
    _abort_nccl()
    _shut_connections(before)


def _abort_nccl() -> None:
    """Abort every NCCL communicator of the process groups torch knows, as torch itself does from another thread
    (its watchdog; ``_abort_process_group``): inside one NCCL group call, since two communicators aborted one by
    one can wait on each other. Their kernels end, so a CUDA sync behind one returns. Nothing without NCCL."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    nccl = getattr(c10d, "ProcessGroupNCCL", None)
    world = getattr(c10d, "_world", None)
    torch = sys.modules.get("torch")
    if nccl is None or world is None or torch is None:
        return
    backends = []
    for group in list(world.pg_map):
        with contextlib.suppress(Exception):  # a group with no CUDA backend raises
            backend = group._get_backend(torch.device("cuda"))
            if isinstance(backend, nccl):
                backends.append(backend)
    if not backends:
        return
    with contextlib.suppress(Exception):
        backends[0]._group_start()
    for backend in backends:
        with contextlib.suppress(Exception):
            backend.abort()
    with contextlib.suppress(Exception):
        backends[0]._group_end()


def _shut_connections(before: set[str]) -> None:
    """Shut the connected TCP sockets opened since ``before`` (the function's process groups', its store's): both
    ends see the connection end, so a peer's collective with this rank fails now rather than at its timeout, and
    so does this rank's own wait in one (gloo cannot be aborted from another thread: measured, torch 2.13)."""
    for fd, inode in _socket_fds().items():
        if inode not in before:
            _shut_if_tcp(fd)


def sockets() -> set[str]:
    """The sockets open now: those open before the function began are not its own (see :func:`enter`)."""
    return set(_socket_fds().values())


def _socket_fds() -> dict[int, str]:
    """This process's open sockets: fd -> "socket:[inode]"."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:"):
                found[int(name)] = target
    return found


def _shut_if_tcp(fd: int) -> None:
    """Shut (not close: the fd stays its owner's) a connected TCP socket: both ends see the connection end.
    Never a listening one: gloo's listener thread ends the process when its accept fails."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    with sock, contextlib.suppress(OSError):
        tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
        if tcp and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.shutdown(socket.SHUT_RDWR)
