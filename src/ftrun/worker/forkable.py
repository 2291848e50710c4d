"""Whether this process (a zygote) can still be forked into workers: it has one thread, and neither torch nor
the CUDA driver was initialised for CUDA (a forked child cannot use it)."""

from __future__ import annotations

import ctypes
import os
import sys

from ftrun.worker import jemalloc


def unforkable() -> str:
    """Why this process can no longer be forked into workers ("": it can)."""
    if torch_cuda_initialised() or cuda_driver_initialised():
        return "initialised CUDA, which a forked worker cannot use (initialise it in the job, not at import)"
    others = jemalloc.thread_names()[1:] if len(os.listdir("/proc/self/task")) > 1 else []
    if others:
        named = ", ".join(sorted(set(others)))
        return f"started a thread ({named}): forking a process with threads is unsafe"
    return ""


CUDA_DRIVER = "libcuda.so.1"  # the driver's soname, whatever its file is called (libcuda.so.580.95.05)
CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_driver_initialised() -> bool:
    """Whether the CUDA driver in this process was initialised (``cuInit`` ran), asked of the driver itself.

    A CUDA build of torch maps the driver into every process at ``import torch``: mapped is not initialised,
    and a child forked then uses CUDA as a fresh process would. After ``cuInit`` (a library asking the device
    count, even when torch does not know), a forked child cannot initialise it. Before ``cuInit`` every driver
    call answers CUDA_ERROR_NOT_INITIALIZED; the library is looked up among those already loaded (never loaded
    here: a node without the driver has nothing to initialise)."""
    try:
        driver = ctypes.CDLL(CUDA_DRIVER, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    count = ctypes.c_int(0)
    return int(driver.cuDeviceGetCount(ctypes.byref(count))) != CUDA_ERROR_NOT_INITIALIZED


def torch_cuda_initialised() -> bool:
    """Torch's own word, where torch.cuda is loaded: it initialised CUDA, or this process is a child of one
    that had (whose driver answers as if never initialised, and cannot be)."""
    cuda = sys.modules.get("torch.cuda")
    if cuda is None:
        return False
    bad_fork = getattr(cuda, "_is_in_bad_fork", lambda: False)
    return bool(getattr(cuda, "_initialized", False) or bad_fork())
