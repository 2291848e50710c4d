"""PURE: a worker's assignment -> its environment. The torchrun contract in one place.

No ``os`` here: the base environment is passed in, so a test can check every
variable without touching the process environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerAssignment:
    """Everything that makes one worker different from the others, for one attempt."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    group_world_size: int
    role_rank: int
    role_world_size: int
    role_name: str
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    run_id: str
    error_file: str
    flight_recorder_file: str = ""  # where torch dumps the recorder at a process group's timeout (+ rank)
    flight_recorder_pipe: str = ""  # NCCL's debug pipe (+ rank + .pipe): a line into it asks for that dump


@dataclass(frozen=True, slots=True)
class Placement:
    """Where this node's workers sit in the job: from the rendezvous round, or the flags (static)."""

    group_rank: int = 0
    group_world_size: int = 1
    rank_offset: int = 0  # the global rank of local rank 0
    world_size: int | None = None  # None: this node's workers are the whole job


def assign(
    local_rank: int,
    nproc: int,
    placement: Placement,
    *,
    role: str,
    master_addr: str,
    master_port: int,
    restart_count: int,
    max_restarts: int,
    run_id: str,
    error_file: str,
    flight_recorder_file: str = "",
    flight_recorder_pipe: str = "",
) -> WorkerAssignment:
    """The assignment of ``local_rank``: global rank = rank offset of this node + local rank (as torchrun)."""
    world = nproc if placement.world_size is None else placement.world_size
    rank = placement.rank_offset + local_rank
    return WorkerAssignment(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=nproc,
        group_rank=placement.group_rank,
        group_world_size=placement.group_world_size,
        role_rank=rank,  # one role per job: role ranks are the global ranks
        role_world_size=world,
        role_name=role,
        master_addr=master_addr,
        master_port=master_port,
        restart_count=restart_count,
        max_restarts=max_restarts,
        run_id=run_id,
        error_file=error_file,
        flight_recorder_file=flight_recorder_file,
        flight_recorder_pipe=flight_recorder_pipe,
    )


FR = "2000"  # entries of torch's flight recorder, its default
PIPE_NAMES = ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_FR_DEBUG_INFO_PIPE_FILE")  # torch <= 2.11 and later


def worker_env(base: Mapping[str, str], a: WorkerAssignment, *, virtual_local_rank: bool = False) -> dict[str, str]:
    """The environment of one worker: ``base`` plus the torchrun variables and ftrun's own.

    Values set here always win over ``base``, so a stale RANK inherited from a
    parent launcher can never leak into a worker. ``virtual_local_rank``: every
    worker sees only its own GPU, as device 0 (LOCAL_RANK=0), as torchrun's flag.
    """
    devices = {}
    if virtual_local_rank:
        visible = [d.strip() for d in base["CUDA_VISIBLE_DEVICES"].split(",")] if "CUDA_VISIBLE_DEVICES" in base else []
        devices = {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": visible[a.local_rank] if visible else str(a.local_rank)}
    return {
        **base,
        "RANK": str(a.rank),
        "LOCAL_RANK": str(a.local_rank),
        "WORLD_SIZE": str(a.world_size),
        "LOCAL_WORLD_SIZE": str(a.local_world_size),
        "GROUP_RANK": str(a.group_rank),
        "GROUP_WORLD_SIZE": str(a.group_world_size),
        "ROLE_RANK": str(a.role_rank),
        "ROLE_WORLD_SIZE": str(a.role_world_size),
        "ROLE_NAME": a.role_name,
        "MASTER_ADDR": a.master_addr,
        "MASTER_PORT": str(a.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(a.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts),
        "TORCHELASTIC_RUN_ID": a.run_id,
        "TORCHELASTIC_ERROR_FILE": a.error_file,
        # torch's env:// init then lets rank 0 host the job's TCPStore: ftrun's store is not one to share.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),  # as torchrun
        "FTRUN_ERROR_FILE": a.error_file,
        **flight_recorder_env(base, a.flight_recorder_file, a.flight_recorder_pipe),
        **startup_env(base),
        **devices,
    }


def flight_recorder_env(base: Mapping[str, str], dump_file: str, pipe: str = "") -> dict[str, str]:
    """torch's flight recorder, which ftrun's hang watch reads (:mod:`ftrun.worker.collectives`), sized at
    torch's own default (gloo records with no setting; NCCL and torchcomms only when it is set), and its dump at a
    process group's timeout (NCCL's watchdog) kept in the rank's log directory rather than in /tmp, and NCCL's
    debug pipe beside it (ftrun asks for a dump through it when it finds a rank hung: :mod:`ftrun.monitor.dumps`).
    What the job set wins, under either of torch's names (TORCH_NCCL_* are the old ones: setting them makes
    torch warn, but the pipe's are each read alone)."""
    env = {}
    if "TORCH_FR_BUFFER_SIZE" not in base and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in base:
        env["TORCH_FR_BUFFER_SIZE"] = FR
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in base:
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if dump_file and "TORCH_FR_DUMP_TEMP_FILE" not in base and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in base:
        env["TORCH_FR_DUMP_TEMP_FILE"] = dump_file
    if pipe and not any(name in base for name in PIPE_NAMES):  # each version reads one name, warning for none
        env.update(dict.fromkeys(PIPE_NAMES, pipe))
    return env


def startup_env(base: Mapping[str, str]) -> dict[str, str]:
    """What ftrun adds to ``base`` that the workers' interpreter reads as it starts. A zygote starts with it
    too: what it sets up then is what a fresh worker has (faulthandler's handlers, as the signal module
    records them at start-up: ``signal.getsignal(SIGSEGV)`` is None in both)."""
    # A crash in C (SIGSEGV) leaves the Python stack on stderr, hence in the report (unless the user chose).
    return {"PYTHONFAULTHANDLER": base.get("PYTHONFAULTHANDLER", "1")}
