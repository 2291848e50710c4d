"""The warm pool: a Spawner that forks workers from pre-imported zygotes.

At start the pool launches a *base* zygote that preloads nothing (ready as soon
as Python is: forking from it is as fast as a fresh start) and, when something
is known to preload (``--preload``, the job's cache, its entry script's
imports), a second one that preloads it: the first attempt's workers wait for it
(it imports once what each would import, see :func:`policy.waited_for_first`).
From then on each spawn forks from the biggest *ready* zygote; with none ready
the worker starts fresh at once, as under torchrun: a restart never waits for the
pool. Zygotes started later preload at idle CPU priority (they use the cores the
workers leave, never slow them down) and stand still while a restart is under
way. Each zygote keeps twice as many standby workers forked ahead of time as the
node runs workers: a spawn hands a
standby its work in one message, and a failure that comes before the standbys
taken are forked again (half a second later, when the new workers have started)
still finds enough. When the workers report more imports, a bigger zygote is
started beside the others; smaller ones are closed only once a bigger one is
ready. Workers come out as the agent's own children (a pidfd and the real exit
status, as for a fresh process); they count as warm when their zygote preloaded
the job's imports (not the base zygote's bare Python).

Whatever goes wrong with a zygote (it died, or does not answer), the worker is
started fresh and the pool goes on without it; a module that makes a zygote unsafe
to fork (it starts a thread, initialises CUDA) is left out of every preload and
the rest preloaded without it: the job's result never depends on the pool. The
first trouble is said on the console, the others only with --verbose.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ftrun.clock import Clock, SystemClock
from ftrun.node.idle_cores import IdleCores
from ftrun.procs import proctree
from ftrun.procs.spawner import ProcessHandle, ProcessSpawner, signal_strays
from ftrun.warm import policy
from ftrun.warm.entry_reading import NOTHING, EntryReading
from ftrun.warm.policy import worker_request
from ftrun.warm.preload import Cache, first_step_imports_known, read_modules_report
from ftrun.warm.zygotes import GrownProcess, PoolError, Zygote
from ftrun.worker.fresh import ZYGOTE_THREADS

Say = Callable[[str], None]
FIRST_WAIT_S = 60.0  # see WarmPool._wait_for_first: about what a fresh worker's imports take on a busy node


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
        workers: int | None = None,
        cache: Cache | None = None,
        script: str | None = None,
        clock: Clock | None = None,
        spared: frozenset[int] = frozenset(),
        first_wait_s: float = FIRST_WAIT_S,
        varying: frozenset[str] = frozenset(),
        path0: str | None = None,
        cwd: str | None = None,
    ) -> None:
        """``standbys``: how many workers each zygote keeps forked ahead of time; ``workers``: the node's workers
        (default: ``standbys``); ``script``: the entry script's absolute path, compiled once in each zygote;
        ``first_wait_s``: how long the first attempt's workers wait for the zygote preloading what is known
        (0: they start fresh beside it, as before); ``varying``: the variables a worker's environment sets apart
        from ``env`` (its rank's): a module that reads one at import is the workers' own; ``path0`` and ``cwd``:
        the workers' sys.path[0] and directory, where the zygote's imports look as theirs do."""
        self._clock = clock or SystemClock()
        self._python = python
        self._script = script
        self._standbys = standbys
        self._env = env
        self._auto = auto
        self._cache = cache
        cached, self._import_s, files = cache.load() if cache is not None and auto else ([], None, {})
        self._trusted = list(preload)  # --preload: the user's word that the script's top changes nothing of them
        self._known = list(dict.fromkeys([*preload, *cached]))  # the most we know to preload
        self._reading: EntryReading = NOTHING  # the entry's leading block, replayed by each zygote before the rest
        self._files: dict[str, str | None] = dict(files)  # where the workers' imports found each top-level module
        self._varying = varying | frozenset(ZYGOTE_THREADS)
        self._where = {"path0": path0, "cwd": cwd}
        self._known_whole = bool(cached)  # what the workers imported over a whole run (see policy.first_fresh)
        self._log = Path(os.devnull)
        self._say: Say = lambda text: None
        self._detail: Say = lambda text: None
        self._on_ready: Callable[[dict[str, Any]], None] = lambda info: None
        self._spared = spared  # process groups of the agent's other helpers (the warden): never strays
        self._fresh = ProcessSpawner(spared)
        self._zygotes: list[Zygote] = []
        # Zygotes a bigger one replaced, killed, not yet reaped.
        self._retired: list[subprocess.Popen[bytes] | GrownProcess] = []
        self._refill = policy.Refill()
        self._workers = standbys if workers is None else workers
        self._cores = len(os.sched_getaffinity(0))
        self._first_wait_s = first_wait_s
        self._first_fresh = -1  # how many more of the first attempt's workers start fresh (-1: not decided yet)
        self._idle: IdleCores | None = None  # the cores' idle time from the start on (how busy the node is)
        self.holding = False  # a restart is under way: see hold()
        self._cold = False  # a worker of this attempt started without a preloaded zygote
        self._restarted = False  # workers were started more than once
        self._off = ""  # why the pool is no longer used (a refusal is not retried)
        self._never: set[str] = set()  # modules a zygote refused: never preloaded again
        self._troubled = False  # a trouble of the pool's was said on the console (the others go to --verbose)
        self._reports: dict[Path, int] = {}  # each worker's report of its imports, by its mtime
        self._to_grow: list[str] = []  # a bigger zygote's modules, waiting for the zygote to grow it from
        self._said_other = False  # the script's change that keeps every later import out was said

    def start(self, log: Path, say: Say, on_ready: Callable[[dict[str, Any]], None], detail: Say) -> None:
        """Start the base zygote, and one preloading what is known. Their output goes to ``log``; ``say`` tells the
        user what to know (the pool is off), ``detail`` how it works (--verbose); ``on_ready`` gets ready reports."""
        self._log, self._say, self._detail, self._on_ready = log, say, detail, on_ready
        self._say_kept_out()
        self._idle = IdleCores.start()
        self._launch([])
        if self._known:  # at normal priority when the first attempt's workers are to wait for it
            self._launch(self._known, idle=self._first_wait_s <= 0)

    def read(self, reading: EntryReading) -> None:
        """What the entry script does before its imports (:mod:`ftrun.warm.entry_reading`): each zygote replays its
        leading block, and checks every other module against what the script changes. What its top keeps out of
        the pool is said once, with how to keep it warm."""
        self._reading = reading
        self.add([*reading.imports, *reading.later])

    def _say_kept_out(self) -> None:
        stop, kept_out = self._reading.stop, self._reading.kept_out
        if stop is not None and kept_out:
            self._say(
                f"warm pool: {stop.place} ({stop.text}) {stop.why}: what the script imports after it"
                f" ({policy.packages(kept_out)}) is the workers' own import, not preloaded; to keep it warm,"
                " move that setting to the launch environment, or name the modules with --preload"
            )

    def plan(self, modules: Sequence[str]) -> dict[str, object]:
        """How a new zygote preloads ``modules``: the script's leading block as the script runs it (its imports
        and literal environment writes, in order; the refused imports left out), then --preload, then the rest,
        each checked against what the script changes (see :mod:`ftrun.worker.import_watch`)."""
        wanted = set(modules)
        steps = [s for s in self._reading.steps if s[0] != "import" or (s[1] in wanted and not self._refused(s[1]))]
        leading = {s[1] for s in steps if s[0] == "import"}
        trusted = [m for m in self._trusted if m in wanted and m not in leading and not self._refused(m)]
        checked = [m for m in modules if m not in leading and m not in trusted and not self._reading.changes.other]
        guards = {**self._reading.changes.as_json(), "varying": sorted(self._varying), "files": self._files}
        return {"steps": steps + [["import", m] for m in trusted], "checked": checked, "guards": guards, **self._where}

    def _refused(self, module: str) -> bool:
        return policy.refused(module, self._never)

    def add(self, modules: Sequence[str]) -> None:
        """More modules known before any worker ran (the entry script's imports). With inductor's among them (its
        source compiles), what the workers import lazily at their first step is known too, as with a whole
        run's cache: every worker of the first attempt waits for the zygote (policy.first_fresh; the real stack
        on 2 cores, first run: launch to first step 10.0 s with one worker fresh, 7.4 s with both waiting)."""
        self._known = list(dict.fromkeys([*self._known, *modules]))
        self._known_whole = self._known_whole or first_step_imports_known(modules)

    def _launch(self, preload: list[str], *, idle: bool = False, grow: bool = False) -> None:
        """``idle``: preload at idle CPU priority (while the job trains, it must not slow it down); ``grow``:
        forked from a ready zygote that has some of ``preload`` where there is one (see policy.grown_from)."""
        if not self._off:
            parent = policy.grown_from(self._zygotes, preload) if grow else None
            if grow and parent is None and policy.parent_coming(self._zygotes, preload):
                self._to_grow = preload  # once its parent is ready (see tend)
                return
            if grow:
                self._to_grow = []
            zygote = None
            if parent is not None:
                try:
                    zygote = parent.grow(preload, idle=idle, standbys=self._standbys, files=self._files)
                except PoolError as e:
                    self._detail(f"warm pool: {e}; a new zygote preloads them all")
            if zygote is None:
                plan = self.plan(preload)
                zygote = Zygote.spawn(
                    self._python,
                    preload,
                    self._env,
                    self._log,
                    idle=idle,
                    standbys=self._standbys,
                    script=self._script,
                    plan=plan,
                )
            if idle and self.holding:  # started during a hold: it stands still with the others (see hold)
                zygote.pause(True)
            self._zygotes.append(zygote)

    @property
    def preloading(self) -> list[str]:
        """The modules of the largest zygote, ready or not (or to grow once its parent is ready)."""
        return max([self._to_grow, *(z.preload for z in self._zygotes)], key=len)

    def signal_strays(self, sig: int, workers: set[int]) -> None:
        """The zygotes and their standby workers (in the zygotes' process groups) are the pool's own."""
        signal_strays(sig, workers, helper_groups={z.proc.pid for z in self._zygotes} | self._spared)

    def sweep(self, workers: set[int], keep: set[int]) -> None:
        zygotes = {z.proc.pid for z in self._zygotes}
        proctree.sweep(signal.SIGKILL, workers, helper_groups=zygotes | self._spared, keep=keep | zygotes)

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Path, stdout: int, stderr: int) -> ProcessHandle:
        request = worker_request(argv, self._python)
        if request is None or self._off:
            self._cold = True
            return self._fresh.spawn(argv, env, cwd, stdout, stderr)
        request.update(env=dict(env), cwd=str(cwd))
        if self._fresh_first():
            self._cold = True
            return self._fresh.spawn(argv, env, cwd, stdout, stderr)
        self._wait_for_first()
        while (zygote := self._best()) is not None:
            try:
                handle = zygote.standby().run(request, stdout, stderr)
            except PoolError as e:
                self._drop(zygote, str(e))
                continue
            if zygote.failed:  # it could not fork a standby in place of this one
                self._drop(zygote, zygote.failed)
            self._cold = self._cold or not handle.warm
            return handle
        self._cold = True
        return self._fresh.spawn(argv, env, cwd, stdout, stderr)

    def tend(self) -> None:
        """Take the zygotes' news (ready, refused, gone) and retire each ready zygote that a bigger ready one
        replaces. Called when the agent is idle too, so that a restart finds this done."""
        self._retired = [proc for proc in self._retired if proc.poll() is None]
        if self._refill.due(self._clock.monotonic()):
            preloading = sum(1 for z in self._zygotes if z.preload and z.ready is None)
            # The first start: held only when a zygote is ready to serve a failure meanwhile (the first attempt's).
            ready = policy.biggest_ready(self._zygotes) is not None
            cold = self._cold and (self._restarted or ready)
            # One preloading counts even when none is yet: the workers report their imports as they meet their
            # peers, and the zygote started for them then would take the same core.
            if not policy.held_for_cold_workers(cold, self._cores, self._workers, max(preloading, 1)):
                self.go_on()  # else at the attempt's first step (the agent's call)
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
        if self._to_grow and not policy.parent_coming(self._zygotes, self._to_grow):
            self._launch(self._to_grow, idle=True, grow=True)
        for z in policy.retired(self._zygotes, self.holding):  # a bigger one serves from now on
            z.close(wait=False)
            self._retired.append(z.proc)
            self._zygotes.remove(z)

    def _fresh_first(self) -> bool:
        """Whether this worker of the first attempt starts fresh, on a core the preloading zygote leaves (see
        :func:`policy.first_fresh`)."""
        self.tend()  # a zygote ready by now serves every worker (its word may sit unread in its socket)
        if self._off or policy.waited_for_first(self._zygotes, self._refill.started) is None:
            return False
        if self._first_fresh < 0:
            idle = self._idle.since_start() if self._idle is not None else None
            self._first_fresh = policy.first_fresh(self._cores, self._workers, whole=self._known_whole, idle=idle)
            busy = "" if idle is None else f" ({idle:.1f} of {self._cores} cores idle of late)"
            self._detail(f"warm pool: {self._first_fresh} of the first workers start fresh beside the zygote{busy}")
        if self._first_fresh == 0:
            return False
        self._first_fresh -= 1
        return True

    def _wait_for_first(self) -> None:
        """The first attempt's workers wait (at most ``first_wait_s``) for the zygote preloading what the job was
        known to import (see :func:`policy.waited_for_first`); past that, or when it refused a module, they start
        fresh as before, and it preloads on at idle time."""
        zygote = None if self._off else policy.waited_for_first(self._zygotes, self._refill.started)
        if zygote is None or self._first_wait_s <= 0:
            return
        zygote.pause(False)  # the attempt's start held it
        if not zygote.poll(self._first_wait_s) and not zygote.failed:
            self._detail(f"warm pool: not ready in {self._first_wait_s:g} s; the first workers start fresh")
            self._first_wait_s = 0.0
            zygote.pause(True)  # with the workers started cold, as any zygote still preloading
        if zygote.ready is not None:
            self._ready(zygote)

    def _best(self) -> Zygote | None:
        """The zygote to fork from now (see :func:`policy.fork_from`); None: the worker starts fresh."""
        self.tend()
        return None if self._off else policy.fork_from(self._zygotes)

    def _ready(self, z: Zygote) -> None:
        assert z.ready is not None
        info = {**z.ready, "preload": len(z.preload), "pid": z.proc.pid}
        if z.grown_from is not None:
            info["grown_from"] = z.grown_from
        self._on_ready(info)
        rss, took = int(info.get("rss_kb", 0)) / 1024, float(info.get("import_s", 0.0))
        loaded = f"{info.get('loaded')} of {info.get('preload')} modules preloaded in {took:.2f} s"
        self._detail(f"warm pool ready (pid {z.proc.pid}): {loaded}, {rss:.0f} MiB resident")
        if z.preload and self._cache is not None and self._auto:
            self._cache.save(z.preload, float(z.ready.get("import_s", 0.0)), self._files)

    def _drop(self, z: Zygote, why: str) -> None:
        z.close()
        if z in self._zygotes:
            self._zygotes.remove(z)
        if z.culprit:  # one module cannot be forked after: the rest is preloaded without it
            self._never |= {z.culprit, *z.by_rule}
            rest = [m for m in z.preload if not policy.refused(m, self._never)]
            if z.by_rule:  # the job would differ: said on the console
                shown = "; ".join(f"{m} {reason}" for m, reason in list(z.by_rule.items())[:4])
                more = f" (and {len(z.by_rule) - 4} more)" if len(z.by_rule) > 4 else ""
                them = "it" if len(z.by_rule) == 1 else "them"
                self._say(f"warm pool: {shown}{more}: the workers import {them} themselves, as a fresh process would")
            else:
                self._trouble(
                    f"warm pool: importing {z.culprit!r} {why}; the workers import it themselves, the rest is"
                    f" preloaded ({policy.packages(rest)})"
                )
            if self._cache is not None:
                self._cache.save(rest, self._import_s, self._files)  # the next run does not try it again
            if rest:
                self._launch(rest, idle=True)
        elif z.refused:
            self._off = why
            for other in self._zygotes:
                other.close()
            self._zygotes.clear()
            self._trouble(f"warm pool off: {why}; workers start as fresh processes")
        else:
            self._detail(f"warm pool: {why}; a new zygote is on its way")
            self._launch(z.preload, idle=True)

    def _trouble(self, text: str) -> None:
        """The pool's first trouble of the run on the console; the others (a chain of refused modules, say)
        only with --verbose: none of them changes the job's result."""
        (self._detail if self._troubled else self._say)(text)
        self._troubled = True

    def learn_reports(self, paths: Sequence[Path], *, run_ends: bool = False) -> None:
        """--warm auto: learn from the workers' reports of what they imported, each time one changed (the workers
        write one as they meet their peers, at their first step, and at exit)."""
        for path in paths:
            try:
                stamp = path.stat().st_mtime_ns
            except OSError:
                continue
            if self._reports.get(path) != stamp:
                self._reports[path] = stamp
                found = read_modules_report(path)
                if found is not None:
                    self._files.update(found[1])
                    self.learn(found[0], run_ends=run_ends)

    def learn(self, modules: Sequence[str], *, run_ends: bool = False) -> None:
        """--warm auto: the workers imported ``modules``; a bigger zygote is started when it is worth it (kept
        for the next run only when ``run_ends``: no restart can come)."""
        if not self._auto or self._off:
            return
        if self._reading.changes.other:  # no check could tell whether an import after it saw the change
            if not self._said_other:
                self._said_other = True
                self._say(
                    f"warm pool: {self._reading.changes.other}: what the workers import after the script's top is"
                    " their own import, not preloaded; to keep it warm, name the modules with --preload"
                )
            return
        bigger = policy.worth_preloading(self.preloading, modules, self._never)
        if bigger is None:
            return
        if self._cache is not None:
            self._cache.save(bigger, self._import_s, self._files)
        if not run_ends:
            self._detail(f"warm pool: preloading {len(bigger)} modules the workers imported, for the next restart")
            self._launch(bigger, idle=True, grow=True)

    def hold(self) -> None:
        """A failure, or workers about to start: the zygotes still preloading stand still (SIGSTOP) until the
        refill after the spawns, or, when workers started cold on a node with no core to spare, until the
        attempt's first step (see go_on, :func:`policy.held_for_cold_workers`); meanwhile the agent learns
        nothing new and retires no zygote. At idle CPU priority they should yield at once, but a kernel that
        defers wakeup preemption to its tick (PREEMPT_NONE, lazy) lets them run on for up to 4 ms at a time
        (seen with perf sched), taken from the agent and the new workers."""
        self.holding = True
        self._cold = False  # the next attempt's spawns say
        for z in self._zygotes:
            if z.preload and z.ready is None:  # the base zygote, a bare Python start, gets ready meanwhile
                z.pause(True)

    def go_on(self) -> None:
        """The hold ends: at the refill, at the attempt's first step, or when the agent waits with no workers to
        start (a rendezvous)."""
        self.holding = False
        for z in self._zygotes:
            z.pause(False)

    def workers_started(self) -> None:
        """An attempt's workers were just started: the standbys they took are forked again once they had time
        to start (see :class:`policy.Refill`; a failure before then takes the spare standbys, and one more forks
        them on the spot: still warm)."""
        self._restarted = self._refill.started
        self._refill.workers_started(self._clock.monotonic())

    def seconds_to_refill(self) -> float | None:
        """How long the agent may sleep before :meth:`tend` is due to refill (None: nothing to refill)."""
        return self._refill.seconds_left(self._clock.monotonic())

    def close(self) -> None:
        for z in self._zygotes:
            z.close()
        self._zygotes.clear()
        for proc in self._retired:
            proc.wait()
        self._retired.clear()
