"""The libraries real training jobs import, in the warm pool: each family installed here is preloaded and its
workers restart warm, with what a fresh worker has; or the pool refuses it precisely (the module, the thread, what
is still preloaded) and the rest stays warm. docs/WARM_RESTARTS.md has the table of findings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import POOL, WriteScript, restarted_warm, run_ftrun

# A worker's threads by name once it used what it imported (a fresh worker's are the measure).
THREADS = """
import json, os, time
{imports}
{use}
time.sleep(0.2)  # jemalloc starts its background thread as its arena is first used
names = sorted(open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task"))
print(json.dumps(names), flush=True)
"""


def threads_of(tmp_path: Path, script: WriteScript, how: str, imports: str, use: str, said: str = "") -> list[str]:
    """The threads of a worker after its imports; ``said``: what the pool says (by default nothing)."""
    script(f"{how}.py", restarted_warm(THREADS.format(imports=imports, use=use)))
    flags = ["--preload", imports.replace("import ", "").replace("\n", ",")] if how == "warm" else ["--no-warm"]
    r = run_ftrun(tmp_path, "--log-dir", str(tmp_path / how), "--max-restarts", "1", *flags, f"{how}.py",
                  env=POOL if how == "warm" else {})  # fmt: skip
    assert r.returncode == 0, r.stderr
    r.run_dir = tmp_path / how / "t"
    if said:
        assert said in r.stderr, r.stderr
    else:
        assert "warm pool" not in r.stderr, r.stderr  # nothing refused, nothing off
    spawned = [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1]
    assert spawned == [how == "warm"], spawned
    names: list[str] = json.loads(r.log(1, 0).splitlines()[-1])
    return names


def test_arrow_is_preloaded_and_a_warm_worker_has_jemallocs_background_thread_as_a_fresh_one(
    tmp_path: Path, script: WriteScript
) -> None:
    """pyarrow (datasets, pandas) starts jemalloc's background thread at import: the zygote turns it off before
    it forks, every warm worker turns it on again."""
    pytest.importorskip("pyarrow")
    use = "table = pyarrow.table({'x': list(range(100_000))})"
    warm = threads_of(tmp_path, script, "warm", "import pyarrow", use)
    fresh = threads_of(tmp_path, script, "fresh", "import pyarrow", use)
    assert "jemalloc_bg_thd" in fresh, fresh
    assert warm == fresh


def test_pandas_and_datasets_restart_warm(tmp_path: Path, script: WriteScript) -> None:
    pytest.importorskip("pandas")
    pytest.importorskip("datasets")
    use = "frame = pandas.DataFrame({'x': range(1000)})"
    warm = threads_of(tmp_path, script, "warm", "import pandas\nimport datasets", use)
    assert "jemalloc_bg_thd" in warm, warm


def test_a_library_whose_own_thread_cannot_be_stopped_is_refused_by_name_and_the_rest_stays_warm(
    tmp_path: Path, script: WriteScript
) -> None:
    """polars starts a thread of its own at import (its out-of-core cleaner): the console names the module, the
    thread and what is still preloaded."""
    pytest.importorskip("polars")
    script("w.py", restarted_warm("import json, polars\nprint('ran', flush=True)\n"))
    r = run_ftrun(tmp_path, "--preload", "json,polars,decimal", "--max-restarts", "1", "w.py", env=POOL)
    assert r.returncode == 0, r.stderr
    said = [ln for ln in r.stderr.splitlines() if "warm pool: importing 'polars' started a thread" in ln]
    assert len(said) == 1, r.stderr
    assert "polars-ooc" in said[0], said  # the thread, by its name
    assert "the rest is preloaded (json, decimal" in said[0], said  # (and what the script imports: os)
    assert [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1] == [True]
    assert r.log(1, 0) == "ran\n"


@pytest.mark.parametrize(
    ("family", "imports"),
    [
        ("hugging face", "import transformers\nimport tokenizers"),
        ("lightning", "import lightning_fabric"),
    ],
)
def test_framework_families_restart_warm(tmp_path: Path, script: WriteScript, family: str, imports: str) -> None:
    for line in imports.splitlines():
        pytest.importorskip(line.split()[1])
    # Lightning's rank_zero_only (and torchmetrics') reads the rank at import: each worker imports it, as fresh
    rank = "lightning_fabric reads LOCAL_RANK at import, whose value differs in each worker"
    said = rank if family == "lightning" else ""
    threads_of(tmp_path, script, "warm", imports, "", said=said)


# What inductor asks of the machine once per process, before its first compile on CPU.
VEC_ISA = """
import json
import torch._inductor.codecache
from torch._inductor import cpu_vec_isa
asked_before = cpu_vec_isa.valid_vec_isa_list.cache_info().currsize
print(json.dumps([asked_before, [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]]), flush=True)
"""


@pytest.mark.torch
def test_a_warm_worker_has_inductors_answers_about_the_machine_as_a_fresh_one_works_them_out(
    tmp_path: Path, script: WriteScript
) -> None:
    """inductor builds and loads a test library per vector instruction set once per process (1.1 s here): the
    zygote asks, a warm worker has the answer a fresh worker works out itself."""
    pytest.importorskip("torch._inductor.cpu_vec_isa")
    answers = {}
    for how in ("warm", "fresh"):
        script(f"{how}.py", restarted_warm(VEC_ISA))
        flags = ["--preload", "torch._inductor.codecache,torch._inductor.cpu_vec_isa"] if how == "warm" else []
        r = run_ftrun(tmp_path, "--log-dir", str(tmp_path / how), "--max-restarts", "1",
                      *(flags or ["--no-warm"]), f"{how}.py", env=POOL if how == "warm" else {})  # fmt: skip
        assert r.returncode == 0, r.stderr
        r.run_dir = tmp_path / how / "t"
        assert "warm pool" not in r.stderr, r.stderr
        answers[how] = json.loads(r.log(1, 0).splitlines()[-1])
    assert answers["warm"][0] == 1, answers  # asked in the zygote...
    assert answers["fresh"][0] == 0, answers  # ...where a fresh worker asks itself
    assert answers["warm"][1] == answers["fresh"][1], answers


# A job's first compile: what dynamo and inductor hold before it, what it made, the threads after it.
FIRST_COMPILE = """
import json, os, threading
import torch
import torch._inductor.codecache
from torch._dynamo.utils import compilation_time_metrics, counters
before = {"counters": {k: dict(v) for k, v in counters.items()}, "timed": list(compilation_time_metrics),
          "headers": torch._inductor.codecache._precompile_header.cache_info().currsize}
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
x = torch.randn(4, 8)
loss = torch.compile(net)(x).square().sum()
loss.backward()
print(json.dumps({**before, "loss": loss.item(), "grad": net[0].weight.grad.sum().item(),
                  "graphs": counters["stats"]["unique_graphs"], "threads": len(os.listdir("/proc/self/task")),
                  "python threads": sorted(t.name for t in threading.enumerate())}), flush=True)
"""


@pytest.mark.torch
def test_a_warm_workers_first_compile_finds_dynamo_as_a_fresh_process_does_with_the_headers_asked(
    tmp_path: Path, script: WriteScript
) -> None:
    """The zygote compiles a small module once (0.3 s of every new process's first compile: dynamo's tables,
    inductor's preprocessing of its precompiled header), then resets dynamo: a warm worker's first compile
    finds no counter, no timing and no graph of it, makes what a fresh worker makes, and has its threads."""
    pytest.importorskip("torch._inductor.codecache")
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # the model's kernels built once, before
    primed = subprocess.run([sys.executable, "-c", FIRST_COMPILE], env={**os.environ, **cache}, timeout=300)
    assert primed.returncode == 0  # (a first compile builds them with a pool of threads: not the point here)
    seen = {}
    for how in ("warm", "fresh"):
        script(f"{how}.py", restarted_warm(FIRST_COMPILE))
        flags = ["--preload", "torch._inductor.codecache"] if how == "warm" else ["--no-warm"]
        r = run_ftrun(tmp_path, "--log-dir", str(tmp_path / how), "--max-restarts", "1", *flags, f"{how}.py",
                      env={**(POOL if how == "warm" else {}), **cache}, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr
        r.run_dir = tmp_path / how / "t"
        assert "warm pool" not in r.stderr, r.stderr  # nothing refused, nothing failed
        spawned = [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1]
        assert spawned == [how == "warm"], spawned
        seen[how] = json.loads(r.log(1, 0).splitlines()[-1])
    warm, fresh = seen["warm"], seen["fresh"]
    assert warm.pop("headers") >= 1, warm  # preprocessed in the zygote...
    assert fresh.pop("headers") == 0, fresh  # ...where a fresh worker does it at its first compile
    assert warm == fresh
    assert (fresh["counters"], fresh["timed"], fresh["graphs"]) == ({}, [], 1), fresh


COMPILES = """
import torch
import torch._inductor.codecache
torch.compile(torch.nn.Linear(4, 2))(torch.ones(3, 4)).sum().backward()
print("compiled", flush=True)
"""


@pytest.mark.torch
def test_a_job_that_has_torch_trace_its_compiles_finds_only_its_own_trace(tmp_path: Path, script: WriteScript) -> None:
    """With TORCH_TRACE set (tlparse's input), the zygote asks inductor nothing (its probe of torch's sources is
    traced too) and compiles nothing: the trace directory holds the one file of the rank's process."""
    pytest.importorskip("torch._inductor.codecache")
    trace = tmp_path / "trace"
    script("w.py", restarted_warm(COMPILES))
    r = run_ftrun(tmp_path, "--preload", "torch._inductor.codecache", "--max-restarts", "1", "w.py",
                  env={**POOL, "TORCH_TRACE": str(trace)}, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1] == [True]
    assert r.log(1, 0) == "compiled\n"
    [traced] = trace.iterdir()  # (torch names it with the rank only once a process group is made)
    assert '"name": "dynamo"' in traced.read_text(), traced  # the job's own compile


ASKED = """
from torch._inductor import cpu_vec_isa
print(cpu_vec_isa.valid_vec_isa_list.cache_info().currsize, flush=True)
"""


@pytest.mark.torch
def test_a_job_that_only_imports_dynamo_is_not_kept_waiting_for_inductors_probes(
    tmp_path: Path, script: WriteScript
) -> None:
    """`import torch._dynamo` loads inductor's cpu_vec_isa, but a job that never compiled with inductor (its cache
    module never loaded) must not wait 1.1 s for a zygote asking: the probes are left to the job."""
    script("w.py", restarted_warm(ASKED))
    r = run_ftrun(tmp_path, "--preload", "torch._dynamo", "--max-restarts", "1", "w.py", env=POOL)
    assert r.returncode == 0, r.stderr
    assert [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1] == [True]
    assert r.log(1, 0) == "0\n"  # not asked in the zygote
