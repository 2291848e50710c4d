"""The worker's side of hang detection: heartbeats and sections written into shared memory.

The hot path makes no system call and allocates nothing: a heartbeat is a
clock read (vDSO) and one store into the mapped slot; a section start or end
is four. The one exception is the worker's first heartbeat under ``--warm
auto``, which writes the list of imported modules to a file, once. If the agent
dies or stalls, the mapping stays valid and every call still returns at once.
Outside ftrun (no ``FTRUN_MONITOR`` in the environment) every call does
nothing, after one warning, so the same script runs under plain ``python``.

Per process, not per thread: sections opened from several threads share one
slot. Every write the agent must see whole (sections, flags, published JSON) is
made under one re-entrant lock, and only the outermost write bumps the slot's
sequence number: two threads (or a signal handler inside a write) can never
leave it odd, which would leave the rank unwatchable.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol, cast

from ftrun.worker import collectives, layout
from ftrun.worker.flush import flush_open_files
from ftrun.worker.imports import report_modules
from ftrun.worker.signals import REQUEST_SIGNAL, STACK_SIGNAL, check_header
from ftrun.worker.timeouts import LEARNED_FLOOR_S, Timeouts, scaled, spawned_at
from ftrun.worker.unattached import Unattached

DEFAULT_SAFETY_FACTOR = 5.0
_now = time.monotonic  # CLOCK_MONOTONIC, as the agent reads it; a test may set another clock here


class _Attached:
    """The client of a worker under ftrun: owns its slot of the monitor table."""

    @classmethod
    def attach(cls, path: str, slot: int, environ: Mapping[str, str]) -> _Attached:
        """The client of ``slot`` in the table at ``path``, announced in it (and its stacks dumped on request)."""
        fd = os.open(path, os.O_RDWR)
        try:
            table = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        check_header(table, slot)
        client = cls(table, slot, environ)
        client._announce(environ.get("FTRUN_STACKS_FILE"))
        return client

    def __init__(self, table: mmap.mmap, slot: int, environ: Mapping[str, str]) -> None:
        """Use :meth:`attach`."""
        self._map = table
        self._stacks_fd = -1
        self._base = layout.slot_offset(slot)
        self._beat_at = self._base + layout.OFF_BEAT
        self._idle_at = self._base + layout.OFF_IDLE
        self._step_at = self._base + layout.OFF_STEP
        self._paced = 0  # steps timed (ftrun.worker.pace)
        self._seq = 0
        self._writing = threading.RLock()  # sections from several threads; a signal handler inside a write
        self._depth = 0  # nested writes on one thread: only the outermost bumps the sequence number
        self._beats = 0
        self.in_charge = False  # the job called heartbeat() or opened a section itself: no automatic beats
        self._last_beat = 0.0
        self._open: dict[str, int] = {}  # name -> entry index
        self._started: dict[str, float] = {}
        self._free = list(range(layout.MAX_OPEN - 1, -1, -1))
        self._names: dict[str, bytes] = {}
        self._flags = 0
        self._agent = int(environ.get("FTRUN_AGENT_PID") or os.getppid())
        self._safety_factor = float(environ.get("FTRUN_SAFETY_FACTOR") or DEFAULT_SAFETY_FACTOR)
        self._modules_file = environ.get("FTRUN_MODULES_FILE", "")
        self._watch_collectives = environ.get("FTRUN_WATCH_COLLECTIVES") != "0"  # 0: --no-hang-detection
        self._modules_told = 0  # len(sys.modules) at the last report
        # --learn-timeouts: every this many automatic steps, the heartbeat timeout is learned from the gaps seen.
        self._learn_after = _int(environ.get("FTRUN_LEARN_AFTER"))
        self._learned_floor = float(environ.get("FTRUN_LEARNED_FLOOR") or LEARNED_FLOOR_S)
        self._steps = 0
        self._named_step: int | None = None  # by ftrun.snapshot or ftrun.restore: the step computed next
        # What was observed, for calculate_timeouts().
        self._attached = _now()
        self._pid = os.getpid()  # a child forked from the rank that ends through Python is not the rank's end
        # Start-up is measured from when the agent started this process, the basis it judges it on.
        self._spawned = spawned_at(environ, self._attached)
        self._idle_since = 0.0  # out of section counts from the end of the first section
        self._first_beat: float | None = None
        self._longest_beat_gap = 0.0
        self._longest_idle = 0.0
        self._longest_section: dict[str, float] = {}
        self._calculated = Timeouts()
        handed = environ.get("FTRUN_MONITOR_TIMEOUTS")
        if handed:  # kept by the agent from an earlier attempt
            self._calculated = Timeouts.from_json(json.loads(handed))

    def _announce(self, stacks: str | None) -> None:
        if stacks:
            # The agent's fallback when py-spy is missing: all threads' stacks, written from the
            # C signal handler, so it works while the main thread holds the GIL in C code.
            # A bare descriptor: faulthandler writes to the fd, a text file object would only cost start-up time.
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
            self._stacks_fd = os.open(stacks, flags, 0o600)
            faulthandler.register(STACK_SIGNAL, file=self._stacks_fd, all_threads=True)
            self._flags |= layout.FLAG_STACKS
        layout.IDLE.pack_into(self._map, self._idle_at, self._idle_since, 0, self._flags)
        layout.STEP.pack_into(self._map, self._step_at, -1)
        layout.FIRST_STEP.pack_into(self._map, self._base + layout.OFF_FIRST_STEP, -1)
        layout.IDENTITY.pack_into(self._map, self._base + layout.OFF_IDENTITY, os.getpid(), self._attached)
        atexit.register(self._exiting)

    def close(self) -> None:
        """Let go of the table: for tests, which attach many clients in one process (a worker keeps its one
        client for life)."""
        atexit.unregister(self._exiting)
        if self._flags & layout.FLAG_STACKS:
            faulthandler.unregister(STACK_SIGNAL)
            os.close(self._stacks_fd)
        self._map.close()

    def script_ended(self, code: int) -> None:
        """The script itself is over with ``code``; what comes next is the interpreter's teardown. After a
        failure the agent may restart at once, beside the teardown (atexit handlers, torch's finalizers: 30-100
        ms), which it leaves to finish unkilled: the job's open files are flushed first (:mod:`.flush`)."""
        if os.getpid() != self._pid:
            return
        layout.ENDED.pack_into(self._map, self._base + layout.OFF_ENDED, _now(), code)
        self._flags |= layout.FLAG_EXITING
        self._write_flags()
        if code:
            flush_open_files()
            self._wake_agent()  # before its peers notice the exit

    def _wake_agent(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self._agent, REQUEST_SIGNAL)

    def _exiting(self) -> None:
        """The script is over: the interpreter's teardown (joining threads, torch) is not a hang."""
        if os.getpid() != self._pid:
            return
        self._flags |= layout.FLAG_EXITING
        self._write_flags()
        self.report_imports()

    def report_imports(self) -> None:
        """--warm auto: what the job imported, for the warm pool; from the job's thread (see worker.imports)."""
        if self._modules_file:
            self._modules_told = len(sys.modules)
            report_modules(self._modules_file)

    def meeting(self, on: bool) -> None:
        """In init_process_group (``on``) or out of it: the agent tells a long wait for the other ranks. Its
        imports have settled by then: told now, a worker that dies before its first step has taught the pool."""
        self._flags = self._flags | layout.FLAG_MEETING if on else self._flags & ~layout.FLAG_MEETING
        self._write_flags()
        if on:
            self.report_imports()
        elif self._watch_collectives:  # met: its process groups are made next, watched from then on
            collectives.watch(self._collectives)

    def restartable(self) -> None:
        """Its function restarts in place (ftrun.restartable): the agent interrupts it rather than stop it."""
        self._flags |= layout.FLAG_RESTARTABLE
        self._write_flags()

    def _collectives(self, raw: bytes) -> None:
        """From the watcher's thread, outside the seqlock: the other buffer, then the head (layout)."""
        if len(raw) <= layout.COLLECTIVES_MAX:
            (seq, _) = layout.COLLECTIVES_HEAD.unpack_from(self._map, self._base + layout.OFF_COLLECTIVES_HEAD)
            at = self._base + layout.collectives_buffer(seq + 1)
            self._map[at : at + len(raw)] = raw
            layout.COLLECTIVES_HEAD.pack_into(self._map, self._base + layout.OFF_COLLECTIVES_HEAD, seq + 1, len(raw))

    def _write_flags(self) -> None:
        with self._seqlock():
            layout.IDLE.pack_into(self._map, self._idle_at, self._idle_since, len(self._open), self._flags)

    def _seqlock(self) -> _Attached:
        """``with self._seqlock():`` a write the agent must see whole: the sequence number is odd during it (the
        agent retries its copy). The client is its own context manager: nothing is allocated per write."""
        return self

    def __enter__(self) -> None:
        self._writing.acquire()
        self._depth += 1
        if self._depth == 1:
            self._seq += 1
            try:
                layout.SEQ.pack_into(self._map, self._base, self._seq)
            except BaseException:  # no __exit__ after a failed __enter__: never leave the lock held
                self._depth -= 1
                self._writing.release()
                raise

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._seq += 1
            layout.SEQ.pack_into(self._map, self._base, self._seq)
        self._writing.release()

    # --- the hot path --------------------------------------------------------------------------

    def heartbeat(self, step: int | None = None) -> None:
        self.in_charge = True
        if step is not None:
            layout.STEP.pack_into(self._map, self._step_at, step)
        self._beat(step)

    def name_step(self, step: int) -> None:
        self._named_step = step
        layout.STEP.pack_into(self._map, self._step_at, step)

    def auto_heartbeat(self) -> None:
        """An optimizer step (ftrun's automatic heartbeat): counts only while the job does not beat on its own."""
        if not self.in_charge:
            self._beat()
            self._steps += 1
            if self._learn_after and self._steps % self._learn_after == 0:
                self._learn()

    def auto_progress(self) -> None:
        """A batch from a DataLoader: progress (an evaluation loop has no optimizer steps), not a step."""
        if not self.in_charge:
            self._beat()

    def _learn(self) -> None:
        """--learn-timeouts: the longest gap between automatic beats x the safety factor, at least the floor;
        it only grows (an evaluation or checkpoint phase seen once widens it for good)."""
        learned = max(self._learned_floor, self._longest_beat_gap * self._safety_factor)
        if self._calculated.heartbeat is None or learned > self._calculated.heartbeat:
            self.set_timeouts(self._calculated.widest(Timeouts(heartbeat=learned)))

    def _beat(self, step: int | None = None) -> None:
        now = _now()
        last = self._last_beat
        if last:
            self._longest_beat_gap = max(self._longest_beat_gap, now - last)
        else:
            self._first_beat = now - self._spawned
            # Before first_beat, which tells the agent it is there: the step the attempt resumed at.
            first = self._named_step if step is None else step
            layout.FIRST_STEP.pack_into(self._map, self._base + layout.OFF_FIRST_STEP, -1 if first is None else first)
            layout.FIRST_BEAT.pack_into(self._map, self._base + layout.OFF_FIRST_BEAT, now)
        self._last_beat = now
        self._beats += 1
        if not self._beats & (self._beats - 1) and len(sys.modules) != self._modules_told:
            # Steps 1, 2, 4, 8...: what the job imported at its first steps (lazily: DDP's, the optimizer's,
            # torch._dynamo) is what a warm pool should preload; told again only when it grew, never per step.
            self.report_imports()
        layout.BEAT.pack_into(self._map, self._beat_at, now, self._beats)

    def paced(self, compute_s: float, step_s: float) -> None:
        """A step timed (:mod:`ftrun.worker.pace`): into the ring first, then the count that shows it."""
        n = self._paced
        layout.PACE.pack_into(self._map, self._base + layout.pace_entry(n), compute_s, step_s)
        self._paced = n + 1
        layout.PACED.pack_into(self._map, self._base + layout.OFF_PACED, n + 1)

    def start_section(self, name: str) -> None:
        self.in_charge = True
        encoded = self._names.get(name) or self._encode(name)
        with self._seqlock():
            if name in self._open:
                raise ValueError(f"section {name!r} is already open: end it before opening it again")
            if not self._free:
                raise ValueError(f"more than {layout.MAX_OPEN} sections open at once (opening {name!r})")
            entry = self._free.pop()
            now = _now()
            if not self._open and self._idle_since and now - self._idle_since > self._longest_idle:
                self._longest_idle = now - self._idle_since
            self._open[name] = entry
            self._started[name] = now
            self._write_entry(entry, now, encoded)

    def end_section(self, name: str) -> None:
        with self._seqlock():
            entry = self._open.pop(name, None)
            if entry is None:
                raise ValueError(f"section {name!r} is not open")
            now = _now()
            took = now - self._started.pop(name)
            if took > self._longest_section.get(name, 0.0):
                self._longest_section[name] = took
            self._free.append(entry)
            if not self._open:
                self._idle_since = now
            self._write_entry(entry, 0.0, b"")

    def _write_entry(self, entry: int, start: float, encoded: bytes) -> None:
        """(Under the seqlock.)"""
        m, base = self._map, self._base
        layout.ENTRY.pack_into(m, base + layout.OFF_ENTRIES + entry * layout.ENTRY.size, start, len(encoded), encoded)
        layout.IDLE.pack_into(m, self._idle_at, self._idle_since, len(self._open), self._flags)

    def _encode(self, name: str) -> bytes:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a section name must be a non-empty string, got {name!r}")
        encoded = name.encode()
        if len(encoded) > layout.NAME_MAX:
            raise ValueError(f"section name {name!r} is longer than {layout.NAME_MAX} bytes")
        self._names[name] = encoded
        return encoded

    def end_all_sections(self) -> None:
        for name in list(self._open):
            self.end_section(name)

    # --- timeouts ------------------------------------------------------------------------------

    def observed(self) -> Timeouts:
        idle = self._longest_idle
        if not self._open and self._idle_since:
            idle = max(idle, _now() - self._idle_since)
        return Timeouts(
            self._first_beat,
            self._longest_beat_gap or None,
            idle or None,
            dict(self._longest_section),
        )

    def fresh_timeouts(self, safety_factor: float | None) -> Timeouts:
        """What was observed so far, times the safety factor (nothing is set)."""
        return scaled(self.observed(), safety_factor or self._safety_factor)

    def calculate_timeouts(self, safety_factor: float | None) -> Timeouts:
        fresh = self.fresh_timeouts(safety_factor)
        self.set_timeouts(self._calculated.widest(fresh))
        return self._calculated

    def set_timeouts(self, timeouts: Timeouts) -> None:
        """Publish calculated timeouts in the slot; the agent applies (and keeps) them."""
        self._calculated = timeouts
        raw = json.dumps(timeouts.to_json()).encode()
        if len(raw) > layout.TIMEOUTS_MAX:
            raise ValueError(f"too many section timeouts to publish ({len(raw)} bytes of JSON)")
        self._publish(layout.TIMEOUTS_HEAD, layout.OFF_TIMEOUTS_HEAD, layout.OFF_TIMEOUTS, raw)

    @property
    def calculated(self) -> Timeouts:
        return self._calculated

    def _publish(self, head: struct.Struct, head_at: int, data_at: int, raw: bytes) -> None:
        """Write ``raw`` in one of the slot's JSON areas and bump its sequence number, under the seqlock."""
        m, base = self._map, self._base
        with self._seqlock():
            (seq, *_) = head.unpack_from(m, base + head_at)
            m[base + data_at : base + data_at + len(raw)] = raw
            head.pack_into(m, base + head_at, seq + 1, len(raw))

    def request(self, raw: bytes) -> None:
        """Write a workload control request in the slot, then wake the agent (rare: never in the hot path)."""
        self._publish(layout.REQUEST_HEAD, layout.OFF_REQUEST_HEAD, layout.OFF_REQUEST, raw)
        os.kill(self._agent, REQUEST_SIGNAL)


