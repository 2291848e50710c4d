"""How long each step of the job computes, with no code change: what names a straggler (the agent's side is
:mod:`ftrun.monitor.pace`).

In synchronous training every rank's step lasts as long as the slowest rank's: the others wait for it in the
gradient all-reduce, which DDP runs during the backward pass. So the time from the end of one optimizer step
to the start of the next backward pass (loading the batch and the forward pass) is the part of a step a rank
spends on its own work, and it is what tells the slow rank from the others; the whole step's time is the
same for all. Two hooks give it: torch's global optimizer step hook (the step's end, with the automatic
heartbeat) and ``torch.autograd.backward`` (which ``Tensor.backward`` calls), wrapped once. A step costs two
clock reads and two stores into the worker's slot.

Not seen: a rank slow only in its backward pass (its forward is as slow, on a throttled device), and jobs
whose collectives wait in the forward pass (FSDP's all-gathers) blur the difference.
"""

from __future__ import annotations

import functools
import os
import time
from types import ModuleType
from typing import Any

from ftrun.jsonobject import object_or_none
from ftrun.worker import client

ENV = "FTRUN_STRAGGLERS"  # "0": --no-stragglers, nothing is timed
SCORES_ENV = "FTRUN_STRAGGLERS_FILE"  # where the agent keeps every rank's score for the attempt
MAX_SCORES_BYTES = 1 << 20

_step_ended = 0.0  # CLOCK_MONOTONIC: the end of the last optimizer step (0: none yet)
_backward_started = 0.0  # the first backward pass since then (0: none)


def stragglers() -> dict[int, float]:
    """Every rank's straggler score as the agent last judged it: how much longer it computes per step than the
    job's other ranks (0.3: 30% longer; ftrun names a rank whose score stays above 0.05). Empty before the first
    judgement (a few seconds of steps), with ``--no-stragglers``, and outside ftrun."""
    path = os.environ.get(SCORES_ENV)
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            found = object_or_none(f.read(MAX_SCORES_BYTES), limit=MAX_SCORES_BYTES) or {}
        return {int(rank): float(score) for rank, score in found.items()}
    except (OSError, ValueError, TypeError):
        return {}


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def hook_backward(module: ModuleType) -> None:
    """Wrap ``torch.autograd.backward`` (looked up on the module at every call, by ``Tensor.backward`` too)."""
    original = getattr(module, "backward", None)
    if original is None or getattr(original, "_ftrun", False):
        return

    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        backward_starts()
        return original(*args, **kwargs)

    backward._ftrun = True  # type: ignore[attr-defined]
    module.backward = backward  # type: ignore[attr-defined]


def backward_starts() -> None:
    global _backward_started  # noqa: PLW0603 (the hot path: a plain global, no object to look up)
    if not _backward_started:  # gradient accumulation: the first backward pass of the step ends its computing
        _backward_started = time.monotonic()


def step_ends() -> None:
    """An optimizer step ended: the step's times go to the agent (a step with no backward pass before it, e.g.
    a second optimizer's, only moves the mark)."""
    global _step_ended, _backward_started
    now = time.monotonic()
    if _step_ended and _backward_started > _step_ended:
        client.paced(_backward_started - _step_ended, now - _step_ended)
    _step_ended, _backward_started = now, 0.0
