"""A warm worker's imports hold what a fresh worker's own imports hold, whatever the script does before them.

Each probe is a script as users write them, which never imports ftrun: it sets things up, then imports, and
prints what its imported modules hold. It runs fresh (--no-warm, each worker a new `python`) and warm: a first
run (its first attempt, then a restart) and a rerun with the cache the first run left. Every field is equal on
every rank of every attempt (docs/WARM_RESTARTS.md, "What may be preloaded").
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sysconfig
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import POOL, WriteScript, run_ftrun

pytestmark = [pytest.mark.torch, pytest.mark.slow]
pytest.importorskip("datasets")

# The end of every probe: the facts, then (first attempt) a failure once the pool preloads what is known.
TAIL = """
import json as _json, os as _os, pathlib as _pathlib, sys as _sys, time as _time
print(_json.dumps(FACTS, sort_keys=True), flush=True)
_attempt = _pathlib.Path(_os.environ["TORCHELASTIC_ERROR_FILE"]).parents[1]
(_attempt / f"printed-{_os.environ['RANK']}").touch()
_deadline = _time.monotonic() + 90  # both ranks printed before one fails (and the other is stopped)
while not all((_attempt / f"printed-{r}").exists() for r in (0, 1)) and _time.monotonic() < _deadline:
    _time.sleep(0.01)
if _os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and _os.environ.get("WAIT_FOR_POOL"):
    _events = _pathlib.Path(_os.environ["TORCHELASTIC_ERROR_FILE"]).parents[2] / "events.jsonl"
    _deadline = _time.monotonic() + 90
    while _time.monotonic() < _deadline and not any(
        _json.loads(line)["kind"] == "pool_ready" and _json.loads(line)["preload"]
        for line in _events.read_text().splitlines()
    ):
        _time.sleep(0.05)
if _os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    _sys.exit(3)
"""

# An offline cluster's top, torch's own settings read at import, the same inside main() before lazy imports, a
# vendored package ahead of the installed one, and a module attribute set before its dependents are imported.
SETS_UP_FIRST = """
import os
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
import sys
import torch
import huggingface_hub.constants as hub
import torch._dynamo.config as dynamo
import {lib}_cfg
{lib}_cfg.DEVICE = "cpu"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "vendor"))
import {lib}_vendored
import {lib}_model

FACTS = {{"hub_offline": hub.HF_HUB_OFFLINE, "dynamo_disable": dynamo.disable, "vendored": {lib}_vendored.VENDORED,
         "device": {lib}_model.CHOSEN}}


def main():
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    import datasets.config
    import torch._inductor.config as inductor
    FACTS.update(datasets_offline=datasets.config.HF_DATASETS_OFFLINE, fx_graph_cache=inductor.fx_graph_cache)


main()
"""

DEFAULT_DTYPE = """
import torch
torch.set_default_dtype(torch.float64)
import {lib}_model
FACTS = {{"dtype": {lib}_model.DTYPE}}
"""

# `-m probe_pkg`: a package whose __main__ configures itself before its imports; and a script that runs it by runpy.
PACKAGE_MAIN = """
import os
os.environ["HF_HUB_OFFLINE"] = "1"
import huggingface_hub.constants as hub
def lazily():
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets.config
    return datasets.config.HF_DATASETS_OFFLINE
FACTS = {{"hub_offline": hub.HF_HUB_OFFLINE, "datasets_offline": lazily()}}
"""
RUNS_IT = """
import os, runpy
os.environ["HF_HUB_OFFLINE"] = "1"
runpy.run_module("probe_pkg", run_name="__main__", alter_sys=True)
"""

# An installed package (in site-packages, as pip puts one): a setting, and a module that reads it at import.
CFG = 'DEVICE = "cuda"\n'
MODEL = """
import torch
from {lib}_cfg import DEVICE
CHOSEN = DEVICE
DTYPE = str(torch.ones(2).dtype)
"""


@pytest.fixture
def lib() -> Iterator[str]:
    """Packages installed for the test (removed after it, even when it fails): a setting, a module reading it at
    import, and one the script vendors a copy of."""
    name = f"ftrunprobe{uuid.uuid4().hex[:8]}"
    site = Path(sysconfig.get_paths()["purelib"])
    made = [site / f"{name}_cfg", site / f"{name}_model", site / f"{name}_vendored"]
    try:
        for path, text in zip(made, (CFG, MODEL.format(lib=name), "VENDORED = False\n"), strict=True):
            path.mkdir()
            (path / "__init__.py").write_text(text)
        yield name
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def facts(tmp_path: Path, how: str, entry: list[str]) -> tuple[dict[tuple[int, int], Any], str]:
    """Each (attempt, rank)'s facts of one run, and its console."""
    flags = ["--no-warm"] if how == "fresh" else []
    r = run_ftrun(tmp_path, "--log-dir", str(tmp_path / how), "--nproc-per-node", "2", "--max-restarts", "1",
                  *flags, *entry, timeout=300, env={**POOL, "FTRUN_CACHE_DIR": str(tmp_path / "cache")})  # fmt: skip
    r.run_dir = tmp_path / how / "t"
    assert r.returncode == 0, r.stderr
    found = {(a, rank): json.loads(r.log(a, rank).splitlines()[-1]) for a in (0, 1) for rank in (0, 1)}
    if how != "fresh":
        warm = [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1]
        assert warm == [True, True], (warm, r.stderr)  # the restart is warm, for what the rule allows
    return found, r.stderr


def differences(fresh: dict[tuple[int, int], Any], warm: dict[tuple[int, int], Any]) -> dict[str, Any]:
    return {
        f"{name} attempt {a} rank {rank}": (warm[a, rank].get(name), value)
        for (a, rank), seen in fresh.items()
        for name, value in seen.items()
        if warm[a, rank].get(name) != value
    }


PROBES = {
    "sets-up-first": (
        {"probe.py": SETS_UP_FIRST, "vendor/{lib}_vendored/__init__.py": "VENDORED = True\n"},
        ["probe.py"],
    ),
    "default-dtype": ({"probe.py": DEFAULT_DTYPE}, ["probe.py"]),
    "module-main": ({"probe_pkg/__init__.py": "", "probe_pkg/__main__.py": PACKAGE_MAIN}, ["-m", "probe_pkg"]),
    "runpy": ({"probe_pkg/__init__.py": "", "probe_pkg/__main__.py": PACKAGE_MAIN, "probe.py": RUNS_IT}, ["probe.py"]),
}


@pytest.mark.parametrize("probe", list(PROBES))
def test_a_warm_worker_imports_what_a_fresh_one_would(
    tmp_path: Path, script: WriteScript, lib: str, probe: str
) -> None:
    files, entry = PROBES[probe]
    for name, text in files.items():
        body = textwrap.dedent(text.format(lib=lib))
        script(
            name.format(lib=lib),
            body + (TAIL if name in ("probe.py", "probe_pkg/__main__.py") and "runpy" not in text else ""),
        )
    fresh, _ = facts(tmp_path, "fresh", entry)
    first, console = facts(tmp_path, "warm", entry)
    rerun, _ = facts(tmp_path, "rerun", entry)  # with what the first run's cache remembers
    assert differences(fresh, first) == {}, console
    assert differences(fresh, rerun) == {}
    if probe == "sets-up-first":  # said once, with the statement and how to keep them warm
        assert console.count("probe.py:10 (" + lib + "_cfg.DEVICE") == 1, console
        assert "--preload" in console
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(tmp_path / "cache")
