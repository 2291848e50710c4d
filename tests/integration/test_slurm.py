"""ftrun where SLURM starts it: `srun -N2 ftrun ...` on a real SLURM cluster of this machine (slurmctld, and a
slurmd per node in a network namespace of its own, with its own address and hostname)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftrun.testing.slurm import SlurmCluster, available
from tests.integration.conftest import WAIT_S

pytestmark = [pytest.mark.torch, pytest.mark.skipif(bool(available()), reason=available() or "")]

JOB = """
import hashlib, os, socket, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(20):
    if sys.argv[1] == "crash" and attempt == 0 and rank == 3 and step == 5:
        os._exit(7)
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(2 * step + rank))
    opt.zero_grad()
    model(data).sum().backward()
    opt.step()
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print(socket.gethostname(), "rank", rank, "checksum", hashlib.sha256(weights).hexdigest()[:16], flush=True)
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with SlurmCluster(tmp_path_factory.mktemp("slurm") / "cluster") as cluster:
        yield cluster


def srun_ftrun(slurm: SlurmCluster, tmp_path: Path, *ftrun: str) -> tuple[int, str]:
    (tmp_path / "job.py").write_text(JOB)
    out = tmp_path / "srun.out"
    argv = ["-N2", "--ntasks-per-node=1", "--chdir", str(tmp_path), "python3", "-m", "ftrun"]
    proc = slurm.srun([*argv, "--log-dir", str(tmp_path / "logs"), "--nproc-per-node", "2", *ftrun], out)
    try:
        code = proc.wait(4 * WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, out.read_text(errors="replace")


def test_srun_trains_on_two_nodes_with_no_rendezvous_flag(slurm: SlurmCluster, tmp_path: Path) -> None:
    code, out = srun_ftrun(slurm, tmp_path, "job.py", "none")
    assert code == 0, out
    said = re.findall(r"SLURM job (\d+): 2 node\(s\) \(SLURM_STEP_NUM_NODES\), this one number (\d)", out)
    assert sorted(n for _, n in said) == ["0", "1"], out
    lines = re.findall(r"^(n\d) rank (\d) checksum (\w+)$", out, re.M)
    assert sorted(int(rank) for _, rank, _ in lines) == [0, 1, 2, 3], out
    assert {host for host, _, _ in lines} == {"n1", "n2"}  # one agent per node, on the nodes SLURM chose
    assert len({checksum for _, _, checksum in lines}) == 1


def test_a_worker_crash_under_srun_restarts_every_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    code, out = srun_ftrun(slurm, tmp_path, "--max-restarts", "1", "job.py", "crash")
    assert code == 0, out
    assert "ROOT CAUSE  rank 3" in out
    spawned = [
        json.loads(line) for f in (tmp_path / "logs").glob("*/events.jsonl") for line in f.read_text().splitlines()
    ]
    restarted = [e for e in spawned if e["kind"] == "worker_spawned" and e["attempt"] == 1]
    assert len(restarted) == 4
    assert len(re.findall(r"^n\d rank \d checksum", out, re.M)) == 4


def test_a_node_slurm_loses_is_a_lost_node_and_the_other_trains_on(slurm: SlurmCluster, tmp_path: Path) -> None:
    """`srun --no-kill` keeps the step when a node fails; ftrun takes the rendezvous from SLURM and the node
    range from --nnodes. n2's slurmd, agent and workers are SIGKILLed at step 5: n1 (the store's host) goes on
    alone and finishes."""
    (tmp_path / "job.py").write_text(JOB.replace("time\n", "time\nfrom pathlib import Path\n", 1).replace(
        "    data = torch.randn", "    if attempt == 0 and step == 5:\n"
        "        Path(f'at5-{rank}').touch()\n        time.sleep(600)\n    data = torch.randn", 1))  # fmt: skip
    out = tmp_path / "srun.out"
    argv = ["-N2", "--ntasks-per-node=1", "--no-kill", "--chdir", str(tmp_path), "python3", "-m", "ftrun"]
    flags = ["--log-dir", str(tmp_path / "logs"), "--nproc-per-node", "2", "--nnodes", "1:2", "--max-restarts", "2"]
    proc = slurm.srun([*argv, *flags, "job.py", "none"], out)
    try:
        deadline = time.monotonic() + 4 * WAIT_S
        while len(list(tmp_path.glob("at5-*"))) < 4:  # every rank at step 5 of the first attempt
            assert proc.poll() is None, out.read_text(errors="replace")
            assert time.monotonic() < deadline, out.read_text(errors="replace")
            time.sleep(0.1)
        slurm.kill_node("n2")
        while not re.search(r"^n1 rank 1 checksum", out.read_text(errors="replace"), re.M):
            assert time.monotonic() < deadline, out.read_text(errors="replace")
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        slurm.command("scancel", "--user", "root")
    text = out.read_text(errors="replace")
    assert sorted(re.findall(r"^n1 rank (\d) checksum", text, re.M)) == ["0", "1"], text  # alone: ranks 0-1
    assert "n2 rank" not in text
