"""A pretraining job built the way big runs build theirs, small enough for two CPU ranks; it never imports ftrun
(but under --restartable).

- the model: a small decoder-only language model, each block compiled (torch.compile) and sharded with FSDP2
  (``fully_shard``) on a 2-D DeviceMesh (replicate x shard: HSDP, one replica here);
- the optimizer: AdamW with a warmup-then-cosine learning-rate schedule;
- the data: token sequences in a Hugging Face ``datasets`` Arrow table on disk (pyarrow, memory-mapped), read
  by a stateful data loader (torchdata's StatefulDataLoader) with two worker processes;
- checkpoints: torch.distributed.checkpoint every --ckpt-every steps, with get_state_dict / set_state_dict, the
  schedule and every rank's loader position in it; a restart resumes from the newest whole one.

    pip install datasets torchdata
    ftrun --nproc-per-node 2 --max-restarts 3 examples/pretrain_stack.py --workdir DIR --crash-at 13
    torchrun --nproc-per-node 2 --max-restarts 3 examples/pretrain_stack.py --workdir DIR --crash-at 13

Rank 1 exits at --crash-at in the first attempt (--crash-by raise: raises). --restartable: the training under
``@ftrun.restartable`` (ftrun's in-process restart): rank 0 (and rank 1 where it raised) keeps its process and
trains again; the imports and torch.compile's code stay, and the new blocks of the same class reuse that code.
Deterministic: a run that crashed and resumed ends with the same weights, bit for bit, as one that never failed;
rank 0 prints their checksum. --timeline writes each rank's
start and steps as JSON lines (bench/recovery.py --job stack reads them).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import time
from pathlib import Path

import datasets
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

VOCAB, WIDTH, CONTEXT, BATCH = 256, 64, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.register_buffer("causal", torch.triu(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=self.causal[: x.size(1), : x.size(1)], need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class LanguageModel(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.reshape(-1, WIDTH))  # (batch x position, vocabulary): not a view of x


def corpus(workdir: Path, sequences: int) -> datasets.Dataset:
    """The token table on disk, written once by rank 0 (as a preprocessing job would), memory-mapped by all."""
    path = workdir / "tokens"
    if dist.get_rank() == 0 and not path.exists():
        g = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, VOCAB, (sequences, CONTEXT + 1), generator=g)
        table = datasets.Dataset.from_dict({"tokens": tokens.tolist()})
        table.save_to_disk(str(workdir / "tokens.tmp"))
        os.replace(workdir / "tokens.tmp", path)
    dist.barrier()
    return datasets.load_from_disk(str(path)).with_format("torch")


def schedule(warmup: int, total: int):  # type: ignore[no-untyped-def]
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return factor


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workdir", required=True, help="the token table and the checkpoints")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--crash-at", type=int, default=None, help="rank 1 exits at this step of the first attempt")
    p.add_argument("--crash-by", choices=("exit", "raise"), default="exit", help="its process's end, or an exception")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend for each block")
    p.add_argument("--timeline", default=None, help="append each rank's start and steps here as JSON lines")
    p.add_argument("--restartable", action="store_true", help="train under @ftrun.restartable (in-process restart)")
    a = p.parse_args()
    run = functools.partial(train, a)
    if a.restartable:  # the only use of ftrun: rank 0 keeps its process, its imports and torch.compile's code
        import ftrun

        run = ftrun.restartable(run)
    run()


def train(a: argparse.Namespace) -> None:
    """Everything is made again in each call: the group, the mesh, FSDP2 (applied once per module), the loader."""
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def mark(event: str, **data: object) -> None:
        if a.timeline:
            with open(a.timeline, "a") as f:
                f.write(json.dumps({"event": event, "wall": time.time(), "rank": rank, "attempt": attempt, **data}))
                f.write("\n")

    mark("start")
    dist.init_process_group("gloo")
    job = Job(Path(a.workdir), a.steps, a.compile_backend)
    start = job.resume()
    batches = iter(job.loader)
    for step in range(start, a.steps):
        loss = job.step(next(batches)["tokens"])
        mark("step", step=step)
        if attempt == 0 and rank == 1 and step == a.crash_at:
            mark("crash", step=step)
            if a.crash_by == "raise":  # under --restartable, rank 1 keeps its process too
                raise RuntimeError(f"rank 1 failed at step {step}")
            print(f"rank 1: exits at step {step}", flush=True)
            os._exit(1)
        if (step + 1) % a.ckpt_every == 0:
            job.save(step + 1)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss:.4f} lr {job.sched.get_last_lr()[0]:.5f}", flush=True)
    digest = job.checksum()
    if rank == 0:
        print(f"checksum {digest}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


class Job:
    """The model, its optimizer and schedule, the data, and their checkpoints."""

    def __init__(self, workdir: Path, steps: int, backend: str) -> None:
        self.workdir, self.rank, world = workdir, dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        self.model = LanguageModel()
        for block in self.model.blocks:
            block.compile(backend=backend)
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule(warmup=5, total=steps))
        table = corpus(workdir, sequences=steps * BATCH * world)
        sampler = DistributedSampler(table, num_replicas=world, rank=self.rank, shuffle=True, seed=0, drop_last=True)
        self.loader = StatefulDataLoader(table, batch_size=BATCH, sampler=sampler, num_workers=2, drop_last=True)
        self.checkpoints = workdir / "checkpoints"

    def step(self, tokens: torch.Tensor) -> float:
        loss = nn.functional.cross_entropy(self.model(tokens[:, :-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()
        return float(loss.item())

    def state(self, step: int) -> dict[str, object]:
        model_state, opt_state = get_state_dict(self.model, self.opt)
        return {"model": model_state, "optim": opt_state, "sched": self.sched.state_dict(),
                f"loader_{self.rank}": self.loader.state_dict(), "step": torch.tensor(step)}  # fmt: skip

    def save(self, step: int) -> None:
        """A DCP checkpoint of ``step`` steps done, named "latest" once every rank has written its part."""
        name = f"step-{step}"
        dcp.save(self.state(step), checkpoint_id=str(self.checkpoints / name))
        dist.barrier()
        if self.rank == 0:
            (self.checkpoints / "latest.tmp").write_text(name)
            os.replace(self.checkpoints / "latest.tmp", self.checkpoints / "latest")

    def resume(self) -> int:
        """The newest whole checkpoint loaded, if any; the step to start from."""
        latest = self.checkpoints / "latest"
        if not latest.exists():
            return 0
        saved = self.state(0)
        dcp.load(saved, checkpoint_id=str(self.checkpoints / latest.read_text()))
        set_state_dict(self.model, self.opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
        self.sched.load_state_dict(saved["sched"])  # type: ignore[arg-type]
        self.loader.load_state_dict(saved[f"loader_{self.rank}"])  # type: ignore[arg-type]
        start = int(saved["step"])  # type: ignore[call-overload]
        print(f"rank {self.rank}: resumed from step {start}", flush=True)
        return start

    def checksum(self) -> str:
        """A digest of the full weights (gathered on every rank)."""
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        digest = hashlib.sha256()
        for name in sorted(full):
            digest.update(name.encode())
            digest.update(full[name].detach().contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]


if __name__ == "__main__":
    main()
