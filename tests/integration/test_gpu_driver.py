"""A GPU node's reality on this CPU machine: the stand-in CUDA driver (:mod:`ftrun.testing.cuda_driver`),
preloaded into the whole job as a CUDA build of torch maps the real one into every process. Mapped is not
initialised: the pool preloads and forks as usual; a module whose import initialises CUDA is left out of the
preload (said once), and the workers that import it themselves still use CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftrun.testing import cuda_driver
from tests.integration.harness import POOL, Result, WriteScript, restarted_warm, run_ftrun

pytestmark = pytest.mark.skipif(bool(cuda_driver.available()), reason=cuda_driver.available() or "built")

# What every GPU job does first (torch does it at its first CUDA call): initialise the driver, count devices.
USES_CUDA = """
import ctypes, json
cuda = ctypes.CDLL("libcuda.so.1")
count = ctypes.c_int(0)
print(json.dumps([cuda.cuInit(0), cuda.cuDeviceGetCount(ctypes.byref(count)), count.value]), flush=True)
"""
WORKS = [0, 0, 1]  # cuInit succeeded, one device
INITIALISES_AT_IMPORT = "import ctypes\nctypes.CDLL('libcuda.so.1').cuInit(0)\n"


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in driver, preloaded into ftrun and everything it starts."""
    library = cuda_driver.build(tmp_path / "driver")
    monkeypatch.setenv("LD_PRELOAD", str(library))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "lib"))
    return library


def spawned(r: Result, attempt: int) -> list[bool]:
    return [bool(e["warm"]) for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == attempt]


def pool_lines(r: Result) -> list[str]:
    return [line for line in r.stderr.splitlines() if "warm pool" in line]


PROBE = """
import ctypes, json, os, sys
from ftrun.worker.forkable import cuda_driver_initialised
seen = [cuda_driver_initialised()]
ctypes.CDLL("libcuda.so.1").cuInit(0)
seen.append(cuda_driver_initialised())
pid = os.fork()
if pid == 0:  # the child of an initialised parent: the driver answers as if never initialised, and cannot be
    child = ctypes.CDLL("libcuda.so.1").cuInit(0)
    os.write(1, json.dumps([cuda_driver_initialised(), child]).encode() + b"\\n")
    os._exit(0)
os.waitpid(pid, 0)
print(json.dumps(seen), flush=True)
"""


def test_the_driver_is_asked_whether_it_was_initialised_not_whether_it_is_mapped(standin: Path) -> None:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    child, parent = map(json.loads, r.stdout.splitlines())
    assert parent == [False, True]  # mapped from the start, initialised only by cuInit
    assert child == [False, cuda_driver.CUDA_ERROR_NOT_INITIALIZED]  # torch's bad-fork flag covers this case
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    absent = subprocess.run(
        [sys.executable, "-c", "from ftrun.worker.forkable import cuda_driver_initialised as c; print(c())"],
        capture_output=True, text=True, timeout=60, check=True, env=env,
    )  # fmt: skip
    assert absent.stdout == "False\n"  # no driver loaded: none is loaded to ask


def test_workers_that_initialise_cuda_restart_warm_and_use_it(
    tmp_path: Path, script: WriteScript, standin: Path
) -> None:
    script("w.py", restarted_warm(USES_CUDA))
    r = run_ftrun(
        tmp_path, "--preload", "json,ctypes", "--nproc-per-node", "2", "--max-restarts", "1", "w.py", env=POOL
    )
    assert r.returncode == 0, r.stderr
    assert spawned(r, 1) == [True, True]
    assert [json.loads(r.log(1, rank)) for rank in (0, 1)] == [WORKS, WORKS]
    assert pool_lines(r) == []  # a driver mapped in the zygote is no trouble at all
    assert "1 restart (warm)" in r.stderr


def test_a_module_that_initialises_cuda_at_import_is_left_out_and_the_rest_stays_warm(
    tmp_path: Path, script: WriteScript, standin: Path
) -> None:
    script("lib/gpuhelper/__init__.py", INITIALISES_AT_IMPORT)
    script("lib/gpuhelper/kernels.py", "")
    script("w.py", restarted_warm("import gpuhelper.kernels\n" + USES_CUDA))
    preload = "json,gpuhelper,decimal,gpuhelper.kernels,ctypes"  # its submodule would import it again
    r = run_ftrun(tmp_path, "--preload", preload, "--nproc-per-node", "2", "--max-restarts", "1", "w.py", env=POOL)
    assert r.returncode == 0, r.stderr
    assert spawned(r, 1) == [True, True]  # from the zygote that preloaded the rest
    assert [json.loads(r.log(1, rank)) for rank in (0, 1)] == [WORKS, WORKS]  # it imported gpuhelper itself
    [line] = pool_lines(r)  # said once, naming the module and what to do
    assert "importing 'gpuhelper' initialised CUDA, which a forked worker cannot use" in line
    assert "initialise it in the job, not at import" in line
    ready = [e for e in r.events() if e["kind"] == "pool_ready" and e["preload"] and not e.get("grown_from")]
    assert len(ready) == 1  # one more zygote, not one per module (one for what the workers imported grows from it)


@pytest.mark.torch
@pytest.mark.parametrize(
    "torch_says",
    ["torch.cuda._initialized = True", "torch.cuda._is_in_bad_fork = lambda: True"],
    ids=["torch-initialised-cuda", "bad-fork"],
)
def test_torch_saying_cuda_is_initialised_leaves_the_module_out(
    tmp_path: Path, script: WriteScript, standin: Path, torch_says: str
) -> None:
    """Torch's own word, where the driver cannot tell (a child of an initialised parent answers 3 as if never
    initialised): a module after which torch says CUDA is initialised, or this is a bad fork, is left out."""
    script("lib/torchcuda.py", f"import torch.cuda\n{torch_says}\n")
    script("w.py", restarted_warm(USES_CUDA))
    r = run_ftrun(tmp_path, "--preload", "json,torchcuda,ctypes", "--max-restarts", "1", "w.py", env=POOL, timeout=240)
    assert r.returncode == 0, r.stderr
    assert spawned(r, 1) == [True]
    assert json.loads(r.log(1, 0)) == WORKS
    [line] = pool_lines(r)
    assert "importing 'torchcuda' initialised CUDA" in line
