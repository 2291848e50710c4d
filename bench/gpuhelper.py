"""A library that initialises CUDA when imported (some do, asking the driver for the device count): bench/gpu.py's
"helper" case. A process forked after this import cannot use CUDA; ftrun's warm pool must leave it out."""

import contextlib
import ctypes

with contextlib.suppress(OSError):  # no CUDA driver on this machine: nothing to initialise
    ctypes.CDLL("libcuda.so.1").cuInit(0)
