"""The warm pool: a Spawner that forks workers from pre-imported zygotes.

At start the pool launches a *base* zygote that preloads nothing (ready as soon
as Python is: forking from it is as fast as a fresh start) and, when something
is known to preload (``--preload``, the job's cache, its entry script's
imports), a second one that preloads it. Each spawn forks from the biggest
*ready* zygote: a restart never waits for one still preloading when another is
ready. With none ready, it waits for the one preloading (it started before a
fresh worker would, and imports only what a worker imports anyway), else uses
the base. When the workers report more imports, a bigger zygote is started
beside the others, at idle CPU priority so that it never slows the training;
smaller ones are closed only once a bigger one is ready. Workers come out as the
agent's own children (a pidfd and the real exit status, as for a fresh process).

Whatever goes wrong with a zygote (it refused a module that starts threads,
died, or does not answer), the worker is started fresh and the pool goes on
without it: the job's result never depends on the pool.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import selectors
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ftrun.agent import proctree
from ftrun.agent.preload import Cache
from ftrun.agent.workers import ProcessHandle, ProcessSpawner, signal_strays
from ftrun.errors import SpawnError

BASE_READY_TIMEOUT_S = 30.0  # the base zygote is a bare Python start: seconds only on a machine in trouble
PRELOAD_TIMEOUT_S = 120.0  # a zygote importing torch and more on a loaded machine
FORK_TIMEOUT_S = 10.0
MAX_MESSAGE = 1 << 20
GROWTH = 20  # a new zygote is worth its CPU when the workers imported 1/GROWTH more modules than it has
# The zygote pins its own thread pools (never the workers'): a library that starts threads at import
# (OpenMP, BLAS) would make the zygote unsafe to fork.
ZYGOTE_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class PoolError(Exception):
    """A zygote cannot serve this spawn (the caller falls back to another, or to a fresh process)."""


class NotYet(PoolError):
    """A zygote has not answered within the time given (it may still be preloading)."""


class AdoptedHandle:
    """A worker forked by a zygote and re-parented to the agent: the agent's child from then on."""

    warm = True

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd = os.pidfd_open(pid)

    def fileno(self) -> int:
        return self._pidfd

    def reap(self) -> int:
        try:
            _, status = os.waitpid(self.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # not adopted after all: its status went to someone else
            code = 255
        os.close(self._pidfd)
        return code

    def signal_group(self, sig: int) -> None:
        proctree.signal_quietly(self.pid, sig, group=True)


def worker_request(argv: Sequence[str], python: str) -> dict[str, Any] | None:
    """What a zygote must run for ``argv``, or None if it cannot (not this Python's script or module)."""
    if len(argv) < 3 or argv[0] != python or argv[1] != "-u":
        return None
    if argv[2] == "-m" and len(argv) >= 4:
        return {"kind": "module", "target": argv[3], "args": list(argv[4:])}
    if argv[2].startswith("-"):
        return None  # -c (--run-path) and other interpreter options: a fresh process
    return {"kind": "script", "target": argv[2], "args": list(argv[3:])}


class _Zygote:
    def __init__(self, python: str, preload: list[str], env: Mapping[str, str], log: Path, *, idle: bool) -> None:
        self.preload = preload
        self.started = time.monotonic()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        argv = [python, "-m", "ftrun.agent.zygote", str(theirs.fileno())] + (["--idle"] if idle else [])
        with log.open("ab") as err:
            self.proc = subprocess.Popen(
                argv,
                pass_fds=(theirs.fileno(),),
                env={**env, **ZYGOTE_THREADS},
                stdin=subprocess.PIPE,
                stdout=err,
                stderr=err,
                start_new_session=True,
                preexec_fn=proctree.die_with_parent_hook(),  # noqa: PLW1509 - only calls prctl
            )
        theirs.close()
        assert self.proc.stdin is not None
        try:  # the list can be long: a pipe, not argv (which has a size limit)
            self.proc.stdin.write(json.dumps(preload).encode())
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: the first look at it finds out
        self.ready: dict[str, Any] | None = None
        self.refused = ""
        self.failed = ""  # why it can no longer serve

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Whether it is ready, waiting at most ``timeout_s`` for its answer; a refusal or death is recorded."""
        if self.ready is None and not self.failed:
            try:
                answer = self._receive(timeout_s, "to finish preloading")
            except NotYet as e:
                if timeout_s > 0:  # waited for in vain
                    self.failed = str(e)
                return False
            except PoolError as e:  # gone
                self.failed = str(e)
                return False
            if "refused" in answer:
                self.refused = self.failed = str(answer["refused"])
                return False
            self.ready = answer
        return self.ready is not None

    def fork(self, request: dict[str, Any], stdout: int, stderr: int) -> int:
        try:
            self._sock.sendmsg(
                [json.dumps(request).encode()],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", (stdout, stderr)).tobytes())],
            )
        except OSError as e:
            raise PoolError(f"the zygote is gone ({e})") from None
        answer = self._receive(FORK_TIMEOUT_S, "to fork")
        if "pid" not in answer:
            raise PoolError(str(answer.get("error", answer)))
        return int(answer["pid"])

    def _receive(self, timeout_s: float, what: str) -> dict[str, Any]:
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise NotYet(f"the zygote took more than {timeout_s:g} s {what}")
        try:
            data = self._sock.recv(MAX_MESSAGE)
        except OSError as e:
            raise PoolError(f"the zygote is gone ({e})") from None
        if not data:
            raise PoolError(f"the zygote exited (code {self.proc.poll()})")
        answer: dict[str, Any] = json.loads(data)
        return answer

    def close(self) -> None:
        self._sock.close()  # the zygote sees EOF and exits
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()


class WarmPool:
    """A Spawner. ``start()`` before the first attempt; ``learn()`` feeds --warm auto; ``close()`` at the end."""

    def __init__(
        self, python: str, preload: Sequence[str], env: Mapping[str, str], *, auto: bool, cache: Cache | None = None
    ) -> None:
        self._python = python
        self._env = env
        self._auto = auto
        self._cache = cache
        cached, self._import_s = cache.load() if cache is not None and auto else ([], None)
        self._known = list(dict.fromkeys([*preload, *cached]))  # the most we know to preload
        self._log = Path(os.devnull)
        self._say: Callable[[str], None] = lambda text: None
        self._on_ready: Callable[[dict[str, Any]], None] = lambda info: None
        self._fresh = ProcessSpawner()
        self._zygotes: list[_Zygote] = []
        self._off = ""  # why the pool is no longer used (a refusal is not retried)

    def start(self, log: Path, say: Callable[[str], None], on_ready: Callable[[dict[str, Any]], None]) -> None:
        """Start the base zygote, and one preloading what is known. Their output goes to ``log``; ``say`` tells
        the user what the pool does, ``on_ready`` gets each zygote's ready report."""
        self._log, self._say, self._on_ready = log, say, on_ready
        self._launch([])
        if self._known:
            self._launch(self._known)

    def add(self, modules: Sequence[str]) -> None:
        """More modules known before any worker ran (the entry script's imports)."""
        self._known = list(dict.fromkeys([*self._known, *modules]))

    def _launch(self, preload: list[str], *, idle: bool = False) -> None:
        """``idle``: preload at idle CPU priority (while the job trains, it must not slow it down)."""
        if not self._off:
            self._zygotes.append(_Zygote(self._python, preload, self._env, self._log, idle=idle))

    @property
    def preloading(self) -> list[str]:
        """The modules of the largest zygote, ready or not."""
        return max((z.preload for z in self._zygotes), key=len, default=[])

    def signal_strays(self, sig: int, workers: set[int]) -> None:
        """The zygotes are the pool's own, never strays of a worker group."""
        signal_strays(sig, workers, helpers={z.proc.pid for z in self._zygotes})

    def reap_orphans(self, keep: set[int]) -> None:
        proctree.reap_orphans(keep | {z.proc.pid for z in self._zygotes})

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, stdout: int, stderr: int) -> ProcessHandle:
        request = worker_request(argv, self._python)
        if request is None or self._off:
            return self._fresh.spawn(argv, env, cwd, stdout, stderr)
        request.update(env=dict(env), cwd=str(cwd), agent_pid=os.getpid())
        while (zygote := self._best()) is not None:
            try:
                pid = zygote.fork(request, stdout, stderr)
            except PoolError as e:
                self._drop(zygote, str(e))
                continue
            try:
                return AdoptedHandle(pid)
            except OSError as e:
                raise SpawnError(f"warm worker {pid} vanished before it was watched: {e}") from e
        return self._fresh.spawn(argv, env, cwd, stdout, stderr)

    def _best(self) -> _Zygote | None:
        """The zygote to fork from: the biggest ready one with something preloaded; with none ready, the
        biggest still preloading (it started before a fresh worker would, and preloads only what the workers
        import anyway: waiting for it beats a fresh start); else the base zygote (a bare Python start)."""
        for z in list(self._zygotes):
            was_ready = z.ready is not None
            if z.poll() and not was_ready:
                self._ready(z)
            elif z.failed:
                self._drop(z, z.failed)
                if self._off:
                    return None
        preloaded = [z for z in self._zygotes if z.preload]
        ready = [z for z in preloaded if z.ready is not None]
        if ready:
            best = max(ready, key=lambda z: len(z.preload))
            for z in list(self._zygotes):
                if z is not best and z.ready is not None:  # a bigger one serves from now on
                    z.close()
                    self._zygotes.remove(z)
            return best
        for z in sorted(preloaded, key=lambda z: len(z.preload), reverse=True) + [
            z for z in self._zygotes if not z.preload
        ]:
            if z.poll(PRELOAD_TIMEOUT_S if z.preload else BASE_READY_TIMEOUT_S):
                self._ready(z)
                return z
            self._drop(z, z.failed or "it did not start")
            if self._off:
                return None
        return None

    def _ready(self, z: _Zygote) -> None:
        assert z.ready is not None
        self._on_ready({**z.ready, "preload": len(z.preload), "pid": z.proc.pid})
        if z.preload and self._cache is not None and self._auto:
            self._cache.save(z.preload, float(z.ready.get("import_s", 0.0)))

    def _drop(self, z: _Zygote, why: str) -> None:
        z.close()
        if z in self._zygotes:
            self._zygotes.remove(z)
        if z.refused:
            self._off = why
            for other in self._zygotes:
                other.close()
            self._zygotes.clear()
            self._say(f"warm pool off: {why}; workers start as fresh processes")
        else:
            self._say(f"warm pool: {why}; a new zygote is on its way")
            self._launch(z.preload, idle=True)

    def learn(self, modules: Sequence[str]) -> None:
        """--warm auto: the workers imported ``modules``; a bigger zygote is started when it is worth it."""
        if not self._auto or self._off:
            return
        current = self.preloading
        wanted = [m for m in modules if m not in current]
        if len(wanted) <= len(current) // GROWTH:
            return  # a few stragglers are not worth a new zygote (preloading costs a core for seconds)
        bigger = list(dict.fromkeys([*current, *wanted]))
        self._say(f"warm pool: preloading {len(bigger)} modules the workers imported, for the next restart")
        if self._cache is not None:
            self._cache.save(bigger, self._import_s)
        self._launch(bigger, idle=True)

    def close(self) -> None:
        for z in self._zygotes:
            z.close()
        self._zygotes.clear()
