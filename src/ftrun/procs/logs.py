"""Worker output: one file per rank and stream, and the console as --redirects/--tee say.

Every stream goes through a pipe that a pump thread copies, unchanged, to the
file and, line by line and optionally prefixed with ``[<rank>]:``, to the
console where it shows there (a line left unfinished a while, a prompt, as it
is). The pump reads until every writer is gone, so lines written just before a
crash are kept. A stream that goes only to its
file is pumped too: a full or failing log disk then costs lines, counted and
said (:mod:`ftrun.procs.disk`), never the worker (writing to the file itself,
its ``print`` would raise ENOSPC into the job).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import shutil
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ftrun.config import NO_RUN_ID, LaunchConfig, LogSpec, Std
from ftrun.errors import ConfigError
from ftrun.node import process_limit
from ftrun.private import DIR_MODE, append_fd, make_dir, own_dir
from ftrun.procs import disk
from ftrun.worker.readable import wait_readable

_CHUNK = 65536
MAX_LINE = 65536  # a console line longer than this is shown cut (the rank's file keeps it whole)
# A traceback on a worker's stderr waits this long before the console shows it: a rank's peer raises within
# milliseconds of its crash ("Connection reset by peer"), and a busy agent may see the crash later; muted
# meanwhile (another rank failed first), it was that failure's echo, which the report sums up. The log has it
# at once, and a failed rank's own traceback is shown as soon as the agent has read all of its output.
TRACEBACK = b"Traceback (most recent call last)"
HOLD_S = 0.5
HOLD_BYTES = 1 << 20  # more than this (a worker printing tracebacks in a loop) is shown at once: memory bounded
# A line left unfinished this long goes to the console as it is (a prompt waiting for input: pdb's "(Pdb) "),
# the rest after it when it comes; the log file has every byte at once anyway.
PARTIAL_S = 0.25


class Console:
    """ftrun's own stdout/stderr, shared by every pump; whole lines, never interleaved (but after a line a pump
    left unfinished for PARTIAL_S: a prompt waits for its answer).

    A stream whose reader went away (``ftrun ... | head``) is dropped from then on:
    the files still get every line, and neither ftrun nor its workers are harmed.
    """

    def __init__(self, stdout: BinaryIO, stderr: BinaryIO) -> None:
        self._streams: dict[Std, BinaryIO | None] = {Std.OUT: stdout, Std.ERR: stderr}
        self._lock = threading.Lock()

    def write_lines(self, stream: Std, data: bytes) -> None:
        with self._lock:
            out = self._streams[stream]
            if out is None:
                return
            try:
                out.write(data)
                out.flush()
            except (BrokenPipeError, ValueError):  # the reader is gone (or the stream was closed)
                self._streams[stream] = None


class LineSink:
    """A file many pumps append whole lines to (--duplicate-std*-filters: ``filtered_stdout.log``)."""

    @classmethod
    def open(cls, path: Path) -> LineSink:
        make_dir(path.parent)
        return cls(append_fd(path), str(path))

    def __init__(self, fd: int, path: str = "") -> None:
        """Use :meth:`open`."""
        self._fd = fd
        self._path = path
        self._lock = threading.Lock()

    def write(self, lines: bytes) -> None:
        with self._lock:
            disk.write_all(self._fd, lines, self._path)

    def close(self) -> None:
        os.close(self._fd)


PIPE_STEM = "pipe_"  # NCCL's debug pipe, beside the recorder's dumps: torch makes <stem><rank>.pipe


@dataclass(frozen=True, slots=True)
class RankPaths:
    dir: Path
    stdout: Path
    stderr: Path
    error_file: Path
    # torch appends the rank to this name when it dumps its flight recorder. Every rank of the attempt dumps
    # into one directory, as torch's analyzer reads them (python -m torch.distributed.flight_recorder.fr_trace).
    flight_recorder: Path

    @staticmethod
    def under(attempt_dir: Path, rank: int) -> RankPaths:
        d = attempt_dir / str(rank)
        recorder = attempt_dir / "flight_recorder" / "rank_"
        return RankPaths(d, d / "stdout.log", d / "stderr.log", d / "error.json", recorder)

    def flight_recorder_dump(self, rank: int) -> Path | None:
        """The recorder's dump torch wrote at a process group's timeout (NCCL's watchdog), if it did."""
        dump = self.flight_recorder.with_name(f"{self.flight_recorder.name}{rank}")
        return dump if dump.exists() else None

    def flight_recorder_pipe(self, rank: int) -> Path:
        """NCCL's debug pipe: a line written into it makes the rank dump its recorder."""
        return self.flight_recorder.with_name(f"{PIPE_STEM}{rank}.pipe")


@dataclass(frozen=True, slots=True)
class Duplicate:
    """Lines containing any of ``needles`` also go, prefixed, to ``sink``."""

    needles: tuple[bytes, ...]
    sink: LineSink


def open_duplicates(spec: LogSpec, attempt_dir: Path) -> dict[Std, Duplicate]:
    """One filtered_std{out,err}.log per attempt for --duplicate-std*-filters (as torchrun's)."""
    found = {}
    for stream, name in ((Std.OUT, "filtered_stdout.log"), (Std.ERR, "filtered_stderr.log")):
        needles = spec.filters(stream)
        if needles:
            found[stream] = Duplicate(tuple(n.encode() for n in needles), LineSink.open(attempt_dir / name))
    return found


def close_duplicates(duplicates: dict[Std, Duplicate]) -> None:
    for d in duplicates.values():
        d.sink.close()


class _Pump(threading.Thread):
    """Copies a worker's stream to its file and, line by line, to the console and/or a duplicate sink."""

    def __init__(
        self,
        read_fd: int,
        file_fd: int,
        console: Console | None,
        stream: Std,
        prefix: bytes,
        duplicate: Duplicate | None,
        label: bytes,
        path: str = "",
    ) -> None:
        super().__init__(name=f"ftrun-pump-{label.decode(errors='replace')}{stream.name}", daemon=True)
        self._read_fd, self._file_fd, self._path = read_fd, file_fd, path
        self.console, self.stream, self._prefix = console, stream, prefix
        self._duplicate, self._label = duplicate, label
        self._progress = threading.Condition()  # notified each time it goes back to reading, and at the end
        self._reading = self._done = False
        self._held: list[bytes] = []  # console lines held since a traceback began (HOLD_S)
        self._hold_until = 0.0

    def run(self) -> None:
        pending = b""  # the start of a line not ended yet: at most MAX_LINE, looked through once
        shown = 0  # how much of it the console shows already (a line left unfinished a while: a prompt)
        due: float | None = None  # when the unshown rest of it goes to the console as it is
        try:
            while (chunk := self._read(due)) != b"":
                if chunk is None:  # no more of the line for PARTIAL_S: pdb's "(Pdb) ", a progress bar's dots
                    self._show(pending, shown, ended=False)
                    shown, due = len(pending), None
                    continue
                disk.write_all(self._file_fd, chunk, self._path)  # a full disk: dropped and counted, still read
                end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) + 1  # \r ends a progress bar's line
                if end:
                    self._show(pending + chunk[:end], shown)
                    pending, shown = chunk[end:], 0
                else:
                    pending += chunk
                if len(pending) > MAX_LINE:  # a line with no end in sight: shown cut, not kept in memory
                    self._show(pending + b"\n", shown)
                    pending, shown = b"", 0
                due = time.monotonic() + PARTIAL_S if len(pending) > shown else None
            if pending:
                self._show(pending + b"\n", shown)
            self.release()
        finally:
            os.close(self._read_fd)
            os.close(self._file_fd)
            with self._progress:
                self._done = True
                self._progress.notify_all()

    def _read(self, due: float | None) -> bytes | None:
        """The next chunk; b"" at the end; None when nothing came by ``due`` (monotonic)."""
        with self._progress:
            self._reading = True
            self._progress.notify_all()
        try:
            while True:
                now = time.monotonic()
                if self._held and now >= self._hold_until:  # checked at every read: the stream may never pause
                    self.release()  # the hold is over, and no other rank failed first
                if due is not None and now >= due:
                    return None
                hold = self._hold_until if self._held else None
                soonest = min((t for t in (hold, due) if t is not None), default=None)
                if wait_readable(self._read_fd, None if soonest is None else max(0.0, soonest - now)):
                    return os.read(self._read_fd, _CHUNK)
        finally:
            with self._progress:
                self._reading = False

    def caught_up(self, timeout_s: float) -> bool:
        """Wait until all that is in the pipe now has been copied: for writers that can write no more, but
        have not closed it yet (processes still exiting)."""

        def idle() -> bool:  # under the lock: while the pump is reading, its end of the pipe is open
            return self._done or (self._reading and _unread(self._read_fd) == 0)

        with self._progress:
            if not self._progress.wait_for(idle, timeout_s):
                return False
        self.release()  # what it wrote is read: its traceback goes to the console now, ahead of its report
        return True

    def release(self) -> None:
        """Show the console lines held since a traceback began (unless muted meanwhile). Under the lock, as
        :meth:`_show` writes, so that no later line of the stream overtakes them."""
        with self._progress:
            held, self._held = self._held, []
            if held and self.console is not None:
                self.console.write_lines(self.stream, b"".join(held))

    def mute(self) -> None:
        """Show nothing more on the console, nor what is held."""
        with self._progress:
            self.console = None
            self._held.clear()

    def _show(self, text: bytes, shown: int, *, ended: bool = True) -> None:
        """Whole lines to the duplicate sink; to the console what it does not show yet (past ``shown``), each
        line prefixed but one it shows the start of. ``ended``: False for a line's start, shown as it is."""
        if self._duplicate is not None and ended:
            wanted = [
                line for line in text.splitlines(keepends=True) if any(n in line for n in self._duplicate.needles)
            ]
            if wanted:
                self._duplicate.sink.write(b"".join(self._label + line for line in wanted))
        console = self.console  # the agent may mute it meanwhile
        lines = text[shown:]
        if console is None or not lines:
            return
        if self._prefix:
            parts = lines.splitlines(keepends=True)
            lines = (parts[0] if shown else self._prefix + parts[0]) + b"".join(self._prefix + p for p in parts[1:])
        with self._progress:
            if self._held or (self.stream is Std.ERR and TRACEBACK in lines):
                if not self._held:
                    self._hold_until = time.monotonic() + HOLD_S
                self._held.append(lines)
                if sum(map(len, self._held)) > HOLD_BYTES:
                    self._hold_until = 0.0  # the next look at the pipe shows it
            else:
                console.write_lines(self.stream, lines)


