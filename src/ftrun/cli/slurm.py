"""Inside a SLURM job step (``srun ftrun train.py``), the rendezvous comes from SLURM's variables.

srun starts one ftrun per node of the step. With no rendezvous flag (nor its ``PET_*`` variable), ftrun takes
the node count from ``SLURM_STEP_NUM_NODES``, the rendezvous id from ``SLURM_JOB_ID`` (a requeued job keeps
it), and hosts the embedded store on the step's first node (``SLURM_STEP_NODELIST``), on a port derived from
the job id so that two jobs sharing a first node do not meet. Said at start, with where each value came from.
Outside a step (the batch script itself, a login shell) nothing is taken: one ftrun there is one node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ftrun.errors import ConfigError

PORT_BASE = 20000  # + the job id modulo PORT_SPAN: below the kernel's ephemeral ports (32768 and up)
PORT_SPAN = 10000


@dataclass(frozen=True, slots=True)
class SlurmStep:
    job_id: str
    nodes: int
    node_index: int
    first_node: str
    requeued: int = 0  # SLURM_RESTART_COUNT: how many times SLURM requeued the job (pre-emption, --requeue)

    @property
    def port(self) -> int:
        return PORT_BASE + int(self.job_id) % PORT_SPAN if self.job_id.isdigit() else PORT_BASE

    def flags(self) -> dict[str, str]:
        """The rendezvous flags (argparse destinations) it stands for."""
        return {
            "nnodes": str(self.nodes),
            "rdzv_backend": "c10d",
            "rdzv_endpoint": f"{self.first_node}:{self.port}",
            "rdzv_id": self.job_id,
        }

    def describe(self) -> str:
        return (
            f"SLURM job {self.job_id}: {self.nodes} node(s) (SLURM_STEP_NUM_NODES), this one number "
            f"{self.node_index} (SLURM_NODEID); rendezvous c10d at {self.first_node}:{self.port} (the first of "
            f"SLURM_STEP_NODELIST; the port from the job id), id {self.job_id} (SLURM_JOB_ID)"
        )


def slurm_step(environ: Mapping[str, str]) -> SlurmStep | None:
    """The SLURM job step this process runs in, or None outside one."""
    job, nodes, nodelist = (environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST"))
    if not job or not nodes or not nodelist:
        return None
    try:
        count = int(nodes)
        hosts = expand_hostlist(nodelist)
    except ValueError as e:
        raise ConfigError("SLURM_STEP_NODELIST", f"cannot read {nodelist!r} ({e})", "pass --rdzv-endpoint") from None
    requeued = environ.get("SLURM_RESTART_COUNT", "0")
    node = int(environ.get("SLURM_NODEID", "0") or 0)
    return SlurmStep(job, count, node, hosts[0], int(requeued) if requeued.isdigit() else 0)


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list, expanded: ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07 login1.
    Raises ValueError on what is not one."""
    hosts: list[str] = []
    for item in _split_top(text):
        prefix, bracket, rest = item.partition("[")
        if not bracket:
            hosts.append(item)
            continue
        inside, close, suffix = rest.partition("]")
        if not close or "[" in suffix:
            raise ValueError(f"unbalanced brackets in {item!r}")
        for part in inside.split(","):
            m = _RANGE.match(part.strip())
            if m is None:
                raise ValueError(f"not a number or range: {part!r}")
            first, last = m.group(1), m.group(2) or m.group(1)
            if int(last) < int(first):
                raise ValueError(f"a range that goes down: {part!r}")
            hosts += [f"{prefix}{n:0{len(first)}d}{suffix}" for n in range(int(first), int(last) + 1)]
    if not hosts:
        raise ValueError("no host")
    return hosts


def _split_top(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]
