"""MASTER_PORT choice: free now, and not one another ftrun handed out moments ago."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ftrun.node import ports


def test_skips_ports_another_ftrun_took_recently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offers = iter([41000, 41000, 41000, 41001])
    monkeypatch.setattr(ports, "_probe_free_port", lambda host: next(offers))
    ledger = tmp_path / "ledger.json"
    assert ports.reserve_port("", 100.0, ledger) == 41000
    assert ports.reserve_port("", 101.0, ledger) == 41001  # the kernel offered 41000 again


def test_old_entries_expire(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_probe_free_port", lambda host: 41000)
    ledger = tmp_path / "ledger.json"
    ports.reserve_port("", 100.0, ledger)
    assert ports.reserve_port("", 100.0 + ports.LEDGER_TTL_S + 1, ledger) == 41000


@pytest.mark.parametrize("content", ["", "{torn", "[1]", '{"41000": "x"}'])
def test_corrupt_ledger_is_forgotten(tmp_path: Path, content: str) -> None:
    ledger = tmp_path / "ledger.json"
    ledger.write_text(content)
    port = ports.reserve_port("127.0.0.1", 100.0, ledger)
    assert 0 < port < 65536


def test_reserved_port_is_bindable(tmp_path: Path) -> None:
    port = ports.reserve_port("127.0.0.1", 100.0, tmp_path / "ledger.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # raises if it were taken
        assert s.getsockname()[1] == port


def test_local_addresses() -> None:
    assert ports.is_local_address("127.0.0.1")
    assert ports.is_local_address("localhost")
    assert not ports.is_local_address("192.0.2.7")  # TEST-NET-1: never this machine, nothing is sent
    assert not ports.is_local_address("")
