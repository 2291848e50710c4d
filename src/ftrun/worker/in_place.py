"""In-process restart, opt-in: ``@ftrun.restartable`` keeps a rank's process when another rank fails.

The ranks that did not fail keep their interpreter, their imports, whatever the job built outside the wrapped
function (the model, its compiled code, a CUDA context), and call the function again; only a failed rank is a new
process (from the warm pool). How a survivor gets there:

1. ftrun interrupts the function: a signal that raises :class:`RestartInPlace` in the main thread, and breaks
   a collective it waits in (:mod:`ftrun.worker.interrupt`). A collective that a lost peer broke raises by itself
   first (gloo's "Connection reset by peer", NCCL's errors); both are taken as the job's restart. Any other
   exception is this rank's own failure: printed and written to its error file as if uncaught (the root cause),
   then this rank restarts in place too, as every other does: its process is sound. Only an exception that
   leaves the process unfit (a CUDA error, which stays with its context; MemoryError) or an exit (SystemExit,
   KeyboardInterrupt) ends it, and it is replaced as before.
2. The function's process groups are destroyed, and the process parks: it tells its agent, through the socket
   named in ``FTRUN_IN_PLACE``, and sleeps there until the next attempt gives it its environment (its rank, the
   new master port, TORCHELASTIC_RESTART_COUNT), its directory and its output, as a warm standby gets them.
3. The function is called again. It restores its state as after any restart (``ftrun.restore()``, a
   checkpoint): it never goes on from memory an interrupted optimizer step left half-written.

Outside ftrun, or from another thread than the main one, the function runs once, as if undecorated.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import ParamSpec, TypeVar

from ftrun.worker import errorfile, interrupt, messages
from ftrun.worker.interrupt import RestartInPlace

ENV = "FTRUN_IN_PLACE"  # the abstract socket name of the agent's door for parked processes
PHASES_ENV = "FTRUN_PHASES_FILE"  # where a rank restarted in place notes when it reached each phase (the report)
PHASES_FILE = "phases.json"  # that file, in the rank's directory of the attempt
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
# What a collective broken by a lost peer raises (gloo's transport, torch's NCCL watchdog): the job's restart.
BROKEN_BY_A_PEER = (
    "gloo/transport",
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL",
)

# An exception whose cause stays in the process: a CUDA error is sticky to its context (every later call fails).
UNFIT = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error", "device-side assert")

MADE_OUTSIDE = (
    "ftrun: @ftrun.restartable: the default process group was made before the function was called "
    "(init_process_group outside it), and a restart in place would end it with nothing to make it again: "
    "the ranks restart as new processes. Call init_process_group (and make what uses the group: DDP, FSDP, a "
    "DeviceMesh) inside the decorated function to keep their processes.\n"
)

P = ParamSpec("P")
R = TypeVar("R")


_phases: dict[str, float] = {}  # this attempt's, in a process restarted in place (empty: none to note)


def restartable(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` so that, when the job restarts, this process calls it again instead of being replaced."""

    @functools.wraps(fn)
    def restarting(*args: P.args, **kwargs: P.kwargs) -> R:
        if not os.environ.get(ENV) or threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        if _with_a_group() is not None:  # made before the function: the rank restarts as a process (see MADE_OUTSIDE)
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # once a node
                sys.stderr.write(MADE_OUTSIDE)
            return fn(*args, **kwargs)
        _arm()
        while True:
            _nccl_errors_leave_the_process()
            before = interrupt.sockets()
            try:
                try:
                    interrupt.enter(before)
                    return fn(*args, **kwargs)
                finally:  # the interrupt may come until this is done: then it is what the outer block sees
                    interrupt.leave()
            except BaseException as e:
                failed = not restarts_the_job(e)
                if failed and not restarts_in_place(e):
                    raise
                if failed:
                    _tell(e)
                why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            _park(why, before, failed)

    return restarting


def _with_a_group() -> ModuleType | None:
    """torch.distributed, where the job imported it and its default process group exists now. Before the
    function's first call, such a group was made outside it (init_process_group, or a framework's set-up): a
    restart in place ends the groups, and nothing outside the function would make one again (seen: every rank's
    next call failed with torch's "Default process group has not been initialized", until the budget was spent)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def restarts_the_job(e: BaseException) -> bool:
    """Whether ``e`` is the job's restart reaching this rank (the interrupt, a collective a lost peer broke, an
    exception the job's own cleanup raised while the interrupt went through it) rather than this rank's own
    failure (as torchrun takes no worker's exception for a failure once it stops the workers)."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, RestartInPlace):
            return True
        seen = seen.__context__
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None) if dist is not None else None
    if isinstance(dist_error, type) and isinstance(e, dist_error):
        return True
    return isinstance(e, RuntimeError) and any(marker in str(e) for marker in BROKEN_BY_A_PEER)


def restarts_in_place(e: BaseException) -> bool:
    """Whether this rank's own failure ``e`` leaves its process fit to call the function again."""
    if not isinstance(e, Exception) or isinstance(e, MemoryError):
        return False  # an exit the job asked for, or an interpreter short of memory
    return not any(marker in str(e) for marker in UNFIT)


