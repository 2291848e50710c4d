"""A failed script's open files are found where jobs keep them, at a cost bounded whatever the heap."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ftrun.worker import flush


def test_files_are_found_in_locals_objects_and_logging_handlers(tmp_path: Path) -> None:
    direct = (tmp_path / "a").open("w")
    nested = (tmp_path / "b").open("wb")
    holder = SimpleNamespace(writer=SimpleNamespace(out=nested))
    handler = logging.FileHandler(tmp_path / "c")
    try:
        found, _ = flush.walk([{"f": direct, "job": holder}, handler])
        assert {id(f) for f in found} == {id(direct), id(nested), id(handler.stream)}
    finally:
        for f in (direct, nested):
            f.close()
        handler.close()


def test_the_walk_is_bounded_whatever_the_heap(tmp_path: Path) -> None:
    big = [[i] for i in range(2 * flush.MAX_VISITS)]  # more objects than the walk may visit
    chain: dict[str, Any] = {"next": {"next": {"next": {"next": {"next": {"file": None}}}}}}
    _, visits = flush.walk([{"big": big, "wide": {str(i): [i] for i in range(10 * flush.MAX_ITEMS)}}, chain])
    assert visits <= flush.MAX_VISITS
    with (tmp_path / "deep").open("w") as deep:
        chain["next"]["next"]["next"]["next"]["next"]["file"] = deep
        assert flush.walk([chain])[0] == []  # beyond MAX_DEPTH: left to the interpreter's teardown


class Deprecated:
    """As torch.distributed.reduce_op: reading any attribute warns."""

    def __getattribute__(self, name: str) -> Any:
        warnings.warn("deprecated", FutureWarning, stacklevel=2)
        return object.__getattribute__(self, name)


def test_the_walk_reads_no_attribute_of_the_jobs_objects(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with (tmp_path / "a").open("w") as f:
            odd = Deprecated()
            object.__setattr__(odd, "f", f)
            assert flush.walk([{"odd": odd}])[0] == [f]


def test_flush_writes_what_the_script_left_in_a_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "log.txt"
    f = path.open("w")
    f.write("the last line")
    monkeypatch.setattr(sys.modules["__main__"], "_left_open", f, raising=False)  # a script's global
    try:
        assert flush.flush_open_files() >= 1
        assert path.read_text() == "the last line"
    finally:
        f.close()
