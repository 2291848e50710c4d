"""PURE: hangs found with no flag, by the collectives: which rank the others wait for, and whether it moves.

Every rank's summary of its collectives (:mod:`ftrun.worker.collectives`) says, per process group, the last
collective it entered and the last that finished. When some ranks have waited :attr:`Patience.waited_s` in
collective #S of a group and a member of that group never entered #S, that member is what they wait for. It is
hung once it has shown no progress for :attr:`Patience.quiet_s` (``--hang-timeout``, 20 s; the other waits
follow from it): its main thread's stack unchanged (or unreadable: its
interpreter held), its CPU time and its I/O unchanged. CPU time spent where the host only spins on a GPU
(``torch.cuda.synchronize``) is not progress, nor the trickle of a process's other threads waking to ask for a
GIL its main thread holds (they wake every 5 ms: a few percent of a core on a loaded machine).

So a rank saving a checkpoint while the others wait in a barrier (its I/O and CPU move), an evaluation on every
rank (nobody waits in a collective), a long first step that compiles, a job without torch.distributed, a sleep
between epochs on every rank: none is a hang.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ftrun.jsonobject import load_object
from ftrun.worker.layout import COLLECTIVES_MAX

WAITED_TO_LOOK_S = 2.0  # ranks in a collective this long: the members that never entered it are looked at
STALE_S = 3.0  # a summary this old: the worker's watcher cannot run (its GIL held, the process stopped)
BUSY_SHARE = 0.05  # the main thread's CPU time growing faster than this share of a core is progress
OTHERS_BUSY_SHARE = 0.25  # and its other threads' and children's together, faster than this share
# I/O slower than this is polling, not progress: NCCL's monitor thread asks the job's TCPStore every second
# whether another rank wants its recorder dumped (TORCH_NCCL_DUMP_ON_TIMEOUT), some 100 bytes a second for as
# long as the process lives; a slow read of a checkpoint or a dataset moves far more.
IO_BUSY_BYTES_PER_S = 2048
DEFAULT_GROUP = "0"  # torch names the default process group "0", every rank's first
SPIN_WAITS = ("torch/cuda/__init__.py", "torch/cuda/streams.py")  # the host spins there on the GPU's work


@dataclass(frozen=True, slots=True)
class Patience:
    """How long the rules wait before a verdict, all from one setting (``--hang-timeout``): a rank the others
    wait for is hung once it showed no progress for ``quiet_s``, and they waited at least half of that; a
    collective every member entered, not finished, none of them moving, is hung after twice that.

    Clocks of other nodes: how long the others waited is read from wall times their nodes wrote, so a clock
    skew between nodes moves that gate; but the rank judged is always this node's, and its quiet time (its
    stack, CPU and I/O, sampled here) is measured on this node's clock alone and is twice as long: a skew under
    ``quiet_s / 2`` changes no verdict, and NTP keeps a cluster's clocks within milliseconds."""

    quiet_s: float = 20.0

    @property
    def waited_s(self) -> float:
        return self.quiet_s / 2

    @property
    def unfinished_s(self) -> float:
        return 2 * self.quiet_s


@dataclass(frozen=True, slots=True)
class InFlight:
    """The oldest collective a rank entered in a group and that has not finished."""

    seq: int
    op: str
    nbytes: int
    since: float  # wall time it was entered


@dataclass(frozen=True, slots=True)
class Group:
    name: str
    description: str
    entered: int  # the last collective entered (its sequence number in the group)
    finished: int
    in_flight: InFlight | None


