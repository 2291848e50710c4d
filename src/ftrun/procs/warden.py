"""Nothing outlives the agent, even a SIGKILL of it: the warden, a small process outside the agent's tree.

While the agent lives it ends its workers' trees itself (process groups, strays
found below it as their subreaper). A SIGKILL gives it no chance: the workers
get their parent-death signal, but a descendant that left for its own session
(a data loader's server, a ``subprocess`` started with ``start_new_session``) is
re-parented to init and lives on, holding GPUs, ports and files.

So the agent starts a warden at once, in a session of its own, holding the read
end of a pipe whose write end only the agent has. When the pipe ends without a
goodbye (the agent died), the warden kills everything the agent left:

- **cgroup** where the machine allows one (cgroup v2, writable: root, or a
  delegated subtree): the agent moves itself into a new cgroup after starting
  the warden, so every process it starts from then on, and theirs, however they
  detach, is in it; the warden kills the cgroup (``cgroup.kill``) and removes it.
- **tree** elsewhere: the warden reads the agent's tree of descendants every
  ``TREE_READ_EVERY_S`` and kills what it last saw (checking each process's start time, so
  a reused pid is never hit), and every process whose environment still names
  the agent (``FTRUN_AGENT_PID``, which every worker has and its children
  inherit); only a process started in the last ``TREE_READ_EVERY_S`` that also cleared its
  environment may escape.

It also frees what the agent kept in memory that outlives processes: its snapshot directories in shared memory
(``AGENT-*`` under the directory it was given), which would otherwise hold RAM until the next agent starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ftrun.procs import proctree
from ftrun.worker.readable import wait_readable

TREE_READ_EVERY_S = 0.5  # tree mode: how often the agent's descendants are read
AGENT_EXIT_WAIT_S = 10.0  # a goodbye comes just before the agent exits: its own exit is awaited first
EMPTY_WAIT_S = 5.0  # for a killed cgroup to empty
GOODBYE = b"bye"
MODE_ENV = "FTRUN_CONTAINMENT"  # "tree" forces the fallback (for tests); else a cgroup where possible


class Warden:
    """The agent's side: start it first thing; :meth:`close` at the very end (the agent's own ending)."""

    @classmethod
    def start(cls, memory: Path | None = None) -> Warden:
        """The warden process started, guarding this process from now on (in a cgroup of its own where it can);
        ``memory``: where this agent's directories in shared memory are (``<pid>-*``), freed should it die."""
        agent = os.getpid()
        cgroup = None if os.environ.get(MODE_ENV) == "tree" else _new_cgroup(agent)
        if cgroup is not None:
            try:
                (cgroup / "cgroup.procs").write_text(str(agent))  # everything the agent starts from now on is in it
            except OSError:
                with contextlib.suppress(OSError):
                    cgroup.rmdir()
                cgroup = None
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftrun.procs.warden", str(agent), str(cgroup or ""), str(memory or "")],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a signal to the agent's process group does not reach it
        )  # it moves itself out of the cgroup first thing (it must outlive what it kills)
        # It forks and this process exits (reaped with the agent's other exited children, or at close); the
        # warden lives on in the process group this one leads. Re-parented to init, or to the agent once it is
        # a subreaper: its process group is given to the spawners as never stray (``group``). Not waited for: the
        # job's start does not wait.
        return cls(proc, cgroup)

    def __init__(self, proc: subprocess.Popen[bytes], cgroup: Path | None) -> None:
        """Use :meth:`start`."""
        self._proc = proc
        self.cgroup = cgroup
        self.group = proc.pid  # the process group the warden lives in (it leads it): never a stray

    def close(self) -> None:
        """The agent is about to exit, its workers ended: the warden removes the cgroup and exits too."""
        assert self._proc.stdin is not None
        if self.cgroup is not None:  # leave it, so that the warden may remove it
            with contextlib.suppress(OSError):
                (self.cgroup.parent / "cgroup.procs").write_text(str(os.getpid()))
        with contextlib.suppress(OSError):
            self._proc.stdin.write(GOODBYE)
            self._proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired, ChildProcessError):
            self._proc.wait(EMPTY_WAIT_S)  # the intermediate process, long gone (if the sweep has not reaped it)


