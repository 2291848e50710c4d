"""What the agent watches in its running workers besides their exits: hang deadlines (the monitor table),
scripts stuck in the interpreter's teardown, torch's FileTimer, and ranks long in ``init_process_group``.

The local group asks it when to look next and calls :meth:`WorkerWatch.check`
when it wakes; the watch acts on what it finds (stacks dumped into the rank's
log, off the loop; the hang or timer signal sent, a stuck teardown ended) and
tells through the group's ``emit`` and ``say``. It returns the workers found
hung, once their stacks are in: for the driver, a hang is a failure like any
other.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from ftrun.clock import Clock
from ftrun.config import LaunchConfig
from ftrun.monitor.blame import suspect, waiting_in_collective
from ftrun.monitor.collectives import Patience
from ftrun.monitor.dumps import StackDumps
from ftrun.monitor.filetimer import FileTimerServer
from ftrun.monitor.hangs import Found, HangWatch
from ftrun.monitor.pace import PaceWatch
from ftrun.monitor.pace import Share as PaceShare
from ftrun.monitor.stalls import PeersCollectives, Stalled, StallWatch, Unmoved
from ftrun.monitor.watchdog import TEARDOWN
from ftrun.observe.events import EventKind
from ftrun.procs import proctree
from ftrun.procs.signals import name as signal_name
from ftrun.procs.workers import Hang, Worker, WorkerState
from ftrun.reminder import Reminder
from ftrun.worker.layout import FLAG_EXITING, FLAG_MEETING, SlotView
from ftrun.worker.requests import Request
from ftrun.worker.timeouts import Timeouts

STACKS_FILE = "stacks.txt"  # per rank: where a worker's faulthandler writes when asked
COLLECTIVE = "collective"  # the timer of a hang found with no flag, by the collectives

Emit = Callable[..., None]
Say = Callable[..., None]


class WorkerWatch:
    @classmethod
    def open(cls, config: LaunchConfig, clock: Clock, emit: Emit, say: Say) -> WorkerWatch:
        """The watch, serving torch's FileTimer pipe when --file-timer asks for it."""
        return cls(config, clock, emit, say, FileTimerServer.serve(config.file_timer) if config.file_timer else None)

    def __init__(self, config: LaunchConfig, clock: Clock, emit: Emit, say: Say, timer: FileTimerServer | None) -> None:
        """Use :meth:`open`."""
        self._config = config
        self._clock = clock
        self._emit = emit
        self._say = say
        self.hangs = HangWatch(config.hang, clock, say, self._timeouts_changed)
        self.timer = timer  # torch's FileTimer
        stragglers = config.stragglers
        self.pace = PaceWatch(
            clock, emit, say, enabled=stragglers.enabled, threshold=stragglers.threshold, exclude=stragglers.exclude
        )
        self.meeting = MeetingNotice(awaited(config))
        self.stalls = StallWatch(config.hang.collectives, clock, Patience(config.hang.quiet_s))
        self._told = False  # what is watched for, said at the first attempt
        self._meeting_look_at = 0.0  # monotonic: when the ranks' slots are next read for a long init
        # What follows a dump: the worker found hung (blamed, signalled), or None (a stuck teardown, ended).
        self._dumps: StackDumps[Worker | None] = StackDumps(lambda w: w.paths.dir / STACKS_FILE)

    @property
    def fds(self) -> tuple[int, ...]:
        """Extra fds that wake the agent: a stack dump done, torch's timer pipe when served."""
        return (self._dumps.fileno(),) if self.timer is None else (self._dumps.fileno(), self.timer.fileno())

    def new_attempt(self, previous: list[Worker], nproc: int, tag: str, attempt_dir: Path, round_: int | None) -> None:
        if not self._told:
            self._told = True
            self._say(watching(self._config))
        if self.timer is not None:
            self.timer.forget({w.pid for w in previous})
        self._dumps.forget()
        self.hangs.new_attempt(nproc, tag)
        self.pace.new_attempt(round_, attempt_dir)
        self.stalls.new_attempt(round_)

    def share_board(self, pace: PaceShare, node: str, collectives: PeersCollectives) -> None:
        """The job has other nodes (this one is ``node``): stragglers and stalls are judged with their ranks."""
        self.pace.share, self.pace.node = pace, node
        self.stalls.share = collectives

    def env(self, local_rank: int, rank_dir: Path, spawned: float) -> dict[str, str]:
        env = {**self.hangs.env(local_rank, str(rank_dir / STACKS_FILE), spawned), **self.pace.env()}
        if self.timer is not None:
            env["TORCHELASTIC_TIMER_FILE"] = str(self.timer.path)
        return env

    def seconds_to_next_check(self, running: bool) -> float | None:
        """How long the agent may sleep (None: nothing to watch)."""
        checks = [self.hangs.seconds_to_next_check() if running else None, self.pace.seconds_to_next(running)]
        when = self.timer.next_expiration() if self.timer is not None else None
        checks.append(None if when is None else max(0.0, when - self._clock.wall()))
        return min((c for c in checks if c is not None), default=None)

    def mark_scripts_over(self, running: list[Worker]) -> None:
        """As a stop begins: which of ``running`` had ended their script (the stop cuts their teardown), for the
        report (a rank that ended while its peers still called collectives with it)."""
        for w in running:  # ended with an error (told, not yet taken): that error is its story, not its end
            slot = self.hangs.slot(w.local_rank)
            ended = slot is not None and slot.pid == w.pid and bool(slot.flags & FLAG_EXITING)
            w.script_over = ended and slot is not None and not (slot.ended and slot.end_code)
            if w.script_over and slot is not None and slot.ended:  # told on the workers' monotonic clock
                w.script_ended_wall = self._clock.wall() - (self._clock.monotonic() - slot.ended)

    def drain(self) -> None:
        """Read the timer requests waiting and the dumps' wake-ups (their pipes woke the agent)."""
        self._dumps.drain()
        if self.timer is not None:
            self.timer.drain()

    def check(self, running: list[Worker]) -> list[Worker]:
        """Act on every deadline passed (dumps started); returns the workers found hung whose stacks are in,
        blamed, not yet signalled (:meth:`condemn`)."""
        self._dumps.drain()
        hung = [w for w in self._dumps.finished() if w is not None]
        busy = self._dumps.busy()
        judged = [
            w for w in running if w.state is WorkerState.RUNNING and w.ended_code is None and w.local_rank not in busy
        ]
        for f in self.hangs.find(judged):
            if f.verdict.timeout == TEARDOWN and f.slot is not None:
                self._stuck_in_teardown(f.worker, f.slot.end_code)
            else:
                self._hung(f, [w for w in judged if w is not f.worker])
        for stalled in self.stalls.find([w for w in judged if w.state is WorkerState.RUNNING], self.hangs.slot):
            self._stalled(stalled, judged)
        while self.stalls.waits:
            self._say(self.stalls.waits.pop(0), always=True)
        for w, why in self.hangs.corrupt_slots(judged):
            self._dumps.start({w.local_rank: w}, self._listens([w]), partial(self._unwatchable, w, why))
        self._expire_timers(running)
        self.pace.check(judged, self.hangs.pace)
        if (now := self._clock.monotonic()) >= self._meeting_look_at:  # a wait of seconds: no need to look often
            self._meeting_look_at = now + MEETING_LOOK_S
            slots = [(w, self.hangs.slot(w.local_rank)) for w in judged]
            notice = self.meeting.check(now, [w.rank for w, s in slots if s is not None and s.flags & FLAG_MEETING])
            if notice:
                self._say(notice, always=True)
        return hung

    def condemn(self, w: Worker) -> None:
        """Act on a hung worker :meth:`check` returned: ``--hang-signal`` to its process group (when the agent
        decides: a node may first hear whether another node names the rank its own ranks wait for)."""
        w.send(self._config.hang.hang_signal)

    def unmoved(self, workers: list[Worker], every: bool) -> Unmoved:
        """A stop's watch of the ``workers`` found hung (``every``: of them all): those its signal leaves
        unmoved are not waited for."""
        return Unmoved(self._clock, [w for w in workers if every or w.hang is not None])

    def requests(self, running: list[Worker]) -> list[tuple[Worker, Request | str]]:
        """Workload control requests the workers wrote since the last look (or why one is unreadable)."""
        return self.hangs.requests(running)

    def close(self) -> None:
        if self.stalls.share is not None:
            self.stalls.share.follow(None)
        self._dumps.close()
        self.hangs.close()
        if self.timer is not None:
            self.timer.close()

    # --- what is done about it --------------------------------------------------------------------

    def _hung(self, found: Found, others: list[Worker]) -> None:
        """A rank missed a deadline: dump the stacks of every rank that went quiet with it (off the loop), then
        blame one (:meth:`_blame`)."""
        v = found.verdict
        when = (self._clock.monotonic(), self._clock.wall())  # the verdict's time, before any dump
        quiet = {found.worker.local_rank: found.worker}
        # Heartbeats stop together on every rank waiting for the hung one: their stacks tell them apart.
        # A section timeout names its rank on purpose; others are read only when they went quiet too.
        if not v.timeout.startswith("section"):
            for other in others:
                if self.hangs.quiet_for(other) >= v.limit_s / 2:
                    quiet[other.local_rank] = other
        listens = self._listens(list(quiet.values()), {found.worker.local_rank: found.slot})
        self._dumps.start(quiet, listens, partial(self._blame, found, quiet, when))

    def _blame(
        self, found: Found, quiet: dict[int, Worker], when: tuple[float, float], stacks: dict[int, str]
    ) -> Worker | None:
        """The hung rank, read from the quiet ranks' stacks: marked failed, its stacks logged, --hang-signal
        sent. None when it is no longer running (it exited while its stacks were read: its exit tells)."""
        quiet = {r: w for r, w in quiet.items() if not w.reaped and w.state is WorkerState.RUNNING}
        if found.worker.local_rank not in quiet:
            return None
        v = found.verdict
        now_mono, now_wall = when
        chosen, why = suspect(found.worker.local_rank, {r: stacks[r] for r in quiet})
        w = quiet[chosen]
        for rank, victim in quiet.items():
            if victim is not w:
                victim.waits_for(stacks[rank], waiting_in_collective(stacks[rank]) or "")
                _append(victim, f"quiet while rank {w.rank} hung; stacks of all threads:\n{stacks[rank]}")
        waiting = waiting_in_collective(stacks[chosen]) or ""
        w.blame(Hang(v.describe(), v.timeout, now_wall - (now_mono - v.deadline), stacks[chosen], why, waiting))
        self._emit(
            EventKind.HANG,
            **w.identity(),
            timeout=v.timeout,
            limit_s=v.limit_s,
            elapsed_s=v.elapsed_s,
            lag_s=now_mono - v.deadline,  # deadline -> verdict
            quiet_s=now_mono - v.last_activity,  # since its last heartbeat or section change
        )
        self._say(f"{w.who} {v.describe()}: {why}", always=True)
        _append(w, f"{v.describe()}; stacks of all threads:\n{stacks[chosen]}")
        return w

    def _stalled(self, s: Stalled, running: list[Worker]) -> None:
        """A rank the others wait for in a collective, showing no progress: its stacks and theirs read (off the
        loop), then it is blamed (:meth:`_blame_stall`)."""
        waiting = {rank for rank, _ in s.stall.waiting}
        quiet = {s.worker.local_rank: s.worker} | {w.local_rank: w for w in running if w.rank in waiting}
        self._dumps.start(quiet, self._listens(list(quiet.values())), partial(self._blame_stall, s, quiet))

    def _blame_stall(self, s: Stalled, quiet: dict[int, Worker], stacks: dict[int, str]) -> Worker | None:
        w = s.worker
        if w.reaped or w.state is not WorkerState.RUNNING:
            return None  # it exited meanwhile: its exit tells
        what = f"hang: {s.stall.describe(w.rank, time.strftime('%H:%M:%S', time.localtime(s.stall.since)))}"
        where = f"at {s.where}" if s.where else "its interpreter held: ftrun's thread in it cannot run"
        if s.stopped:
            where = "its process is stopped (SIGSTOP, a debugger)"
        why = f"it showed no progress for {s.quiet_s:.0f} s (stack, CPU time and I/O unchanged; {where})"
        for rank, victim in quiet.items():
            if victim is not w and not victim.reaped:
                victim.waits_for(stacks[rank], f"{s.stall.op} #{s.stall.seq}")
                _append(
                    victim, f"waiting for rank {w.rank} in {victim.waiting_in}; stacks of all threads:\n{stacks[rank]}"
                )
        w.blame(Hang(what, COLLECTIVE, self._clock.wall(), stacks[w.local_rank], why))
        self._emit(
            EventKind.HANG, **w.identity(), timeout=COLLECTIVE, limit_s=self.stalls.patience.quiet_s,
            elapsed_s=s.quiet_s, lag_s=0.0, quiet_s=s.quiet_s,
        )  # fmt: skip
        self._say(f"{w.who} {what}: {why}", always=True)
        _append(w, f"{what}; {why}; stacks of all threads:\n{stacks[w.local_rank]}")
        return w

    def _listens(self, workers: list[Worker], slots: dict[int, SlotView | None] | None = None) -> dict[int, bool]:
        """Whose client dumps its own stacks on STACK_SIGNAL (the fallback when py-spy is missing)."""
        known = slots or {}
        return {w.local_rank: self.hangs.client_listens(known.get(w.local_rank) or self.hangs.slot(w.local_rank))
                for w in workers}  # fmt: skip

    def _unwatchable(self, w: Worker, why: str, stacks: dict[int, str]) -> Worker | None:
        """Its monitor slot stayed unreadable (something in the job wrote over ftrun's shared memory): it could
        hang unseen from now on, so it fails here, with its stacks, rather than go on unwatched."""
        if w.reaped or w.state is not WorkerState.RUNNING:
            return None
        what = f"its monitor slot in shared memory is corrupt ({why}): ftrun could no longer watch it for hangs"
        w.blame(Hang(what, "monitor slot", self._clock.wall(), stacks[w.local_rank]))
        self._say(f"{w.who} {what}", always=True)
        _append(w, f"{what}; stacks of all threads:\n{stacks[w.local_rank]}")
        return w

    def _stuck_in_teardown(self, w: Worker, code: int) -> None:
        """Its script ended with ``code`` and the interpreter's teardown never did: end it (once its stacks are
        read, off the loop), keep the result."""
        w.script_ended(code)
        grace = self._config.hang.teardown_s
        self._emit(EventKind.TEARDOWN_STUCK, **w.identity(), end_code=code, grace_s=grace)
        self._say(
            f"{w.who}: its script ended (exit code {code}) but the interpreter's teardown is stuck after "
            f"{grace:g} s (e.g. torch's gloo teardown race); ending it, with the script's result",
            always=True,
        )
        self._dumps.start({w.local_rank: w}, {}, partial(self._end_teardown, w))

    def _end_teardown(self, w: Worker, stacks: dict[int, str]) -> None:
        _append(w, f"stuck in interpreter teardown after the script ended; stacks:\n{stacks[w.local_rank]}")
        if w.handle is not None and not w.reaped:
            w.handle.signal_group(signal.SIGKILL)

    def _expire_timers(self, running: list[Worker]) -> None:
        """torch's FileTimer: a worker whose timer expired gets the timer's signal (and is the root cause)."""
        if self.timer is None:
            return
        for e in self.timer.expired(self._clock.wall()):
            worker = next((w for w in running if w.pid == e.pid), None)
            if worker is None or e.signal <= 0:
                continue
            what = f"timer {e.scope!r} expired (torch FileTimer)"
            worker.blame(Hang(what, "file timer", e.expiration_wall))
            self._emit(EventKind.TIMER_EXPIRED, **worker.identity(), scope=e.scope, signal=signal_name(e.signal))
            self._say(f"{worker.who}: {what}; sending {signal_name(e.signal)}", always=True)
            proctree.signal_quietly(worker.pid, e.signal)  # the process, as torch's server does

    def _timeouts_changed(self, in_force: Timeouts) -> None:
        self._emit(EventKind.TIMEOUTS, **in_force.to_json())


