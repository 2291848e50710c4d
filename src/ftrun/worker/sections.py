"""Named sections of a worker's work (``ftrun.section``), each with its own timeout: the job's side."""

from __future__ import annotations

from types import TracebackType

from ftrun.worker import client


class _Section:
    """``with ftrun.section(name):``; one cached object per name, so entering allocates nothing."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __enter__(self) -> None:
        client._client.start_section(self._name)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        client._client.end_section(self._name)


_sections: dict[str, _Section] = {}


def section(name: str) -> _Section:
    """``with ftrun.section("step"):`` a named span with its own timeout; sections may nest or overlap."""
    found = _sections.get(name)
    if found is None:
        found = _sections[name] = _Section(name)
    return found


def start_section(name: str) -> None:
    """Open section ``name``; opening one that is already open is a ValueError."""
    client._client.start_section(name)


def end_section(name: str) -> None:
    """Close section ``name``; closing one that is not open is a ValueError."""
    client._client.end_section(name)


def end_all_sections() -> None:
    client._client.end_all_sections()
