"""The agent's side of one zygote process: start it, hear whether it is ready (or refused a module), take
its standby workers, stop it and go on. The zygote itself is :mod:`ftrun.warm.zygote`; the pool that keeps
several and chooses among them, :mod:`ftrun.warm.pool`.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftrun.private import append_fd
from ftrun.procs import proctree
from ftrun.worker import messages
from ftrun.worker.fresh import ZYGOTE_THREADS
from ftrun.worker.readable import wait_readable

FORK_TIMEOUT_S = 10.0
GROW_TIMEOUT_S = 1.0  # for a zygote forked from a ready one to say its pid


class PoolError(Exception):
    """A zygote cannot serve this spawn (the caller falls back to another, or to a fresh process)."""


class NotYet(PoolError):
    """A zygote has not answered within the time given (it may still be preloading)."""


class AdoptedHandle:
    """A worker forked by a zygote and re-parented to the agent: the agent's child from then on. ``warm``: its
    zygote had preloaded the job's imports (the base zygote's workers import everything themselves)."""

    def __init__(self, pid: int, *, warm: bool) -> None:
        self.pid = pid
        self.warm = warm
        self._pidfd = os.pidfd_open(pid)

    def fileno(self) -> int:
        return self._pidfd

    def reap(self) -> int | None:
        code: int | None = None  # not adopted after all (its status went to someone else): unknown, not invented
        with contextlib.suppress(ChildProcessError):
            _, status = os.waitpid(self.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        self.close()
        return code

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def signal_group(self, sig: int) -> None:
        proctree.signal_quietly(self.pid, sig, group=True)


class Standby:
    """A worker forked ahead of time, asleep on its socket until it is told what to run."""

    def __init__(self, pid: int, sock: socket.socket, *, warm: bool) -> None:
        self.sock = sock
        self.handle = AdoptedHandle(pid, warm=warm)

    def alive(self) -> bool:
        return not wait_readable(self.handle, 0)  # a pidfd is readable once the process exited

    def run(self, request: dict[str, Any], stdout: int, stderr: int) -> AdoptedHandle:
        """The standby becomes the worker ``request`` describes, with ftrun's standard input (as a fresh worker
        inherits it: always open, ftrun's main opens /dev/null there when it starts without one) and these
        standard output and error."""
        try:
            messages.send(self.sock, request, (0, stdout, stderr))
        except OSError as e:
            raise PoolError(f"the standby worker {self.handle.pid} is gone ({e})") from None
        finally:
            self.sock.close()
        return self.handle

    def discard(self) -> None:
        """It exits when its socket closes; the agent reaps it with the other orphans."""
        self.sock.close()
        self.handle.close()


class GrownProcess:
    """A zygote forked from another, re-parented to the agent: what the pool asks of a zygote's process (as of a
    subprocess.Popen), through a pidfd. Its exit status may be taken by the agent's reaping of orphans: then
    it is -1."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None and (self._pidfd < 0 or wait_readable(self._pidfd, 0)):
            self.returncode = -1
            with contextlib.suppress(ChildProcessError):  # reaped already by the agent's reaping of orphans
                done, status = os.waitpid(self.pid, os.WNOHANG)  # never blocks, should the pid be another's now
                if done:
                    self.returncode = os.waitstatus_to_exitcode(status)
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1
        return self.returncode

    def wait(self) -> int:
        if self._pidfd >= 0:
            wait_readable(self._pidfd, None)
        return self.poll() or 0

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    @classmethod
    def spawn(
        cls,
        python: str,
        preload: list[str],
        env: Mapping[str, str],
        log: Path,
        *,
        idle: bool,
        standbys: int,
        script: str | None = None,
        plan: Mapping[str, object] | None = None,
    ) -> Zygote:
        """Start a zygote preloading ``preload`` and ask it for ``standbys`` workers forked ahead of time;
        ``script``: the entry script (absolute), which the zygote compiles once for all its workers; ``plan``: how
        (:func:`ftrun.warm.pool.WarmPool.plan`: the script's leading block replayed, the later imports checked;
        default: ``preload`` imported as given)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [python, "-m", "ftrun.warm.zygote", str(theirs.fileno())] + (["--idle"] if idle else [])
        with os.fdopen(append_fd(log), "ab") as err:
            proc = subprocess.Popen(
                argv,
                pass_fds=(theirs.fileno(),),
                env={**env, **ZYGOTE_THREADS},
                stdin=subprocess.PIPE,
                stdout=err,
                stderr=err,
                start_new_session=True,  # its group holds the standbys too: see WarmPool.signal_strays
                preexec_fn=proctree.die_with_parent_hook(),  # noqa: PLW1509 - only calls prctl
            )
        theirs.close()
        assert proc.stdin is not None
        try:  # the list can be long: a pipe, not argv (which has a size limit)
            proc.stdin.write(json.dumps(plan or {"steps": [["import", m] for m in preload]}).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: the first look at it finds out
        zygote = cls(proc, ours, preload, script)
        for _ in range(standbys):  # queued: the zygote forks them as soon as it has preloaded
            zygote.ask_standby()
        return zygote

    def grow(
        self, preload: list[str], *, idle: bool, standbys: int, files: Mapping[str, str | None] | None = None
    ) -> Zygote:
        """A zygote forked from this ready one, which imports only what ``preload`` adds to this one's: the
        job's big imports (torch: ~1.5 s of a core) are not paid again for each bigger zygote, and its pages
        stay shared with this one's; ``files``: where the workers' imports found each top-level module (the new
        one checks its own imports find the same). Raises PoolError when this one cannot fork it now."""
        if self.ready is None or self.paused or self.failed:
            raise PoolError("the zygote is not ready to grow another")
        have = set(self.preload)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        added = [m for m in preload if m not in have]
        request = {"agent_pid": os.getpid(), "grow": added, "idle": idle, "inherited": self.ready.get("loaded", 0)}
        request["files"] = dict(files or {})
        try:
            messages.send(self._sock, request, (theirs.fileno(),))
            with selectors.DefaultSelector() as sel:  # the agent's loop waits: briefly (a fork takes ~10 ms)
                sel.register(ours, selectors.EVENT_READ)
                if not sel.select(GROW_TIMEOUT_S):  # a late one finds its socket closed, and exits
                    raise NotYet(f"it took more than {GROW_TIMEOUT_S:g} s to fork")
            pid = int(json.loads(ours.recv(messages.MAX_MESSAGE) or b"{}")["pid"])
            grown = Zygote(GrownProcess(pid), ours, preload, self._script)
            grown.grown_from = self.proc.pid
        except (OSError, PoolError, KeyError, ValueError) as e:
            ours.close()
            raise PoolError(f"no zygote grown from {self.proc.pid}: {e}") from None
        finally:
            theirs.close()
        for _ in range(standbys):
            grown.ask_standby()
        return grown

    def __init__(
        self, proc: subprocess.Popen[bytes] | GrownProcess, sock: socket.socket, preload: list[str], script: str | None
    ) -> None:
        """A zygote process already started (:meth:`spawn`), talked to over ``sock``."""
        self.proc = proc
        self._sock = sock
        self.preload = preload
        self._script = script
        self.ready: dict[str, Any] | None = None
        self.refused = ""
        self.culprit = ""  # the module it refused (left out of every preload from then on)
        self.by_rule: dict[str, str] = {}  # the modules refused because a worker's own import would differ, why
        self.failed = ""  # why it can no longer serve
        self._asked: deque[socket.socket] = deque()  # standbys asked for, in order; the zygote answers in order
        self._standbys: deque[Standby] = deque()
        self.owed = 0  # standbys taken and not yet asked for again
        self.paused = False
        self.grown_from: int | None = None  # the zygote it was forked from (None: a process of its own)

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Whether it is ready, waiting at most ``timeout_s`` (only the first attempt's workers wait, and only for
        the zygote preloading what the job was known to import); a refusal or death is recorded."""
        if self.ready is None and not self.failed:
            try:
                answer = self._receive(timeout_s, "to finish preloading")
            except NotYet:
                return False
            except PoolError as e:  # gone
                self.failed = str(e)
                return False
            if "refused" in answer:
                self.refused = self.failed = str(answer["refused"])
                self.culprit = str(answer.get("module", ""))
                found = answer.get("by_rule")
                self.by_rule = {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}
                return False
            self.ready = answer
            # A hold may have stopped it after it said so and before the agent read it: a ready zygote only
            # waits for work, and the restart's workers are forked from it now.
            self.pause(False)
        return self.ready is not None

    def pause(self, paused: bool) -> None:
        """Stand still (SIGSTOP) or go on (SIGCONT)."""
        if paused != self.paused and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)
            self.paused = paused

    def ask_standby(self) -> None:
        """Ask for one more standby worker (answered later: nobody waits for the fork now)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            messages.send(self._sock, {"agent_pid": os.getpid(), "script": self._script}, (theirs.fileno(),))
        except OSError as e:
            ours.close()
            self.failed = f"the zygote is gone ({e})"
        else:
            self._asked.append(ours)
        finally:
            theirs.close()

    def standby(self) -> Standby:
        """A live standby worker of this (ready) zygote; another one is asked for in its place at the next
        refill, or now when none is left (a failure came before the refill)."""
        if not self._asked and not self._standbys and self.owed:
            self.ask_standby()
            self.owed -= 1
        while self._asked:  # collect the answers that came, waiting only when no standby is left
            waited = FORK_TIMEOUT_S if not self._standbys else 0.0
            try:
                answer = self._receive(waited, "to fork a standby worker")
            except NotYet:
                if waited > 0:
                    raise
                break
            sock = self._asked.popleft()
            if "pid" not in answer:
                sock.close()
                raise PoolError(str(answer.get("error", answer)))
            try:
                self._standbys.append(Standby(int(answer["pid"]), sock, warm=bool(self.preload)))
            except OSError:  # it died before it was watched
                sock.close()
        while self._standbys:
            standby = self._standbys.popleft()
            self.owed += 1
            if standby.alive():
                return standby
            standby.discard()
        raise PoolError("the zygote has no standby worker")

    def refill(self) -> None:
        """Ask for the standbys taken since the last refill (when the agent is idle: forking a zygote of
        hundreds of MiB takes ~10 ms of a core, which the workers being started need)."""
        for _ in range(self.owed):
            self.ask_standby()
        self.owed = 0

    def _receive(self, timeout_s: float, what: str) -> dict[str, Any]:
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise NotYet(f"the zygote took more than {timeout_s:g} s {what}")
        try:
            data = self._sock.recv(messages.MAX_MESSAGE)
        except OSError as e:
            raise PoolError(f"the zygote is gone ({e})") from None
        if not data:
            raise PoolError(f"the zygote exited (code {self.proc.poll()})")
        answer: dict[str, Any] = json.loads(data)
        return answer

    def close(self, *, wait: bool = True) -> None:
        """``wait=False``: do not wait for the process to be gone (a zygote of hundreds of MiB takes tens of
        milliseconds to tear down); the pool reaps it later."""
        for standby in self._standbys:
            standby.discard()
        for sock in self._asked:
            sock.close()
        self._standbys.clear()
        self._asked.clear()
        self._sock.close()  # the zygote sees EOF and exits
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        if wait:
            self.proc.wait()