@dataclass(frozen=True, slots=True)
class RankCollectives:
    """One rank's summary, as its worker last wrote it."""

    rank: int
    read_at: float  # wall time the worker read its recorder
    stack_since: float  # wall time its main thread's stack last changed
    where: str  # its main thread's innermost frame, file:line
    groups: tuple[Group, ...]
    loop_from: float | None = None  # wall time since which its stack only came back to the same few places

    @property
    def new_place_since(self) -> float:
        """When its stack last reached a place it had not been to lately (as its stack changing, where the
        worker's watcher says nothing of loops)."""
        return self.stack_since if self.loop_from is None else self.loop_from

    @property
    def looping(self) -> bool:
        """Its stack moved, but only round the same few places, since it last reached a new one."""
        return self.new_place_since < self.stack_since

    @classmethod
    def unseen(cls, rank: int) -> RankCollectives:
        """A rank whose watcher wrote nothing yet (within a second of its start, or its GIL held since)."""
        return cls(rank, 0.0, 0.0, "", ())

    @classmethod
    def parse(cls, rank: int, raw: bytes) -> RankCollectives:
        """Raises ValueError on anything but a summary the worker writes."""
        try:
            doc = load_object(raw, limit=COLLECTIVES_MAX, what="a summary of collectives", error=ValueError)
            groups = tuple(
                Group(
                    str(n),
                    str(d),
                    int(e),
                    int(f),
                    InFlight(int(x[0]), str(x[1]), int(x[2]), float(x[3])) if x else None,
                )
                for n, d, e, f, x in doc["g"]
            )
            since = float(doc["s"])
            return cls(rank, float(doc["t"]), since, str(doc["w"]), groups, float(doc.get("l", since)))
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise ValueError(f"an unreadable summary of collectives: {e!r}") from None

    def group(self, name: str) -> Group | None:
        return next((g for g in self.groups if g.name == name), None)


@dataclass(frozen=True, slots=True)
class Stall:
    """Ranks wait in collective ``seq`` of a group that members never entered (``missing``; empty: all entered
    it and it does not finish)."""

    group: str
    description: str
    seq: int
    op: str
    nbytes: int
    waiting: tuple[tuple[int, float], ...]  # (rank, when it entered), by rank
    missing: tuple[int, ...]
    calls: tuple[tuple[int, str, int], ...] = ()  # (rank, op, bytes) of each rank in it, where they differ
    behind: tuple[tuple[int, InFlight], ...] = ()  # missing ranks still in an earlier one, which the others finished

    @property
    def since(self) -> float:
        """When the first rank entered it."""
        return min(since for _, since in self.waiting)

    def odd_ones(self) -> set[int]:
        """In a mismatch, the ranks whose call fewer ranks made than another (none where all are as many)."""
        kinds = list(self._kinds().values())
        sizes = [len(ranks) for ranks in kinds]
        if not sizes or min(sizes) == max(sizes):
            return set()
        return {r for ranks in kinds if len(ranks) == min(sizes) for r in ranks}

    def _kinds(self) -> dict[tuple[str, int], list[int]]:
        kinds: dict[tuple[str, int], list[int]] = {}
        for r, op, nbytes in self.calls:
            kinds.setdefault((op, nbytes), []).append(r)
        return kinds

    def describe(self, rank: int, at: str) -> str:
        """'rank 3 never entered all_reduce #1412 (default_pg, 4.0 MB) that ranks 0-2 entered at 12:01:03', or
        where every member entered it: 'ranks 0-3 entered ... at 12:01:03; it never finished (rank 3 stopped
        moving first)'; ``at``: :attr:`since` as the reader's clock of day says it (the caller's local time)."""
        group = self.description or "group " + self.group
        what = f"{self.op} #{self.seq} ({group}, {_size(self.nbytes)})"
        waiting = _ranks([r for r, _ in self.waiting])
        if self.calls and not self.missing:  # a mismatch: the ranks' #seq are different calls, never one
            kinds = self._kinds()
            said = "; ".join(f"{_ranks(rs)} {op} of {_size(n)}" for (op, n), rs in sorted(kinds.items()))
            odd = rank in self.odd_ones()
            why = f"rank {rank}'s call is the odd one" if odd else f"rank {rank} stopped moving first"
            return (
                f"{waiting} called different collectives as #{self.seq} of {group} at {at} ({said}): a mismatch, "
                f"which never finishes ({why})"
            )
        if not self.missing:
            return f"{waiting} entered {what} at {at}; it never finished (rank {rank} stopped moving first)"
        said = f"rank {rank} never entered {what} that {waiting} entered at {at}"
        stuck = next((f for r, f in self.behind if r == rank), None)
        if stuck is not None:  # a collective that did not match on every rank: finished by some, never by it
            said += (
                f": it is still in {stuck.op} #{stuck.seq} ({_size(stuck.nbytes)}), which {waiting} finished (did the "
                f"ranks' calls #{stuck.seq} match, in size and kind?)"
            )
        return said