class RankOutput:
    """The stdout/stderr of one worker: fds to give the child, and the pumps that copy them.

    ``label``: the worker's line prefix (``[default0]:``), used when tee'd and in duplicate files;
    ``duplicates``: per stream, where lines matching --duplicate-std*-filters also go.
    """

    @classmethod
    def open(
        cls,
        paths: RankPaths,
        local_rank: int,
        spec: LogSpec,
        console: Console,
        label: str,
        duplicates: dict[Std, Duplicate] | None = None,
    ) -> RankOutput:
        """The worker's log files opened (created with its directory), with a pipe per stream ftrun copies."""
        make_dir(paths.dir)
        make_dir(paths.flight_recorder.parent)  # torch writes into it, creates nothing
        child_fds: dict[Std, int] = {}
        pumps: list[_Pump] = []
        for stream, path in ((Std.OUT, paths.stdout), (Std.ERR, paths.stderr)):
            file_fd = append_fd(path)
            shown = spec.console(local_rank, stream)
            duplicate = (duplicates or {}).get(stream)
            read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
            prefix = label.encode() if spec.prefixed(local_rank, stream) else b""
            child_fds[stream] = write_fd
            shown_on = console if shown else None
            pumps.append(_Pump(read_fd, file_fd, shown_on, stream, prefix, duplicate, label.encode(), str(path)))
        return cls(child_fds, pumps)

    def __init__(self, child_fds: dict[Std, int], pumps: list[_Pump]) -> None:
        """Use :meth:`open`."""
        self._child_fds = child_fds
        self._pumps = pumps

    @property
    def stdout_fd(self) -> int:
        return self._child_fds[Std.OUT]

    @property
    def stderr_fd(self) -> int:
        return self._child_fds[Std.ERR]

    def child_started(self) -> None:
        """Close the child's ends in the agent (the child has its copies)."""
        for fd in self._child_fds.values():
            os.close(fd)
        self._child_fds.clear()

    def start_copying(self) -> None:
        """Start the threads that copy the output (after every worker of the attempt is started: starting a
        thread waits for it to run, and a restart waits for no one). The pipe holds what comes meanwhile."""
        for pump in self._pumps:
            if pump.ident is None:  # not started yet
                process_limit.start(pump)

    def mute_errors(self) -> None:
        """Stop copying stderr to the console (the log keeps it all): after another rank failed, what this one
        writes there is the failure's echo ("Connection closed by peer"), summarised in the report instead."""
        for pump in self._pumps:
            if pump.stream is Std.ERR:
                pump.mute()

    def wait_caught_up(self, timeout_s: float) -> bool:
        """Wait until what the worker wrote is copied (it is ending: no more comes, but its pipes are open)."""
        return all(pump.caught_up(timeout_s) for pump in self._pumps)

    def wait_drained(self, timeout_s: float) -> bool:
        """Wait until every writer (the worker and its children) has closed the pipes."""
        for pump in self._pumps:
            if pump.ident is not None:  # started (a worker that could not be spawned has pumps never started)
                pump.join(timeout_s)
        return not any(p.is_alive() for p in self._pumps)


