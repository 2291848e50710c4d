"""Failure reports: one per failure cycle, the root cause (earliest failure) first.

Built from the worker records of the failed attempt, their error files (ftrun's
or torch's ``@record``) and, when a worker wrote none, the last lines of its
stderr log, so that a plain script without any decorator still shows its
traceback. Exits that ftrun caused (it stopped the other ranks) are listed
apart from the failure.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from ftrun.config import NO_RUN_ID
from ftrun.errors import ErrorFileError
from ftrun.observe.gpu_errors import GpuError, diagnose
from ftrun.observe.last_words import READ_BYTES, READ_LINES, STDOUT_TAIL_LINES, last_error, shown_tail, tail
from ftrun.private import write_atomically
from ftrun.procs import disk
from ftrun.procs.workers import Worker, WorkerState
from ftrun.worker.errorfile import ErrorRecord, read_error_file
from ftrun.worker.in_place import BROKEN_BY_A_PEER

HEADLINE_CHARS = 400  # a root cause's one line: its error's first characters
MAX_SHARED_CHARS = 16_000  # of stacks in a root cause shared with the other nodes
_PORT_IN_USE = re.compile(r"address already in use|EADDRINUSE|errno 98", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class WorkerOutcome:
    rank: int
    local_rank: int
    host: str
    pid: int
    state: str  # WorkerState value
    exit_code: int | None
    signal: str | None
    exit_wall: float | None
    exit_mono: float | None
    error: ErrorRecord | None
    error_file_problem: str | None
    stderr_tail: tuple[str, ...]
    stdout_log: str
    stderr_log: str
    error_file: str
    hang: str | None = None  # the watchdog's verdict, when ftrun found this worker hung
    hang_wall: float | None = None  # when the missed deadline passed
    stacks: str | None = None  # all threads, dumped before it was stopped
    why: str | None = None  # why this rank was blamed for a hang rather than the others that went quiet
    waiting_stacks: str | None = None  # a rank that went quiet waiting for the hung one: its stacks
    waiting_in: str | None = None  # and the collective it waited in (read from those stacks by the hang watch)
    request: str | None = None  # its workload control request ("stopped the job: loss is NaN")
    stdout_tail: tuple[str, ...] = ()  # read only when stderr had nothing
    last_error: str | None = None  # the last exception line in its stderr (a stopped rank's secondary error)
    oom_killed: bool = False  # the kernel counted an out-of-memory kill while this attempt ran
    flight_recorder: str | None = None  # torch's dump of its flight recorder at a process group's timeout
    gpu_error: GpuError | None = None  # the CUDA or NCCL error its stderr shows
    unwritten: int = 0  # bytes of its output its log files lack (the log disk was full or failing)
    in_place: bool = False  # interrupted and kept: its process restarts in place (ftrun.restartable)
    script_over: bool = False  # its script had ended when ftrun stopped it: the stop cut its teardown
    left: str | None = None  # the ranks that still called collectives with it when its script ended (uneven data)
    script_ended_wall: float | None = None  # when its script ended, where it told (its teardown cut after)

    @property
    def how(self) -> str:
        if self.left:
            ended = "" if self.exit_code == 0 or self.script_over else f" ({self._end()})"
            return f"its script ended{ended} while {self.left} still called collectives with it"
        if self.request:
            return f"{self.request}, then {self._end()}"
        if self.hang:
            return f"{self.hang}, then {self._end()}"
        return self._end()

    def _end(self) -> str:
        if self.in_place:
            ended = "its function raised" if self.state == WorkerState.FAILED.value else "interrupted"
            return f"{ended}; its process restarts in place"
        if self.signal:
            return f"killed by {self.signal}" + (
                " in its interpreter's teardown: its script had ended" * self.script_over
            )
        if self.exit_code is None:
            return "exit status unknown (it was not this agent's child when it ended)"
        return f"exit code {self.exit_code}"

    @property
    def ended_wall(self) -> float | None:
        """When it ended: its exit, else (its process kept, its function raised) its error's record."""
        if self.script_over and self.script_ended_wall is not None:
            return self.script_ended_wall
        return self.exit_wall or (self.error.timestamp if self.error is not None else None)

    @property
    def cause(self) -> str:
        """How it ended, and the error it ended with: from its error file, else the last exception line in its
        stderr (a script that never called @record: `ModuleNotFoundError: No module named 'x'`)."""
        headline = self.gpu_error.what if self.gpu_error else self.error.headline if self.error else self.last_error
        if headline and len(headline) > HEADLINE_CHARS:  # a message of megabytes: its start, the report has more
            headline = headline[:HEADLINE_CHARS] + " [...]"
        return f"{self.how}: {headline}" if headline else self.how

    def summary(self) -> str:
        return f"rank {self.rank} (local rank {self.local_rank}, pid {self.pid} on {self.host}) {self.cause}"


