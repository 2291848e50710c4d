"""A stand-in NVML (``libnvidia-ml.so.1``), for tests of a GPU that breaks on a machine without one.

It answers the calls ftrun's ``builtin:gpu`` health check makes through ``nvidia-ml-py`` (init, the device count,
a device's handle and memory, its uncorrectable ECC errors, its retired pages pending) for one GPU, whose state
a test sets at any moment by writing the file named by ``$NVML_STANDIN_STATE``:

    (missing or empty)   a healthy GPU
    ecc N                N uncorrectable ECC errors since the driver loaded
    lost                 the GPU fell off the bus: asking for its memory answers NVML_ERROR_GPU_IS_LOST

Found by its soname ahead of any real one when its directory is first in ``LD_LIBRARY_PATH``. Needs gcc.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

SONAME = "libnvidia-ml.so.1"
STATE = "NVML_STANDIN_STATE"

SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NVML_SUCCESS 0
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_GPU_IS_LOST 15

typedef struct { unsigned long long total, free, used; } memory_t;

/* The GPU's state, read from the file named by $NVML_STANDIN_STATE at every call: "", "ecc N" or "lost". */
static void state(char *word, unsigned long long *count) {
  const char *path = getenv("NVML_STANDIN_STATE");
  FILE *f = path ? fopen(path, "r") : NULL;
  word[0] = 0;
  *count = 0;
  if (f) {
    if (fscanf(f, "%15s %llu", word, count) < 1) word[0] = 0;
    fclose(f);
  }
}

int nvmlInitWithFlags(unsigned int flags) { (void)flags; return NVML_SUCCESS; }
int nvmlInit_v2(void) { return NVML_SUCCESS; }
int nvmlShutdown(void) { return NVML_SUCCESS; }
const char *nvmlErrorString(int result) {
  return result == NVML_ERROR_GPU_IS_LOST ? "GPU is lost" : "Unknown Error";
}
int nvmlDeviceGetCount_v2(unsigned int *count) { *count = 1; return NVML_SUCCESS; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
  if (index != 0) return NVML_ERROR_INVALID_ARGUMENT;
  *device = (void *)0x1;
  return NVML_SUCCESS;
}
int nvmlDeviceGetMemoryInfo(void *device, memory_t *memory) {
  char word[16];
  unsigned long long count;
  (void)device;
  state(word, &count);
  if (strcmp(word, "lost") == 0) return NVML_ERROR_GPU_IS_LOST;
  memory->total = 80ULL << 30;
  memory->used = 1ULL << 30;
  memory->free = memory->total - memory->used;
  return NVML_SUCCESS;
}
int nvmlDeviceGetTotalEccErrors(void *device, int error_type, int counter_type, unsigned long long *count) {
  char word[16];
  unsigned long long n;
  (void)device; (void)counter_type;
  state(word, &n);
  *count = (error_type == 1 && strcmp(word, "ecc") == 0) ? n : 0; /* 1: NVML_MEMORY_ERROR_TYPE_UNCORRECTED */
  return NVML_SUCCESS;
}
int nvmlDeviceGetRetiredPagesPendingStatus(void *device, int *pending) {
  (void)device;
  *pending = 0;
  return NVML_SUCCESS;
}
"""


def available() -> str:
    """Why the stand-in cannot be used here, or "" when it can."""
    if not shutil.which("gcc"):
        return "gcc is missing (apt-get install gcc)"
    if importlib.util.find_spec("pynvml") is None:  # nvidia-ml-py: ftrun's GPU check loads the library with it
        return "nvidia-ml-py is not installed"
    return ""


def build(directory: Path) -> Path:
    """Compile the stand-in into ``directory`` (put it first in LD_LIBRARY_PATH); returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "nvml_standin.c"
    source.write_text(SOURCE)
    gcc = shutil.which("gcc") or "gcc"
    subprocess.run(
        [gcc, "-shared", "-fPIC", f"-Wl,-soname,{SONAME}", "-o", str(directory / SONAME), str(source)],
        check=True,
        capture_output=True,
    )
    return directory
