"""Timeouts a job calculates from what its ranks did (``ftrun.calculate_timeouts``) and keeps in its
checkpoints (``ftrun.monitor_state``/``load_monitor_state``), NVIDIA's saved state included."""

from __future__ import annotations

from typing import Any

from ftrun.worker import client
from ftrun.worker.timeouts import NVIDIA_STATE_KEY, Timeouts, from_nvidia_state

STATE_VERSION = 1


def calculate_timeouts(*, safety_factor: float | None = None, synchronize: bool = True) -> dict[str, Any]:
    """Set the timeouts from what was observed so far: the largest heartbeat gap, time from the worker's
    start to its first heartbeat, out-of-section span and duration of each section, times
    ``safety_factor`` (default: ``--safety-factor``). Timeouts only grow. Returns what this worker
    calculated (JSON-able).

    The agents make every rank of the job agree: each agent applies the largest value any of its local
    ranks published, and in a multi-node job with a store the largest of every node. That needs nothing
    from the job's own process group (NCCL, ``cuda:gloo`` and CPU groups alike); ``synchronize`` is
    accepted for compatibility and has no effect.
    """
    del synchronize  # the agents agree across ranks and nodes (see above)
    if safety_factor is not None and not safety_factor > 0:
        raise ValueError(f"safety_factor must be > 0, got {safety_factor}")
    return client._client.calculate_timeouts(safety_factor).to_json()


def monitor_state() -> dict[str, Any]:
    """The calculated timeouts as JSON-able data, to keep in a checkpoint."""
    return {"v": STATE_VERSION, "timeouts": client._client.calculated.to_json()}


def load_monitor_state(state: dict[str, Any]) -> None:
    """Restore what :func:`monitor_state` returned, or what NVIDIA's ``RankMonitorClient.state_dict()`` saved
    (its calculated heartbeat timeouts); raises ValueError if it is neither."""
    if isinstance(state, dict) and (not state or NVIDIA_STATE_KEY in state):
        timeouts = from_nvidia_state(state, client._client.calculated)
    elif isinstance(state, dict) and state.get("v") == STATE_VERSION and "timeouts" in state:
        timeouts = Timeouts.from_json(state["timeouts"])
    else:
        raise ValueError(f"not an ftrun monitor state of version {STATE_VERSION}: {state!r:.200}")
    client._client.set_timeouts(timeouts)
