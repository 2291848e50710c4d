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
from tests.integration.harness import WAIT_S

pytestmark = [
    pytest.mark.torch,
    pytest.mark.xdist_group("slurm"),  # under xdist, one cluster for the module on one process
    pytest.mark.skipif(bool(available()), reason=available() or ""),
]

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


def test_a_node_slurm_loses_is_a_lost_node_and_the_other_trains_on(tmp_path: Path) -> None:
    """`srun --no-kill` keeps the step when a node fails; ftrun takes the rendezvous from SLURM and the node
    range from --nnodes. n2's slurmd, agent and workers are SIGKILLed at step 5: n1 (the store's host) goes on
    alone and finishes. A cluster of its own: the others' keeps both nodes."""
    with SlurmCluster(tmp_path / "cluster") as slurm:
        lose_a_node(slurm, tmp_path)


def lose_a_node(slurm: SlurmCluster, tmp_path: Path) -> None:
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
        # both ranks' lines, not the first one printed: srun relays each worker's output on its own
        while len(re.findall(r"^n1 rank \d checksum", out.read_text(errors="replace"), re.M)) < 2:
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


PREEMPTIBLE = """
import hashlib, os, signal, socket, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(True))  # the job's own checkpoint-on-signal code
signal.signal(signal.SIGUSR1, lambda *_: print(f"rank {os.environ['RANK']} got SIGUSR1", flush=True))
rank, requeued = int(os.environ["RANK"]), int(os.environ.get("SLURM_RESTART_COUNT", "0"))
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
if Path("ckpt.pt").exists():
    saved = torch.load("ckpt.pt")
    model.module.load_state_dict(saved["model"]), opt.load_state_dict(saved["opt"])
    start = saved["step"] + 1
    restarts = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"rank {rank} resumed at step {start} (requeued {requeued}, restart {restarts})", flush=True)
for step in range(start, 40):
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(2 * step + rank))
    opt.zero_grad()
    model(data).sum().backward()
    opt.step()
    if sys.argv[1] == "preempt" and requeued == 0 and step >= 10:
        Path(f"at10-{rank}").touch()
        time.sleep(0.3)
    if stop:
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, "ckpt.tmp")
            os.replace("ckpt.tmp", "ckpt.pt")
            print(f"rank 0 saved step {step} on SIGTERM", flush=True)
        sys.exit(0)
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print(socket.gethostname(), "rank", rank, "checksum", hashlib.sha256(weights).hexdigest()[:16], flush=True)
"""


def sbatch(slurm: SlurmCluster, workdir: Path, how: str) -> str:
    """The job submitted as a requeueable batch job of 2 nodes, its output appended to ``workdir/out``."""
    workdir.mkdir()
    (workdir / "job.py").write_text(PREEMPTIBLE)
    script = workdir / "job.sh"
    ftrun = f"python3 -m ftrun --log-dir {workdir / 'logs'} --nproc-per-node 2 job.py {how}"
    script.write_text(f"#!/bin/sh\nsrun --ntasks-per-node=1 {ftrun}\n")
    flags = ["--parsable", "-N2", "--requeue", "--open-mode=append", f"--chdir={workdir}", f"--output={workdir}/out"]
    submitted = slurm.command("sbatch", *flags, str(script))
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def finished(slurm: SlurmCluster, job: str, workdir: Path) -> str:
    """The job's output once SLURM no longer lists it."""
    deadline = time.monotonic() + 6 * WAIT_S
    while slurm.command("squeue", "-h", "-j", job).stdout.strip():
        assert time.monotonic() < deadline, (workdir / "out").read_text(errors="replace")
        time.sleep(0.5)
    return (workdir / "out").read_text(errors="replace")


@pytest.mark.slow
@pytest.mark.alone  # the job's ranks finish their step between SIGTERM and KillWait (5 s): others' load breaks it
def test_preempted_and_requeued_the_job_checkpoints_on_sigterm_and_resumes_with_nothing_lost(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """SLURM's warning first (`scancel --signal=USR1`, as --signal=USR1@90 sends it): every worker gets it
    from SLURM, once, and the run goes on. Then `scontrol requeue`, what pre-emption with PreemptMode=REQUEUE
    does: SIGTERM to the step, KillWait, SIGKILL, the job back in the queue, run again with the same job id.
    The workers get the SIGTERM, rank 0 saves, ftrun exits within KillWait; the requeued run resumes from the
    checkpoint and ends with the weights of a run that was never pre-empted."""
    job = sbatch(slurm, tmp_path / "preempted", "preempt")
    deadline = time.monotonic() + 4 * WAIT_S
    while len(list((tmp_path / "preempted").glob("at10-*"))) < 4:
        assert time.monotonic() < deadline, (tmp_path / "preempted" / "out").read_text(errors="replace")
        time.sleep(0.1)
    warned = slurm.command("scancel", "--signal=USR1", job)  # what --signal=USR1@90 sends before the limit
    assert warned.returncode == 0, warned.stderr
    while (tmp_path / "preempted" / "out").read_text(errors="replace").count("got SIGUSR1") < 4:
        assert time.monotonic() < deadline, (tmp_path / "preempted" / "out").read_text(errors="replace")
        time.sleep(0.1)
    requeued = slurm.command("scontrol", "requeue", job)
    assert requeued.returncode == 0, requeued.stderr
    while "PENDING" not in slurm.command("squeue", "-h", "-o", "%T", "-j", job).stdout:
        assert time.monotonic() < deadline, (tmp_path / "preempted" / "out").read_text(errors="replace")
        time.sleep(0.2)
    slurm.command("scontrol", "update", f"JobId={job}", "StartTime=now")  # SLURM delays a requeued job's start
    out = finished(slurm, job, tmp_path / "preempted")
    assert out.count("SIGUSR1 from SLURM: a warning every process of the step got; the run goes on") == 2, out
    assert out.count("got SIGUSR1") == 4, out  # once each, from SLURM: ftrun did not hand it on again
    saved = re.findall(r"rank 0 saved step (\d+) on SIGTERM", out)
    assert len(saved) == 1, out
    assert sorted(re.findall(r"rank (\d) resumed at step (\d+) \(requeued 1, restart 1\)", out)) == [
        (str(r), str(int(saved[0]) + 1)) for r in range(4)
    ], out
    assert out.count("run interrupted (exit 143)") == 2, out  # each node's ftrun ended within KillWait, not killed
    assert out.count("(one each time SLURM requeued the job: 1)") == 2, out  # each node's summary: both starts
    for events in (tmp_path / "preempted" / "logs").glob("*/events.jsonl"):  # one run directory per node
        kinds = [json.loads(line)["kind"] for line in events.read_text().splitlines()]
        assert kinds.count("run_started") == 2, kinds
        assert (events.parent / "attempt_0").is_dir()
        assert (events.parent / "attempt_1").is_dir()
    assert len(list((tmp_path / "preempted" / "logs").glob("*/events.jsonl"))) == 2
    preempted = sorted(re.findall(r"^n\d rank (\d) checksum (\w+)$", out, re.M))
    never = finished(slurm, sbatch(slurm, tmp_path / "never", "none"), tmp_path / "never")
    assert preempted == sorted(re.findall(r"^n\d rank (\d) checksum (\w+)$", never, re.M)), (out, never)
    assert len(preempted) == 4
