"""The ``--config`` file: TOML, or YAML (``.yaml``/``.yml``), with the flags' names underscored as keys.

Flags given on the command line win over the file, key by key.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path

from ftrun.errors import ConfigError


def read_config_file(path: Path, known: Iterable[str]) -> dict[str, object]:
    """The file's settings; each key must be one of ``known``."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError("--config", f"cannot read {path}: {why}", "pass an existing TOML or YAML file") from None
    data = _yaml(path, text) if path.suffix in (".yaml", ".yml") else _toml(path, text)
    allowed = sorted(known)
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        listed = ", ".join(unknown)
        close = [m for key in unknown for m in difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)]
        fix = f"did you mean {', '.join(close)}?" if close else f"use only {', '.join(allowed)}"
        raise ConfigError("--config", f"unknown key(s) in {path}: {listed}", fix)
    return data


def _toml(path: Path, text: str) -> dict[str, object]:
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("--config", f"{path} is not valid TOML: {e}", "fix the file") from None


def _yaml(path: Path, text: str) -> dict[str, object]:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("--config", f"{path} is not valid YAML: {e}", "fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError("--config", f"{path} holds a YAML {kind}, not a mapping", "use KEY: VALUE lines")
    return {str(k): v for k, v in data.items()}
