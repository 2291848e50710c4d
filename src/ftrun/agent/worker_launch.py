"""PURE: one worker's launch, from the config and the attempt: its place in the job (the assignment), its
command line and its environment. The local group adds what only it knows (the hang watch's slot, the peer
relay's address, the snapshots' directory) as ``extra``, and spawns it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ftrun.agent.driver import StartWorkers
from ftrun.agent.env import WorkerAssignment, assign, worker_env
from ftrun.config import LaunchConfig
from ftrun.node.numa import ENV as CPU_AFFINITY_ENV
from ftrun.procs.logs import PIPE_STEM, RankPaths

MODULES_FILE = "modules.json"  # per rank: what the worker imported (--warm auto)
LOCAL_RANK_MACRO = "${local_rank}"  # torchrun's, in the script's arguments


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    assignment: WorkerAssignment
    argv: list[str]
    env: dict[str, str]


def worker_launch(
    c: LaunchConfig,
    command: StartWorkers,
    paths: RankPaths,
    local_rank: int,
    master_port: int,
    extra: Mapping[str, str],
) -> WorkerLaunch:
    placement = command.placement
    assignment = assign(
        local_rank,
        c.nproc_per_node,
        placement,
        role=c.role,
        master_addr=command.master_addr,
        master_port=master_port,
        restart_count=command.restart_count,
        max_restarts=c.max_restarts,
        run_id=c.run_id,
        error_file=str(paths.error_file),
        flight_recorder_file=str(paths.flight_recorder),
        flight_recorder_pipe=str(paths.flight_recorder.with_name(PIPE_STEM)),
    )
    env = {**worker_env(c.worker_base_env, assignment, virtual_local_rank=c.virtual_local_rank), **extra}
    if c.warm.enabled and c.warm.auto:
        env["FTRUN_MODULES_FILE"] = str(paths.dir / MODULES_FILE)
    if c.cpu_affinity:
        env[CPU_AFFINITY_ENV] = c.cpu_affinity[local_rank]
    argv = [a.replace(LOCAL_RANK_MACRO, str(local_rank)) for a in c.entrypoint.command(c.python)]
    return WorkerLaunch(assignment, argv, env)
