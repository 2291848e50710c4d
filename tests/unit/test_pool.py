"""The warm pool's pure decisions: which workers it can fork, which modules it preloads."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ftrun.config import Entrypoint, EntrypointKind
from ftrun.warm import policy
from ftrun.warm.policy import worker_request
from ftrun.warm.preload import (
    INDUCTOR_IMPORTS,
    Cache,
    compiles_with_inductor,
    first_step_imports_known,
    installed_modules,
    read_entry_script,
    read_modules_report,
)

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
    found = read_modules_report(report)
    assert found is not None
    assert found[0] == ["json", "torch", "torch._dynamo"]
    assert found[1]["mymodel"] == files["mymodel"]  # where each top-level module was found, the job's own too
    assert "torch._dynamo" not in found[1]
    report.write_text("{garbage")
    assert read_modules_report(report) is None
    assert read_modules_report(tmp_path / "missing.json") is None


@pytest.mark.parametrize(
    ("source", "compiles"),
    [
        ("import torch\nmodel = torch.compile(model)", True),
        ("import torch as t\ndef build(block, backend):\n    block.compile(backend=backend)", True),  # nn.Module's
        ("import torch\nmodel.compile(backend='aot_eager')", False),  # another backend named
        ("import re, torch\nPATTERN = re.compile('step ([0-9]+)')", False),  # a module's other than torch's
        ("import regex as rx, torch\nrx.compile('x')", False),
        ("import torch\nmodel(x)", False),
    ],
)
def test_a_script_that_compiles_with_inductor_names_inductor_among_its_imports(
    tmp_path: Path, source: str, compiles: bool
) -> None:
    """A first run's zygote preloads inductor before the first step where the script's source compiles with it:
    its workers import it only at their first call."""
    assert compiles_with_inductor(ast.parse(source)) is compiles
    (tmp_path / "train.py").write_text(source + "\n")
    reading = read_entry_script(Entrypoint(EntrypointKind.SCRIPT, "train.py", ()), tmp_path, sys.executable)
    found = [*reading.imports, *reading.later]  # inductor's: imported at the first compile, checked as later ones
    if importlib.util.find_spec("torch") is not None:
        assert set(INDUCTOR_IMPORTS) <= set(found) if compiles else not set(INDUCTOR_IMPORTS) & set(found), found
        assert first_step_imports_known(found) is compiles  # then every first worker waits for the zygote


def test_a_script_is_warm_from_any_directory_a_module_only_from_its_own(tmp_path: Path) -> None:
    """A rerun in a fresh directory (a sweep, a benchmark) finds what the script imported last time; ``-m``
    resolves against the directory, so a module's cache is per directory."""
    script = tmp_path / "train.py"
    script.write_text("import json\n")
    here, there = tmp_path / "a", tmp_path / "b"
    here.mkdir()
    there.mkdir()
    by_script = Entrypoint(EntrypointKind.SCRIPT, str(script))
    files = {"json": "/usr/lib/python3.11/json/__init__.py", "numpy": "/site/numpy/__init__.py"}
    Cache(tmp_path / "cache", "python", by_script, here).save(["json"], 0.5, files)
    kept = {"json": files["json"]}  # the files of the modules kept: checked by the zygote against this run's
    assert Cache(tmp_path / "cache", "python", by_script, there).load() == (["json"], 0.5, kept)
    by_module = Entrypoint(EntrypointKind.MODULE, "train")
    Cache(tmp_path / "cache", "python", by_module, here).save(["json"], 0.5, files)
    assert Cache(tmp_path / "cache", "python", by_module, there).load() == ([], None, {})
    assert Cache(tmp_path / "cache", "python", by_module, here).load() == (["json"], 0.5, kept)


@dataclass
class Z:
    """A zygote as the policy sees it."""

    preload: list[str]
    ready: dict[str, Any] | None = None


def test_a_worker_forks_from_the_biggest_ready_zygote() -> None:
    base, small, big = Z([], {}), Z(["json"], {}), Z(["json", "numpy"], {})
    assert policy.fork_from([base, small, big]) is big
    assert policy.fork_from([base, small, Z(["json", "numpy"])]) is small  # the bigger one still preloading


def test_with_no_preload_ready_the_base_serves_and_with_none_ready_no_one_is_waited_for() -> None:
    assert policy.fork_from([base := Z([], {}), Z(["json"])]) is base  # the base zygote: a bare Python, ready
    assert policy.fork_from([Z([]), Z(["json"]), Z(["json", "numpy"])]) is None  # a fresh worker at once


def test_a_refused_module_and_what_lies_inside_it_are_never_preloaded() -> None:
    never = {"gpuhelper"}
    assert policy.refused("gpuhelper", never)
    assert policy.refused("gpuhelper.kernels", never)  # importing it imports the package
    assert not policy.refused("gpuhelpers", never)
    assert policy.worth_preloading([], ["torch", "gpuhelper.kernels", "gpuhelpers"], never) == ["torch", "gpuhelpers"]