@dataclass(frozen=True, slots=True)
class FailureReport:
    run_id: str
    attempt: int
    will_restart: bool
    master_port: int
    root_cause: WorkerOutcome
    other_failures: tuple[WorkerOutcome, ...]
    stopped_by_ftrun: tuple[WorkerOutcome, ...]
    hint: str | None
    # Another node's verdict when every quiet rank here waited for its peers: the job's root cause.
    elsewhere: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"v": 1, **asdict(self)}


def outcome(worker: Worker, host: str, oom_killed: bool = False) -> WorkerOutcome:
    error: ErrorRecord | None = None
    problem: str | None = None
    read = tail(worker.paths.stderr, READ_LINES, READ_BYTES)
    gpu = diagnose(read)
    stderr_tail = shown_tail(read, gpu)
    try:
        error = read_error_file(worker.paths.error_file)
    except ErrorFileError as e:
        problem = str(e)
    return WorkerOutcome(
        rank=worker.rank,
        local_rank=worker.local_rank,
        host=host,
        pid=worker.pid,
        state=worker.state.value,
        in_place=worker.kept,
        script_over=worker.script_over,
        script_ended_wall=worker.script_ended_wall,
        exit_code=worker.exit_code,
        signal=worker.signal_name,
        exit_wall=worker.exit_wall,
        exit_mono=worker.exit_mono,
        error=error,
        error_file_problem=problem,
        stderr_tail=stderr_tail,
        stdout_log=str(worker.paths.stdout),
        stderr_log=str(worker.paths.stderr),
        error_file=str(worker.paths.error_file),
        hang=worker.hang.what if worker.hang else None,
        hang_wall=worker.hang.wall if worker.hang else None,
        stacks=worker.hang.stacks if worker.hang else None,
        why=worker.hang.why if worker.hang and worker.hang.why else None,
        waiting_stacks=worker.waiting_stacks or None,
        waiting_in=worker.waiting_in or None,
        request=worker.request or None,
        stdout_tail=() if stderr_tail else tuple(tail(worker.paths.stdout, STDOUT_TAIL_LINES)),
        last_error=last_error(stderr_tail, worker.exit_code),
        oom_killed=oom_killed,
        flight_recorder=str(dump) if (dump := worker.paths.flight_recorder_dump(worker.rank)) else None,
        gpu_error=gpu,
        unwritten=disk.lost_from(str(worker.paths.stdout)) + disk.lost_from(str(worker.paths.stderr)),
    )


def outcome_json(o: WorkerOutcome) -> dict[str, Any]:
    """A root cause as the other nodes read it (``outcome_from_json``)."""
    record = asdict(o)
    for key in ("stacks", "waiting_stacks"):
        if record.get(key):
            record[key] = record[key][:MAX_SHARED_CHARS]
    return record


def outcome_from_json(record: Mapping[str, Any]) -> WorkerOutcome:
    """Another node's root cause; ValueError if it is not one. Its monotonic time is another machine's: dropped."""
    fields = {f.name for f in dataclass_fields(WorkerOutcome)}
    try:
        error = record.get("error")
        values = {k: v for k, v in record.items() if k in fields}
        values.update(
            error=ErrorRecord(**error) if isinstance(error, dict) else None,
            gpu_error=GpuError(**gpu) if isinstance(gpu := record.get("gpu_error"), dict) else None,
            stderr_tail=tuple(record.get("stderr_tail") or ()),
            stdout_tail=tuple(record.get("stdout_tail") or ()),
            exit_mono=None,
        )
        return WorkerOutcome(**values)
    except TypeError as e:
        raise ValueError(f"not a root cause: {e}") from None


