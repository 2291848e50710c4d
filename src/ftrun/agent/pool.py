"""The warm pool: a Spawner that forks workers from pre-imported zygotes.

At start the pool launches a *base* zygote that preloads nothing (ready as soon
as Python is: forking from it is as fast as a fresh start) and, when something
is known to preload (``--preload``, the job's cache, its entry script's
imports), a second one that preloads it. Each spawn forks from the biggest
*ready* zygote: a restart never waits for one still preloading when another is
ready. With none ready, it waits for the one preloading (it started before a
fresh worker would, and imports only what a worker imports anyway), else uses
the base. Each zygote keeps twice as many standby workers forked ahead of time as
the node runs workers: a spawn hands a standby its work in one message, and a
failure that comes before the standbys taken are forked again (half a second
later, when the new workers have started) still finds enough. When the workers
report more imports, a bigger zygote is started beside the others, at idle CPU
priority so that it never slows the training (and stopped while a restart is
under way); smaller ones are closed only once a bigger one is ready. Workers come
out as the agent's own children (a pidfd and the real exit status, as for a fresh
process).

Whatever goes wrong with a zygote (it refused a module that starts threads,
died, or does not answer), the worker is started fresh and the pool goes on
without it: the job's result never depends on the pool.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ftrun.agent import proctree
from ftrun.agent.preload import Cache
from ftrun.agent.workers import ProcessHandle, ProcessSpawner, signal_strays

REFILL_DELAY_S = 0.5  # after an attempt's spawns: see WarmPool.workers_started
BASE_READY_TIMEOUT_S = 30.0  # the base zygote is a bare Python start: seconds only on a machine in trouble
PRELOAD_TIMEOUT_S = 120.0  # a zygote importing torch and more on a loaded machine
FORK_TIMEOUT_S = 10.0
MAX_MESSAGE = 1 << 20
GROWTH = 20  # a new zygote is worth its CPU when the workers imported 1/GROWTH more modules than it has
# The zygote pins its own thread pools (never the workers'): a library that starts threads at import
# (OpenMP, BLAS) would make the zygote unsafe to fork.
ZYGOTE_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


Say = Callable[[str], None]


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
        self.close()
        return code

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

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


class _Standby:
    """A worker forked ahead of time, asleep on its socket until it is told what to run."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.sock = sock
        self.handle = AdoptedHandle(pid)

    def alive(self) -> bool:
        return not select.select([self.handle], [], [], 0)[0]  # a pidfd is readable once the process exited

    def run(self, request: dict[str, Any], stdout: int, stderr: int) -> AdoptedHandle:
        try:
            self.sock.sendmsg(
                [json.dumps(request).encode()],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", (stdout, stderr)).tobytes())],
            )
        except OSError as e:
            raise PoolError(f"the standby worker {self.handle.pid} is gone ({e})") from None
        finally:
            self.sock.close()
        return self.handle

    def discard(self) -> None:
        """It exits when its socket closes; the agent reaps it with the other orphans."""
        self.sock.close()
        self.handle.close()


class _Zygote:
    def __init__(
        self,
        python: str,
        preload: list[str],
        env: Mapping[str, str],
        log: Path,
        *,
        idle: bool,
        standbys: int,
        script: str | None = None,
    ) -> None:
        """``script``: the entry script (absolute), which the zygote compiles once for all its workers."""
        self.preload = preload
        self._script = script
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
                start_new_session=True,  # its group holds the standbys too: see WarmPool.signal_strays
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
        self._asked: deque[socket.socket] = deque()  # standbys asked for, in order; the zygote answers in order
        self._standbys: deque[_Standby] = deque()
        self.owed = 0  # standbys taken and not yet asked for again
        self.paused = False
        for _ in range(standbys):  # queued: the zygote forks them as soon as it has preloaded
            self.ask_standby()

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Whether it is ready, waiting at most ``timeout_s`` for its answer; a refusal or death is recorded."""
        if timeout_s > 0:
            self.pause(False)  # waited for: it must go on
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

    def pause(self, paused: bool) -> None:
        """Stand still (SIGSTOP) or go on (SIGCONT)."""
        if paused != self.paused and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)
            self.paused = paused

    def ask_standby(self) -> None:
        """Ask for one more standby worker (answered later: nobody waits for the fork now)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.sendmsg(
                [json.dumps({"agent_pid": os.getpid(), "script": self._script}).encode()],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", (theirs.fileno(),)).tobytes())],
            )
        except OSError as e:
            ours.close()
            self.failed = f"the zygote is gone ({e})"
        else:
            self._asked.append(ours)
        finally:
            theirs.close()

    def standby(self) -> _Standby:
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
                self._standbys.append(_Standby(int(answer["pid"]), sock))
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
            data = self._sock.recv(MAX_MESSAGE)
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


