"""--warm auto: what a worker imported, written for its agent (which preloads it in a zygote for the next restart).

Written by the worker's client from the job's own thread, at moments when its
imports have settled: as it meets its peers (``init_process_group``), at its first
heartbeat and at exit; the agent reads ``modules.json`` in the rank's log directory.
Never from a thread of ftrun's: one that takes the GIL while the job's main thread
is about to block can make it miss a signal (its Python handler would run only
after the blocking call returns), which a fresh ``python`` never does.
"""

from __future__ import annotations

import contextlib
import json
import os


def report_modules(path: str) -> None:
    """Write {module name: file} of everything imported so far, for the agent's --warm auto."""
    import sys

    files = {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())}
    tmp = f"{path}.tmp"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with open(os.open(tmp, flags, 0o600), "w", encoding="utf-8") as f:  # the run's files are its user's alone
            json.dump(files, f)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):
        pass  # only an optimisation of the next restart is lost
