"""ftrun's start-up in a worker started fresh (no warm pool), as a warm worker has it.

Before the job's code runs, ftrun's client is attached (a hang in an import gets its
stacks without py-spy), every optimizer step becomes a heartbeat, and an uncaught
exception tells the agent the script is over once Python has printed it. Python imports
``sitecustomize`` at start-up from the first directory of ``sys.path`` that has one;
the agent puts this directory first on the worker's PYTHONPATH. The job then sees its
PYTHONPATH as it gave it (so the worker's own children never pass through here), and
the environment's own ``sitecustomize``, if any, still runs.

Deliberately plain: it runs in every fresh worker, before anything else.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # nothing more imported in every fresh worker than Python itself does
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType


def _boot() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p) != here]
    original = os.environ.pop("FTRUN_BOOT_PYTHONPATH", None)
    if original is None:
        return  # not a worker ftrun started (a stray PYTHONPATH): hand over at once
    if original:
        os.environ["PYTHONPATH"] = original
    else:
        os.environ.pop("PYTHONPATH", None)
    if os.environ.get("FTRUN_MONITOR"):
        try:
            from ftrun.worker import autobeat, client

            client.attach()
            autobeat.install()
            sys.excepthook = _tells_the_agent(sys.excepthook)
        except Exception as e:  # the job runs as it would have, only without ftrun's early help
            sys.stderr.write(f"ftrun: could not attach the hang monitor before the job's code: {e!r}\n")


def _tells_the_agent(hook: Callable[..., object]) -> Callable[..., None]:
    """An uncaught exception ends the script: once Python printed it, the agent hears of the end at once (as a
    warm worker's zygote tells it), flushes the job's files and may restart beside the interpreter's teardown,
    before the other ranks see this one's sockets close and print their own tracebacks. A hook installed after
    this one may hold what was printed and write it once this one returns (torch.distributed's, which prefixes
    each line with "[rankN]:", swaps sys.stderr for a buffer around it): then the end is told as the interpreter
    finalizes, after every hook, else the agent would report the failure before its traceback is in the log."""

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        hook(kind, value, tb)
        if sys.stderr is sys.__stderr__:
            _tell_the_end()
        else:
            import atexit

            atexit.register(_tell_the_end)  # the first to run of the atexit handlers: they come after the hooks

    return excepthook


def _tell_the_end() -> None:
    from ftrun.worker import client

    client.script_ended(1)


def _hand_over() -> None:
    """Run the environment's own sitecustomize, as Python would have without ftrun's."""
    ours = sys.modules.pop("sitecustomize")
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401 - the next one on sys.path
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
        sys.modules["sitecustomize"] = ours  # none: Python's own import of this module expects one there


_boot()
_hand_over()