def report_from_json(record: Mapping[str, Any]) -> FailureReport:
    """A report as written to ``failure_report.json`` (for ``ftrun report``); ValueError if it is not one."""
    try:
        return FailureReport(
            run_id=str(record["run_id"]),
            attempt=int(record["attempt"]),
            will_restart=bool(record["will_restart"]),
            master_port=int(record["master_port"]),
            root_cause=outcome_from_json(record["root_cause"]),
            other_failures=tuple(map(outcome_from_json, record.get("other_failures") or ())),
            stopped_by_ftrun=tuple(map(outcome_from_json, record.get("stopped_by_ftrun") or ())),
            hint=record.get("hint"),
            elsewhere=record.get("elsewhere"),
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a failure report: {e}") from None


def _earliest_first(o: WorkerOutcome) -> tuple[float, int]:
    # ftrun's error record is stamped when the exception was caught, before the
    # interpreter's teardown (which for a torch process can outlast a peer that
    # fails *because* of this one, e.g. "Connection closed by peer"); so that
    # stamp, not the exit, says when the worker failed. Everything else is
    # ordered by when ftrun saw it exit (torch's own stamp has whole seconds).
    # A hang failed when its deadline passed, long before ftrun stopped it.
    if o.hang_wall is not None:
        return (o.hang_wall, o.rank)
    if o.error is not None and o.error.source == "ftrun":
        return (min(o.error.timestamp, o.exit_wall or float("inf")), o.rank)
    return (o.exit_wall if o.exit_wall is not None else float("inf"), o.rank)


def build_report(
    workers: Sequence[Worker],
    *,
    run_id: str,
    attempt: int,
    will_restart: bool,
    master_port: int,
    host: str,
    elsewhere: Mapping[str, Any] | None = None,
    root: WorkerOutcome | None = None,
    oom_killed: bool = False,
) -> FailureReport:
    """The report of a failed attempt; raises ValueError if no worker failed. ``root``: the root cause when
    it is on another node (every worker here was stopped because of it)."""
    outcomes = [outcome(w, host, oom_killed) for w in workers]
    failed = sorted((o for o in outcomes if o.state == WorkerState.FAILED.value), key=_earliest_first)
    if root is None:
        if not failed:
            raise ValueError(f"attempt {attempt} has no failed worker to report")
        root, failed = failed[0], failed[1:]
    # a rank stopped here that stands for the root cause (a node lost) is told once, as such
    stopped = tuple(
        o
        for o in outcomes
        if o.state == WorkerState.STOPPED.value and (o.host, o.pid, o.rank) != (root.host, root.pid, root.rank)
    )
    hint = _hint(root, master_port)
    early = _left_early(root, outcomes)
    if early and hint is None:  # the rank that left is the root cause; the broken collective's error, its echo
        first = min(early, key=lambda o: (o.ended_wall or float("inf"), o.rank))
        echo, root = root, replace(first, left=f"rank {root.rank}")
        failed = [echo, *failed]
        stopped = tuple(o for o in stopped if o is not first)
        hint = (
            f"rank {echo.rank}'s error is the echo: it called a collective with {_ranks_named(early)}, whose "
            "script had ended. Do all ranks run as many steps (the same number of batches on each)?"
        )
    remote = dict(elsewhere) if elsewhere is not None else None
    return FailureReport(run_id, attempt, will_restart, master_port, root, tuple(failed), stopped, hint, remote)


def oom_kills() -> int | None:
    """The kernel's count of out-of-memory kills since boot (None where /proc/vmstat does not tell)."""
    try:
        with open("/proc/vmstat", encoding="ascii") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _hint(root: WorkerOutcome, port: int) -> str | None:
    if root.gpu_error is not None and root.gpu_error.hint:
        return root.gpu_error.hint
    text = "\n".join([*root.stderr_tail, root.error.message if root.error else ""])
    if _PORT_IN_USE.search(text):
        return (
            f"MASTER_PORT {port} was already in use when the workers bound it "
            "(another job on this machine?); without --master-port ftrun picks a fresh free port for every attempt"
        )
    if root.signal == "SIGKILL" and root.oom_killed and not (root.hang or root.request):
        return "the kernel's out-of-memory killer killed a process while this attempt ran (oom_kill in /proc/vmstat)"
    return None


def _left_early(root: WorkerOutcome, outcomes: Sequence[WorkerOutcome]) -> list[WorkerOutcome]:
    """The root cause is a collective broken by a peer, and ranks here had ended their script before: the
    classic of ranks that run different numbers of steps (a rank's own data shorter than the others')."""
    text = "\n".join([*root.stderr_tail, root.error.message if root.error else "", root.last_error or ""])
    failed = root.ended_wall
    if failed is None or not any(words in text for words in BROKEN_BY_A_PEER):
        return []
    done = [o for o in outcomes if o.rank != root.rank and o.host == root.host]
    ended = [o for o in done if o.script_over and o.state == WorkerState.STOPPED.value]
    return ended + [o for o in done if o.state == WorkerState.SUCCEEDED.value and (o.exit_wall or failed) < failed]


def _ranks_named(outcomes: Sequence[WorkerOutcome]) -> str:
    ranks = sorted(o.rank for o in outcomes)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def when(wall: float | None, *, date: bool = True, unknown: str = "?") -> str:
    """A wall-clock time as a person reads it, to the millisecond (``date``: with the day)."""
    if wall is None:
        return unknown
    shape = "%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S"
    return time.strftime(shape, time.localtime(wall)) + f".{int(wall % 1 * 1000):03d}"


def _who(o: WorkerOutcome) -> str:
    return f"rank {o.rank} (local rank {o.local_rank}, pid {o.pid})"


def _recorder_lines(o: WorkerOutcome) -> list[str]:
    if not o.flight_recorder:
        return []
    read = f"python -m torch.distributed.flight_recorder.fr_trace {Path(o.flight_recorder).parent}"
    return [f"  torch dumped its flight recorder at the timeout: {o.flight_recorder} (read all ranks': {read})"]


def render(report: FailureReport) -> str:
    """The report as text for a terminal: root cause first, with its traceback."""
    r = report.root_cause
    verdict = "restarting" if report.will_restart else "not restarting"
    lines = [
        "=" * 78,
        f"ftrun: attempt {report.attempt}{'' if report.run_id == NO_RUN_ID else f' of run {report.run_id}'} failed "
        f"({verdict})",
        "Root Cause (first observed failure):",  # torchrun's words: scripts that look for them find them
    ]
    lines += _root_lines(report)
    if r.error and r.error.traceback:
        lines.append(f"  traceback (from {r.error.source} error file {r.error_file}):")
        lines += ["    " + line for line in r.error.traceback.rstrip().splitlines()]
    elif r.error:
        lines.append(f"  error: {r.error.headline}")
    if not (r.error and r.error.traceback) and not r.stacks:
        if r.stderr_tail:
            cut = r.stderr_tail[-1].startswith("... and ")  # shown_tail's traceback, teardown noise after it
            lines.append("  stderr, from the traceback:" if cut else f"  last {len(r.stderr_tail)} lines of stderr:")
            lines += ["    " + line for line in r.stderr_tail]
        elif r.stdout_tail:
            lines.append(f"  nothing on stderr; last {len(r.stdout_tail)} lines of stdout:")
            lines += ["    " + line for line in r.stdout_tail]
        else:
            lines.append("  (the worker wrote nothing, on stderr or stdout)")
    if r.error_file_problem:
        lines.append(f"  error file unreadable: {r.error_file_problem}")
    if report.hint:
        lines.append(f"  hint: {report.hint}")
    lines.append(f"  logs: {r.stdout_log}, {r.stderr_log}")
    if r.unwritten:
        lines.append(f"  its logs lack {r.unwritten} bytes of its output: the log disk was full or failing")
    lines += _recorder_lines(r)
    for o in report.other_failures:
        lines += _also_failed_lines(o)
    for o in report.stopped_by_ftrun:
        lines += _stopped_lines(o)
    lines.append("=" * 78)
    return "\n".join(lines)


def _also_failed_lines(o: WorkerOutcome) -> list[str]:
    """A failure after the root cause: when, the error it ended with (from its error file), where its logs are."""
    lines = [f"ALSO FAILED {_who(o)}: {o.how} at {when(o.ended_wall)}"]
    if o.gpu_error:
        lines.append(f"  {o.gpu_error.what}")
    elif o.error is not None:
        lines.append(f"  {o.error.headline}")
    lines.append(f"  logs: {o.stderr_log}")
    return lines + _recorder_lines(o)


def _stopped_lines(o: WorkerOutcome) -> list[str]:
    """A rank ftrun stopped for the root cause: what it waited in, or the error it met after it."""
    lines = [f"STOPPED BY FTRUN {_who(o)}: {o.how}"]
    where = o.waiting_in
    if where:
        lines.append(f"  it was waiting for its peers: {where} (stacks in {o.stderr_log})")
    if o.gpu_error:
        lines.append(f"  after the root cause: {o.gpu_error.what} (in {o.stderr_log})")
    elif o.last_error and not where:
        lines.append(f"  a secondary error, after the root cause: {o.last_error[:160]} (in {o.stderr_log})")
    return lines


def _gpu_field(gpu: GpuError) -> str:
    """A field beside torchrun's ("  exitcode  : 1"): nccl or cuda."""
    return f"{'nccl' if gpu.kind.startswith('nccl') else 'cuda':<10}"


def _torchrun_fields(r: WorkerOutcome) -> list[str]:
    """torchrun's fields of the root cause, as it spells them: scripts that parse its block find them."""
    at = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(r.ended_wall)) if r.ended_wall else "<N/A>"
    code = r.exit_code if r.exit_code is not None else (-signal.Signals[r.signal] if r.signal else "<N/A>")
    return [
        f"  time      : {at}",
        f"  host      : {r.host}",
        f"  rank      : {r.rank} (local_rank: {r.local_rank})",
        f"  exitcode  : {code} (pid: {r.pid})",
        f"  error_file: {r.error_file if r.error is not None else '<N/A>'}",
    ]