def stalls(ranks: Iterable[RankCollectives], now: float, waited_s: float = WAITED_TO_LOOK_S) -> list[Stall]:
    """The collectives some ranks have waited in for ``waited_s``, per group, with the members that never
    entered them (a member is a rank whose summary has the group); the one most ranks wait in first.

    Where ranks wait for each other across groups (rank 2 in a subgroup's collective that waits for rank 1,
    rank 1 with the others in the default group's, waiting for rank 2), the rank the most ranks wait for is
    the one that went astray: the first stall's missing ranks are the culprits, the others' are victims."""
    by_group: dict[str, list[tuple[RankCollectives, Group]]] = {}
    unseen = []
    for r in ranks:
        if not r.groups:
            unseen.append(r)
        for g in r.groups:
            by_group.setdefault(g.name, []).append((r, g))
    if DEFAULT_GROUP in by_group:  # every rank is in it: one whose watcher never wrote has entered none of it
        by_group[DEFAULT_GROUP] += [(r, Group(DEFAULT_GROUP, "", -1, -1, None)) for r in unseen]
    found = []
    for name, members in sorted(by_group.items()):
        # A collective some member finished has finished for every member: one still in flight in a summary is
        # an old summary's (its writer cannot run: the GIL held since), not a wait.
        done = max(g.finished for _, g in members)
        waiting = [
            (r, g)
            for r, g in members
            if g.in_flight is not None and g.in_flight.seq > done and g.in_flight.since <= now - waited_s
        ]
        if not waiting:
            continue
        seq = min(g.finished + 1 for _, g in waiting)  # the collective the longest waiters are in
        # Every member in it waits in it, one that entered it a moment ago too: it is no missing member, and
        # the stall is not every member's without it.
        stuck = [(r.rank, g) for r, g in members if g.in_flight is not None and g.finished + 1 == seq <= g.entered]
        flying = next((g.in_flight for _, g in stuck if g.in_flight is not None), None)
        if flying is None:
            continue
        entered = tuple(sorted((rank, g.in_flight.since if g.in_flight else now) for rank, g in stuck))
        missing = tuple(sorted(r.rank for r, g in members if g.entered < seq))
        calls = tuple(sorted((rank, g.in_flight.op, g.in_flight.nbytes) for rank, g in stuck if g.in_flight))
        if len({(op, nbytes) for _, op, nbytes in calls}) == 1:
            calls = ()  # one call: no mismatch
        behind = tuple(
            sorted(
                (r.rank, g.in_flight) for r, g in members if g.entered < seq and g.in_flight and g.in_flight.seq < seq
            )
        )
        description = stuck[0][1].description
        found.append(Stall(name, description, seq, flying.op, flying.nbytes, entered, missing, calls, behind))
    return sorted(found, key=lambda s: (-len(s.waiting), s.since))


@dataclass(frozen=True, slots=True)
class Suspects:
    """Whom a stall puts under watch: the members missing from its collective, each hung once quiet for
    ``quiet_s``; else (``whole``: every member entered it) all of them, with more patience, one blamed only
    when none of them moves."""

    stall: Stall
    ranks: frozenset[int]
    quiet_s: float
    whole: bool


def suspects(found: Sequence[Stall], patience: Patience) -> Suspects | None:
    """The stall to judge of those :func:`stalls` found (one with missing members first), and whom."""
    missing = next((s for s in found if s.missing), None)
    if missing is not None:
        return Suspects(missing, frozenset(missing.missing), patience.quiet_s, whole=False)
    if not found:
        return None
    return Suspects(found[0], frozenset(rank for rank, _ in found[0].waiting), patience.unfinished_s, whole=True)