def _tell(e: BaseException) -> None:
    """What an uncaught ``e`` would have left: its traceback on stderr, its record in the error file (from the
    job's function down: the wrapper's own frame is ftrun's, not the job's)."""
    if e.__traceback__ is not None and e.__traceback__.tb_next is not None:
        e.__traceback__ = e.__traceback__.tb_next
    with contextlib.suppress(Exception):  # a closed stderr or a full disk loses one of the two, not the restart
        traceback.print_exception(e)
    with contextlib.suppress(Exception):
        errorfile.record_exception(e)


def _arm() -> None:
    """Take the interrupt, and tell the agent this rank restarts in place (its slot's flag)."""
    interrupt.arm()
    from ftrun.worker import client

    client.restartable()


def _nccl_errors_leave_the_process() -> None:
    """NCCL's watchdog, at a communicator's error (a peer lost, a collective's timeout), ends the process under
    TORCH_NCCL_ASYNC_ERROR_HANDLING 1 (torchrun's setting, and ftrun's) and 3 (torch's default): a restartable
    rank's process must outlive it. Under 2 the watchdog aborts the communicators only, and the rank's next wait
    on them raises (the job's restart). Read by each new NCCL group: set before the function makes its own."""
    if os.environ.get(NCCL_ERROR_HANDLING, "3") in ("1", "3"):
        os.environ[NCCL_ERROR_HANDLING] = "2"


def _park(why: str, before: set[str], failed: bool) -> None:
    """Let go of the attempt that ended (``before``: the sockets open when it began), tell the agent (``failed``:
    this rank's own exception ended it), and become the next attempt's rank when it says so (exits when the agent
    closes the door instead: the run ended, or this process is not wanted)."""
    _let_go(before)
    door = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        door.connect("\0" + os.environ[ENV])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        messages.send(door, {"parked": why, "local_rank": local_rank, "failed": failed})
        request, fds = messages.receive(door)
    except OSError:
        request, fds = None, []
    finally:
        door.close()
    if request is None:
        for fd in fds:
            os.close(fd)
        os._exit(1)  # the agent let this process go (its exit is nobody's failure: the attempt is over)
    _become(request, fds)


def _let_go(before: set[str]) -> None:
    """What the interrupted attempt held: the output it had not written yet, its collectives (broken, so that a
    peer still inside one with this rank gets an error now rather than at its timeout: NCCL's communicators
    aborted, the TCP connections it opened shut), its process groups."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    interrupt.break_collectives(before)
    if (dist := _with_a_group()) is not None:
        _end_the_groups(dist)
    else:
        _forget_the_group_never_made()
    _forget_what_libraries_kept()
    from ftrun.worker import peers

    peers.stop_peer_heartbeat()
    gc.collect()


def _end_the_groups(dist: ModuleType) -> None:
    """Every process group ended and forgotten. A graceful end may refuse: NCCL's finalize of a communicator
    aborted raises (torch's ProcessGroupNCCL.shutdown) before torch has forgotten its groups, and the next
    init_process_group would find the default group still there. Torch's own abort then ends what is left and
    forgets them all (it works for gloo's groups too: torch 2.13, measured)."""
    try:
        dist.destroy_process_group()
    except Exception:
        with contextlib.suppress(Exception):
            dist.distributed_c10d._abort_process_group()


def _forget_the_group_never_made() -> None:
    """An init_process_group that failed (a peer gone while it waited for it) had already named its group: torch
    names default groups by a count ("0") that only the end of the default group resets, and a failed init never
    made one. Left as it is, this rank's next group would be "1" while a new rank's is "0": their keys in the
    store never meet, and both wait in init_process_group (seen in CI: a rank whose peer exited during its init)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None)
    with contextlib.suppress(Exception):
        if world is not None and world.group_count:
            world.group_count = 0


def _forget_what_libraries_kept() -> None:
    """Hugging Face Accelerate keeps the process's distributed set-up in singletons made once per process (its
    states: the first ``Accelerator()`` calls init_process_group, a later one reads what the first found): the
    next call's ``Accelerator()`` would hand it the group just ended ("Default process group has not been
    initialized"), or a state an interrupt left half-made. They are cleared as Accelerate clears them between two
    set-ups in one process (its own tests), so that the next call sets up anew; only where the job imported it."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    with contextlib.suppress(Exception):  # another version's internals: its next set-up says what is wrong
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


def _become(request: messages.Message, fds: list[int]) -> None:
    """The next attempt's rank: its output, directory and environment (the variables ftrun gave the last
    attempt are replaced; those the process set itself stay), and its slot of the new monitor table."""
    if len(fds) != 2:
        os._exit(1)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    env: dict[str, str] = request["env"]
    for name in set(request["given"]) - env.keys():
        os.environ.pop(name, None)
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    from ftrun.worker import client

    interrupt.handed(request.get("interrupts"))
    client.reattach()
    client.restartable()
    _phases.clear()
    phase("handed")


def phase(name: str) -> None:
    """A process restarted in place reached ``name`` ("handed": it has its attempt; "met": its peers, in
    init_process_group; "restored": ftrun.restore returned), written for ``ftrun report`` (wall clock). Nothing
    in a process that was not restarted in place."""
    path = os.environ.get(PHASES_ENV)
    if not path or (not _phases and name != "handed") or name in _phases:
        return
    _phases[name] = time.time()
    with contextlib.suppress(OSError), open(path, "w") as f:  # a failing log disk loses the note, nothing else
        json.dump(_phases, f)
