"""Is this node fit to train? The health checks ``--health-check`` names, run by the agent before the node joins
a round and every ``--health-check-interval`` while it trains.

A check is a shell command (healthy when it exits 0; its output goes into the report) or a built-in:

- ``builtin:gpu``: every NVIDIA GPU answers NVML (``nvidia-ml-py``) with no uncorrectable ECC error since the
  driver loaded and no retired page waiting for a reset; nothing to check (healthy) where there is no NVIDIA
  driver or no ``nvidia-ml-py``.
- ``builtin:nic[=IF,...]``: the named network interfaces (by default every one backed by a device: not
  loopback, bridges or veths) have their link up, from sysfs.
- ``builtin:writable=DIR``: a file can be written, synced, read back and removed in DIR (the checkpoints').
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftrun.errors import ConfigError

BUILTIN = "builtin:"
TIMEOUT_S = 120.0  # a check that takes longer has failed
MAX_OUTPUT_CHARS = 4000  # of a command's output, kept for the report (its end)
SYSFS_NET = Path("/sys/class/net")
DOWN = {"down", "lowerlayerdown", "notpresent", "dormant"}  # "unknown": drivers that do not report it


@dataclass(frozen=True, slots=True)
class Verdict:
    check: str
    healthy: bool
    output: str  # what the check said (the end of a command's output)
    seconds: float
    ended: str = ""  # how a command that failed ended: "exit 3", "killed by signal 9", "no answer within 120 s"

    def describe(self) -> str:
        """One line: the check, whether it passed, and the last thing it said (or how it ended)."""
        lines = [line.strip() for line in self.output.splitlines() if line.strip()]
        said = lines[-1] if lines else self.ended
        return f"health check {self.check!r} {'passed' if self.healthy else 'failed'}" + (f": {said}" if said else "")


def check_spec(check: str) -> None:
    """Raise ConfigError if ``check`` names a built-in that does not exist, or lacks its argument."""
    if not check.startswith(BUILTIN):
        return
    name, _, arg = check[len(BUILTIN) :].partition("=")
    if name not in BUILTINS:
        raise ConfigError("--health-check", f"no built-in check {name!r}", f"use one of {', '.join(BUILTINS)}")
    if name == "writable" and not arg:
        raise ConfigError("--health-check", "builtin:writable needs a directory", "pass builtin:writable=/ckpt")


def run_check(check: str, timeout_s: float = TIMEOUT_S, env: Mapping[str, str] | None = None) -> Verdict:
    """Run one check now (blocking, at most ``timeout_s``)."""
    started = time.monotonic()
    ended = ""
    if check.startswith(BUILTIN):
        name, _, arg = check[len(BUILTIN) :].partition("=")
        try:
            healthy, output = BUILTINS[name](arg)
        except Exception as e:  # a check that breaks says the node is not known to be healthy
            healthy, output = False, f"the check itself failed: {e!r}"
    else:
        output, ended = _command(check, timeout_s, env)
        healthy = not ended
    return Verdict(check, healthy, output[-MAX_OUTPUT_CHARS:], time.monotonic() - started, ended)


def _command(command: str, timeout_s: float, env: Mapping[str, str] | None) -> tuple[str, str]:
    """Its output, and how it failed ("" if it exited 0)."""
    # A shell command, in its own process group (killed whole on timeout), stdin closed.
    with subprocess.Popen(  # noqa: S602 (the user's own command line, as --health-check gave it)
        command, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, env=None if env is None else dict(env),
    ) as p:  # fmt: skip
        try:
            out, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            return out.decode(errors="replace"), f"no answer within {timeout_s:g} s"
    text = out.decode(errors="replace")
    if p.returncode:
        return text, f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}"
    return text, ""


def gpus(_: str, nvml: Any = None) -> tuple[bool, str]:
    """NVML's view of every GPU (``nvml``: the ``pynvml`` module, for tests)."""
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")  # nvidia-ml-py
        except ImportError:
            return True, "nothing checked: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        return True, f"nothing checked: no NVIDIA driver ({e})"
    try:
        sick = []
        count = nvml.nvmlDeviceGetCount()
        for i in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                nvml.nvmlDeviceGetMemoryInfo(handle)  # a GPU fallen off the bus fails here
            except nvml.NVMLError as e:
                sick.append(f"GPU {i} does not answer: {e}")
                continue
            uncorrected = (nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)
            ecc = _supported(nvml, nvml.nvmlDeviceGetTotalEccErrors, handle, *uncorrected)
            if ecc:
                sick.append(f"GPU {i} has {ecc} uncorrectable ECC error(s) since the driver loaded")
            pending = _supported(nvml, nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
            if pending:
                sick.append(f"GPU {i} has retired pages pending: it needs a reset")
        return not sick, "; ".join(sick) or f"{count} GPU(s) healthy"
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _supported(nvml: Any, query: Callable[..., Any], *args: Any) -> Any:
    """A query's answer, or None where the GPU does not support it."""
    try:
        return query(*args)
    except nvml.NVMLError as e:
        if getattr(e, "value", None) == nvml.NVML_ERROR_NOT_SUPPORTED:
            return None
        raise


def nic_links(names: str, root: Path = SYSFS_NET) -> tuple[bool, str]:
    """The links of ``names`` (comma separated; "": every interface backed by a device) are up."""
    wanted = [n for n in names.split(",") if n] or sorted(p.name for p in root.iterdir() if (p / "device").exists())
    if not wanted:
        return True, "nothing checked: no network interface backed by a device"
    down = []
    for name in wanted:
        try:
            state = (root / name / "operstate").read_text().strip()
        except OSError:
            down.append(f"{name}: no such interface")
            continue
        if state in DOWN:
            down.append(f"{name}: link {state}")
    return not down, "; ".join(down) or f"link up: {', '.join(wanted)}"


def writable(directory: str) -> tuple[bool, str]:
    """A small file written, synced, read back and removed in ``directory``."""
    probe = Path(directory) / f".ftrun-health-{os.getpid()}"
    data = os.urandom(4096)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        same = probe.read_bytes() == data
    except OSError as e:
        return False, f"cannot write in {directory}: {e.strerror or e}"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return same, f"{directory} is writable" if same else f"{directory} gave back other bytes than were written"


BUILTINS: dict[str, Callable[[str], tuple[bool, str]]] = {"gpu": gpus, "nic": nic_links, "writable": writable}
