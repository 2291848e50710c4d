"""This node's health checks as the agent runs them (the checks themselves: :mod:`ftrun.node.health`).

Before the node first joins the job, the checks run and must pass: a node that fails one stays out, says which
and why, and checks again every interval until it passes or the join timeout ends its wait. While it is in the
job, the checks run at the start of every attempt (a new round, a restart) and every interval, in a thread (a
check may take seconds; the agent's loop keeps its clock). A failure then makes the node leave the job, as
``ftrun.exclude_this_node()`` would: its workers are stopped, the others go on without it (an elastic job) and
the node is not readmitted; the check and its output are in the failure report. A worker that failed with a
CUDA error that leaves its GPU in doubt (an uncorrectable ECC error, a GPU fallen off the bus) has the GPU
checked (``builtin:gpu``) at the next attempt's start, whether or not ``--health-check`` names it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

from ftrun.clock import Clock
from ftrun.config import HealthSpec
from ftrun.node.health import Verdict, run_check
from ftrun.observe.events import EventKind
from ftrun.procs.workers import Worker
from ftrun.worker.readable import wait_readable
from ftrun.worker.signals import REQUEST_SIGNAL

GPU_CHECK = "builtin:gpu"
Emit = Callable[..., None]
Say = Callable[[str], None]


def run_all(checks: Sequence[str]) -> list[Verdict]:
    """Every check, in order, stopping at the first that fails (the rest would only add time)."""
    verdicts = []
    for check in checks:
        verdicts.append(v := run_check(check))
        if not v.healthy:
            break
    return verdicts


class HealthWatch:
    """Owns the checking thread; the agent's loop takes a failure from it with :meth:`reason_to_leave`."""

    @classmethod
    def start(cls, spec: HealthSpec, host: str, emit: Emit, say: Say) -> HealthWatch:
        watch = cls(spec, host, emit, say)
        if spec.checks:
            watch._thread.start()
        return watch

    def __init__(self, spec: HealthSpec, host: str, emit: Emit, say: Say) -> None:
        """Use :meth:`start`."""
        self._spec = spec
        self._host = host
        self._emit = emit
        self._say = say
        self._lock = threading.Lock()
        self._kick = threading.Event()  # check now (a new attempt started)
        self._closed = False
        self._failed: Verdict | None = None  # found by the thread, not yet taken by the loop
        self._attempt: int | None = None  # the attempt whose start was checked
        self._gpu_doubt = ""  # why the GPU is checked at the next attempt's start ("": it is not)
        self._thread = threading.Thread(target=self._run, name="ftrun-health", daemon=True)

    def gate(self, clock: Clock, timeout_s: float, wake_fd: int, interrupted: Callable[[], bool]) -> Verdict | None:
        """Before the node joins: the checks until they pass (None) or ``timeout_s`` passed (the last failure).
        A signal to ftrun (``wake_fd`` readable, ``interrupted()``) ends the wait too."""
        deadline = clock.monotonic() + timeout_s
        while True:
            failed = self._tell(run_all(self._spec.checks), "before joining")
            left = deadline - clock.monotonic()
            if failed is None or left <= 0:
                return failed
            wait = min(self._spec.interval_s, left)
            self._say(f"{self._host} stays out of the job; its health checks run again in {wait:.0f} s")
            wait_readable(wake_fd, wait)
            if interrupted():
                return failed

    def suspect_gpu(self, why: str) -> None:
        """A worker's CUDA error (``why``) leaves its GPU in doubt: check it at the next attempt's start."""
        with self._lock:
            self._gpu_doubt = why
            start = not self._thread.is_alive() and not self._closed
        if start:
            self._thread.start()

    def reason_to_leave(self, running: Sequence[Worker]) -> str | None:
        """A check that failed while the workers run (once), as the reason this node leaves the job."""
        if running and running[0].attempt != self._attempt:  # a new attempt: checked at its start
            self._attempt = running[0].attempt
            self._kick.set()
        with self._lock:
            failed, self._failed = (self._failed, None) if running else (None, self._failed)
        if failed is None:
            return None
        self._tell([failed], "while training")
        return f"{failed.describe()} (on {self._host})"

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._kick.set()

    def _run(self) -> None:
        while True:
            self._kick.wait(self._spec.interval_s)
            self._kick.clear()
            with self._lock:
                if self._closed:
                    return
                doubt, self._gpu_doubt = self._gpu_doubt, ""
            checks = list(self._spec.checks)
            if doubt and GPU_CHECK not in checks:
                checks.append(GPU_CHECK)
            failed = next((v for v in run_all(checks) if not v.healthy), None)
            if doubt and failed is None:
                self._say(f"{self._host}'s GPUs passed their check after {doubt}: it stays in the job")
            if failed is not None:
                with self._lock:
                    self._failed = failed
                os.kill(os.getpid(), REQUEST_SIGNAL)  # wakes the agent's loop, as a worker's request does

    def _tell(self, verdicts: list[Verdict], when: str) -> Verdict | None:
        """Events for the checks run from the loop; returns the failure, said with its output."""
        failed = next((v for v in verdicts if not v.healthy), None)
        for v in verdicts:
            self._emit(
                EventKind.HEALTH_CHECK, check=v.check, healthy=v.healthy, when=when, seconds=round(v.seconds, 3),
                ended=v.ended, output=v.output[-1000:],
            )  # fmt: skip
        if failed is not None:
            ended = f" ({failed.ended})" if failed.ended else ""
            self._say(f"{self._host} failed its health check {failed.check!r} {when}{ended}:\n{failed.output.rstrip()}")
        return failed
