"""Progress seen with no code change: every optimizer step of the job is a heartbeat.

ftrun's worker start-up calls :func:`install` before the job's code runs. It never
imports torch itself: when the job imports ``torch.optim`` (or already has it,
forked from a warm pool), torch's global optimizer step hook
(``register_optimizer_step_post_hook``) gets a tiny function that records a
heartbeat in the worker's slot: a clock read and two stores, well under a
microsecond per step. A job that calls ``ftrun.heartbeat()`` or opens a section
itself is in charge from then on: the automatic heartbeats stop.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from ftrun.monitor import client

TARGET = "torch.optim.optimizer"


def install() -> None:
    """Heartbeat at every optimizer step, now if torch's optimizers are loaded, else once the job loads them."""
    module = sys.modules.get(TARGET)
    if module is not None:
        _hook(module)
    elif not any(isinstance(f, _WhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported())


def _hook(module: ModuleType) -> None:
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is not None:  # torch >= 2.0
        register(_after_step)


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    client.auto_heartbeat()


class _WhenImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of ``torch.optim.optimizer`` so that the hook goes in right after
    the module has run, then steps aside."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenHook(spec.loader)
        return spec


class _ThenHook(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        created: ModuleType | None = self._loader.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _hook(module)