class WarmPool:
    """A Spawner. ``start()`` before the first attempt; ``learn()`` feeds --warm auto; ``close()`` at the end."""

    def __init__(
        self,
        python: str,
        preload: Sequence[str],
        env: Mapping[str, str],
        *,
        auto: bool,
        standbys: int,
        cache: Cache | None = None,
        script: str | None = None,
    ) -> None:
        """``standbys``: how many workers each zygote keeps forked ahead of time (the node's workers);
        ``script``: the entry script's absolute path, compiled once in each zygote."""
        self._python = python
        self._script = script
        self._standbys = standbys
        self._env = env
        self._auto = auto
        self._cache = cache
        cached, self._import_s = cache.load() if cache is not None and auto else ([], None)
        self._known = list(dict.fromkeys([*preload, *cached]))  # the most we know to preload
        self._log = Path(os.devnull)
        self._say: Say = lambda text: None
        self._detail: Say = lambda text: None
        self._on_ready: Callable[[dict[str, Any]], None] = lambda info: None
        self._fresh = ProcessSpawner()
        self._zygotes: list[_Zygote] = []
        self._retired: list[subprocess.Popen[bytes]] = []  # zygotes a bigger one replaced, killed, not yet reaped
        self._refill_at: float | None = None  # monotonic: when the standbys taken are forked again
        self.holding = False  # a restart is under way: see hold()
        self._off = ""  # why the pool is no longer used (a refusal is not retried)

    def start(self, log: Path, say: Say, on_ready: Callable[[dict[str, Any]], None], detail: Say) -> None:
        """Start the base zygote, and one preloading what is known. Their output goes to ``log``; ``say`` tells the
        user what to know (the pool is off), ``detail`` how it works (--verbose); ``on_ready`` gets ready reports."""
        self._log, self._say, self._detail, self._on_ready = log, say, detail, on_ready
        self._launch([])
        if self._known:
            self._launch(self._known)

    def add(self, modules: Sequence[str]) -> None:
        """More modules known before any worker ran (the entry script's imports)."""
        self._known = list(dict.fromkeys([*self._known, *modules]))

    def _launch(self, preload: list[str], *, idle: bool = False) -> None:
        """``idle``: preload at idle CPU priority (while the job trains, it must not slow it down)."""
        if not self._off:
            self._zygotes.append(
                _Zygote(
                    self._python, preload, self._env, self._log, idle=idle, standbys=self._standbys, script=self._script
                )
            )

    @property
    def preloading(self) -> list[str]:
        """The modules of the largest zygote, ready or not."""
        return max((z.preload for z in self._zygotes), key=len, default=[])

    def signal_strays(self, sig: int, workers: set[int]) -> None:
        """The zygotes and their standby workers (in the zygotes' process groups) are the pool's own."""
        signal_strays(sig, workers, helper_groups={z.proc.pid for z in self._zygotes})

    def sweep(self, workers: set[int], keep: set[int]) -> None:
        zygotes = {z.proc.pid for z in self._zygotes}
        proctree.sweep(signal.SIGKILL, workers, helper_groups=zygotes, keep=keep | zygotes)

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, stdout: int, stderr: int) -> ProcessHandle:
        request = worker_request(argv, self._python)
        if request is None or self._off:
            return self._fresh.spawn(argv, env, cwd, stdout, stderr)
        request.update(env=dict(env), cwd=str(cwd))
        while (zygote := self._best()) is not None:
            try:
                handle = zygote.standby().run(request, stdout, stderr)
            except PoolError as e:
                self._drop(zygote, str(e))
                continue
            if zygote.failed:  # it could not fork a standby in place of this one
                self._drop(zygote, zygote.failed)
            return handle
        return self._fresh.spawn(argv, env, cwd, stdout, stderr)

    def tend(self) -> None:
        """Take the zygotes' news (ready, refused, gone) and retire each ready zygote that a bigger ready one
        replaces. Called when the agent is idle too, so that a restart finds this done."""
        self._retired = [proc for proc in self._retired if proc.poll() is None]
        if self._refill_at is not None and time.monotonic() >= self._refill_at:
            self._refill_at = None
            self.go_on()
            for z in self._zygotes:
                z.refill()
        for z in list(self._zygotes):
            was_ready = z.ready is not None
            if z.poll() and not was_ready:
                self._ready(z)
            elif z.failed:
                self._drop(z, z.failed)
                if self._off:
                    return
        best = self._biggest_ready()
        if best is not None and not self.holding:  # the teardown of a retired zygote: ~15 ms of a core
            for z in list(self._zygotes):
                if z is not best and z.ready is not None:  # a bigger one serves from now on
                    z.close(wait=False)
                    self._retired.append(z.proc)
                    self._zygotes.remove(z)

    def _biggest_ready(self) -> _Zygote | None:
        ready = [z for z in self._zygotes if z.preload and z.ready is not None]
        return max(ready, key=lambda z: len(z.preload)) if ready else None

    def _best(self) -> _Zygote | None:
        """The zygote to fork from: the biggest ready one with something preloaded; with none ready, the
        biggest still preloading (it started before a fresh worker would, and preloads only what the workers
        import anyway: waiting for it beats a fresh start); else the base zygote (a bare Python start)."""
        self.tend()
        if self._off:
            return None
        best = self._biggest_ready()
        if best is not None:
            return best
        preloaded = [z for z in self._zygotes if z.preload]
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
            self._detail(f"warm pool: {why}; a new zygote is on its way")
            self._launch(z.preload, idle=True)

    def learn(self, modules: Sequence[str], *, run_ends: bool = False) -> None:
        """--warm auto: the workers imported ``modules``; a bigger zygote is started when it is worth it (kept
        for the next run only when ``run_ends``: no restart can come)."""
        if not self._auto or self._off:
            return
        current = self.preloading
        have = set(current)
        wanted = [m for m in modules if m not in have]
        if len(wanted) <= len(current) // GROWTH:
            return  # a few stragglers are not worth a new zygote (preloading costs a core for seconds)
        bigger = list(dict.fromkeys([*current, *wanted]))
        if self._cache is not None:
            self._cache.save(bigger, self._import_s)
        if not run_ends:
            self._detail(f"warm pool: preloading {len(bigger)} modules the workers imported, for the next restart")
            self._launch(bigger, idle=True)

    def hold(self) -> None:
        """A failure, or workers about to start: the zygotes still preloading stand still (SIGSTOP) until the
        refill after the spawns (see go_on); meanwhile the agent learns nothing new and retires no zygote. At
        idle CPU priority they should yield at once, but a kernel that defers wakeup preemption to its tick
        (PREEMPT_NONE, lazy) lets them run on for up to 4 ms at a time (seen with perf sched), taken from the
        agent and the new workers."""
        self.holding = True
        for z in self._zygotes:
            if z.ready is None:
                z.pause(True)

    def go_on(self) -> None:
        """The hold ends: at the refill, or when the agent waits with no workers to start (a rendezvous)."""
        self.holding = False
        for z in self._zygotes:
            z.pause(False)

    def workers_started(self) -> None:
        """An attempt's workers were just started: the standbys they took are forked again once they had time
        to start (forking a zygote of hundreds of MiB costs ~10 ms of a core, which they need now; a failure
        before then takes the spare standbys, and one more forks them on the spot: still warm)."""
        self._refill_at = time.monotonic() + REFILL_DELAY_S

    def seconds_to_refill(self) -> float | None:
        """How long the agent may sleep before :meth:`tend` is due to refill (None: nothing to refill)."""
        return None if self._refill_at is None else max(0.0, self._refill_at - time.monotonic())

    def close(self) -> None:
        for z in self._zygotes:
            z.close()
        self._zygotes.clear()
        for proc in self._retired:
            proc.wait()
        self._retired.clear()