def test_a_bigger_ready_zygote_retires_the_others_but_not_during_a_restart() -> None:
    base, small, big, coming = Z([], {}), Z(["json"], {}), Z(["json", "numpy"], {}), Z(["a", "b", "c"])
    assert policy.retired([base, small, big, coming], holding=False) == [base, small]
    assert policy.retired([base, small, big, coming], holding=True) == []
    assert policy.retired([base, coming], holding=False) == []  # nothing bigger is ready yet


def test_a_few_more_imports_are_not_worth_a_new_zygote() -> None:
    current = [f"m{i}" for i in range(40)]
    assert policy.worth_preloading(current, [*current, "x", "y"], set()) is None  # 2 <= 40 // GROWTH
    bigger = policy.worth_preloading(current, [*current, "x", "y", "z"], set())
    assert bigger == [*current, "x", "y", "z"]
    assert policy.worth_preloading([], ["torch", "bad"], {"bad"}) == ["torch"]  # a refused module never again


def test_the_refill_is_due_once_its_delay_after_the_workers_started() -> None:
    refill = policy.Refill()
    assert refill.seconds_left(10.0) is None
    assert not refill.due(10.0)
    refill.workers_started(10.0)
    assert refill.seconds_left(10.1) == pytest.approx(policy.REFILL_DELAY_S - 0.1)
    assert not refill.due(10.0 + policy.REFILL_DELAY_S / 2)
    assert refill.due(10.0 + policy.REFILL_DELAY_S)
    assert not refill.due(20.0)  # once


def test_cold_workers_keep_the_preloading_zygotes_still_when_no_core_is_spare() -> None:
    assert policy.held_for_cold_workers(cold=True, cores=2, workers=2, preloading=1)
    assert not policy.held_for_cold_workers(cold=True, cores=16, workers=8, preloading=2)  # a GPU node: cores spare
    assert not policy.held_for_cold_workers(cold=False, cores=2, workers=2, preloading=1)  # warm: none competes
    assert not policy.held_for_cold_workers(cold=True, cores=2, workers=2, preloading=0)


def test_what_is_still_preloaded_is_said_by_package() -> None:
    assert policy.packages([]) == "nothing"
    assert policy.packages(["torch", "torch.nn", "numpy"]) == "torch, numpy"
    assert policy.packages([f"p{i}.x" for i in range(9)], shown=3) == "p0, p1, p2 and 6 more"


def test_the_first_attempts_workers_wait_for_the_zygote_preloading_what_is_known_and_later_ones_never() -> None:
    base, known = Z([], {}), Z(["json", "numpy"])
    assert policy.waited_for_first([base, known], started=False) is known
    assert policy.waited_for_first([base, known], started=True) is None  # a restart never waits
    assert policy.waited_for_first([base, Z(["json"], {})], started=False) is None  # ready: forked at once
    assert policy.waited_for_first([base], started=False) is None  # nothing known to preload


def test_the_first_attempt_starts_fresh_on_every_core_but_the_one_the_zygote_preloads_on() -> None:
    assert policy.first_fresh(cores=2, workers=2, whole=False) == 1  # one imports itself, the zygote beside it
    assert policy.first_fresh(cores=2, workers=8, whole=False) == 1  # seven fork from it: one import, not seven
    assert policy.first_fresh(cores=16, workers=8, whole=False) == 8  # a core to spare: as before
    assert policy.first_fresh(cores=1, workers=4, whole=False) == 0


def test_on_a_busy_node_the_first_attempt_starts_fresh_only_on_the_cores_that_were_idle() -> None:
    """The idle cores measured while the zygote imported: a fresh worker with no core of its own would import
    beside the zygote on a shared one (the same import twice, both slower)."""
    assert policy.first_fresh(cores=2, workers=2, whole=False, idle=0.9) == 1  # quiet: the zygote's core aside
    assert policy.first_fresh(cores=2, workers=2, whole=False, idle=0.3) == 0  # every core taken
    assert policy.first_fresh(cores=16, workers=8, whole=False, idle=4.2) == 4
    assert policy.first_fresh(cores=16, workers=8, whole=False, idle=16.0) == 8  # never more than the workers
    assert policy.first_fresh(cores=2, workers=2, whole=False, idle=2.0) == 1  # never the zygote's core
    assert policy.first_fresh(cores=16, workers=8, whole=True, idle=16.0) == 0


def test_the_first_attempt_waits_for_a_zygote_preloading_what_a_whole_run_imported() -> None:
    """The job's cache has what its workers imported lazily too (compiling, stepping): a fresh worker would
    import it all on its own critical path."""
    assert policy.first_fresh(cores=2, workers=2, whole=True) == 0
    assert policy.first_fresh(cores=16, workers=8, whole=True) == 0


def test_a_bigger_zygote_grows_from_the_biggest_ready_one_whose_modules_it_has() -> None:
    base, small, big = Z([], {}), Z(["torch"], {}), Z(["torch", "numpy"], {})
    assert policy.grown_from([base, small, big], ["torch", "numpy", "json"]) is big
    assert policy.grown_from([base, small, big], ["torch", "json"]) is small  # big has numpy, not wanted
    assert policy.grown_from([base, Z(["torch"])], ["torch", "json"]) is None  # still preloading; the base never
    assert policy.grown_from([small], ["numpy"]) is None  # nothing in common: a new process preloads them
