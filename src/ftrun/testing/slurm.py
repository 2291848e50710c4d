"""A real SLURM cluster on this machine, for tests: slurmctld, and one slurmd per node in a network namespace
of its own (:mod:`ftrun.testing.netns`) with its own address, hostname and ``/etc/hosts``; munge with a key and
socket of its own. ``srun -N2`` then really starts one task per node, each seeing its node as a real one.

Debian's ``slurm-wlm`` (22.05) and ``munge``; root (namespaces). ``available()`` says why not;
``close()`` stops every daemon it started and removes what it made.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from ftrun.testing.netns import Network, Node
from ftrun.testing.netns import available as netns_available

READY_S = 60.0
CONTROLLER = "ctl"


def available() -> str:
    """Why a SLURM cluster cannot be started here, or ""."""
    missing = [t for t in ("slurmctld", "slurmd", "srun", "munged", "unshare", "nsenter") if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install slurm-wlm munge util-linux)"
    return netns_available()


class SlurmCluster:
    def __init__(self, workdir: Path, nodes: int = 2, kill_wait_s: int = 5) -> None:
        """``kill_wait_s``: SLURM's KillWait, from the signal that ends a job to its SIGKILL."""
        self.dir = workdir
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self._kill_wait_s = kill_wait_s
        self._net = Network()
        self._daemons: list[subprocess.Popen[bytes]] = []
        self.conf = workdir / "slurm.conf"
        self.nodes: list[Node] = []

    @property
    def env(self) -> dict[str, str]:
        """The environment a SLURM command needs to talk to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> SlurmCluster:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._net.start()
        self.nodes = [self._net.add(name) for name in self.names]
        hosts = self.dir / "hosts"
        lines = [f"{n.addr} {n.name}" for n in self.nodes] + [f"{self._net.gateway} {CONTROLLER}"]
        hosts.write_text(Path("/etc/hosts").read_text() + "\n".join(lines) + "\n")
        self._munge()
        self.conf.write_text(self._config())
        (self.dir / "state").mkdir(exist_ok=True)
        self._spawn(["unshare", "--uts", "sh", "-c", f"hostname {CONTROLLER}; exec slurmctld -D -f {self.conf}"])
        for node in self.nodes:
            (self.dir / f"spool-{node.name}").mkdir(exist_ok=True)
            inside = (
                f"mount --bind {hosts} /etc/hosts; hostname {node.name}; exec slurmd -D -f {self.conf} -N {node.name}"
            )
            self._spawn(
                ["nsenter", f"--net=/run/netns/{node.netns}", "unshare", "--uts", "--mount", "sh", "-c", inside]
            )
        self._await_idle()
        return self

    def command(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A SLURM command (sinfo, squeue, scontrol, scancel, sbatch) against this cluster."""
        argv = (_which(argv[0]), *argv[1:])
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False)

    def srun(self, argv: Sequence[str], out: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """``srun ARGV`` started, its output (both streams) to ``out``; the caller waits for it."""
        with out.open("wb") as log:
            return subprocess.Popen([_which("srun"), *argv], env={**self.env, **(env or {})}, stdout=log, stderr=log)

    def kill_node(self, name: str) -> None:
        """SIGKILL a node's slurmd and everything running in its namespace (its tasks, their agents)."""
        node = next(n for n in self.nodes if n.name == name)
        pids = subprocess.run([_which("ip"), "netns", "pids", node.netns], capture_output=True, text=True, check=False)
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                continue

    def close(self) -> None:
        for proc in self._daemons:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
        for node in self.nodes:
            self.kill_node(node.name)
        self._net.close()

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # --- what start() does ---------------------------------------------------------------------------------

    def _munge(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        d = self.dir
        self._spawn([
            "munged", "--foreground", "--force", f"--socket={d / 'munge.sock'}", f"--key-file={key}",
            f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munge.seed'}",
        ])  # fmt: skip
        deadline = time.monotonic() + READY_S
        while not (d / "munge.sock").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"munged did not start: {(d / 'munged.log').read_text(errors='replace')}")
            time.sleep(0.05)

    def _config(self) -> str:
        d = self.dir
        nodes = "\n".join(f"NodeName={n.name} NodeAddr={n.addr} CPUs={os.cpu_count() or 1}" for n in self.nodes)
        port = 16000 + secrets.randbelow(4000)
        return f"""ClusterName=ftrun{secrets.token_hex(2)}
SlurmctldHost={CONTROLLER}({self._net.gateway})
SlurmctldPort={port}
SlurmdPort={port + 1}
AuthType=auth/munge
AuthInfo=socket={d / "munge.sock"}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d / "slurmctld.pid"}
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d / "slurmctld.log"}
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
KillWait={self._kill_wait_s}
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={",".join(self.names)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""

    def _spawn(self, argv: list[str]) -> None:
        with (self.dir / "daemons.log").open("ab") as log:
            self._daemons.append(subprocess.Popen([_which(argv[0]), *argv[1:]], stdout=log, stderr=log, env=self.env))

    def _await_idle(self) -> None:
        deadline = time.monotonic() + READY_S
        while True:
            states = self.command("sinfo", "-h", "-N", "-o", "%T").stdout.split()
            if len(states) == len(self.nodes) and all(s == "idle" for s in states):
                return
            if time.monotonic() > deadline or any(p.poll() is not None for p in self._daemons):
                logs = "\n".join(f.read_text(errors="replace")[-2000:] for f in sorted(self.dir.glob("*.log")))
                raise TimeoutError(f"the SLURM cluster did not come up (nodes {states}):\n{logs}")
            time.sleep(0.2)


def _which(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: {available()}")
    return found
