"""What a fresh process would have, given back to a warm worker after its fork from the zygote.

A fork copies the zygote: its random states and its thread pools, pinned to one thread so that it is safe
to fork. A fresh ``python`` draws its randomness from the OS and sizes its pools from the environment and
the CPUs it may use; a warm worker gets the same, here, before the job's code runs:

- randomness: numpy's legacy global ``RandomState`` and torch's default CPU generator are drawn anew
  (torch's CUDA generators start from a fixed seed in a fresh process too, and are left alone). Python's
  ``random`` reseeds itself at fork. The hash seed of ``str`` cannot be drawn anew once an interpreter
  runs: every warm worker of a zygote shares it (set PYTHONHASHSEED to make fresh workers alike too).
- thread pools: torch's intra-op threads, and the BLAS and OpenMP libraries loaded by the preloaded
  modules (OpenBLAS, MKL, BLIS, libgomp...: found once in the zygote with threadpoolctl), each as it
  sizes itself from OMP_NUM_THREADS and the like, else from the CPUs.

Run in the zygote: :func:`find_pools` once after preloading. In each worker: :func:`redraw_randomness` and
:func:`restore_threads`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

POOLS: list[Any] = []  # threadpoolctl's controllers of the BLAS/OpenMP libraries the zygote loaded
CORES: dict[frozenset[int], int] = {}  # CPUs allowed -> physical cores among them (sysfs reads: ~0.7 ms a worker)

# Where each kind of pool reads its size at start-up, first found wins (then: the CPUs, or physical cores).
# The zygote pins its own thread pools (never the workers'): a library that starts threads at import (OpenMP,
# BLAS) would make it unsafe to fork. Each worker sizes its pools again, as a fresh process would.
ZYGOTE_THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
POOL_VARIABLES = {
    "openblas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"),
    "mkl": ("MKL_NUM_THREADS", "OMP_NUM_THREADS"),
    "blis": ("BLIS_NUM_THREADS", "OMP_NUM_THREADS"),
    "openmp": ("OMP_NUM_THREADS",),
}


def find_pools() -> None:
    """In the zygote, after preloading: the thread pools of the native libraries now loaded (none: nothing to
    do in the workers, and threadpoolctl is not even imported)."""
    if not any(name in sys.modules for name in ("numpy", "scipy", "torch")):
        return
    # Invisible to the job: threadpoolctl sets KMP_DUPLICATE_LIB_OK at import, which a job that imports it
    # must then see happen as in a fresh process (and one that does not, never see).
    environment = dict(os.environ)
    try:
        import threadpoolctl
    except ImportError:  # the pools keep the zygote's single thread: slower, never wrong
        return
    finally:
        os.environ.clear()
        os.environ.update(environment)
        sys.modules.pop("threadpoolctl", None)
    controllers = threadpoolctl.ThreadpoolController().lib_controllers
    POOLS[:] = [c for c in controllers if c.internal_api in POOL_VARIABLES]


def redraw_randomness() -> None:
    """Random states a fresh process draws from the OS, drawn anew (a fork copied the zygote's)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # the legacy global RandomState: np.random.rand() and friends
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()  # a fresh process seeds it from the OS: torch.initial_seed() differs


def restore_threads(env: Mapping[str, str] | None = None) -> None:
    """The zygote pinned its thread pools to 1 (safe to fork); the worker gets what a fresh process would, from
    ``env`` (default: os.environ; the zygote's: as the script's top sets it before its imports load the pools)."""
    env = os.environ if env is None else env
    torch = sys.modules.get("torch")
    torch_dir = os.path.dirname(getattr(torch, "__file__", None) or "/nonexistent") + os.sep
    torch_pool_set = False
    for pool in POOLS:
        if pool.internal_api == "openmp" and pool.filepath.startswith(torch_dir):
            size, torch_pool_set = torch_threads(env), True  # torch sizes its own OpenMP at first use, by its rule
        else:
            wanted = _from_environment(POOL_VARIABLES[pool.internal_api], env)
            size = wanted or (physical_cores() if pool.internal_api == "mkl" else len(os.sched_getaffinity(0)))
        if pool.num_threads != size:
            pool.set_num_threads(size)
    if torch is not None and not torch_pool_set:  # torch.set_num_threads also starts a thread pool at once,
        torch.set_num_threads(torch_threads(env))  # which a fresh process starts on first use: only as a fallback


def torch_threads(env: Mapping[str, str] | None = None) -> int:
    """torch's intra-op threads in a fresh process: OMP_NUM_THREADS / MKL_NUM_THREADS, else physical cores."""
    return _from_environment(("OMP_NUM_THREADS", "MKL_NUM_THREADS"), env) or physical_cores()


def _from_environment(names: tuple[str, ...], env: Mapping[str, str] | None = None) -> int | None:
    """The first of ``names`` set to a positive count (OMP_NUM_THREADS may be a list per nesting level)."""
    env = os.environ if env is None else env
    for name in names:
        first = env.get(name, "").split(",")[0].strip()
        if first.isdigit() and int(first) > 0:
            return int(first)
    return None


def physical_cores() -> int:
    """Cores (not hyperthreads) this process may run on, as torch and MKL count their default threads;
    counted once in the zygote for the CPUs its workers inherit."""
    cpus = frozenset(os.sched_getaffinity(0))
    if cpus not in CORES:
        cores = set()
        for cpu in cpus:
            try:
                with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id") as f:
                    core = f.read().strip()
                with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id") as f:
                    cores.add((f.read().strip(), core))
            except OSError:
                cores.add(("", str(cpu)))
        CORES[cpus] = max(1, len(cores))
    return CORES[cpus]
