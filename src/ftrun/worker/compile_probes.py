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
"""

from __future__ import annotations

import sys

INDUCTOR_USED = "torch._inductor.codecache"  # loaded once the job compiled with inductor (not by importing dynamo)
PROBES = (
    ("torch._inductor.cpu_vec_isa", "valid_vec_isa_list"),  # the instruction sets: a build and a load each
    ("torch._inductor.codecache", "torch_key"),  # the hash of torch's sources in every cache key
)


def ask_in_advance() -> dict[str, str]:
    """Ask every probe whose module is loaded; returns {probe: error} for those that failed (the worker then
    asks again itself, as a fresh one would)."""
    failed: dict[str, str] = {}
    if INDUCTOR_USED not in sys.modules:
        return failed
    for module, name in PROBES:
        loaded = sys.modules.get(module)
        if loaded is None:
            continue
        try:
            getattr(loaded, name)()
        except Exception as e:  # a compiler missing here is missing for the worker too: it will say so itself
            failed[f"{module}.{name}"] = f"{type(e).__name__}: {e}"[:200]
    return failed