def _root_lines(report: FailureReport) -> list[str]:
    """Who is to blame and why, with the stacks it was found with; another node's rank when ours waited for it."""
    r = report.root_cause
    lost = lost_summary(report.elsewhere)
    if lost:
        after = "FAILED AFTER IT" if r.state == WorkerState.FAILED.value else "STOPPED FOR IT"
        return [f"ROOT CAUSE  {lost}", f"{after} {_who(r)} on {r.host}: {r.how}"]
    if report.elsewhere is not None:
        label = "NOTICED IT" if report.elsewhere.get("noticed") else "WAITED FOR IT"
        lines = [*_elsewhere(report.elsewhere), f"{label} {_who(r)} on {r.host}: {r.how}"]
        found = "quiet"
    else:
        lines = [f"ROOT CAUSE  {_who(r)} on {r.host}: {r.how} at {when(r.hang_wall or r.ended_wall)}"]
        lines += [*_torchrun_fields(r), *([f"  why this rank: {r.why}"] if r.why else [])]
        if r.gpu_error:
            lines.append(f"  {_gpu_field(r.gpu_error)}: {r.gpu_error.what}")
        found = "hung"
    if r.stacks:
        lines.append(f"  stacks of all threads when it was found {found}:")
        lines += ["    " + line for line in r.stacks.rstrip().splitlines()]
    return lines


