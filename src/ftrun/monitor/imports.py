"""--warm auto: what a worker imported, written for its agent (which preloads it in a zygote for the next restart).

Written as soon as the worker's imports settle (from a daemon thread in a warm
worker; at the first heartbeat otherwise) and again at exit, so that a worker
killed right after its imports has told; the agent reads ``modules.json`` in the
rank's log directory.
"""

from __future__ import annotations

import json
import os
import time

SETTLE_S = 0.3  # no new import for this long: the imports have settled
SETTLE_POLL_S = 0.1
SETTLE_GIVE_UP_S = 120.0  # nothing new for this long: the job imports no more; the watcher ends


def report_when_imports_settle(path: str) -> None:
    """--warm auto: report the worker's modules each time its imports settle, from a daemon thread, so the
    agent knows what to preload long before a crash (and a worker killed right after has reported)."""
    import _thread
    import sys

    def watch() -> None:
        seen = len(sys.modules)
        reported = -1  # once at least: a warm worker may import nothing its zygote had not (still news to learn)
        changed = time.monotonic()
        while time.monotonic() - changed < SETTLE_GIVE_UP_S:
            time.sleep(SETTLE_POLL_S)
            now, count = time.monotonic(), len(sys.modules)
            if count != seen:
                seen, changed = count, now
            elif count != reported and now - changed >= SETTLE_S:
                report_modules(path)
                reported = count

    # Not threading.Thread: its start() waits for the thread to run, and the worker's start-up waits for no one.
    _thread.start_new_thread(watch, ())


def report_modules(path: str) -> None:
    """Write {module name: file} of everything imported so far, for the agent's --warm auto."""
    import sys

    files = {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())}
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(files, f)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):
        pass  # only an optimisation of the next restart is lost
