"""Tracebacks reach the failure report with ftrun's @record, torch's @record, or no decorator at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import WriteScript, run_ftrun

BODIES = {
    "plain": "def main():\n    raise ValueError('bad batch 7')\n\nmain()\n",
    "ftrun": "import ftrun\n\n@ftrun.record\ndef main():\n    raise ValueError('bad batch 7')\n\nmain()\n",
    "torch": (
        "from torch.distributed.elastic.multiprocessing.errors import record\n\n"
        "@record\ndef main():\n    raise ValueError('bad batch 7')\n\nmain()\n"
    ),
}
SOURCES = {"plain": "last ", "ftrun": "from ftrun error file", "torch": "from torch error file"}


@pytest.mark.parametrize("decorator", ["plain", "ftrun", pytest.param("torch", marks=pytest.mark.torch)])
def test_exception_traceback_in_report(tmp_path: Path, script: WriteScript, decorator: str) -> None:
    script("w.py", BODIES[decorator])
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "w.py")
    assert r.returncode == 1
    root = r.stderr[r.stderr.index("ROOT CAUSE") :]
    assert SOURCES[decorator] in root
    assert "ValueError: bad batch 7" in root
    assert "raise ValueError('bad batch 7')" in root
    assert ", in main" in root
    if decorator != "plain":
        assert r.report(0)["root_cause"]["error"]["exc_type"] == "ValueError"  # type: ignore[index]