def _unread(fd: int) -> int:
    """Bytes waiting in a pipe."""
    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return buf[0]


TAIL_LINE_BYTES = 2000  # a longer line in a tail is cut to its start (the log keeps it whole)
TAIL_SCAN_BYTES = 16 << 20  # how far back the start of a long last line is looked for


def tail_lines(path: Path, count: int, max_bytes: int = 65536) -> list[str]:
    """The last ``count`` lines of a log file (decoded leniently), [] when missing. A line longer than
    TAIL_LINE_BYTES is cut to its start, where an exception's type and first words are (a 2 MB message), with
    its length said: even a last line longer than ``max_bytes`` is shown by its start."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - max_bytes)
            f.seek(start)
            lines = [(line, len(line)) for line in f.read().splitlines()]
            if start and lines and len(lines) <= count:  # the oldest line shown began before what was read
                lines[0] = _whole_start(f, start, lines[0][0])
    except FileNotFoundError:
        return []
    if start and len(lines) > count:
        lines = lines[1:]  # the first line is probably cut
    return [_cut(line, length) for line, length in lines[-count:]]


def _whole_start(f: BinaryIO, at: int, rest: bytes) -> tuple[bytes, int]:
    """The line whose end, ``rest``, starts at ``at``: its first TAIL_LINE_BYTES and its whole length."""
    begin = at
    while begin > 0 and at - begin < TAIL_SCAN_BYTES:
        step = min(65536, begin)
        f.seek(begin - step)
        block = f.read(step)
        found = max(block.rfind(b"\n"), block.rfind(b"\r"))
        if found >= 0:
            begin -= step - found - 1
            break
        begin -= step
    else:
        if begin > 0:  # no start within reach: its end it is, said to be cut
            return b"... " + rest[-TAIL_LINE_BYTES:], -1
    f.seek(begin)
    return (f.read(min(at - begin, TAIL_LINE_BYTES)) + rest)[: TAIL_LINE_BYTES + 1], at - begin + len(rest)


def _cut(line: bytes, length: int) -> str:
    """``length``: the whole line's, -1 when longer than TAIL_SCAN_BYTES."""
    text = line[:TAIL_LINE_BYTES].decode("utf-8", errors="replace")
    if 0 <= length <= TAIL_LINE_BYTES:
        return text
    of = f"{length} bytes" if length > 0 else f"over {TAIL_SCAN_BYTES >> 20} MiB"
    return f"{text} [... cut: a line of {of}, whole in the log]"


