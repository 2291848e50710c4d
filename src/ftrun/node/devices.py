"""Accelerators visible to the workers, found without importing torch (which costs seconds)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def count_gpus(environ: Mapping[str, str], dev: Path = Path("/dev")) -> int:
    """NVIDIA GPUs visible to the workers: CUDA_VISIBLE_DEVICES if set, else the device files."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in dev.glob("nvidia[0-9]*") if p.name[len("nvidia") :].isdigit()])


INTEL = "0x8086"


def count_xpus(environ: Mapping[str, str], drm: Path = Path("/sys/class/drm")) -> int:
    """Intel GPUs (XPUs) visible to the workers: ZE_AFFINITY_MASK if set, else Intel render nodes."""
    mask = environ.get("ZE_AFFINITY_MASK")
    if mask is not None:
        return len({d.strip().split(".")[0] for d in mask.split(",") if d.strip()})
    found = 0
    for node in drm.glob("renderD[0-9]*"):
        try:
            found += (node / "device" / "vendor").read_text().strip() == INTEL
        except OSError:
            continue
    return found


OTHER_ACCELERATORS = ("kfd", "accel", "neuron0", "hl0")  # AMD (ROCm), the kernel's accel class, AWS Neuron, Gaudi


def accelerators_visible(environ: Mapping[str, str], dev: Path = Path("/dev")) -> bool:
    """Whether the workers may hold an accelerator's memory: it is freed only once a process is fully gone."""
    if count_gpus(environ, dev) or count_xpus(environ):
        return True
    return any((dev / name).exists() for name in OTHER_ACCELERATORS)
