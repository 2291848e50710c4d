"""The memory cgroup the agent starts in (a container's limit, a SLURM job's): how much room it leaves, asked
once at start. Near its limit the kernel's OOM killer picks the biggest process in the cgroup: a worker, which
ftrun reports and restarts; ftrun refuses to start where not even the agent and a worker would fit.

cgroup v2 (``memory.max``, ``memory.current``) and v1 (``memory.limit_in_bytes``, ``memory.usage_in_bytes``);
every ancestor's limit applies too, so the tightest is taken.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from ftrun.errors import ConfigError

MIB = 1 << 20
AGENT_BYTES = 128 * MIB  # the agent, its warden and helpers, resident
WORKER_BYTES = 64 * MIB  # a Python worker before the job's imports: below that, nothing can run
TIGHT_BYTES_PER_WORKER = 1 << 30  # a job's worker with torch imported and a model: said, not refused
NO_LIMIT = 1 << 62  # v1 says "no limit" with a number near 2**63


def room(proc_self: Path = Path("/proc/self")) -> tuple[int, int] | None:
    """(the tightest limit, what its cgroup uses now) among the memory cgroups this process is in and their
    ancestors; None where no limit applies."""
    found: list[tuple[int, int]] = []
    for directory, limit_file, usage_file in _memory_dirs(proc_self):
        for level in (directory, *directory.parents):  # up to the hierarchy's root, the last with the files
            limit, usage = _number(level / limit_file), _number(level / usage_file)
            if limit is None or usage is None:
                break
            if limit < NO_LIMIT:
                found.append((limit, usage))
    return min(found, key=lambda f: f[0] - f[1]) if found else None


def check(workers: int) -> str:
    """Refuse at once, in one line, where the cgroup has no room for the agent and its workers; returns a line
    to say where it is tight ("" where it is not)."""
    found = room()
    if found is None:
        return ""
    limit, used = found
    left = limit - used
    if left < (need := AGENT_BYTES + WORKER_BYTES * workers):
        raise ConfigError(
            "the memory cgroup",
            f"its limit is {limit // MIB} MiB and {used // MIB} MiB are in use: {left // MIB} MiB left, and an "
            f"agent with {workers} workers needs {need // MIB} MiB at least",
            "raise the limit (the container's memory limit; memory.max; SLURM's --mem) or free memory in it",
        )
    if left < TIGHT_BYTES_PER_WORKER * workers:
        return (
            f"the memory cgroup leaves {left // MIB} MiB for {workers} workers (limit {limit // MIB} MiB): past it "
            "the kernel's OOM killer ends a worker, which ftrun reports and restarts"
        )
    return ""


def _memory_dirs(proc_self: Path) -> list[tuple[Path, str, str]]:
    """This process's memory cgroup directories, with their limit and usage files' names."""
    mounts: dict[str, tuple[str, Path]] = {}  # "v1" / "v2" -> (the mount's root in the hierarchy, mount point)
    with contextlib.suppress(OSError):
        for line in (proc_self / "mountinfo").read_text().splitlines():
            fields = line.split()
            fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
            if fstype == "cgroup2":
                mounts.setdefault("v2", (fields[3], Path(fields[4])))
            elif fstype == "cgroup" and "memory" in options:
                mounts.setdefault("v1", (fields[3], Path(fields[4])))
    found = []
    with contextlib.suppress(OSError):
        for line in (proc_self / "cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") else None
            if version is None or version not in mounts:
                continue
            root, point = mounts[version]
            inner = path.removeprefix(root if root != "/" else "").lstrip("/")
            if version == "v2":
                found.append((point / inner, "memory.max", "memory.current"))
            else:
                found.append((point / inner, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    return found


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return NO_LIMIT if text == "max" else int(text) if text.isdigit() else None