def lost_summary(elsewhere: Mapping[str, Any] | None) -> str:
    """The root cause when nodes were lost ("" when that is not why): which, and what the rendezvous said."""
    if not elsewhere or not elsewhere.get("lost"):
        return ""
    nodes = ", ".join(str(n) for n in elsewhere["lost"])
    return f"node {nodes} lost: {elsewhere.get('what')}"


def _elsewhere(v: Mapping[str, Any]) -> list[str]:
    """Another node's hung rank, as that node's agent found it."""
    pid = f" (pid {v.get('pid')})" if v.get("pid") is not None else ""
    lines = [f"ROOT CAUSE  rank {v.get('rank')}{pid} on {v.get('host')}, another node: {v.get('what')}"]
    if v.get("noticed"):
        lines.append(f"  why this rank: {v.get('why')}")
    elif v.get("why"):
        lines.append(
            f"  why this rank: {v['why']} (found by node {v.get('node')}; every quiet rank here waited for it)"
        )
    if v.get("stacks"):
        lines.append("  stacks of all threads when it was found hung:")
        lines += ["    " + line for line in str(v["stacks"]).rstrip().splitlines()]
    return lines


def write_launcher_error_file(report: FailureReport, path: Path) -> None:
    """The root cause in torch's error-file layout, for whoever launched ftrun with a TORCHELASTIC_ERROR_FILE
    of its own (a scheduler, a nested launcher), as torchrun passes its first failure up."""
    r = report.root_cause
    callstack = (r.error.traceback if r.error else "") or r.stacks or "\n".join(r.stderr_tail)
    doc = {
        "message": {
            "message": f"ftrun: {r.summary()}",
            "extraInfo": {"py_callstack": callstack, "timestamp": str(int(r.exit_wall or time.time()))},
        },
        "errorCode": r.exit_code if r.exit_code is not None else 1,
    }
    raw = json.dumps(doc)
    disk.guarded(str(path), len(raw), lambda: write_atomically(path, raw))


def write_json(report: FailureReport, path: Path) -> bool:
    """False where the log disk refused it (the console has it all the same)."""
    doc = json.dumps(report.to_json(), indent=2)
    return disk.guarded(str(path), len(doc), lambda: write_atomically(path, doc))
