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