def _int(text: str | None) -> int:
    return int(text) if text and text.isdigit() else 0


def attach() -> None:
    """Attach to the agent's monitor table now rather than at the first call (ftrun's worker start-up)."""
    _attach()


def auto_heartbeat() -> None:
    """ftrun's automatic heartbeat (an optimizer step), ignored once the job beats on its own."""
    _client.auto_heartbeat()


def paced(compute_s: float, step_s: float) -> None:
    """A step's times (ftrun's hooks, :mod:`ftrun.worker.pace`)."""
    _client.paced(compute_s, step_s)


def auto_progress() -> None:
    """ftrun's automatic progress beat (a DataLoader batch), ignored once the job beats on its own."""
    _client.auto_progress()


def meeting_peers(on: bool) -> None:
    """The job is in init_process_group, meeting the other ranks (``on``), or done with it (ftrun's hook)."""
    _client.meeting(on)


def restartable() -> None:
    """This rank's function restarts in place (see :mod:`ftrun.worker.in_place`)."""
    if os.environ.get("FTRUN_MONITOR"):
        _client.restartable()


def reattach() -> None:
    """Attach to the slot the environment names now: a rank restarted in place, in its next attempt's table."""
    if isinstance(_client, _Attached):
        _client.close()
    _attach()


def script_ended(code: int) -> None:
    """Tell the agent the script is over (with ``code``), so that a hang in the interpreter's teardown after it
    is known for what it is. Called by ftrun's own worker start-up, not by jobs."""
    if os.environ.get("FTRUN_MONITOR"):
        _client.script_ended(code)


