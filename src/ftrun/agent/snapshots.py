"""The agent's keeping of its workers' in-memory snapshots (``ftrun.snapshot``; :mod:`ftrun.worker.snapshot`).

The workers write their snapshots into a directory of this run in shared memory (``/dev/shm``), which the
agent makes (0700) and names in their environment: a worker's death does not free them. At each restart the
agent names the step to restore (``FTRUN_RESTORE_STEP``): the newest that every local rank wrote whole and that
no restore found corrupt (a worker that finds its part does not verify marks the step bad and fails; the next
restart takes the step before), agreed with the other nodes of the job (:mod:`ftrun.job.snapshot_agreement`).
A step restored twice, each time followed by a failure before a newer step was whole, is given up too: the
state itself may be what fails (a NaN it holds), so the restart after takes the step before, and after that
none (the job's own checkpoint). It keeps the newest :data:`KEEP` whole steps of each rank, and removes the
directory when the run ends (an agent SIGKILLed: its warden removes it at once, or else the next agent of this
user).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from ftrun.agent.snapshot_plan import GIVE_UP_AFTER, plan_attempt
from ftrun.job.board import JobBoard
from ftrun.job.snapshot_agreement import UNAGREED_STEP, Decision, Offer, RoundAgreement, alone
from ftrun.job.snapshot_mirror import SnapshotMirror, held, whole_files
from ftrun.private import own_dir
from ftrun.worker.snapshot import ENV_COPIES, ENV_DIR, ENV_MEMORY, ENV_RANKS, ENV_RESTORE, RESTORE_UNAGREED
from ftrun.worker.snapshot_file import (
    STEP_DIR,
    CorruptSnapshot,
    World,
    bad_steps,
    is_whole,
    path_of,
    peer_path,
    pinned_steps,
    whole_steps,
    world_of,
)

SHARED_MEMORY = Path("/dev/shm")  # noqa: S108 - a directory of the user's own in it (own_dir: 0700, owner checked)


def snapshot_root() -> Path:
    """Where this user's agents keep their runs' snapshots: ``<pid>-<run>-...`` each (the warden frees a
    SIGKILLed agent's at once)."""
    base = SHARED_MEMORY if SHARED_MEMORY.is_dir() else Path(tempfile.gettempdir())
    return base / f"ftrun-snapshots-{os.geteuid()}"


class SnapshotKeeper:
    @classmethod
    def open(cls, run_name: str, say: Callable[[str], None], memory: int = 1 << 30, ranks: int = 1) -> SnapshotKeeper:
        """A directory of this run's in shared memory (the temp dir where there is none), named after this
        agent's pid; those of agents that died without removing theirs (SIGKILL, and their warden killed too)
        are removed first. ``memory``: --snapshot-memory, for the node's ``ranks`` together."""
        parent = own_dir(snapshot_root())
        for stale in parent.iterdir():
            owner = stale.name.split("-", 1)[0]
            if owner.isdigit() and not psutil.pid_exists(int(owner)):
                shutil.rmtree(stale, ignore_errors=True)
        room = os.statvfs(parent)
        if (holds := room.f_blocks * room.f_frsize) < memory:
            say(
                f"--snapshot-memory is {memory / (1 << 30):.2f} GiB but {parent.parent} holds "
                f"{holds / (1 << 30):.2f} GiB: the job's ftrun.snapshot calls that find no room there are skipped "
                "(a container's /dev/shm is often small: give it more, e.g. docker run --shm-size, or lower "
                "--snapshot-memory)"
            )
        directory = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-{run_name}-", dir=parent))
        return cls(directory, say, memory // max(1, ranks))

    def __init__(self, directory: Path, say: Callable[[str], None], rank_share: int) -> None:
        """Use :meth:`open`. ``rank_share``: the bytes each local rank's snapshot files may take (--snapshot-memory
        over the local ranks)."""
        self.dir = directory
        self._rank_share = rank_share
        self._say = say
        self._restore: int | None = None
        self._unagreed = False
        self._failed_after: dict[int, int] = {}  # a restored step -> the attempts that failed before a newer one
        self._mirror: SnapshotMirror | None = None
        self._held: dict[int, set[int]] = {}
        self._ranks: list[int] = []  # this attempt's local ranks
        self.restoring = ""  # what this attempt's workers restore, as said ("": no snapshot to speak of)

    def mirror(self, host: str, job_key: bytes) -> None:
        """Copy this node's snapshots to the next node, and hold the previous node's (a job of several nodes):
        a lost node's ranks restore from their copy (:mod:`ftrun.job.snapshot_mirror`)."""
        if self._mirror is None:
            try:
                self._mirror = SnapshotMirror.serve(self.dir, host, job_key, self._rank_share)
            except OSError as e:  # the job goes on; a node lost takes its snapshots with it
                self._say(f"snapshots are not copied to another node: cannot listen on {host} ({e})")

    def new_attempt(self, ranks: Sequence[int], restore: Restore | None, world_size: int = 0) -> None:
        """Before the attempt's workers start: the step they restore, ``restore.agree`` deciding it from what
        each node has (None: no restore at all, a static job of several nodes), the files of it this node
        lacks fetched or taken from its peer copies, given up steps removed, the older ones pruned; then this
        node's snapshots are copied to the next node as they come."""
        if self._mirror is not None:
            self._mirror.stop_sending()
        self._ranks = list(ranks)
        self._held = held(self.dir)
        found = {r: whole_steps(self.dir, [r]) | self._held.get(r, set()) for r in ranks}
        plan = plan_attempt(
            found,
            bad=bad_steps(self.dir),  # a worker found a part corrupt
            pinned=pinned_steps(self.dir),  # a lost node's copy meets them
            restored=self._restore,
            failed_after=self._failed_after,
        )
        self._failed_after = plan.failed_after
        if plan.given_up is not None:
            self._say(
                f"step {plan.given_up} was restored {GIVE_UP_AFTER} times and the job failed each time before a "
                "newer snapshot: its state may be what fails; it is given up for an older one"
            )
        for step in (*plan.remove, *plan.prune):  # a step removed and written again whole counts again
            shutil.rmtree(self.dir / STEP_DIR.format(step), ignore_errors=True)
        have = plan.have
        # Every other rank's file whole here too, a copy or its own from a world of another size: a job that
        # reshards takes the old ranks' parts from wherever they are (ftrun.restore_parts).
        holds: dict[int, set[int]] = {}
        for rank, steps in [*self._held.items(), *whole_files(self.dir).items()]:
            if rank not in have:
                holds[rank] = holds.get(rank, set()) | steps
        mirror, group_rank = self._mirror.address if self._mirror else None, restore.group_rank if restore else 0
        offer = Offer(have, holds, mirror, group_rank, self._replicated(have))
        decision = restore.agree(offer) if restore is not None else Decision(None)
        self._unagreed = decision.step == UNAGREED_STEP or not self._gather(decision, ranks)
        self._restore = None if self._unagreed else decision.step
        self.restoring = ""
        if self._restore is not None:
            then = self._world_changed(self._restore, ranks, world_size)
            self.restoring = self._restoring(self._restore, then, world_size)
            if then is not None:
                self._gather_parts(self._restore, decision.parts)
        elif self._unagreed:
            self.restoring = "the nodes did not agree on a snapshot step in time: this attempt's ftrun.restore() fails"
        elif any(have.values()) or holds:
            self.restoring = (
                "no snapshot step is whole on every rank on the nodes here (a node new to the job has none of a "
                "state that depends on the rank, or a lost node's copy had not reached its peer): the workers "
                "start without one, ftrun.restore() returns None"
            )
        if self.restoring:
            self._say(self.restoring)
        if self._mirror is not None and restore is not None and restore.successor is not None:
            self._mirror.send_to(restore.successor, list(ranks), paces=restore.group_rank == 0)

    def _replicated(self, have: Mapping[int, set[int]]) -> dict[int, int]:
        """The steps whose state the job said serves any rank (``replicated=True``), each with a rank here that
        has it: a node new to the job (a world that grew) takes that file for its own ranks."""
        found: dict[int, int] = {}
        for rank, steps in have.items():
            for step in steps - set(found):
                world = self._world_of(step, rank)
                if world is not None and world.replicated:
                    found[step] = rank
        return found

    def _world_of(self, step: int, rank: int) -> World | None:
        """The world a rank's file of a step here says it was taken in (None: it does not say, or it cannot be
        read: the worker that restores it finds that and says so)."""
        try:
            return world_of(path_of(self.dir, step, rank))
        except (OSError, CorruptSnapshot):
            return None

    def _world_changed(self, step: int, ranks: Sequence[int], world_size: int) -> int | None:
        """The size of the world the step was taken in, where it differs from this one's and the state depends
        on the rank (then only every old rank's part serves: ftrun.restore_parts); None otherwise."""
        then = self._world_of(step, ranks[0]) if ranks else None
        if then is None or then.replicated or not world_size or then.size == world_size:
            return None
        return then.size

    def _restoring(self, step: int, then: int | None, world_size: int) -> str:
        """What the workers restore: the step, or, where it was taken in a world of another size, what they do."""
        if then is None:
            return f"the workers restore the snapshot of step {step}, whole on every rank"
        return (
            f"the snapshot of step {step} was taken in a world of {then} ranks, this one has {world_size}: "
            "ftrun.restore() returns it only where the job said its state does not depend on the world "
            "(ftrun.snapshot(..., replicated=True)), else None; ftrun.restore_parts() gives every old rank's part "
            "gathered from the nodes that hold them, to reshard"
        )

    def _gather_parts(self, step: int, parts: Mapping[int, str]) -> None:
        """Every old rank's part of the step here, fetched into its own place from the node that holds it where
        this one has neither that nor a copy; those that cannot be had restore_parts names missing."""
        for rank, address in sorted(parts.items()):
            here = (path_of(self.dir, step, rank), peer_path(self.dir, step, rank))
            if any(is_whole(p) for p in here) or self._mirror is None:
                continue
            if self._mirror.fetch(address, step, rank):
                self._say(f"rank {rank}'s part of step {step} fetched from {address}, for a job that reshards")
            else:
                self._say(f"rank {rank}'s part of step {step} could not be had from {address}")

    def _gather(self, decision: Decision, ranks: Sequence[int]) -> bool:
        """This node's files of the decided step in their place: its own, a peer copy it holds, or fetched from
        the mirror the decision names; False when one cannot be had."""
        step = decision.step
        if step is None or step == UNAGREED_STEP:
            return True
        for rank in ranks:
            own, copy = path_of(self.dir, step, rank), peer_path(self.dir, step, rank)
            if is_whole(own):
                continue
            if is_whole(copy):  # this node holds the copy of a rank it now has: the copy becomes its own
                own.parent.mkdir(parents=True, exist_ok=True)
                copy.replace(own)
                continue
            address, whose = decision.fetch.get(rank, ("", rank))
            if not address or self._mirror is None or not self._mirror.fetch(address, step, whose, into=rank):
                self._say(f"rank {rank}'s snapshot of step {step} could not be had from {address or 'any node'}")
                return False
            if whose == rank:
                self._say(f"rank {rank}'s snapshot of step {step} fetched from the node holding its copy ({address})")
            else:
                self._say(f"rank {rank} takes rank {whose}'s snapshot of step {step}, a state that serves any rank, "
                          f"from {address}")  # fmt: skip
        return True

    def env(self) -> dict[str, str]:
        env = {ENV_DIR: str(self.dir), ENV_MEMORY: str(self._rank_share), ENV_COPIES: "1" if self._mirror else "0"}
        env[ENV_RANKS] = ",".join(map(str, self._ranks))
        if self._restore is not None or self._unagreed:
            env[ENV_RESTORE] = RESTORE_UNAGREED if self._unagreed else str(self._restore)
        return env

    def close(self) -> None:
        """The run is over: its snapshots free the memory they hold."""
        if self._mirror is not None:
            self._mirror.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class Restore:
    """How an attempt's snapshot step is decided, and where this node's snapshots are copied to."""

    agree: Callable[[Offer], Decision]
    group_rank: int = 0
    successor: Callable[[], str | None] | None = None  # the next node's mirror, once it offered


def restore_plan(
    nodes: int, board: JobBoard | None, round_: int | None, group_rank: int, domain: str = ""
) -> Restore | None:
    """Here alone, with the other nodes through the store (copies to the next node), or not at all (a static
    job of several nodes has no store to agree through)."""
    if nodes == 1:
        return Restore(alone)
    if board is None or round_ is None:
        return None
    agreement = RoundAgreement(board, round_, nodes, group_rank, domain)
    return Restore(agreement.agree, group_rank, agreement.successor_mirror)
