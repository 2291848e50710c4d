"""ftrun: a fault-tolerant, elastic launcher for distributed training.

This namespace is the worker API only: what a training script calls. The
launcher itself is the ``ftrun`` command (:mod:`ftrun.cli`).
"""

from ftrun.errorfile import record

__version__ = "0.1.0"

__all__ = ["__version__", "record"]