def culprits(
    watched: Suspects,
    quiet: Mapping[int, tuple[float, bool] | None],
    summaries: Mapping[int, RankCollectives],
    now: float,
    patience: Patience,
) -> list[int]:
    """The suspects blamed, of those looked at on this node (``quiet``: rank -> how long it showed no progress
    and whether its process is stopped; None: its process is gone, and its exit tells). A missing member is
    hung once quiet long enough, with the others waiting at least the patience's waited_s. In a collective
    every member entered, none of the local members may move, and only one is blamed: the one that stopped
    moving first, a stopped process before any other, else the one whose stack has not changed the longest."""
    if now - watched.stall.since < patience.waited_s:
        return []
    hung = {rank: q[1] for rank, q in quiet.items() if q is not None and q[0] >= watched.quiet_s}
    if not watched.whole or not hung:
        return list(hung)
    if len(hung) < len(quiet):
        return []  # one of them moves (or is gone): the collective may be slow, not hung
    odd = watched.stall.odd_ones()  # a mismatch: the ranks whose call is the rare one went astray
    pick = [rank for rank in hung if rank in odd] or list(hung)
    return [min(pick, key=lambda rank: (not hung[rank], summaries[rank].stack_since or now))]


@dataclass(frozen=True, slots=True)
class Sample:
    """What a rank's process did, as /proc tells, at one moment."""

    at: float  # wall
    main_cpu_s: float  # the main thread's CPU time
    other_cpu_s: float  # its other threads' and its children's
    io_bytes: int  # bytes it read and wrote, storage and otherwise
    stopped: bool  # state T or t: it cannot run at all
    waiting_for: str = ""  # whom its main thread waits for, if not itself: a person at a prompt, a program (waits)


class Progress:
    """PURE: when a rank last showed a sign of progress, from the samples taken while it is looked at."""

    def __init__(self) -> None:
        self._last: dict[int, Sample] = {}
        self._moved: dict[int, float] = {}  # rank -> wall time of its last sign of CPU or I/O progress

    def add(self, rank: int, sample: Sample, where: str, looping: bool = False) -> None:
        """``looping``: its main thread goes round a loop it never leaves; its CPU time then is no progress."""
        last = self._last.get(rank)
        self._last[rank] = sample
        if last is None:
            self._moved[rank] = sample.at  # looked at from now: nothing is known of before
            return
        dt = sample.at - last.at
        spins = any(w in where for w in SPIN_WAITS)
        main_busy = sample.main_cpu_s - last.main_cpu_s > BUSY_SHARE * dt and not (spins or looping)
        busy = main_busy or sample.other_cpu_s - last.other_cpu_s > OTHERS_BUSY_SHARE * dt
        moving_io = sample.io_bytes - last.io_bytes > IO_BUSY_BYTES_PER_S * dt
        if not sample.stopped and (busy or moving_io or sample.waiting_for):  # another's wait is no hang of its own
            self._moved[rank] = sample.at

    def moved_at(self, rank: int) -> float | None:
        """The wall time of ``rank``'s last sign of CPU or I/O progress (None: never sampled)."""
        return self._moved.get(rank)

    def forget(self, keep: Sequence[int]) -> None:
        for rank in set(self._last) - set(keep):
            del self._last[rank], self._moved[rank]

    def quiet_since(self, r: RankCollectives, now: float) -> float:
        """When ``r`` last moved: its stack reached a new place (when its watcher still reads it), or its CPU or
        I/O did."""
        moved = self._moved.get(r.rank, now)
        if now - r.read_at <= STALE_S:
            moved = max(moved, r.new_place_since)
        return moved


def _in_flight(x: list[object]) -> InFlight:
    seq, op, nbytes, since = x
    return InFlight(int(str(seq)), str(op), int(str(nbytes)), float(str(since)))


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _ranks(ranks: Sequence[int]) -> str:
    """'rank 2', 'ranks 0-2', 'ranks 0, 2, 5'."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
