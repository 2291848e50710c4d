"""Error files: ftrun.record writes them, torch's layout and ftrun's are both read, bad ones are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ftrun
from ftrun.errors import ErrorFileError
from ftrun.worker.errorfile import read_error_file


def test_record_writes_the_exception_and_reraises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", "3")

    @ftrun.record
    def main() -> None:
        raise KeyError("missing shard")

    with pytest.raises(KeyError):
        main()
    rec = read_error_file(path)
    assert rec is not None
    assert (rec.exc_type, rec.rank, rec.source) == ("KeyError", 3, "ftrun")
    assert "missing shard" in rec.message
    assert "raise KeyError" in rec.traceback
    # torch's reader finds its own keys in the same file
    assert json.loads(path.read_text())["message"]["message"].startswith("KeyError")


def test_record_is_silent_on_success_and_exit_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv("FTRUN_ERROR_FILE", str(path))

    @ftrun.record
    def main() -> int:
        raise SystemExit(0)

    assert main() is None
    assert ftrun.record(lambda: 5)() == 5
    assert not path.exists()


def test_record_outside_ftrun_only_reraises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FTRUN_ERROR_FILE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    with pytest.raises(ZeroDivisionError):
        ftrun.record(lambda: 1 / 0)()


def test_reads_torch_layout(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    doc = {
        "message": {
            "message": "ValueError: bad",
            "extraInfo": {"py_callstack": "Traceback...", "timestamp": "17"},
        }
    }
    path.write_text(json.dumps(doc))
    rec = read_error_file(path)
    assert rec is not None
    assert (rec.exc_type, rec.message, rec.traceback, rec.timestamp, rec.source) == (
        "ValueError",
        "bad",  # apart, as in ftrun's own record: a summary joins them once
        "Traceback...",
        17.0,
        "torch",
    )


@pytest.mark.parametrize(
    ("written", "headline"),
    [
        ("torch.distributed.DistNetworkError: port in use", "torch.distributed.DistNetworkError: port in use"),
        ("DistNetworkError: a: b", "DistNetworkError: a: b"),
        ("no type here: only words", "no type here: only words"),
        ("plain", "plain"),
    ],
)
def test_a_torch_record_reads_type_and_message_once(tmp_path: Path, written: str, headline: str) -> None:
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": {"message": written, "extraInfo": {"py_callstack": "", "timestamp": 1}}}))
    rec = read_error_file(path)
    assert rec is not None
    assert rec.headline == headline


def test_missing_file_is_none(tmp_path: Path) -> None:
    assert read_error_file(tmp_path / "none.json") is None


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[1, 2]",
        b'{"ftrun": {"v": 9}}',
        b'{"ftrun": {"v": 1, "timestamp": "x"}}',
        b'{"message": 5}',
        b"\xff\xfe",
        b'{"ftrun": {"v": 1, "timestamp": 1, "rank": "0"}}',
    ],
)
def test_corrupt_files_raise_a_named_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "error.json"
    path.write_bytes(content)
    with pytest.raises(ErrorFileError, match=str(path)):
        read_error_file(path)
