"""What the worker's collectives are doing, read from torch's flight recorder once a second.

torch records every collective of every process group (its op, group, sequence number, sizes, and whether it
finished): gloo groups with no setting, NCCL ones, in a recorder of their own, when a trace buffer is set (ftrun
sets one). A thread, started
once the job has met its peers (``init_process_group``), reads the recorder every :data:`POLL_S` and writes a
summary into the worker's slot: per group, the last collective entered and the last finished, and the one in
flight. With it goes where the main thread is (its innermost frame) and when its stack last changed. The agent
compares the ranks' summaries: the rank that never entered the collective its peers wait in is the hung one
(:mod:`ftrun.monitor.collectives`).

The thread needs the GIL for a fraction of a millisecond a second: it reads each group's counts (entered,
finished), and the recorder's entries (which collective, how big, since when) only where a group has had one in
flight since the last read, or once for a new group's name. A whole dump holds the GIL for 30-100 ms once the
recorder is full (its 2000 entries: gloo marks none of them done), and the job's main thread waits that long:
read every second, it cost a job of many small collectives a third of its speed (``python bench/hangs.py --cost
--buckets 20 --step-time 0.005``). A worker whose main thread holds the GIL in C code stops updating its summary:
that silence is itself what the agent reads. It never imports torch.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

Record = dict[str, Any]  # a flight recorder dump, as torch's JSON has it

POLL_S = 1.0
# torch's recorders: the one every backend but NCCL records into (gloo), and NCCL's own (a CUDA build's)
RECORDERS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
MAX_GROUPS = 8  # the groups with the latest collectives are kept (a job with hundreds of groups uses few at once)
_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
                "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16}  # fmt: skip

LOOP_PLACES = 3  # a main thread whose stack only comes back to this many places goes round one loop
# Long work that goes round a loop in Python and does end: a batch of a slow dataset, a compile's tracing, a
# checkpoint's serialisation. A stack through these is never taken for a loop that never leaves.
LONG_WORK = (
    "torch/utils/data/",
    "torch/_dynamo/",
    "torch/_inductor/",
    "torch/serialization.py",
    "torch/distributed/checkpoint/",
)

_started = False


def _nowhere(raw: bytes) -> None:
    """Where summaries go before :func:`watch` names the slot."""


_publish: Callable[[bytes], None] = _nowhere


class Places:
    """PURE: since when the main thread's stack has only come back to the same few places. A rank spinning in
    Python (``while not ready: ...``) changes its stack every second yet never leaves its loop; one working its
    way through a step, a compile or a data loader keeps reaching new places."""

    def __init__(self, now: float) -> None:
        self._seen: set[tuple[tuple[str, int], ...]] = set()
        self.since = now

    def add(self, stack: tuple[tuple[str, int], ...], now: float) -> None:
        if any(w in f for f, _ in stack for w in LONG_WORK):
            self._seen, self.since = {stack}, now
        elif stack not in self._seen:
            self._seen.add(stack)
            if len(self._seen) > LOOP_PLACES:
                self._seen, self.since = {stack}, now


def watch(publish: Callable[[bytes], None]) -> None:
    """Start the thread (once per process); ``publish`` writes a summary into the slot (the latest one given:
    a rank restarted in place publishes into its new attempt's slot)."""
    global _started, _publish  # noqa: PLW0603 - one watcher per process
    _publish = publish
    if _started:
        return
    _started = True
    threading.Thread(target=_run, name="ftrun-collectives", daemon=True).start()


def _run() -> None:
    main = threading.main_thread().ident
    stack: tuple[tuple[str, int], ...] = ()
    stack_since = time.time()
    places = Places(stack_since)
    published = False
    counts: dict[str, tuple[int, int]] = {}
    names: dict[str, tuple[str, str]] = {}  # group id -> its name and description (from entries read)
    looked: set[str] = set()  # the group ids an entries' read has seen (one whose entries are gone stays unnamed)
    while True:
        time.sleep(POLL_S if published else POLL_S / 10)  # the first summary as soon as the group is made
        record = _read_recorder(with_entries=False)
        if record is None:
            continue
        before, counts = counts, group_counts(record)
        new = any(entered >= 0 and group not in looked for group, (entered, _) in counts.items())
        if new or waited_since(before, counts):  # a group used since the last read: once, for its name
            record = _read_recorder(with_entries=True) or record
            names.update(group_names(record))
            looked.update(counts)
        now = time.time()
        seen = _stack_of(main)
        if seen != stack:
            stack, stack_since = seen, now
        places.add(seen, now)
        where = f"{seen[0][0]}:{seen[0][1]}" if seen else ""
        doc = summary(record, now, stack_since, where, names) | {"l": round(places.since, 3)}
        _publish(json.dumps(doc, separators=(",", ":")).encode())
        published = True


def _read_recorder(*, with_entries: bool) -> Record | None:
    """Every group's status in the flight recorder, and ``with_entries`` its collectives not retired yet; None
    before the job's default group exists (or after it was destroyed), or with a torch that has no recorder."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_initialized():
            return None
        c10d = sys.modules["torch"]._C._distributed_c10d
        dumps = [getattr(c10d, name, None) for name in RECORDERS]
        records = [
            json.loads(dump(includeCollectives=with_entries, onlyActive=True)) for dump in dumps if dump is not None
        ]
    except Exception:
        return None
    return merged(records) if records else None


def group_counts(record: Record) -> dict[str, tuple[int, int]]:
    """PURE: per group, the sequence numbers of the last collective entered and the last finished."""
    return {
        str(name): (int(s.get("last_enqueued_collective", -1)), int(s.get("last_completed_collective", -1)))
        for name, s in (record.get("pg_status") or {}).items()
    }


def waited_since(before: dict[str, tuple[int, int]], now: dict[str, tuple[int, int]]) -> bool:
    """PURE: whether a group has had a collective in flight since the last read (none finished in between): its
    entries are read then, to tell which one and since when (a hang's summary; a long collective's)."""
    for name, (entered, finished) in now.items():
        was = before.get(name)
        if was is not None and entered > finished and was[1] == finished and was[0] > finished:
            return True
    return False


def merged(records: list[Record]) -> Record:
    """PURE: one record of several recorders' dumps (NCCL keeps its own): their entries together, and per group
    the status of the recorder that saw the most of it (a group on two backends is in both)."""
    entries: list[Any] = []
    status: dict[str, dict[str, Any]] = {}
    for record in records:
        entries += record.get("entries") or []
        for name, s in (record.get("pg_status") or {}).items():
            seen = status.get(name)
            if seen is None or int(s.get("last_enqueued_collective", -1)) > int(
                seen.get("last_enqueued_collective", -1)
            ):
                status[name] = s
    return {"entries": entries, "pg_status": status}


def _stack_of(thread: int | None) -> tuple[tuple[str, int], ...]:
    """Where ``thread`` is, innermost first, as (file, line). Its frame is never kept past this call: a frame
    keeps every frame below it and their locals alive (an interrupted attempt's model, its process groups and
    their threads, freed from this thread when it looked next; a process restarted in place aborted so, in a
    Trainer's job)."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    stack = []
    while frame is not None:
        stack.append((frame.f_code.co_filename, frame.f_lineno))
        frame = frame.f_back
    return tuple(stack)


def group_names(record: Record) -> dict[str, tuple[str, str]]:
    """PURE: per group id, its name and description, as the recorder's entries say. torch keys each group's status by
    an id counted over the process's whole life, and names groups by a count that the default group's end resets:
    a process restarted in place has a default group "0" whose id is 1, 2... (a new process's: 0)."""
    names = {}
    for e in record.get("entries") or []:
        name, description = [*(e.get("process_group") or []), "?", ""][:2]
        names[str(e.get("pg_id", name))] = (str(name), str(description))
    return names


def summary(
    record: Record, now: float, stack_since: float, where: str, names: dict[str, tuple[str, str]] | None = None
) -> Record:
    """PURE: the slot's summary of one flight recorder dump (``names``: the group names learnt from earlier dumps'
    entries, by id; this dump's entries add theirs).

    ``g``: per group ``[name, description, entered, finished, in flight]``, the latest entered first; in flight:
    ``[seq, op, bytes, since]`` of the oldest collective entered and not finished, or None. A group of an attempt
    that ended (a process restarted in place keeps its recorder) gives way to the newer group of its name. ``t``:
    when read; ``s``: when the main thread's stack last changed; ``w``: its innermost frame. (The watcher adds
    ``l``: since when the stack has only come back to the same few places, :class:`Places`.)
    """
    names = {**(names or {}), **group_names(record)}
    flying: dict[str, list[Any]] = {}  # by group id
    for e in record.get("entries") or []:
        group = str(e.get("pg_id", (e.get("process_group") or ["?"])[0]))
        seq = int(e.get("collective_seq_id") or 0)
        if e.get("retired") or e.get("is_p2p") or seq >= flying.get(group, [seq + 1])[0]:
            continue
        op = str(e.get("profiling_name") or "?").split(":")[-1]
        sizes = zip(e.get("input_sizes") or [], e.get("input_dtypes") or [], strict=False)
        flying[group] = [seq, op, sum(_nbytes(s, d) for s, d in sizes), int(e.get("time_created_ns") or 0) / 1e9]
    newest: dict[str, tuple[int, int, list[object]]] = {}  # by name: (id, entered, row) of the highest id
    for group, status in (record.get("pg_status") or {}).items():
        entered = int(status.get("last_enqueued_collective", -1))
        if entered < 0:
            continue
        name, description = names.get(group, (group, ""))
        gid = int(group) if group.isdigit() else -1
        if name not in newest or gid > newest[name][0]:
            finished = int(status.get("last_completed_collective", -1))
            newest[name] = (gid, entered, [name, description, entered, finished, flying.get(group)])
    groups = [row for _, _, row in sorted(newest.values(), key=lambda v: -v[1])]
    return {"t": round(now, 3), "s": round(stack_since, 3), "w": where[-120:], "g": groups[:MAX_GROUPS]}


def _nbytes(sizes: list[int], dtype: str) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n * _DTYPE_BYTES.get(dtype, 4)
