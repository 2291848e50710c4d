"""A pretraining job built the way big runs build theirs, small enough for two CPU ranks; it never imports ftrun.

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

Rank 1 exits at --crash-at in the first attempt. Deterministic: a run that crashed and resumed ends with the
same weights, bit for bit, as one that never failed; rank 0 prints their checksum. --timeline writes each rank's
start and steps as JSON lines (bench/recovery.py --job stack reads them).
"""

from __future__ import annotations

import argparse
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.checkpoint.state_dict import set_state_dict
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
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend for each block")
    p.add_argument("--timeline", default=None, help="append each rank's start and steps here as JSON lines")
    a = p.parse_args()
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def mark(event: str, **data: object) -> None:
        if a.timeline:
            with open(a.timeline, "a") as f:
                f.write(json.dumps({"event": event, "wall": time.time(), "rank": rank, "attempt": attempt, **data}))
                f.write("\n")

    mark("start")
    workdir = Path(a.workdir)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)
    model = LanguageModel()
    for block in model.blocks:
        block.compile(backend=a.compile_backend)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(warmup=5, total=a.steps))

    table = corpus(workdir, sequences=a.steps * BATCH * world)
    sampler = DistributedSampler(table, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = StatefulDataLoader(table, batch_size=BATCH, sampler=sampler, num_workers=2, drop_last=True)

    def state() -> dict[str, object]:
        model_state, opt_state = get_state_dict(model, opt)
        return {"model": model_state, "optim": opt_state, "sched": sched.state_dict(),
                f"loader_{rank}": loader.state_dict(), "step": torch.tensor(0)}  # fmt: skip

    start = 0
    latest = workdir / "checkpoints" / "latest"
    if latest.exists():  # the newest whole checkpoint (its name written once every rank finished it)
        saved = state()
        dcp.load(saved, checkpoint_id=str(workdir / "checkpoints" / latest.read_text()))
        set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
        sched.load_state_dict(saved["sched"])  # type: ignore[arg-type]
        loader.load_state_dict(saved[f"loader_{rank}"])  # type: ignore[arg-type]
        start = int(saved["step"])  # type: ignore[call-overload]
        print(f"rank {rank}: resumed from step {start}", flush=True)

    batches = iter(loader)
    for step in range(start, a.steps):
        tokens = next(batches)["tokens"]
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        mark("step", step=step)
        if attempt == 0 and rank == 1 and step == a.crash_at:
            print(f"rank 1: exits at step {step}", flush=True)
            os._exit(1)
        if (step + 1) % a.ckpt_every == 0:
            saving = state()
            saving["step"] = torch.tensor(step + 1)
            name = f"step-{step + 1}"
            dcp.save(saving, checkpoint_id=str(workdir / "checkpoints" / name))
            dist.barrier()
            if rank == 0:
                (workdir / "checkpoints" / "latest.tmp").write_text(name)
                os.replace(workdir / "checkpoints" / "latest.tmp", latest)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.5f}", flush=True)

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        digest = hashlib.sha256()
        for name in sorted(full):
            digest.update(name.encode())
            digest.update(full[name].detach().contiguous().numpy().tobytes())
        print(f"checksum {digest.hexdigest()[:16]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
