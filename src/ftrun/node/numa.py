"""``--numa-binding``: each worker runs on the CPUs near its GPU, as torchrun's modes mean it.

The topology is read from sysfs, without importing torch: the NVIDIA GPUs in PCI
order (what CUDA uses on nodes of identical GPUs), each one's NUMA node, the
CPUs of each node, sockets and last-level caches. The worker whose local rank
is i is bound near GPU i (through ``CUDA_VISIBLE_DEVICES`` when it lists
indices). The binding is applied in the worker before any of its code runs
(``FTRUN_CPU_AFFINITY``), so every thread it starts inherits it.

Modes (torch's): ``node``, the CPUs of the GPU's NUMA node; ``socket``, of every
node on that socket; ``exclusive``, the node's CPUs shared out, disjoint, among
the workers whose GPUs are on it; ``core-complex``, one last-level-cache domain
of the node per worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

MODES = ("node", "socket", "exclusive", "core-complex")
ENV = "FTRUN_CPU_AFFINITY"


class CannotBind(Exception):
    """The machine does not say enough to bind (no GPU, one NUMA node, GPUs named by UUID...)."""


def parse_cpus(text: str) -> set[int]:
    """``0-3,8,10-11`` -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def format_cpus(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def gpu_nodes(environ: Mapping[str, str], root: Path = Path("/")) -> list[int]:
    """The NUMA node of each GPU the workers see, in CUDA's order; raises CannotBind."""
    found = sorted(p.name.lower() for p in (root / "proc/driver/nvidia/gpus").glob("*"))
    if not found:
        raise CannotBind("no NVIDIA GPU is visible")
    nodes = []
    for bus in found:
        text = _read(root / "sys/bus/pci/devices" / bus / "numa_node")
        nodes.append(max(0, int(text)) if text.lstrip("-").isdigit() else 0)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return nodes
    picked = [d.strip() for d in visible.split(",") if d.strip()]
    if not all(d.isdigit() and int(d) < len(nodes) for d in picked):
        raise CannotBind(f"CUDA_VISIBLE_DEVICES={visible} is not a list of GPU indices")
    return [nodes[int(d)] for d in picked]


def plan(mode: str, nproc: int, environ: Mapping[str, str], root: Path = Path("/")) -> list[set[int]]:
    """The CPUs of each local rank; raises CannotBind."""
    per_gpu = gpu_nodes(environ, root)
    numa = sorted(int(p.name[4:]) for p in (root / "sys/devices/system/node").glob("node[0-9]*"))
    if len(numa) <= 1:
        raise CannotBind(f"this machine has {len(numa) or 'no'} NUMA node")
    if nproc > len(per_gpu):
        raise CannotBind(f"{nproc} workers but {len(per_gpu)} GPU(s)")
    node_cpus = {n: parse_cpus(_read(root / f"sys/devices/system/node/node{n}/cpulist")) for n in numa}
    homes = per_gpu[:nproc]
    if mode == "node":
        return [node_cpus[n] for n in homes]
    if mode == "socket":
        socket_of = {n: _socket(min(cpus), root) for n, cpus in node_cpus.items() if cpus}
        return [set().union(*(c for m, c in node_cpus.items() if socket_of.get(m) == socket_of.get(n))) for n in homes]
    sharers = {n: [r for r, h in enumerate(homes) if h == n] for n in set(homes)}
    if mode == "exclusive":
        return [_share(sorted(node_cpus[n]), len(sharers[n]))[sharers[n].index(r)] for r, n in enumerate(homes)]
    if mode == "core-complex":
        return [_caches(node_cpus[n], root, len(sharers[n]))[sharers[n].index(r)] for r, n in enumerate(homes)]
    raise CannotBind(f"unknown mode {mode!r}")


def _share(cpus: Sequence[int], parts: int) -> list[set[int]]:
    """``cpus`` in ``parts`` contiguous, disjoint slices of (nearly) equal size."""
    size, extra = divmod(len(cpus), parts)
    slices, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        slices.append(set(cpus[start:end]))
        start = end
    return slices


def _caches(cpus: set[int], root: Path, parts: int) -> list[set[int]]:
    """One last-level-cache domain of the node per worker (cycling if there are more workers than domains)."""
    domains: list[set[int]] = []
    for cpu in sorted(cpus):
        if any(cpu in d for d in domains):
            continue
        shared = _last_level_cache(cpu, root) & cpus
        domains.append(shared or {cpu})
    return [domains[i % len(domains)] for i in range(parts)]


def _last_level_cache(cpu: int, root: Path) -> set[int]:
    caches = sorted((root / f"sys/devices/system/cpu/cpu{cpu}/cache").glob("index[0-9]*"))
    if not caches:
        return {cpu}
    return parse_cpus(_read(caches[-1] / "shared_cpu_list") or str(cpu))


def _socket(cpu: int, root: Path) -> int:
    text = _read(root / f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id")
    return int(text) if text.isdigit() else 0


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