CarryOn = Callable[[Path, str, "int | None"], "Path | None"]  # (log dir, run name, SLURM node) -> run dir

KEEP_RUNS = 20  # run directories the default log directory keeps (the newest); a --log-dir of one's own keeps all


def open_run_dir(config: LaunchConfig, carry_on: CarryOn | None = None) -> tuple[Path, str]:
    """The run's new directory, and what to say of the old ones removed. Named after the run id; torchrun's
    default id, "none", names none: then the script and the start time do (train-20261126-175727). The default
    log directory, in the shared temp dir, keeps the KEEP_RUNS newest runs of its user; a --log-dir keeps all.
    After SLURM requeued the job, ``carry_on`` finds the directory of this node's start before, if any."""
    logs, name = config.logs, config.run_id
    if name == NO_RUN_ID:
        name = f"{Path(config.entrypoint.target).name.removesuffix('.py') or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"
    if config.requeued and carry_on and (before := carry_on(logs.base_dir, name, config.node_index)) is not None:
        return before, f"SLURM requeued the job ({config.requeued} time(s)): carrying on in {before}"
    try:
        run_dir = fresh_dir(logs.base_dir / name, shared_base=logs.shared_base)
    except OSError as e:  # a read-only mount, a path under a file, /proc: said before anything starts
        flag = "--log-dir" if not logs.shared_base else "the default log directory"
        raise ConfigError(flag, f"cannot create {logs.base_dir / name}: {e.strerror or e}",
                          "pass --log-dir DIR, a directory this user can write") from None  # fmt: skip
    if not logs.shared_base:
        return run_dir, ""
    runs = [d for d in logs.base_dir.iterdir() if (d / "events.jsonl").is_file()]
    runs.sort(key=last_written, reverse=True)
    recent = time.time() - 3600  # a run still going rewrites its status every second: never one of these
    old = [d for d in runs[KEEP_RUNS:] if last_written(d) < recent]
    for d in old:
        shutil.rmtree(d, ignore_errors=True)
    said = f"removed {len(old)} old run(s) from {logs.base_dir} (it keeps the {KEEP_RUNS} newest; --log-dir keeps all)"
    return run_dir, said if old else ""