def _append(w: Worker, text: str) -> None:
    with w.paths.stderr.open("a", encoding="utf-8") as log:  # the pump appends too (O_APPEND)
        log.write(f"\n[ftrun] {text}\n")


NOTICE_AFTER_S = 10.0  # a rank meeting its peers longer than this is told to wait (torch waits up to 30 min)
NOTICE_EVERY_S = 30.0  # and again, as long as it waits
MEETING_LOOK_S = 1.0  # how often the slots are read for it


def watching(config: LaunchConfig) -> str:
    """What ftrun watches for hangs, said once at the start, with how to change it."""
    t = config.hang.timeouts
    if not config.hang.collectives:
        return "hangs: only the timeouts given are watched (--no-hang-detection)" if t.any else "hangs: not watched"
    own = "; the timeouts given are watched too" if t.any else " (--hang-timeout S; sooner: --heartbeat-timeout S)"
    return (
        f"hangs: a rank its peers wait for in a collective, showing no progress for {config.hang.quiet_s:g} s, is "
        f"stopped and named{own}; --no-hang-detection turns this off"
    )


def awaited(config: LaunchConfig) -> str:
    """What ranks that wait in init_process_group wait for, and what the user can do, as far as the flags tell."""
    n = config.nnodes.max
    if n > 1 and not config.elastic:
        return (
            f"a static job of {n} nodes starts training once every node runs ftrun with --nnodes {n}, its own "
            f"--node-rank (0 to {n - 1}; this is node {config.node_rank}), --master-addr {config.master_addr} "
            f"and --master-port {config.master_port}"
        )
    if n > 1:
        return "ranks on other nodes of this round have not come (their agents' logs tell why)"
    return "every rank is on this node: torch's own store does not answer (a MASTER_ADDR that is not this machine?)"


class MeetingNotice:
    """PURE: says (after NOTICE_AFTER_S, then every NOTICE_EVERY_S) that ranks still wait in init_process_group
    for the rest of the world, and what for; torch itself says nothing until its timeout, 30 minutes later."""

    def __init__(self, awaited: str) -> None:
        self._awaited = awaited
        self._reminder = Reminder(NOTICE_AFTER_S, NOTICE_EVERY_S)

    def check(self, now: float, meeting: list[int]) -> str | None:
        """``meeting``: the ranks here in init_process_group now. Returns what to say, if it is time."""
        waited = self._reminder.due(now, bool(meeting))
        if waited is None:
            return None
        wait = "waiting" if waited < NOTICE_AFTER_S + NOTICE_EVERY_S else "still waiting"
        ranks = ", ".join(map(str, sorted(meeting)))
        return f"rank(s) {ranks} {wait} {waited:.0f} s in init_process_group for the other ranks: {self._awaited}"
