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
    from typing import Any


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
            _tells_exits()
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
        _uncaught.append(1)
        if sys.stderr is sys.__stderr__:
            _tell_the_end()
        else:
            import atexit

            atexit.register(_tell_the_end)  # the first to run of the atexit handlers: they come after the hooks

    return excepthook


def _tells_exits() -> None:
    """``sys.exit(code)``, ``exit(code)`` in the main thread: once that SystemExit ended the script, the agent
    hears of the end with its code at the first atexit handler, before the interpreter's teardown (a gloo
    process group's: 0.4 s), as a warm worker's zygote tells it. Else a peer's echo of this exit ("Connection
    closed by peer"), told at once as an exception, was taken for the root cause. Python tells no atexit
    handler why it exits: a SystemExit ended the script when the outermost frame never ran again after the call
    that raised it (or ended re-raising it, after a ``finally``); one caught, after which the script went on,
    is not told (its end is then known as before: at the process's exit). ``raise SystemExit`` is not seen."""
    import _thread
    import atexit
    import builtins

    main = _thread.get_ident()
    noted: list[Any] = []  # the last exit's status, the outermost frame, where that frame was then

    def note(status: object) -> None:
        if _thread.get_ident() == main:
            outer = sys._getframe()
            while outer.f_back is not None:
                outer = outer.f_back
            if not noted:
                atexit.register(_tell_exit, noted)  # the last registered: the first to run
            noted[:] = [status, outer, outer.f_lasti]

    _tells_the_end_before_threads_join(noted)
    real_exit = sys.exit

    def exit(status: object = None, /) -> None:
        note(status)
        real_exit(status)  # type: ignore[arg-type]

    sys.exit = exit  # type: ignore[assignment]
    quitter = type(getattr(builtins, "exit", None))  # site's exit() and quit()
    if quitter.__module__ == "_sitebuiltins":
        real_call = quitter.__call__

        def call(self: object, code: object = None) -> None:
            note(code)
            real_call(self, code)

        quitter.__call__ = call  # type: ignore[method-assign]


def _tells_the_end_before_threads_join(noted: list[Any]) -> None:
    """The script's end, told as Python joins the threads it left (``threading._shutdown``, before any atexit
    handler): a non-daemon thread that never returns held a fresh worker there, its script over, with the agent
    never told (it waited for ever, or took the destroyed group's last collective for a hang and failed a run
    whose script had succeeded). The code: the uncaught exception's 1, a ``sys.exit`` that ended the script,
    else 0 (a bare ``raise SystemExit(n)`` is not seen: its process's own exit status tells it, unless its
    teardown is stuck too)."""
    import threading

    join = threading._shutdown  # type: ignore[attr-defined]

    def shutdown() -> None:
        if not _told:
            if noted and not _uncaught:
                _tell_exit(noted)
            if not _told:
                _tell_the_end(1 if _uncaught else 0)
        join()

    threading._shutdown = shutdown  # type: ignore[attr-defined]


def _tell_exit(noted: list[Any]) -> None:
    import opcode

    status, outer, lasti = noted
    try:
        ended = outer.f_lasti == lasti or outer.f_code.co_code[outer.f_lasti] == opcode.opmap["RERAISE"]
    except (IndexError, KeyError):  # an interpreter whose frames read otherwise: told at the process's exit
        return
    if ended:
        _tell_the_end(0 if status is None else status & 0xFF if isinstance(status, int) else 1)


def _tell_the_end(code: int = 1) -> None:
    if not _told:
        _told.append(code)
        from ftrun.worker import client

        client.script_ended(code)


_told: list[int] = []  # the end is told once: an exception's after a SystemExit caught is the script's end
_uncaught: list[int] = []  # an exception ended the script (told at once, or after every hook)


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
