"""A stand-in CUDA driver, for tests and benchmarks of a GPU node's reality on a machine without one.

It behaves as the real driver was measured to on an H100 node (torch 2.11+cu130, driver 580): preloaded
into a whole job (``LD_PRELOAD``), it is mapped in every process, as a CUDA build of torch maps the real one
at ``import torch``; every call answers CUDA_ERROR_NOT_INITIALIZED (3) until ``cuInit``; after ``cuInit``
``cuDeviceGetCount`` answers one device; and a process forked after its parent's ``cuInit`` answers 3 to
everything, ``cuInit`` included: it can never use CUDA (the real one's child fails with "CUDA driver
initialization failed" or, under torch, "Cannot re-initialize CUDA in forked subprocess").

Built with gcc as ``libcuda.so.1`` (the real driver's soname, so that ``dlopen("libcuda.so.1")`` finds the
one already loaded). :func:`build` needs gcc; :func:`available` says why it cannot be built.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SONAME = "libcuda.so.1"
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_INITIALIZED = 3

SOURCE = r"""
#include <unistd.h>

/* The process that initialised the driver. In a child forked after it the value is inherited but is not the
   child's own pid: that child can never initialise the driver, and every call says it is not initialised. */
static pid_t initialised_by;

int cuInit(unsigned int flags) {
  (void)flags;
  if (initialised_by == 0) initialised_by = getpid();
  return initialised_by == getpid() ? 0 : 3;
}

int cuDeviceGetCount(int *count) {
  if (initialised_by != getpid()) return 3;
  *count = 1;
  return 0;
}

int cuDriverGetVersion(int *version) {
  *version = 13000;
  return 0;
}
"""


def available() -> str:
    """Why the stand-in cannot be built here, or "" when it can."""
    return "" if shutil.which("gcc") else "gcc is missing (apt-get install gcc)"


def build(directory: Path) -> Path:
    """Compile the stand-in into ``directory``; returns the library's path (to put in LD_PRELOAD)."""
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "cuda_standin.c"
    source.write_text(SOURCE)
    library = directory / "libcuda.so.580.standin"  # named as the real one is; found by its soname
    gcc = shutil.which("gcc") or "gcc"
    subprocess.run(
        [gcc, "-shared", "-fPIC", f"-Wl,-soname,{SONAME}", "-o", str(library), str(source)],
        check=True,
        capture_output=True,
    )
    return library
