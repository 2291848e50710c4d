"""The integration tests' harness: running the real ftrun command on real worker scripts (the fixtures that
use it are in conftest.py).

Every process a test starts is stopped at teardown, even when the test fails:
ftrun runs in its own session and is killed with SIGKILL if still alive: list[LiveFtrun], and
its workers die with it (parent-death signal). Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

from ftrun.node.ports import reserve_port

RUN_ID = "t"
WAIT_S = 60.0  # generous bound for one step of a test on a loaded 2-core machine
PORT_TRIES = 3
T = TypeVar("T")


class PortTaken(Exception):
    """The port a test chose was taken by someone else before ftrun could bind it."""


def with_free_port(attempt: Callable[[int], T]) -> T:
    """Run ``attempt(port)`` with a free loopback port, again with another if it raises PortTaken.

    A port cannot be handed to another process bound, so it is chosen free and bound
    later by ftrun; meanwhile any process on the machine may take it (an outgoing
    connection's ephemeral port, say). The ledger that ftrun's own agents share keeps
    them off it; the rare outsider costs a retry.
    """
    for tries_left in range(PORT_TRIES - 1, -1, -1):
        try:
            return attempt(reserve_port("127.0.0.1", time.time()))
        except PortTaken:
            if not tries_left:
                raise
    raise AssertionError("unreachable")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    def events(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in (self.run_dir / "events.jsonl").read_text().splitlines()]

    def report(self, attempt: int) -> dict[str, object]:
        doc: dict[str, object] = json.loads((self.run_dir / f"attempt_{attempt}" / "failure_report.json").read_text())
        return doc

    def log(self, attempt: int, rank: int, stream: str = "stdout") -> str:
        return (self.run_dir / f"attempt_{attempt}" / str(rank) / f"{stream}.log").read_text()


def ftrun_argv(tmp_path: Path, *args: str, logs: str = "logs", run_id: str | None = RUN_ID) -> list[str]:
    """``run_id`` None: no --rdzv-id at all (torchrun's default)."""
    ids = ["--rdzv-id", run_id] if run_id is not None else []
    return [sys.executable, "-m", "ftrun", "--log-dir", str(tmp_path / logs), *ids, *args]


def run_ftrun(
    tmp_path: Path,
    *args: str,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    stdin: str | None = None,
) -> Result:
    """Run ftrun to its end; its workers' scripts are looked up in tmp_path; ``env``: added to the environment;
    ``stdin``: what ftrun reads on its standard input (none otherwise: the workers inherit it, as under torchrun)."""
    proc = subprocess.Popen(
        ftrun_argv(tmp_path, *args),
        cwd=tmp_path,
        env={
            **os.environ,
            **(env or {}),
        },  # explicit: C-level changes to this process's environment (readline sets LINES) stay out
        stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        seen = where_it_waits(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"ftrun did not end within {timeout:g} s; its session then:\n{seen}\n{err[-4000:]}"
        ) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return Result(proc.returncode, out, err, tmp_path / "logs" / RUN_ID)


def where_it_waits(agent: int) -> str:
    """An agent that did not do what a test waited for: its session's processes and the agent's threads' stacks,
    taken before the test's end kills them (the failing test's only picture of a hang)."""
    spy = Path(sys.executable).with_name("py-spy")  # a dev dependency
    try:
        stacks = subprocess.run([spy, "dump", "--pid", str(agent)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        stacks = f"(py-spy: {e})"
    return f"{processes_of(agent)}\n{stacks}"


def processes_of(session: int, pids: Sequence[int] = ()) -> str:
    """``ps`` of a session's processes, ``pids`` and everything below them (a failing test's picture: who waits
    where)."""
    lines = subprocess.run(
        ["ps", "-eo", "pid,ppid,sid,stat,wchan:24,etimes,args", "--forest"], capture_output=True, text=True
    ).stdout.splitlines()[1:]
    rows = [(line.split(), line) for line in lines]
    wanted = {int(f[0]) for f, _ in rows if int(f[2]) == session} | set(pids)
    while grown := {int(f[0]) for f, _ in rows if int(f[1]) in wanted} - wanted:
        wanted |= grown
    return "\n".join(line for f, line in rows if int(f[0]) in wanted) or "(none)"


def clean_run(shared: Path, *args: str, files: Mapping[str, str] | None = None, timeout: float = 120.0) -> Result:
    """A run that never fails, as the reference a test compares its weights with: each set of arguments (and
    ``files``, written into its directory first) runs once a test session, shared by every test and xdist worker
    (``shared``: the session's directory above the workers'; a lock file keeps the others waiting while one
    runs it). A failed one is run again by the next."""
    key = hashlib.sha256(repr((args, sorted((files or {}).items()))).encode()).hexdigest()[:16]
    here = shared / f"clean-{key}"
    done = here / "result.json"
    with FileLock(str(shared / f"clean-{key}.lock"), timeout=4 * timeout):
        if done.exists():
            told = json.loads(done.read_text())
            return Result(0, told["stdout"], told["stderr"], here / "logs" / RUN_ID)
        shutil.rmtree(here, ignore_errors=True)
        here.mkdir(parents=True)
        for name, text in (files or {}).items():
            (here / name).write_text(text)
        r = run_ftrun(here, *args, timeout=timeout)
        if r.returncode == 0:
            done.write_text(json.dumps({"stdout": r.stdout, "stderr": r.stderr}))
        return r


class LiveFtrun:
    """ftrun running in the background; the test reads its stdout line by line."""

    def __init__(
        self, tmp_path: Path, *args: str, name: str = "", run_id: str | None = RUN_ID,
        env: Mapping[str, str] | None = None, wrapper: Sequence[str] = (),
    ) -> None:  # fmt: skip
        """``name`` keeps several agents in one test apart (their logs and stderr); ``env``: added to the
        environment; ``wrapper``: a command that execs ftrun's (its arguments follow), as ``prlimit --``."""
        suffix = f"-{name}" if name else ""
        self.stderr_path = tmp_path / f"ftrun{suffix}.stderr"
        self._stderr = self.stderr_path.open("w")
        self._stderr_lines: list[str] = []
        self._stderr_changed = threading.Condition()
        self.proc = subprocess.Popen(
            [*wrapper, *ftrun_argv(tmp_path, *args, logs=f"logs{suffix}", run_id=run_id)],
            cwd=tmp_path,
            env={
                **os.environ,
                **(env or {}),
            },  # explicit: C-level changes to this process's environment (readline sets LINES) stay out
            stdin=subprocess.DEVNULL,  # the workers inherit it: never the test runner's (xdist's channel)
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        # A thread copies stderr to the file and wakes wait_for_stderr; the agent never blocks on a full pipe.
        self._stderr_pump = threading.Thread(target=self._pump_stderr, daemon=True)
        self._stderr_pump.start()
        assert self.proc.stdout is not None
        self._stdout = self.proc.stdout
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._stdout, selectors.EVENT_READ)
        self._buffer = b""
        self.lines: list[str] = []
        self._logs, self._run_id = tmp_path / f"logs{suffix}", run_id

    @property
    def run_dir(self) -> Path:
        """Without a run id (torchrun's default, "none"), the run is named after the script and its start."""
        if self._run_id is not None:
            return self._logs / self._run_id
        return max(self._logs.iterdir(), key=lambda d: d.stat().st_mtime)

    def wait_for_lines(self, pattern: str, count: int, timeout: float = WAIT_S) -> list[re.Match[str]]:
        """Block until ``count`` stdout lines match ``pattern`` (or fail after ``timeout``)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            found = [m for m in map(regex.search, self.lines) if m]
            if len(found) >= count:
                return found
            left = deadline - time.monotonic()
            if left <= 0 or not self._selector.select(left):
                raise AssertionError(
                    f"{count} lines like {pattern!r} not seen in {timeout} s; saw {self.lines}; the agent then:\n"
                    f"{where_it_waits(self.proc.pid) if self.proc.poll() is None else 'exited'}"
                )
            chunk = os.read(self._stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"ftrun closed stdout; saw {self.lines}; stderr: {self.stderr()}")
            self._buffer += chunk
            *complete, self._buffer = self._buffer.split(b"\n")
            self.lines += [line.decode(errors="replace") for line in complete]

    def _pump_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            self._stderr.write(line)
            self._stderr.flush()
            with self._stderr_changed:
                self._stderr_lines.append(line)
                self._stderr_changed.notify_all()
        with self._stderr_changed:
            self._stderr_lines.append("")  # end of stream
            self._stderr_changed.notify_all()

    def wait_for_stderr(self, pattern: str, timeout: float = WAIT_S) -> str:
        """Block until ftrun writes a stderr line matching ``pattern``; returns the line."""
        regex = re.compile(pattern)

        def seen() -> str | None:
            return next((line for line in self._stderr_lines if regex.search(line)), None) or (
                "" if self._stderr_lines[-1:] == [""] else None
            )

        with self._stderr_changed:
            line = self._stderr_changed.wait_for(seen, timeout)
        if not line:
            alive = where_it_waits(self.proc.pid) if self.proc.poll() is None else "exited"
            raise AssertionError(f"no stderr line like {pattern!r} in {timeout} s; stderr: {self.stderr()}; {alive}")
        return line

    def wait(self, timeout: float = WAIT_S) -> int:
        """Wait for ftrun to exit; then ``lines`` holds all it wrote to stdout."""
        code = self.proc.wait(timeout)
        self._stderr_pump.join(timeout)
        with contextlib.suppress(AssertionError):  # reads to the end of stdout; ends with "closed stdout"
            self.wait_for_lines(r"(?!)", 1, timeout)
        return code

    def stderr(self) -> str:
        with self._stderr_changed:
            return "".join(self._stderr_lines)

    def events(self) -> list[dict[str, Any]]:
        """The agent's event log, found where it said its logs are (its run id may be the test's own)."""
        found = re.search(r"logs in (\S+)", self.wait_for_stderr(r"logs in \S+"))
        assert found
        return [json.loads(line) for line in (Path(found.group(1)) / "events.jsonl").read_text().splitlines()]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(WAIT_S)
        self._stderr_pump.join(WAIT_S)
        self._selector.close()
        self._stdout.close()
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        self._stderr.close()


WriteScript = Callable[[str, str], str]


# A worker never waits for the warm pool: the first attempt starts fresh unless a zygote is ready. A test of warm
# workers has its first attempt wait (in the job, bounded) until the agent saw a zygote with a preload ready, then
# fail, so that the body runs warm at attempt 1. Under --no-warm (no pool), run it with WAIT_FOR_POOL unset.
WAITS_FOR_THE_POOL = """
def wait_for_the_pool():
    import json as _json, os as _os, pathlib as _pathlib, time as _time
    events = _pathlib.Path(_os.environ["TORCHELASTIC_ERROR_FILE"]).parents[2] / "events.jsonl"
    deadline = _time.monotonic() + 60
    while _time.monotonic() < deadline:
        for line in events.read_text().splitlines():
            event = _json.loads(line)
            if event["kind"] == "pool_ready" and event["preload"]:
                return
        _time.sleep(0.02)
    raise SystemExit("the test's warm pool was not ready in 60 s")
"""
FAILS_ONCE_THE_POOL_IS_READY = (
    WAITS_FOR_THE_POOL
    + """
import os as _os
if _os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    if _os.environ.get("WAIT_FOR_POOL"):
        wait_for_the_pool()
    raise SystemExit(3)
"""
)
POOL = {"WAIT_FOR_POOL": "1"}  # run_ftrun(..., env=POOL): FAILS_ONCE_THE_POOL_IS_READY waits for the pool


def restarted_warm(body: str) -> str:
    """A script whose first attempt fails (with env POOL: once the warm pool is ready), then runs ``body``."""
    return FAILS_ONCE_THE_POOL_IS_READY + textwrap.dedent(body)


def until(check: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
    """Poll ``check`` (state another process changes, with nothing to wait on) until it returns something true."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen in {timeout} s: {what}")
        time.sleep(0.1)


def write_gate(fifo: Path, text: str, timeout: float = WAIT_S) -> None:
    """Write ``text`` into a FIFO a worker reads, once it has it open: a bounded wait (opening a FIFO to write
    blocks until a reader comes, and a worker that died never comes)."""

    def opened() -> int | None:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:  # ENXIO: no reader yet
            if e.errno != errno.ENXIO:
                raise
            return None

    fd = until(opened, f"a reader of {fifo.name}", timeout)
    try:
        os.set_blocking(fd, True)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Wait (on pidfds, not by polling) until the processes exit; returns those still alive."""
    alive = []
    deadline = time.monotonic() + timeout
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                if not sel.select(max(0.0, deadline - time.monotonic())) and not _zombie(pid):
                    alive.append(pid)
        finally:
            os.close(fd)
    return alive


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(")") + 2] in "ZX"


# --- stores for several agents (tcp: a separate `ftrun store` process, so that any agent can be killed) ---

CONF = "last_call_timeout=0.5,keep_alive_interval=0.5,keep_alive_max_attempt=2,join_timeout=60,close_timeout=20"


NOBODY = 65534


def as_nobody(argv: Sequence[str], nproc: int, scratch: Path) -> list[str] | str:
    """``argv`` run as the user nobody under ``prlimit --nproc`` (the kernel never applies the limit to root),
    or why it cannot be here. A private mount namespace makes the way to this Python, its environment and ftrun
    searchable by nobody where a directory of root's blocks it (pyenv under a 0700 /root, CI's 0700 virtual
    environment): a 0711 tmpfs over that directory, with each of its entries bound back into it from
    ``scratch``."""
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("unshare", "setpriv", "prlimit")):
        return "needs root, unshare, setpriv and prlimit"
    needed = [Path(sys.executable), Path(os.path.realpath(sys.executable)), Path(sys.prefix), Path(__file__)]
    blocked: set[Path] = set()  # every directory on the way that others cannot search, the outer ones first
    for path in needed:
        way = [*reversed(path.resolve().parents), path.resolve()] if path.is_dir() else [*reversed(path.parents)]
        blocked |= {d for d in way if d.is_dir() and not os.stat(d).st_mode & 0o001}
    script = ["set -e"]
    for i, directory in enumerate(sorted(blocked, key=lambda d: len(d.parts))):
        hold = scratch / f"view-{i}"
        hold.mkdir()
        script += [f"mount --bind {directory} {hold}", f"mount -t tmpfs -o mode=0711,size=1m tmpfs {directory}"]
        for entry in sorted(directory.iterdir()):
            if entry.is_symlink():
                script.append(f"ln -s {os.readlink(entry)} {entry}")
                continue
            script.append(f"mkdir {entry}" if entry.is_dir() else f"touch {entry}")
            script.append(f"mount --bind {hold / entry.name} {entry}")
    script.append(f'exec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups -- prlimit --nproc={nproc} "$@"')
    return ["unshare", "-m", "sh", "-c", "\n".join(script), "sh", *argv]
