"""The warm worker pool: a Spawner that forks workers from a pre-imported zygote.

The agent starts the zygote (:mod:`ftrun.agent.zygote`) once per run, before the
first attempt; it imports the modules to preload while the agent gets on with
the rendezvous, then forks each attempt's workers in milliseconds. The workers
come out as the agent's own children (a pidfd and the real exit status, as for
a fresh process). Whatever goes wrong with the zygote (it refused a module that
starts threads, died, or does not answer), the attempt gets fresh processes,
and a dead zygote is replaced: the job's result never depends on the pool.

With ``--warm auto`` the workers report the modules they imported; the next
zygote preloads those (installed packages only, never the job's own code).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import selectors
import socket
import subprocess
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ftrun.agent import proctree
from ftrun.agent.workers import ProcessHandle, ProcessSpawner, signal_strays
from ftrun.errors import SpawnError

READY_TIMEOUT_S = 120.0  # a zygote importing torch on a loaded machine
FORK_TIMEOUT_S = 10.0
MAX_MESSAGE = 1 << 20


class PoolError(Exception):
    """The zygote cannot serve this spawn (the caller falls back to a fresh process)."""


class AdoptedHandle:
    """A worker forked by the zygote and re-parented to the agent: the agent's child from then on."""

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
    """What the zygote must run for ``argv``, or None if it cannot (not this Python's script or module)."""
    if len(argv) < 3 or argv[0] != python or argv[1] != "-u":
        return None
    if argv[2] == "-m" and len(argv) >= 4:
        return {"kind": "module", "target": argv[3], "args": list(argv[4:])}
    if argv[2].startswith("-"):
        return None  # -c (--run-path) and other interpreter options: a fresh process
    return {"kind": "script", "target": argv[2], "args": list(argv[3:])}


def installed_modules(names: Sequence[str], files: Mapping[str, str | None]) -> list[str]:
    """The modules worth preloading: from the standard library or installed packages, in the order the
    worker imported them (import side effects then happen as they did there). The job's own modules are
    left out: they may read the rank at import, or change between runs."""
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    keep = []
    for name in names:
        path = files.get(name)
        if name in ("__main__", "__mp_main__") or name.startswith("ftrun") or not path:
            continue
        if any(path.startswith(root + os.sep) for root in roots):
            keep.append(name)
    return list(dict.fromkeys(keep))


class _Zygote:
    def __init__(self, python: str, preload: list[str], env: Mapping[str, str], log: Path) -> None:
        self.preload = preload
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        with log.open("ab") as err:
            self.proc = subprocess.Popen(
                [python, "-m", "ftrun.agent.zygote", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=dict(env),
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
            pass  # it died at once: the first fork finds out and falls back
        self.ready: dict[str, Any] | None = None
        self.refused = ""

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """The zygote's ready message (read once); raises PoolError if it refused, died or is too slow."""
        if self.ready is None:
            answer = self._receive(timeout_s, "to finish preloading")
            if "refused" in answer:
                self.refused = str(answer["refused"])
                raise PoolError(self.refused)
            self.ready = answer
        return self.ready

    def fork(self, request: dict[str, Any], stdout: int, stderr: int) -> int:
        self.wait_ready(READY_TIMEOUT_S)
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
                raise PoolError(f"the zygote took more than {timeout_s:g} s {what}")
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

    def __init__(self, python: str, preload: Sequence[str], env: Mapping[str, str], *, auto: bool) -> None:
        self._python = python
        self._preload = list(dict.fromkeys(preload))
        self._env = env
        self._log = Path(os.devnull)
        self._auto = auto
        self._say: Callable[[str], None] = lambda text: None
        self._on_ready: Callable[[dict[str, Any]], None] = lambda info: None
        self._fresh = ProcessSpawner()
        self._zygote: _Zygote | None = None
        self._off = ""  # why the pool is no longer used (a refusal is not retried)

    def start(self, log: Path, say: Callable[[str], None], on_ready: Callable[[dict[str, Any]], None]) -> None:
        """Start the zygote (in the background: it answers once it has preloaded). Its output goes to
        ``log``; ``say`` tells the user what the pool does, ``on_ready`` gets its ready report."""
        self._log, self._say, self._on_ready = log, say, on_ready
        self._launch()

    def _launch(self) -> None:
        if self._zygote is None and not self._off:
            self._zygote = _Zygote(self._python, self._preload, self._env, self._log)

    def signal_strays(self, sig: int, workers: set[int]) -> None:
        """The zygote is the pool's own, never a stray of a worker group."""
        signal_strays(sig, workers, helpers={self._zygote.proc.pid} if self._zygote is not None else set())

    def reap_orphans(self, keep: set[int]) -> None:
        proctree.reap_orphans(keep | ({self._zygote.proc.pid} if self._zygote is not None else set()))

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, stdout: int, stderr: int) -> ProcessHandle:
        request = worker_request(argv, self._python)
        if request is None or self._off:
            return self._fresh.spawn(argv, env, cwd, stdout, stderr)
        self._launch()
        assert self._zygote is not None
        request.update(env=dict(env), cwd=str(cwd), agent_pid=os.getpid())
        try:
            fresh_ready = self._zygote.ready is None
            pid = self._zygote.fork(request, stdout, stderr)
            if fresh_ready and self._zygote.ready is not None:
                self._on_ready(
                    {**self._zygote.ready, "preload": len(self._zygote.preload), "pid": self._zygote.proc.pid}
                )
        except PoolError as e:
            self._fail(str(e))
            return self._fresh.spawn(argv, env, cwd, stdout, stderr)
        try:
            return AdoptedHandle(pid)
        except OSError as e:
            raise SpawnError(f"warm worker {pid} vanished before it was watched: {e}") from e

    def _fail(self, why: str) -> None:
        refused = self._zygote is not None and bool(self._zygote.refused)
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        if refused:
            self._off = why
            self._say(f"warm pool off: {why}; workers start as fresh processes")
        else:
            self._say(f"warm pool: {why}; this worker starts fresh, and a new pool is on its way")
            self._launch()

    def learn(self, modules: Sequence[str]) -> None:
        """--warm auto: preload what the workers imported, in a new zygote (the old one goes)."""
        if not self._auto or self._off:
            return
        wanted = [m for m in modules if m not in self._preload]
        if len(wanted) <= len(self._preload) // 20:
            return  # a few stragglers are not worth a new zygote (preloading costs a core for seconds)
        self._preload += wanted
        self._say(f"warm pool: preloading {len(self._preload)} modules the workers imported, for the next restart")
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        self._launch()

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None


def read_modules_report(path: Path) -> list[str] | None:
    """A worker's report of its imported modules ({name: file}), filtered; None if absent or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        return None
    return installed_modules(list(data), {k: v if isinstance(v, str) else None for k, v in data.items()})
