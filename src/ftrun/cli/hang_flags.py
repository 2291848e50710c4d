"""Hang detection settings: the hang flags over the ``--config`` file, into a HangSpec."""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

from ftrun.cli import nvidia_ft
from ftrun.cli.flags import parse_seconds, parse_signal_name
from ftrun.config import HANG_QUIET_S, HangSpec
from ftrun.errors import ConfigError
from ftrun.worker.timeouts import LEARNED_FLOOR_S, TEARDOWN_GRACE_S, Timeouts

HANG_KEYS = {
    "initial_heartbeat_timeout": "--initial-heartbeat-timeout",
    "heartbeat_timeout": "--heartbeat-timeout",
    "out_of_section_timeout": "--out-of-section-timeout",
    "safety_factor": "--safety-factor",
    "hang_signal": "--hang-signal",
    "section_timeouts": "--section-timeout",
    "teardown_timeout": "--teardown-timeout",
    "learn_timeouts": "--learn-timeouts",
    "learned_timeout_floor": "--learned-timeout-floor",
    "hang_detection": "--no-hang-detection",
    "hang_timeout": "--hang-timeout",
}


def parse_section_timeouts(flag: str, items: Sequence[str]) -> dict[str, float]:
    found: dict[str, float] = {}
    for item in items:
        name, sep, seconds = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(flag, f"expected NAME=SECONDS, got {item!r}", f"pass e.g. {flag} step=30")
        name = name.strip()
        found[name] = parse_seconds(f"{flag} {name}", seconds, fix=f"pass e.g. {flag} {name}=30")
    return found


def parse_steps(flag: str, value: object) -> int:
    if value is None:
        return 0
    text = str(value).strip()
    if not text.isdigit():
        raise ConfigError(flag, f"expected a number of optimizer steps, got {value!r}", f"pass e.g. {flag} 100")
    return int(text)


def parse_hang(
    flags: Mapping[str, object],
    config_file: Mapping[str, object],
    nvidia_flags: Mapping[str, object] | None = None,
    nvidia_file: Path | None = None,
    config_path: Path | None = None,
) -> tuple[HangSpec, list[str]]:
    """Hang settings, each from the first source that sets it: ftrun's flags (``flags`` maps HANG_KEYS to the
    raw values, None if not given), NVIDIA's ``--ft-*`` flags (their names), the --config file's keys, NVIDIA's
    YAML (``--ft-cfg-path``). Returns them and what to say about settings that were not applied."""
    layers: list[Mapping[str, object]] = [{k: v for k, v in flags.items() if v is not None}]
    layers.append(nvidia_ft.from_flags(nvidia_flags or {}))
    layers.append(config_file)
    notices: list[str] = []
    if nvidia_file is not None:
        from_yaml, ignored = nvidia_ft.read_yaml(nvidia_file)
        layers.append(from_yaml)
        if ignored:
            notices.append(f"--ft-cfg-path: not applied (nothing to do in ftrun): {', '.join(ignored)}")

    def raw(key: str) -> object:
        return next((layer[key] for layer in layers if layer.get(key) is not None), None)

    def in_file(key: str) -> bool:
        setter = next((i for i, layer in enumerate(layers) if layer.get(key) is not None), 0)
        return setter == 2 and config_path is not None

    def named(key: str) -> str:
        """Who set ``key``, as an error names it: the flag, or the key in the --config file."""
        return f"{key} in {config_path}" if in_file(key) else HANG_KEYS[key]

    def seconds(key: str) -> float | None:
        value = raw(key)
        fix = f"write e.g. {key} = 5 in {config_path}" if in_file(key) else None
        return None if value is None else parse_seconds(named(key), str(value), fix=fix)

    sections: dict[str, float] = {}
    for layer in reversed(layers):  # the first source wins, section by section
        found = layer.get("section_timeouts") or {}
        if isinstance(found, list | tuple):  # --section-timeout NAME=SECONDS, repeated
            sections.update(parse_section_timeouts(HANG_KEYS["section_timeouts"], found))
        elif isinstance(found, dict):
            sections.update(
                parse_section_timeouts(HANG_KEYS["section_timeouts"], [f"{k}={v}" for k, v in found.items()])
            )
        else:
            where = f"section_timeouts in {config_path}" if config_path is not None else "--config"
            raise ConfigError(where, "must be a table of NAME = SECONDS", "see the README")
    detection = raw("hang_detection")
    if not isinstance(detection, bool | None):
        raise ConfigError(named("hang_detection"), f"must be true or false, got {detection!r}", "write e.g. false")
    factor = raw("safety_factor")
    hang_signal = raw("hang_signal")
    spec = HangSpec(
        Timeouts(
            seconds("initial_heartbeat_timeout"),
            seconds("heartbeat_timeout"),
            seconds("out_of_section_timeout"),
            sections,
        ),
        parse_seconds(named("safety_factor"), str(factor)) if factor is not None else 5.0,
        parse_signal_name(named("hang_signal"), str(hang_signal)) if hang_signal is not None else signal.SIGTERM,
        seconds("teardown_timeout") or TEARDOWN_GRACE_S,
        parse_steps(named("learn_timeouts"), raw("learn_timeouts")),
        seconds("learned_timeout_floor") or LEARNED_FLOOR_S,
        detection is not False,
        seconds("hang_timeout") or HANG_QUIET_S,
    )
    return spec, notices
