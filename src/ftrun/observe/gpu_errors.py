"""CUDA and NCCL errors named from what a worker printed: the words a person needs in the root cause.

torch prints a CUDA error as ``CUDA error: <the runtime's words>`` wherever the process next synchronised (kernels
run asynchronously), an out-of-memory as the caching allocator's summary, and NCCL's failures from its watchdog
thread as ``WorkNCCL(SeqNum=.., OpType=..)`` lines. The lines this reads were recorded on an H200 (torch 2.11,
NCCL 2.28.9): tests/fixtures/gpu/h200. Pure: lines in, a :class:`GpuError` (or None) out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_PREFIX = re.compile(r"^\[rank\d+\]:\s?")  # torch's prefix on a rank's stderr ("[rank1]: ...")
_ASSERT = re.compile(r"([\w.]+\.cu(?:h)?:\d+): .*Assertion `(.*)` failed\.")
_CUDA_ERROR = re.compile(r"CUDA error: (.+?)\s*$")
_ASSERT_RAISED = re.compile(r"CUDA error: device-side assert triggered")
_NCCL_ERROR = re.compile(r"NCCL error: (.+?)(?:, NCCL version [\d.]+)?\s*$")
_SIZE = r"([\d.]+ \w?i?B)"
_OOM = re.compile(
    rf"CUDA out of memory\. Tried to allocate {_SIZE}\. GPU (\d+) has a total capacity of {_SIZE} of which {_SIZE}"
)
_OOM_HELD = re.compile(rf"this process has {_SIZE} memory in use")
_OOM_RESERVED = re.compile(rf"and {_SIZE} is reserved by PyTorch but unallocated")
_WORK = re.compile(r"WorkNCCL\(SeqNum=(\d+), OpType=(\w+), NumelIn=(\d+)")
_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout: .*Timeout\(ms\)=(\d+)\) ran for (\d+) millisec")
_PEER = re.compile(r"(?:Connection closed by remote peer|connect to) ?([^\s,]*)")
# CUDA errors after which the device itself is in doubt, not only this process's context
_DEVICE_BROKEN = ("uncorrectable ECC error", "fallen off the bus", "unspecified launch failure", "busy or unavailable")
BLOCKING = "rerun with CUDA_LAUNCH_BLOCKING=1 to stop at the kernel that failed"
ASYNC_HINT = f"CUDA reports a kernel's error at the next synchronisation, so the stack may point past it: {BLOCKING}"


@dataclass(frozen=True, slots=True)
class GpuError:
    kind: str  # device-assert, illegal-address, out-of-memory, cuda, nccl-timeout, nccl-remote, nccl
    what: str  # one line for the root cause
    hint: str | None = None
    device_broken: bool = False  # the GPU may be unusable: keep it out of the next round
    line: int = -1  # where in the lines it was found (the traceback that holds it is the one to show)


def diagnose(lines: Sequence[str]) -> GpuError | None:
    """The CUDA or NCCL error these lines of a worker's stderr show, the one that ended it; None if none."""
    text = [_PREFIX.sub("", line) for line in lines]
    for find in (_assert, _oom, _cuda, _nccl_timeout, _nccl_error):
        found = find(text)
        if found is not None:
            return found
    return None


def _first(text: Sequence[str], pattern: re.Pattern[str]) -> tuple[int, re.Match[str]] | None:
    for i, line in enumerate(text):
        m = pattern.search(line)
        if m:
            return i, m
    return None


def _assert(text: Sequence[str]) -> GpuError | None:
    found = _first(text, _ASSERT)
    raised = _first(text, _ASSERT_RAISED)
    at = raised or found
    if at is None:
        return None
    where = f" at {found[1].group(1).rsplit('/', 1)[-1]}: {found[1].group(2)}" if found else ""
    return GpuError("device-assert", f"a device-side assert in a CUDA kernel{where}", ASYNC_HINT, line=at[0])


def _oom(text: Sequence[str]) -> GpuError | None:
    found = _first(text, _OOM)
    if found is None:
        return None
    i, m = found
    asked, gpu, total, free = m.groups()
    held = _OOM_HELD.search(text[i])
    reserved = _OOM_RESERVED.search(text[i])
    what = f"CUDA out of memory on GPU {gpu}: asked for {asked} with {free} free of {total}"
    what += f" (this process held {held.group(1)})" if held else ""
    hint = None
    if reserved and _gib(reserved.group(1)) >= 1.0:
        hint = f"{reserved.group(1)} was reserved but unallocated: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    return GpuError("out-of-memory", what, hint, line=i)


def _cuda(text: Sequence[str]) -> GpuError | None:
    found = _first(text, _CUDA_ERROR)
    if found is None:
        return None
    i, m = found
    words = m.group(1)
    broken = any(b in words for b in _DEVICE_BROKEN)
    if "illegal memory access" in words:
        return GpuError("illegal-address", "an illegal memory access in a CUDA kernel", ASYNC_HINT, line=i)
    hint = "the GPU may be unusable: check nvidia-smi and the kernel log (Xid)" if broken else ASYNC_HINT
    return GpuError("cuda", f"CUDA error: {words}", hint, device_broken=broken, line=i)


def _nccl_timeout(text: Sequence[str]) -> GpuError | None:
    found = _first(text, _TIMEOUT)
    if found is None:
        return None
    i, m = found
    op = _work(text[i])
    limit_ms, ran_ms = int(m.group(1)), int(m.group(2))
    what = f"NCCL's watchdog timed out {op}: it ran {ran_ms / 1000:.1f} s"
    what += f", past the process group's timeout of {limit_ms / 1000:g} s"
    return GpuError("nccl-timeout", what, "a peer never entered it or never finished it: see its rank", line=i)


def _nccl_error(text: Sequence[str]) -> GpuError | None:
    found = _first(text, _NCCL_ERROR)
    if found is None:
        return None
    i, m = found
    op = _work(text[i])
    during = f" in {op}" if op else ""
    if "remote process exited" in m.group(1) or "ncclRemoteError" in " ".join(text[i : i + 3]):
        peer = next((p.group(1) for line in text[i : i + 6] if (p := _PEER.search(line)) and p.group(1)), "")
        who = f" ({peer})" if peer else ""
        what = f"NCCL remote error{during}: a peer{who} closed its connection: its process exited or the network failed"
        return GpuError("nccl-remote", what, line=i)
    return GpuError("nccl", f"NCCL error{during}: {m.group(1)}", line=i)


def _work(line: str) -> str:
    m = _WORK.search(line)
    return f"{m.group(2)} #{m.group(1)} ({m.group(3)} elements)" if m else ""


def _gib(size: str) -> float:
    number, unit = size.split()
    return float(number) * {"B": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0, "TiB": 1024.0}.get(unit, 0.0)
