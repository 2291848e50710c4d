"""Reading a JSON object that came from outside (a worker's file, the store): bounded, validated."""

from __future__ import annotations

import json
from typing import Any


def load_object(raw: bytes, *, limit: int, what: str, error: type[Exception]) -> dict[str, Any]:
    """Parse ``raw`` as one JSON object, at most ``limit`` bytes; anything else raises ``error`` naming ``what``."""
    if len(raw) > limit:
        raise error(f"{what}: {len(raw)} bytes, more than {limit}")
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{what}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise error(f"{what}: not a JSON object")
    return doc


class NotAnObject(ValueError):
    pass


def object_or_none(raw: bytes, *, limit: int) -> dict[str, Any] | None:
    """``raw`` as one JSON object of at most ``limit`` bytes, or None (for readers that skip what is not one)."""
    try:
        return load_object(raw, limit=limit, what="", error=NotAnObject)
    except NotAnObject:
        return None