class _Client(Protocol):
    """What the worker API calls: the attached client (:class:`_Attached`) or, outside ftrun, :class:`Unattached`."""

    @property
    def calculated(self) -> Timeouts: ...

    def heartbeat(self, step: int | None = None) -> None: ...

    def name_step(self, step: int) -> None: ...

    def auto_heartbeat(self) -> None: ...

    def auto_progress(self) -> None: ...

    def paced(self, compute_s: float, step_s: float) -> None: ...

    def start_section(self, name: str) -> None: ...

    def end_section(self, name: str) -> None: ...

    def end_all_sections(self) -> None: ...

    def request(self, raw: bytes) -> None: ...

    def calculate_timeouts(self, safety_factor: float | None) -> Timeouts: ...

    def fresh_timeouts(self, safety_factor: float | None) -> Timeouts: ...

    def set_timeouts(self, timeouts: Timeouts) -> None: ...

    def script_ended(self, code: int) -> None: ...

    def restartable(self) -> None: ...

    def meeting(self, on: bool) -> None: ...


class _NotYet:
    """Before the first call: attach (or not) on first use, then get out of the way (it stands for either)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_attach(), name)


_client: _Client = cast("_Client", _NotYet())


def _attach() -> _Attached | Unattached:
    # The one place that replaces the client: the hot path then reads a plain global.
    global _client  # noqa: PLW0603
    path, slot = os.environ.get("FTRUN_MONITOR"), os.environ.get("FTRUN_MONITOR_SLOT")
    client: _Attached | Unattached
    if not path or slot is None:
        client = Unattached("not running under ftrun (no FTRUN_MONITOR)")
    else:
        try:
            client = _Attached.attach(path, int(slot), os.environ)
        except (OSError, ValueError) as e:
            client = Unattached(f"cannot attach to the monitor table {path}: {e}")
    _client = client
    return client


# --- the worker API (re-exported by ``ftrun``) -------------------------------------------------


def heartbeat(step: int | None = None) -> None:
    """Tell ftrun this worker is making progress; ``step``, the job's own step number, lets ftrun tell how
    much work a failure cost (a restarted job resumes from its checkpoint's step)."""
    _client.heartbeat(step)


def name_step(step: int) -> None:
    """The step the job will compute next (``ftrun.snapshot``, ``ftrun.restore``), for lost work: unlike a
    heartbeat, the automatic beats go on."""
    _client.name_step(step)


def request(raw: bytes) -> None:
    """Write an encoded workload control request for the agent (see :mod:`ftrun.worker.workload`)."""
    _client.request(raw)
