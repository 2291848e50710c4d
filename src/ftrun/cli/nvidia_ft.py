"""NVIDIA ft_launcher's hang settings, read with ftrun's meaning: its YAML ``fault_tolerance:`` section
(``--ft-cfg-path``) and its ``--ft-*`` flags, so a job set up for ft_launcher keeps its timeouts.

Only the settings that mean something to ftrun are read; the others (NIC and storage checks, GPU memory
reclaim, attribution services...) are named once at start as not applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftrun.errors import ConfigError

# NVIDIA's name -> ftrun's (hang_flags.HANG_KEYS)
NAMES = {
    "initial_rank_heartbeat_timeout": "initial_heartbeat_timeout",
    "rank_heartbeat_timeout": "heartbeat_timeout",
    "rank_out_of_section_timeout": "out_of_section_timeout",
    "rank_section_timeouts": "section_timeouts",
    "safety_factor": "safety_factor",
    "rank_termination_signal": "hang_signal",
}
# Accepted, with nothing to do in ftrun: it checks deadlines when they fall due, not every few seconds.
NO_EFFECT = ("workload_check_interval", "node_health_check_interval", "restart_check_interval", "log_level")


def flag(nvidia_name: str) -> str:
    return "--ft-" + nvidia_name.replace("_", "-")


def _none(value: object) -> object:
    """NVIDIA writes an unset timeout as None, null or an empty string."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        return None
    return value


def from_flags(values: Mapping[str, object]) -> dict[str, object]:
    """``--ft-*`` flag values (NVIDIA's names, None when not given) -> ftrun's hang keys."""
    found: dict[str, object] = {}
    for name, key in NAMES.items():
        value = _none(values.get(name))
        if value is None:
            continue
        if name == "rank_section_timeouts":
            value = _sections_flag(str(value))
        found[key] = value
    return found


def _sections_flag(text: str) -> dict[str, object]:
    """``step:30,eval:600`` (NVIDIA's format); a section set to None is off."""
    sections: dict[str, object] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, seconds = item.partition(":")
        if not sep or not name.strip():
            raise ConfigError(flag("rank_section_timeouts"), f"expected NAME:SECONDS, got {item!r}", "e.g. step:30")
        if _none(seconds) is not None:
            sections[name.strip()] = seconds.strip()
    return sections


def read_yaml(path: Path) -> tuple[dict[str, object], list[str]]:
    """The ``fault_tolerance:`` section of an ft_launcher YAML file (anywhere in it, as NVIDIA looks) -> ftrun's
    hang keys, and the names of the settings it has that ftrun does not apply."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError("--ft-cfg-path", f"cannot read {path}: {e.strerror or e}", "pass an existing file") from None
    except yaml.YAMLError as e:
        raise ConfigError("--ft-cfg-path", f"{path} is not valid YAML: {e}", "fix the file") from None
    section = _find_section(data)
    if not isinstance(section, dict):
        raise ConfigError("--ft-cfg-path", f"no fault_tolerance: section in {path}", "add one, as ft_launcher wants")
    found: dict[str, object] = {}
    for name, key in NAMES.items():
        value = _none(section.get(name))
        if value is None:
            continue
        if name == "rank_section_timeouts":
            if not isinstance(value, dict):
                raise ConfigError("--ft-cfg-path", "rank_section_timeouts must map names to seconds", "fix the file")
            value = {str(k): v for k, v in value.items() if _none(v) is not None}
        found[key] = value
    ignored = sorted(str(k) for k in section if k not in NAMES and k not in NO_EFFECT)
    return found, ignored


def _find_section(data: Any) -> Any:
    if isinstance(data, dict):
        if "fault_tolerance" in data:
            return data["fault_tolerance"]
        children = list(data.values())
    elif isinstance(data, list):
        children = data
    else:
        return None
    for child in children:
        found = _find_section(child)
        if found is not None:
            return found
    return None
