"""Every test runs with its own warm-pool cache, so no test is warm from another's run."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def own_warm_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTRUN_CACHE_DIR", str(tmp_path / "ftrun-cache"))
