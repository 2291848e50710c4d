"""The README's code blocks as users copy them: each runs inside a job, under ftrun, with a failure."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import ftrun_argv, run_ftrun

pytestmark = pytest.mark.torch

README = Path(__file__).resolve().parents[2] / "README.md"

# What the DCP block assumes around it: a DDP model, its optimizer, a checkpoint directory, the steps, a step.
AROUND_DCP = """
import hashlib, os, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch import nn
import ftrun

dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
ckpt_dir, steps = sys.argv[1], 12

def train_step(step):
    if attempt == 0 and rank == 1 and step == int(os.environ.get("CRASH_AT", -1)):
        os._exit(3)
    g = torch.Generator().manual_seed(step * 10 + rank)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)).backward()
    optimizer.step()

{block}
print(f"rank {{rank}} started at {{start}}", flush=True)
digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in model.module.state_dict().values()))
print("checksum", digest.hexdigest()[:16], flush=True)
dist.destroy_process_group()
"""


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


@pytest.mark.slow
def test_the_readmes_dcp_block_restores_the_step_ftrun_names_with_the_momentum(tmp_path: Path) -> None:
    [block] = [b for b in python_blocks() if "SnapshotWriter" in b]
    (tmp_path / "job.py").write_text(AROUND_DCP.format(block=block))
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "job.py", str(tmp_path / "ckpt"),
                  env={"CRASH_AT": "7"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert re.search(r"the workers restore the snapshot of step [56]\b", r.stderr), r.stderr
    root = r.report(0)["root_cause"]  # the first start found nothing to load, and trained until the crash
    assert isinstance(root, dict)
    assert root["rank"] == 1, root
    assert "exit code 3" in r.stderr
    for tries in ("clean", "again"):  # the reference, under torchrun; its gloo teardown aborted twice on a
        # loaded machine ("terminate called without an active exception", SIGABRT), which is not what this checks
        (tmp_path / tries).mkdir()
        clean = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(tmp_path / "job.py"), str(tmp_path / tries / "ckpt")],
            cwd=tmp_path / tries, capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        if clean.returncode == 0:
            break
    assert clean.returncode == 0, clean.stderr[-8000:]
    # torchrun's workers write to one stdout as they please: a rank's line may end after another's begins
    restored = re.findall(r"checksum ([0-9a-f]{16})", r.log(1, 0))
    assert restored == re.findall(r"checksum ([0-9a-f]{16})", clean.stdout)[:1] != [], (restored, clean.stdout)


# What the in-place block assumes around it: a model to build, the steps, a step.
AROUND_IN_PLACE = """
import copy, hashlib, os
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import ftrun

rank, steps, said = int(os.environ["RANK"]), 30, set()

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

def train_step(model, opt, step):
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt not in said:  # each attempt's first step
        said.add(attempt)
        print(f"rank {{rank}} attempt {{attempt}} pid {{os.getpid()}}", flush=True)
    if attempt == 0 and rank == 1 and step == int(os.environ.get("CRASH_AT", -1)):
        os._exit(3)
    g = torch.Generator().manual_seed(step * 10 + rank)
    opt.zero_grad()
    nn.functional.mse_loss(model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)).backward()
    opt.step()

{block}
digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in net.state_dict().values()))
print("checksum", digest.hexdigest()[:16], flush=True)
"""


def test_the_readmes_in_place_block_keeps_the_survivors_process_and_its_weights(tmp_path: Path) -> None:
    [block] = [b for b in python_blocks() if "@ftrun.restartable" in b]
    (tmp_path / "job.py").write_text(AROUND_IN_PLACE.format(block=block))
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "job.py", env={"CRASH_AT": "12"})
    assert r.returncode == 0, r.stderr
    assert "1 restart (in place)" in r.stderr, r.stderr
    before, after = (re.findall(r"rank 0 attempt \d pid (\d+)", r.log(a, 0)) for a in (0, 1))
    assert before == after != [], (before, after)  # rank 0 went on in its own process
    (tmp_path / "clean").mkdir()
    clean = run_ftrun(tmp_path / "clean", "--nproc-per-node", "2", str(tmp_path / "job.py"))
    assert clean.returncode == 0, clean.stderr
    assert re.findall(r"checksum (\w+)", r.log(1, 0)) == re.findall(r"checksum (\w+)", clean.stdout)[:1] != []


DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo"


def shape(line: str) -> str:
    """A console line with what changes between runs left out: paths, numbers (times, pids, steps' losses), the
    weights' checksum (its floating-point sums differ from one CPU's vector instructions to another's: AVX2,
    AVX-512), and whether the restart was warm (on a busy machine the pool may not be ready by the crash:
    .ci/run checks it)."""
    line = re.sub(r"/\S+", "PATH", line).replace(" (warm)", "")
    line = re.sub(r"checksum [0-9a-f]+", "checksum HEX", line)
    return re.sub(r"\d+(\.\d+)?", "N", line).strip()


@pytest.mark.alone  # the demo's story on a quiet machine: under others' load rank 0 may see the crash first
def test_the_readmes_demo_output_is_what_the_demo_prints(tmp_path: Path) -> None:
    """The lines the README shows for `scripts/demo` are the lines its job prints, no more, no fewer: the demo's
    ftrun command, run as scripts/demo runs it (without its install)."""
    text = README.read_text()
    start = text.index("`scripts/demo` shows the root cause")
    block = text.index("```\n", start) + 4
    shown = text[block : text.index("\n```", block)].splitlines()
    demo = " ".join(ln.strip().rstrip("\\") for ln in DEMO.read_text().splitlines()[-2:])
    assert demo.startswith('exec "$PYTHON" -m ftrun '), demo
    args = [a for a in demo.split()[4:] if a != '"$@"']
    paths = {'"$checkpoints"': str(tmp_path), "examples/train_ddp.py": str(README.parent / "examples/train_ddp.py")}
    args = [paths.get(a, a) for a in args]
    proc = subprocess.run(
        ftrun_argv(tmp_path, *args, run_id=None), cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    printed = [shape(ln) for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    readme = [shape(ln) for ln in shown if not ln.startswith("scripts/demo:")]  # the script's own line
    assert sorted(readme) == sorted(printed), "\n".join(sorted(set(readme) ^ set(printed)))