def last_written(run_dir: Path) -> float:
    """When the run last wrote its events or its status (0: neither is there)."""
    times = [0.0]
    for name in ("events.jsonl", "status.json"):
        with contextlib.suppress(OSError):
            times.append((run_dir / name).stat().st_mtime)
    return max(times)


def fresh_dir(path: Path, *, shared_base: bool = False) -> Path:
    """``path``, or ``path.1``, ``path.2``...: a rerun with the same id never overwrites logs. A new directory,
    0700; ``shared_base``: its parent is in a shared directory and must be this user's own (see ftrun.private)."""
    if shared_base:
        own_dir(path.parent)
    else:
        make_dir(path.parent)
    candidates: Iterable[Path] = (path if n == 0 else path.with_name(f"{path.name}.{n}") for n in range(10_000))
    for candidate in candidates:
        try:
            candidate.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"{path}: too many runs with this id; pass another --rdzv-id")


def attempt_dir(run_dir: Path, attempt: int, warn: Callable[[str], None]) -> Path:
    """The attempt's directory in the run's; where the log disk refuses it (read-only after an I/O error, full),
    a new one elsewhere, said: the workers' error files, their peers' addresses and the report need a place."""
    wanted = run_dir / f"attempt_{attempt}"
    try:
        make_dir(wanted)
        return wanted
    except OSError as e:
        problem = e.strerror or str(e)
    for base in (None, "/dev/shm"):  # noqa: S108 - TMPDIR (else /tmp), then memory: mkdtemp, a new 0700 dir
        with contextlib.suppress(OSError):
            elsewhere = Path(tempfile.mkdtemp(prefix=f"ftrun-{run_dir.name}-attempt_{attempt}-", dir=base))
            warn(f"cannot create {wanted}: {problem}; this attempt's files are in {elsewhere}")
            return elsewhere
    raise OSError(f"cannot create {wanted} ({problem}), nor a directory in the temporary directory or /dev/shm")
