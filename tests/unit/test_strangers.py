"""The door every listener keeps: strangers bounded in all and per address, a flood said once."""

from __future__ import annotations

import resource

import pytest

from ftrun import strangers
from ftrun.strangers import Door


def test_strangers_are_bounded_per_address_and_in_all_and_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(strangers, "bounds", lambda: (3, 2))
    said: list[str] = []
    store, metrics = Door("the store on port 1", said.append), Door("the metrics on port 2", said.append)
    assert [store.admit("10.0.0.9") for _ in range(3)] == [True, True, False]  # 2 from one address
    assert metrics.admit("10.0.0.7")
    assert not metrics.admit("10.0.0.8")  # 3 in all, at every door of the process
    assert not store.admit("10.0.0.6")
    assert len(said) == 2  # once per door
    assert said[0].startswith("the store on port 1: refusing connections")
    assert "first from 10.0.0.9; at most 3 wait at once, 2 from one address" in said[0]
    store.settled("10.0.0.9")  # one proved itself, or left
    assert store.admit("10.0.0.5")
    assert (store.refused, metrics.refused) == (2, 1)
    for address in ("10.0.0.9", "10.0.0.7", "10.0.0.5"):
        store.settled(address)


def test_the_bounds_follow_the_file_limit() -> None:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert strangers.bounds() == (max(64, soft // 2), max(16, soft // 8))  # half in all, an eighth per address
