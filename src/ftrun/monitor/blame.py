"""PURE: which of the quiet ranks is the hung one, read from their Python stacks.

When one rank hangs, the others stop too, waiting for it inside a collective:
heartbeats alone cannot tell them apart. Their stacks can: a rank blocked in
torch.distributed (an all-reduce, a barrier, a ``wait()``) or in autograd's
backward (where DDP's all-reduce runs) is waiting for a peer; a rank anywhere
else is the suspect.
"""

from __future__ import annotations

from collections.abc import Mapping

# Where a waiting rank's stack is (py-spy prints "function (file:line)", faulthandler 'File "file", line N').
WAITING_IN = (
    "torch/distributed/",
    "torch/autograd/",
    "torch/nn/parallel/distributed.py",
    "torch/_tensor.py",  # Tensor.backward
)


def waiting_in_collective(stacks: str) -> str | None:
    """The frame that shows the rank waits for its peers (a collective or backward), or None."""
    for line in stacks.splitlines():
        if any(marker in line for marker in WAITING_IN):
            return line.strip()
    return None


def suspect(first: int, stacks: Mapping[int, str]) -> tuple[int, str]:
    """The rank to blame and why. ``first``: the rank whose deadline passed first; ``stacks``: every quiet
    rank's stacks (``first`` among them)."""
    waiting = {rank: waiting_in_collective(text) for rank, text in stacks.items()}
    free = sorted(rank for rank, where in waiting.items() if where is None)
    waiters = sorted(rank for rank, where in waiting.items() if where is not None)
    if waiting.get(first) is None:
        if waiters:
            return first, f"not in a collective while rank(s) {_list(waiters)} waited in one"
        return first, "the first to miss its deadline"
    if free:
        return free[0], f"not in a collective while rank(s) {_list(waiters)} waited in one (e.g. {waiting[first]})"
    return (
        first,
        "the first to miss its deadline (every quiet rank here waits in a collective: the hung one may be on "
        "another node)",
    )


def _list(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
