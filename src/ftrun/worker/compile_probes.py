"""What torch.compile works out about the machine once per process, worked out once in the zygote instead.

A new process that compiles with inductor on CPU first asks which vector instruction sets the machine can build
and load: it compiles a test library per instruction set and starts a Python process per set to load it (six
here: 1.1 s on a 2-core node, more than half of a cached compile). It also hashes torch's own sources into the
key of its cache (0.13 s). Both answers depend only on the machine and the installed torch, and torch keeps them
for the life of the process (``functools.cache``): asked in the zygote, every worker forked from it has them, as
a fresh process would once it asked. Asked only when the job's own imports brought these modules in: inductor's
cache (``torch._inductor.codecache``), which a job loads only once it compiled with inductor. ``import
torch._dynamo`` alone loads ``cpu_vec_isa`` too: a job that never compiles must not wait 1.1 s for a zygote
asking it (its first attempt's workers wait for that zygote).

The first compile in a process pays once more: dynamo builds its tables of what to trace, and inductor's C++
path preprocesses the headers it precompiles (``g++ -E``, to key them) before it loads even a cached kernel. The
zygote compiles one small module, then gives dynamo a fresh process's state (``torch._dynamo.reset``, its
counters as they were): a worker's first compile of a cached model then takes 0.08 s instead of 0.42 s (a
3-layer MLP) and 0.27 s instead of 0.61 s (a transformer layer), on this 2-core node.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator

INDUCTOR_USED = "torch._inductor.codecache"  # loaded once the job compiled with inductor (not by importing dynamo)
PROBES = (
    ("torch._inductor.cpu_vec_isa", "valid_vec_isa_list"),  # the instruction sets: a build and a load each
    ("torch._inductor.codecache", "torch_key"),  # the hash of torch's sources in every cache key
)


FIRST_COMPILE = "torch.compile of a small module"
TQDM_MONITOR = "monitor_interval"  # seconds between the looks of tqdm's monitor thread; 0: no thread


def ask_in_advance() -> dict[str, str]:
    """Ask every probe whose module is loaded, then compile once; returns {probe: error} for those that failed
    (the worker then asks again itself, as a fresh one would)."""
    failed: dict[str, str] = {}
    if INDUCTOR_USED not in sys.modules or _compiles_recorded():
        return failed
    with _uncounted():
        for module, name in PROBES:
            loaded = sys.modules.get(module)
            if loaded is None:
                continue
            try:
                getattr(loaded, name)()
            except Exception as e:  # a compiler missing here is missing for the worker too: it will say so itself
                failed[f"{module}.{name}"] = f"{type(e).__name__}: {e}"[:200]
        error = compiled_once()
    if error:
        failed[FIRST_COMPILE] = error
    return failed


@contextlib.contextmanager
def _uncounted() -> Iterator[None]:
    """Dynamo's counters and timings (``torch._dynamo.utils.counters``, ``compile_times()``) left as they were:
    a worker starts with none of the zygote's."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        yield
        return
    counted = {k: v.copy() for k, v in utils.counters.items()}
    timed = {k: list(v) for k, v in utils.compilation_time_metrics.items()}
    try:
        yield
    finally:
        utils.counters.clear()
        utils.counters.update(counted)
        utils.compilation_time_metrics.clear()
        utils.compilation_time_metrics.update(timed)


@functools.cache  # once per process, as torch's probes (a zygote grown from a ready one has it done)
def compiled_once() -> str:
    """Compile a small module with inductor on CPU, its backward too, then leave dynamo as a fresh process has
    it; returns why it failed ("": it did not). Only where torch is built for CPU alone: a compile, even of CPU
    tensors with dynamo alone, asks ``torch.cuda.is_available()`` and ``device_count()`` (inductor
    ``current_device()`` too), which on a CUDA build initialise the driver, and no worker forked after that can
    use CUDA (read with a profiler on this CPU build of torch 2.13)."""
    import torch
    import torch._dynamo
    import torch._inductor.config
    import torch._inductor.metrics

    if torch.version.cuda or torch.version.hip:
        return ""
    try:
        with _no_monitor_thread(), torch._inductor.config.patch(compile_threads=1):  # more: a pool of threads
            # A module of torch's functions: a function of tensor methods leaves half the gain (dynamo builds its
            # tables of torch's functions, and of modules, at their first trace).
            small = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
            torch.compile(small, backend="inductor")(torch.ones(2, 4)).sum().backward()
    except Exception as e:  # the worker's own first compile pays, as a fresh one's does, and says why
        return f"{type(e).__name__}: {e}"[:200]
    finally:
        torch._dynamo.reset()  # torch's own "as if you had started a fresh process"
        torch._inductor.metrics.reset()
    return ""


def _compiles_recorded() -> bool:
    """Whether the job has torch record its compiles (a structured trace, inductor's debug directory): it finds
    only its own processes' there (a probe is timed into the trace too), as without the pool."""
    return bool(os.environ.get("TORCH_TRACE")) or os.environ.get("TORCH_COMPILE_DEBUG") == "1"


@contextlib.contextmanager
def _no_monitor_thread() -> Iterator[None]:
    """tqdm (when installed) starts a monitor thread at its first bar, even a disabled one: inductor makes one."""
    bar = getattr(sys.modules.get("torch.hub"), "tqdm", None)  # tqdm's class, or torch's stand-in without it
    interval = getattr(bar, TQDM_MONITOR, None)
    if interval is None:
        yield
        return
    setattr(bar, TQDM_MONITOR, 0)
    try:
        yield
    finally:
        setattr(bar, TQDM_MONITOR, interval)
