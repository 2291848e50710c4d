"""The warm pool's pure decisions: which workers it can fork, which modules it preloads."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

from ftrun.config import Entrypoint, EntrypointKind
from ftrun.warm.pool import worker_request
from ftrun.warm.preload import Cache, installed_modules, read_modules_report

PY = "/usr/bin/python3"


def test_what_the_zygote_can_run() -> None:
    assert worker_request([PY, "-u", "train.py", "--lr", "1"], PY) == {
        "kind": "script",
        "target": "train.py",
        "args": ["--lr", "1"],
    }
    assert worker_request([PY, "-u", "-m", "pkg.main", "x"], PY) == {
        "kind": "module",
        "target": "pkg.main",
        "args": ["x"],
    }
    assert worker_request([PY, "-u", "-c", "import runpy", "t.py"], PY) is None  # --run-path: fresh
    assert worker_request(["./a.out", "x"], PY) is None  # --no-python: fresh
    assert worker_request(["/other/python", "-u", "t.py"], PY) is None  # another interpreter: fresh


def test_only_installed_modules_are_preloaded(tmp_path: Path) -> None:
    stdlib = sysconfig.get_paths()["stdlib"]
    site = sysconfig.get_paths()["purelib"]
    files = {
        "json": os.path.join(stdlib, "json", "__init__.py"),
        "torch": os.path.join(site, "torch", "__init__.py"),
        "torch._dynamo": os.path.join(site, "torch", "_dynamo", "__init__.py"),
        "mymodel": str(tmp_path / "mymodel.py"),  # the job's own code: may read RANK at import
        "__main__": str(tmp_path / "train.py"),
        "ftrun.worker.client": os.path.join(site, "ftrun", "monitor", "client.py"),
        "sys": None,  # built in: nothing to preload
    }
    assert installed_modules(list(files), files) == ["json", "torch", "torch._dynamo"]
    report = tmp_path / "modules.json"
    report.write_text(json.dumps(files))
    assert read_modules_report(report) == ["json", "torch", "torch._dynamo"]
    report.write_text("{garbage")
    assert read_modules_report(report) is None
    assert read_modules_report(tmp_path / "missing.json") is None


def test_a_script_is_warm_from_any_directory_a_module_only_from_its_own(tmp_path: Path) -> None:
    """A rerun in a fresh directory (a sweep, a benchmark) finds what the script imported last time; ``-m``
    resolves against the directory, so a module's cache is per directory."""
    script = tmp_path / "train.py"
    script.write_text("import json\n")
    here, there = tmp_path / "a", tmp_path / "b"
    here.mkdir()
    there.mkdir()
    by_script = Entrypoint(EntrypointKind.SCRIPT, str(script))
    Cache(tmp_path / "cache", "python", by_script, here).save(["json"], 0.5)
    assert Cache(tmp_path / "cache", "python", by_script, there).load() == (["json"], 0.5)
    by_module = Entrypoint(EntrypointKind.MODULE, "train")
    Cache(tmp_path / "cache", "python", by_module, here).save(["json"], 0.5)
    assert Cache(tmp_path / "cache", "python", by_module, there).load() == ([], None)
    assert Cache(tmp_path / "cache", "python", by_module, here).load() == (["json"], 0.5)
