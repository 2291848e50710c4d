"""PURE: which of the quiet ranks is the hung one, read from their Python stacks.

When one rank hangs, the others stop too, waiting for it inside a collective:
heartbeats alone cannot tell them apart. Their stacks can, read where the rank is:
its main thread's innermost frames, past the standard library's plumbing (a lock's
wait, a queue's get). A rank whose innermost frame of its own is torch.distributed's
(an all-reduce, a barrier, a ``wait()``) or autograd's (backward, where DDP's
all-reduce runs) waits for a peer; a rank anywhere else is the suspect. Frames
further out never count: a decorator (torch's ``@record`` lives in
``torch/distributed/elastic``), a training framework's loop, a launcher's.

Both dumps are read: py-spy's (``function (file:line)``, threads named) and
faulthandler's (``File "file", line N in function``); innermost frame first in both.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping

# Where a waiting rank's innermost frame of its own is.
WAITING_IN = (
    "torch/distributed/",
    "torch/autograd/",
    "torch/nn/parallel/distributed.py",
    "torch/_tensor.py",  # Tensor.backward
)
NEVER_WAITING = ("torch/distributed/elastic/",)  # torch's @record and launcher: wrappers, not collectives

_PY_SPY_FRAME = re.compile(r"^\s+(?P<function>\S.*) \((?P<file>[^()]+):\d+\)\s*$")
_FAULTHANDLER_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line \d+ in (?P<function>.+)$')
_THREAD = re.compile(r"^(Thread|Current thread) ")
_STDLIB_PATH = re.compile(r"/lib/python3\.\d+/(?!.*(site|dist)-packages/)")


Frame = tuple[str, str]  # (the frame's file, the line that shows it)


def threads(stacks: str) -> list[tuple[str, list[Frame]]]:
    """Each thread of a dump: its header line and its frames, innermost first."""
    found: list[tuple[str, list[Frame]]] = []
    for line in stacks.splitlines():
        if _THREAD.match(line):
            found.append((line, []))
            continue
        frame = _PY_SPY_FRAME.match(line) or _FAULTHANDLER_FRAME.match(line)
        if frame and found:
            found[-1][1].append((frame["file"], line.strip()))
    return found


def main_thread(stacks: str) -> list[Frame] | None:
    """The frames of the thread that runs the script: py-spy names it; in faulthandler's dump it is the one
    that did not start in threading's bootstrap. None: not found (no dump, or one that cannot be read)."""
    dumped = threads(stacks)
    for header, frames in dumped:
        if '"MainThread"' in header:
            return frames
    for _, frames in dumped:
        if frames and not frames[-1][0].endswith("threading.py"):
            return frames
    return None


def waiting_in_collective(stacks: str) -> str | None:
    """The frame that shows the rank waits for its peers (a collective or backward), or None."""
    for file, line in main_thread(stacks) or ():
        if _plumbing(file):
            continue
        waits = any(m in file for m in WAITING_IN) and not any(m in file for m in NEVER_WAITING)
        return line if waits else None
    return None


def suspect(first: int, stacks: Mapping[int, str]) -> tuple[int, str]:
    """The rank to blame and why. ``first``: the rank whose deadline passed first; ``stacks``: every quiet
    rank's stacks (``first`` among them). When the stacks cannot tell, the reason says so."""
    unread = sorted(rank for rank, text in stacks.items() if main_thread(text) is None)
    waiting = {rank: waiting_in_collective(text) for rank, text in stacks.items() if rank not in unread}
    free = sorted(rank for rank, where in waiting.items() if where is None)
    waiters = sorted(rank for rank, where in waiting.items() if where is not None)
    if unread:
        return first, (
            f"the first to miss its deadline; the stacks cannot tell (none readable for rank(s) {_list(unread)})"
        )
    if len(free) == 1 and not waiters:
        return free[0], "the only rank found quiet here"
    if len(free) == 1:
        return free[0], f"not in a collective while rank(s) {_list(waiters)} waited in one (e.g. {waiting[waiters[0]]})"
    if free:
        return first if first in free else free[0], (
            f"the first to miss its deadline among rank(s) {_list(free)}, none of them in a collective: the "
            "stacks cannot tell which one the others wait for"
        )
    return first, (
        "the first to miss its deadline (every quiet rank here waits in a collective: the hung one may be on "
        "another node)"
    )


def _plumbing(file: str) -> bool:
    """A frame of the standard library (a lock, a queue, a selector): where a rank waits, not why."""
    if file.startswith("/"):
        return bool(_STDLIB_PATH.search(file))  # faulthandler: full paths
    top = file.split("/", maxsplit=1)[0].removesuffix(".py")  # py-spy: paths from sys.path entries, stdlib among them
    return top in sys.stdlib_module_names


def _list(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
