"""Progress seen with no code change: every optimizer step of the job is a heartbeat.

ftrun's worker start-up calls :func:`install` before the job's code runs. It never
imports torch itself: when the job imports ``torch.optim`` (or already has it,
forked from a warm pool), torch's global optimizer step hook
(``register_optimizer_step_post_hook``) gets a tiny function that records a
heartbeat in the worker's slot: a clock read and two stores, well under a
microsecond per step; and the step's times, for straggler detection
(:mod:`ftrun.worker.pace`). Every batch a ``DataLoader`` yields is progress too, so an
evaluation loop (no optimizer step) is not a hang. A job that calls
``ftrun.heartbeat()`` or opens a section itself is in charge from then on: the
automatic heartbeats stop.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from ftrun.worker import client, in_place, pace
from ftrun.worker.master_wait import hook_rendezvous


def _hook_optimizer(module: ModuleType) -> None:
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is not None:  # torch >= 2.0
        register(_after_timed_step if pace.enabled() else _after_step)


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    client.auto_heartbeat()


def _after_timed_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    client.auto_heartbeat()
    pace.step_ends()


def _hook_rendezvous(module: ModuleType) -> None:
    """A warm start's race for rank 0's TCPStore (master_wait); and the agent is told while the job meets its
    peers (a long wait there is said, with what it waits for)."""
    hook_rendezvous(module, _meeting)


def _meeting(on: bool) -> None:
    client.meeting_peers(on)
    if not on:  # a rank restarted in place notes when it met its peers again (ftrun report)
        in_place.phase("met")


def _hook_data_loader(module: ModuleType) -> None:
    """Every batch a DataLoader yields is progress: an evaluation loop makes no optimizer step, but it does
    fetch batches. torch has no public hook here, so the iterator's ``__next__`` is wrapped, once."""
    iterator = getattr(module, "_BaseDataLoaderIter", None)
    original = getattr(iterator, "__next__", None)
    if original is None or getattr(original, "_ftrun", False):
        return

    def __next__(self: Any) -> Any:
        batch = original(self)
        client.auto_progress()
        return batch

    __next__._ftrun = True  # type: ignore[attr-defined]
    iterator.__next__ = __next__  # type: ignore[union-attr]


def _hook_backward(module: ModuleType) -> None:
    if pace.enabled():
        pace.hook_backward(module)


HOOKS = {
    "torch.optim.optimizer": _hook_optimizer,
    "torch.autograd": _hook_backward,
    "torch.utils.data.dataloader": _hook_data_loader,
    "torch.distributed.rendezvous": _hook_rendezvous,
}


def install() -> None:
    """Hook torch's modules now if the job has them, else once the job imports them."""
    missing = set()
    for name, hook in HOOKS.items():
        module = sys.modules.get(name)
        if module is None:
            missing.add(name)
        else:
            hook(module)
    if missing and not any(isinstance(f, _WhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported(missing))


class _WhenImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of each module in ``HOOKS`` so that its hook goes in right after
    the module has run; steps aside once all are in."""

    def __init__(self, waiting: set[str]) -> None:
        self._waiting = waiting

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in self._waiting:
            return None
        self._waiting.discard(fullname)
        if not self._waiting:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenHook(spec.loader, HOOKS[fullname])
        return spec


class _ThenHook(importlib.abc.Loader):
    def __init__(self, loader: Any, hook: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        created: ModuleType | None = self._loader.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._hook(module)