def _new_cgroup(agent: int) -> Path | None:
    """A new cgroup v2 below the agent's own, or None where the machine does not allow one."""
    mount = _cgroup2_mount()
    try:
        own = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    except (OSError, StopIteration):
        return None
    if mount is None:
        return None
    parent = mount / own.lstrip("/")
    for stale in parent.glob("ftrun-*"):  # left by a warden that was itself killed: removable once empty
        with contextlib.suppress(OSError, ValueError):
            if proctree.started(int(stale.name.split("-", 1)[1])) is None:
                stale.rmdir()
    path = parent / f"ftrun-{agent}"
    try:
        path.mkdir()
    except OSError:
        return None
    return path


def _cgroup2_mount() -> Path | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] == "cgroup2":
                return Path(left.split()[4])
    return None


# --- the warden process ----------------------------------------------------------------------------


def main(agent: int, cgroup: str, memory: str = "") -> None:
    if os.fork():  # not the agent's child: never one of the strays it sweeps, nor in the tree it leaves
        os._exit(0)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)  # a Ctrl-C in the terminal reaches the agent, not the warden
    if cgroup:  # started from inside it: out, to the agent's former cgroup
        try:
            (Path(cgroup).parent / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            cgroup = ""  # it would kill itself with the rest: the tree it is, then
    seen: dict[int, int] = {}
    said = b""
    while True:
        if wait_readable(0, TREE_READ_EVERY_S):
            chunk = os.read(0, 64)
            if not chunk:
                break
            said += chunk
        elif not cgroup:
            seen = _descendants(agent) or seen
    _await_exit(agent)
    killed = _kill_cgroup(Path(cgroup)) if cgroup else _kill_seen(seen, agent)
    freed = _free(Path(memory), agent) if memory and said != GOODBYE else 0
    if (killed or freed) and said != GOODBYE:
        also = f" and freed {freed / (1 << 20):.0f} MiB of its snapshots" if freed else ""
        said_here = f"ftrun: the agent (pid {agent}) was killed; its warden ended the {killed} process(es) it left"
        os.write(2, f"{said_here}{also}\n".encode())


def _free(memory: Path, agent: int) -> int:
    """Remove the dead agent's directories under ``memory`` (named ``<agent pid>-...``); the bytes freed."""
    freed = 0
    for found in memory.glob(f"{agent}-*"):
        for f in found.rglob("*"):
            with contextlib.suppress(OSError):
                freed += f.lstat().st_size if f.is_file() else 0
        shutil.rmtree(found, ignore_errors=True)
    return freed


def _descendants(agent: int) -> dict[int, int]:
    """pid -> start time of every process below the agent now."""
    found = {pid: proctree.started(pid) for pid in proctree.descendants([agent]) if pid != os.getpid()}
    return {pid: t for pid, t in found.items() if t is not None}


def _await_exit(agent: int) -> None:
    with contextlib.suppress(OSError):
        fd = os.pidfd_open(agent)
        try:
            wait_readable(fd, AGENT_EXIT_WAIT_S)  # readable once it exited
        finally:
            os.close(fd)


def _kill_cgroup(path: Path) -> int:
    procs = path / "cgroup.procs"
    left = _pids(procs)
    if left:
        try:
            (path / "cgroup.kill").write_text("1")
        except OSError:  # before Linux 5.14: one by one, until none is left
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
    deadline = EMPTY_WAIT_S
    while _pids(procs) and deadline > 0:
        time.sleep(0.05)
        deadline -= 0.05
    with contextlib.suppress(OSError):
        path.rmdir()
    return len(left)


def _pids(procs: Path) -> list[int]:
    try:
        return [int(line) for line in procs.read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_seen(seen: dict[int, int], agent: int) -> int:
    """Each process last seen below the agent that is still the same process, each process whose environment
    names the agent, and everything below them now."""
    alive = [pid for pid, t in seen.items() if proctree.started(pid) == t]  # a reused pid is another's process
    roots = {*alive, *_marked(agent)} - {os.getpid()}
    victims = roots | proctree.descendants(roots)
    for pid in victims:
        proctree.signal_quietly(pid, signal.SIGKILL)
    return len(victims)


def _marked(agent: int) -> set[int]:
    """The processes whose environment carries the agent's pid as the workers' FTRUN_AGENT_PID."""
    mark = f"\0FTRUN_AGENT_PID={agent}\0".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
                if mark in b"\0" + f.read():
                    found.add(int(entry))
    return found


if __name__ == "__main__":
    main(int(sys.argv[1]), *sys.argv[2:4])
