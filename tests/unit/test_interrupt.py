"""What the interrupt's thread breaks in a rank blocked in C: which of torch's backends it aborts, and how (pure
logic over stand-ins for torch's objects: NCCL needs a GPU; bench/gpu.py --in-place runs the real one); and
which call an interrupt is for (the real signal and thread, in a process of their own)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

from ftrun.worker import interrupt


class FakeNccl:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def _group_start(self) -> None:
        self.calls.append("group start")

    def _group_end(self) -> None:
        self.calls.append("group end")

    def abort(self) -> None:
        self.calls.append(f"abort {self.name}")


class FakeGroup:
    def __init__(self, cuda_backend: object | None) -> None:
        self.cuda_backend = cuda_backend

    def _get_backend(self, device: str) -> object:
        if device != "cuda" or self.cuda_backend is None:
            raise RuntimeError("no backend for this device")  # as torch: a gloo-only group has none for CUDA
        return self.cuda_backend


def fake_torch(monkeypatch: pytest.MonkeyPatch, groups: list[FakeGroup]) -> None:
    c10d = types.ModuleType("torch.distributed.distributed_c10d")
    c10d.ProcessGroupNCCL = FakeNccl  # type: ignore[attr-defined]
    c10d._world = types.SimpleNamespace(pg_map=dict.fromkeys(groups))  # type: ignore[attr-defined]
    torch = types.ModuleType("torch")
    torch.device = lambda name: name  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", c10d)
    monkeypatch.setitem(sys.modules, "torch", torch)


def test_every_nccl_communicator_is_aborted_inside_one_group_call_and_gloo_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    fake_torch(monkeypatch, [FakeGroup(FakeNccl("world", calls)), FakeGroup(None), FakeGroup(FakeNccl("tp", calls))])
    interrupt._abort_nccl()
    assert calls == ["group start", "abort world", "abort tp", "group end"]


def test_without_nccl_nothing_is_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch(monkeypatch, [FakeGroup(None)])
    interrupt._abort_nccl()  # raises nothing, calls nothing
    monkeypatch.delitem(sys.modules, "torch.distributed.distributed_c10d")
    interrupt._abort_nccl()


def run_alone(code: str) -> str:
    """``code`` in a process of its own (the interrupt's handler and wakeup fd are the process's); its output."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_interrupt_heard_between_two_calls_ends_the_next_unless_the_agent_sent_it_for_the_attempt_before() -> None:
    said = run_alone("""
        import os
        from ftrun.worker import interrupt
        from ftrun.worker.signals import INTERRUPT_SIGNAL

        def call():
            try:
                interrupt.enter(set())
            except interrupt.RestartInPlace:
                return "interrupted"
            interrupt.leave()
            return "runs"

        interrupt.arm()
        said = [call()]  # nothing heard
        os.kill(os.getpid(), INTERRUPT_SIGNAL)  # heard while no call runs: a peer failed as the attempt began
        said.append(call())
        interrupt.handed(2)  # the next attempt: the agent had sent 2 before it, 1 of them heard so far
        said.append(call())
        os.kill(os.getpid(), INTERRUPT_SIGNAL)  # the other of those, heard late: the attempt before's
        said.append(call())
        os.kill(os.getpid(), INTERRUPT_SIGNAL)  # this attempt's
        said.append(call())
        print(" ".join(said))
    """)
    assert said == "runs interrupted runs runs interrupted"


def test_an_interrupt_of_the_call_before_read_late_by_the_thread_breaks_nothing_of_the_next() -> None:
    """The thread reads the last call's interrupt only after the next call began (held here as a busy node would
    hold it): the next call waits for it, and the connection it opens stays up."""
    said = run_alone("""
        import linecache, os, socket, sys, threading, time
        from ftrun.worker import interrupt
        from ftrun.worker.signals import INTERRUPT_SIGNAL

        def wait_for_the_thread_at(line):
            deadline = time.monotonic() + 10
            while True:
                frame = sys._current_frames()[interrupt._listener.ident]
                if line in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
                    return
                assert time.monotonic() < deadline, f"the thread never reached {line}"
                time.sleep(0.01)

        interrupt.arm()
        interrupt._breaking.acquire()  # the thread, once it read the byte below, waits here
        os.write(interrupt._told.fileno(), bytes([INTERRUPT_SIGNAL]))  # the call before's interrupt, unread
        wait_for_the_thread_at("with _breaking")
        call = threading.Thread(target=interrupt.enter, args=(interrupt.sockets(),))
        call.start()
        call.join(0.3)  # the next call begins (with the wait for the thread, it is still waiting)
        listener = socket.create_server(("127.0.0.1", 0))
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        interrupt._breaking.release()
        call.join(10)
        wait_for_the_thread_at("heard.recv")  # done with what it read
        try:
            client.sendall(b"x")
            got = server.recv(1)
        except OSError:  # shut by the thread
            got = b""
        print("kept" if got == b"x" else "shut")
    """)
    assert said == "kept"


def test_the_thread_breaks_again_what_the_main_thread_opens_while_it_stays_in_c_and_stops_once_it_is_out() -> None:
    """The interrupt's byte comes while the main thread is "in C" (no Python handler runs here): the thread shuts
    the function's connection, and the next one it makes (as torch's store client connects again by itself);
    once the main thread is out, nothing more."""
    said = run_alone("""
        import os, socket
        from ftrun.worker import interrupt
        from ftrun.worker.signals import INTERRUPT_SIGNAL

        listener = socket.create_server(("127.0.0.1", 0))

        def connection():
            client = socket.create_connection(listener.getsockname())
            server, _ = listener.accept()
            server.settimeout(10)
            return client, server

        def shut(ends):  # waits for the thread (bounded): the end of stream once the connection is shut
            try:
                return ends[1].recv(1) == b""
            except TimeoutError:
                return False

        interrupt.arm()
        interrupt.enter(interrupt.sockets())
        first = connection()
        os.write(interrupt._told.fileno(), bytes([INTERRUPT_SIGNAL]))  # the signal's byte; no handler runs
        said = [shut(first)]
        said.append(shut(connection()))  # made again while still "in C"
        interrupt.leave()
        after = connection()
        after[0].sendall(b"x")
        said.append(after[1].recv(1) == b"x")  # up
        print(said)
    """)
    assert said == "[True, True, True]"
