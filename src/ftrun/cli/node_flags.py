"""Straggler detection and node health check settings: their flags over the ``--config`` file."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ftrun.cli.flags import parse_seconds
from ftrun.config import HEALTH_INTERVAL_S, STRAGGLER_THRESHOLD, HealthSpec, StragglerSpec
from ftrun.errors import ConfigError
from ftrun.node.health import check_spec

NODE_KEYS = {
    "stragglers": "--no-stragglers",
    "straggler_threshold": "--straggler-threshold",
    "straggler_action": "--straggler-action",
    "health_check": "--health-check",
    "health_check_interval": "--health-check-interval",
}
ACTIONS = ("report", "exclude")


def parse_stragglers(
    no_stragglers: bool, threshold: str | None, action: str | None, config_file: Mapping[str, object]
) -> StragglerSpec:
    enabled = not no_stragglers and config_file.get("stragglers", True) is not False
    raw = threshold if threshold is not None else config_file.get("straggler_threshold")
    limit = STRAGGLER_THRESHOLD
    if raw is not None:
        try:
            limit = float(str(raw))
        except ValueError:
            limit = math.nan
        if not math.isfinite(limit) or limit <= 0:
            raise ConfigError(
                "--straggler-threshold", f"expected a share above 0 (0.05: 5% slower), got {raw!r}", "pass e.g. 0.1"
            )
    chosen = str(action if action is not None else config_file.get("straggler_action", "report"))
    if chosen not in ACTIONS:
        raise ConfigError("--straggler-action", f"unknown action {chosen!r}", f"use one of {', '.join(ACTIONS)}")
    return StragglerSpec(enabled, limit, chosen == "exclude")


def parse_health(checks: Sequence[str] | None, interval: str | None, config_file: Mapping[str, object]) -> HealthSpec:
    found = checks if checks else config_file.get("health_check") or ()
    if isinstance(found, str):
        found = (found,)
    if not isinstance(found, list | tuple) or not all(isinstance(c, str) and c.strip() for c in found):
        raise ConfigError("--health-check", f"expected commands, got {found!r}", "pass e.g. --health-check ./check.sh")
    for check in found:
        check_spec(check)  # a builtin's name and argument, checked before anything starts
    raw = interval if interval is not None else config_file.get("health_check_interval")
    every = HEALTH_INTERVAL_S if raw is None else parse_seconds("--health-check-interval", str(raw))
    return HealthSpec(tuple(found), every)
