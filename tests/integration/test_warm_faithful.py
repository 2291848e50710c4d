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
        assert console.count("probe.py:11 (sys.path.insert(") == 1, console
        assert "--preload" in console
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(tmp_path / "cache")


# A Hugging Face job for an offline cluster, as its users write it: offline and cache variables first, then its
# imports; a tiny GPT-2 built from its config (nothing downloaded), a `datasets` table, DDP over gloo, a
# checkpoint at every step. Rank 1 crashes at step 4 of the first attempt; the restart resumes from the
# checkpoint and ends with the weights of a run that never failed.
HF_JOB = """
import os
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HOME"] = "hf-home"
import hashlib
import sys
import datasets
import torch
import torch.distributed as dist
import transformers
import transformers.utils.hub
from torch.nn.parallel import DistributedDataParallel


def main():
    dist.init_process_group("gloo")
    rank, steps = dist.get_rank(), 8
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = DistributedDataParallel(transformers.GPT2LMHeadModel(config))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    table = datasets.Dataset.from_dict({"ids": [[(i * 7 + j) % 64 for j in range(16)] for i in range(64)]})
    table.set_format("torch")
    start = 0
    if os.path.exists("ckpt.pt"):
        state = torch.load("ckpt.pt")
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    for step in range(start, steps):
        batch = table[(step * 4 + rank * 2) % 64 : (step * 4 + rank * 2) % 64 + 2]["ids"]
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, "ckpt.tmp")
            os.replace("ckpt.tmp", "ckpt.pt")
        dist.barrier()
        if step == 3 and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and len(sys.argv) > 1:
            os._exit(3)
    if rank == 0:
        weights = b"".join(p.detach().numpy().tobytes() for p in model.module.parameters())
        print("checksum", hashlib.sha256(weights).hexdigest()[:16], "offline", transformers.utils.hub.is_offline_mode(),
              datasets.config.HF_DATASETS_OFFLINE, flush=True)
    dist.barrier()
    del model
    dist.destroy_process_group()


main()
"""


def test_a_hugging_face_job_set_up_for_an_offline_cluster_restarts_warm_to_the_clean_runs_weights(
    tmp_path: Path, script: WriteScript
) -> None:
    pytest.importorskip("transformers")
    script("hf.py", HF_JOB)
    runs = {}
    for name, flags, args in (("clean", ["--no-warm"], []), ("crashed", [], ["crash"])):
        work = tmp_path / name
        work.mkdir()
        (work / "hf.py").write_text((tmp_path / "hf.py").read_text())
        r = run_ftrun(work, "--nproc-per-node", "2", "--max-restarts", "1", *flags, "hf.py", *args, timeout=300,
                      env={"FTRUN_CACHE_DIR": str(tmp_path / "cache")})  # fmt: skip
        assert r.returncode == 0, r.stderr
        runs[name] = r
    clean, crashed = (r.stdout.split("checksum ")[-1].split()[:4] for r in runs.values())
    assert clean == crashed, (clean, crashed)
    assert clean[2:] == ["True", "True"]  # offline, as the script's top said, on the warm restart too
    r = runs["crashed"]
    assert [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1] == [True, True]
    assert "warm pool:" not in r.stderr  # the script's top is all replayed: nothing kept out of the pool
