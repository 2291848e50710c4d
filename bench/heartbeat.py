"""Hang detection: what it costs the training loop, and how fast a hang is found and recovered.

1. Cost, in a worker under ftrun: 1e6 calls of ``ftrun.heartbeat()`` and 1e6
   section start/end pairs (``with ftrun.section("step")``), timed in batches
   of 100; median and p99 of the per-call cost over the batches.
2. Detection: one of two workers under ftrun stops heartbeating (--heartbeat-timeout 0.5);
   from ftrun's event log: deadline -> verdict, and verdict -> new workers spawned.
3. The demo DDP job (2 ranks, gloo) with --hang-at and --out-of-section-timeout
   (the step is a section): from the hang (the job's own
   timeline) to every rank stepping again, and that minus the heartbeat timeout.
4. With no code change: the cost of the automatic heartbeat (the optimizer step hook,
   in a warm worker) per step, and bench/plain_ddp.py (never imports ftrun) with rank 1
   hanging at step 40 and --heartbeat-timeout 3: hang -> every rank stepping again.

    python bench/heartbeat.py [--reps 5]

NVIDIA's resiliency extension (ft_launcher), measured on this machine when the
issue was written: 10.8 us median, 93 us p99 per heartbeat (a socket call).
Prints figures; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "train_ddp.py"
FT_LAUNCHER_HEARTBEAT_US = (10.8, 93.0)  # median, p99; quoted (see the docstring)

COST = """
import json, time, ftrun
BATCH, BATCHES = 100, 10_000
def timed(fn):
    costs = []
    for _ in range(BATCHES):
        t0 = time.perf_counter_ns()
        for _ in range(BATCH):
            fn()
        costs.append((time.perf_counter_ns() - t0) / BATCH / 1000)
    costs.sort()
    return costs[len(costs) // 2], costs[int(len(costs) * 0.99)]
def nothing():
    pass
def step():
    with ftrun.section("step"):
        pass
ftrun.heartbeat()
print(json.dumps({"loop": timed(nothing), "heartbeat": timed(ftrun.heartbeat), "section": timed(step)}))
"""

AUTO_COST = """
import json, sys, time
import torch
from ftrun.worker.autobeat import _after_step  # what torch calls after every optimizer step
BATCH, BATCHES = 100, 10_000
costs = []
for _ in range(BATCHES):
    t0 = time.perf_counter_ns()
    for _ in range(BATCH):
        _after_step(None, (), {})
    costs.append((time.perf_counter_ns() - t0) / BATCH / 1000)
costs.sort()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
optimizer_module = sys.modules["torch.optim.optimizer"]  # torch.optim hides the submodule's name
hooked = bool(optimizer_module._global_optimizer_post_hooks)
# A DataLoader batch: the wrapped iterator against torch's own, alternating, over the same 20,000 items.
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter
wrapped = _BaseDataLoaderIter.__next__
original = wrapped.__closure__[0].cell_contents  # what the wrapper calls
loader = DataLoader(list(range(20_000)), batch_size=None)
per_batch = {"ftrun": [], "torch": []}
for _ in range(10):
    for name, fn in (("ftrun", wrapped), ("torch", original)):
        _BaseDataLoaderIter.__next__ = fn
        t0 = time.perf_counter_ns()
        for _ in loader:
            pass
        per_batch[name].append((time.perf_counter_ns() - t0) / 20_000 / 1000)
_BaseDataLoaderIter.__next__ = wrapped
batch = {name: sorted(v)[len(v) // 2] for name, v in per_batch.items()}
print(json.dumps({"hook": [costs[len(costs) // 2], costs[int(len(costs) * 0.99)]], "installed": hooked,
                  "batch": batch, "batch_hooked": getattr(wrapped, "_ftrun", False)}))
"""

STOPS_BEATING = """
import os, time, ftrun
for _ in range(20):
    ftrun.heartbeat()
    time.sleep(0.01)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    if os.environ["RANK"] == "1":
        time.sleep(60)  # hung
    for _ in range(6000):  # rank 0 stays healthy
        ftrun.heartbeat()
        time.sleep(0.01)
"""


def ftrun_cmd(workdir: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ftrun",
        "--log-dir",
        str(workdir / "logs"),
        "--event-log",
        str(workdir / "ev"),
        *args,
    ]


def cost() -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "cost.py").write_text(COST)
        out = subprocess.run(
            ftrun_cmd(Path(d), "cost.py"), cwd=d, capture_output=True, text=True, timeout=600, check=True
        )
    result: dict[str, list[float]] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def detection() -> tuple[float, float]:
    """(deadline -> verdict, verdict -> new workers spawned) in seconds."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "w.py").write_text(STOPS_BEATING)
        cmd = ftrun_cmd(Path(d), "--nproc-per-node", "2", "--max-restarts", "1", "--heartbeat-timeout", "0.5", "w.py")
        subprocess.run(cmd, cwd=d, capture_output=True, timeout=120, check=True)
        events = [json.loads(line) for line in (Path(d) / "ev").read_text().splitlines()]
    hang = next(e for e in events if e["kind"] == "hang")
    respawned = max(e["mono"] for e in events if e["kind"] == "worker_spawned" and e["attempt"] == 1)
    return hang["lag_s"], respawned - hang["mono"]


def demo(hang_at: int, timeout_s: float) -> float:
    """The demo's hang -> every rank stepping again, in seconds."""
    with tempfile.TemporaryDirectory() as d:
        timeline = Path(d) / "timeline.jsonl"
        cmd = ftrun_cmd(
            Path(d), "--nproc-per-node", "2", "--max-restarts", "2", "--out-of-section-timeout", str(timeout_s),
            str(DEMO), "--steps", str(hang_at + 20), "--checkpoint-every", "10", "--hang-at", str(hang_at),
            "--checkpoint-dir", str(Path(d) / "ckpt"), "--timeline", str(timeline), "--log-every", "1000000",
        )  # fmt: skip
        subprocess.run(cmd, cwd=d, capture_output=True, timeout=300, check=True)
        records = [json.loads(line) for line in timeline.read_text().splitlines()]
    hung = next(r["wall"] for r in records if r["event"] == "hang")
    resumed = [
        min(r["wall"] for r in records if r["attempt"] == 1 and r["rank"] == k and r["event"] == "step") for k in (0, 1)
    ]
    return max(resumed) - hung


def auto_cost() -> dict[str, object]:
    """The automatic heartbeat's cost per optimizer step, in a warm worker (where it is installed)."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "auto.py").write_text(AUTO_COST)
        out = subprocess.run(
            ftrun_cmd(Path(d), "--max-restarts", "1", "auto.py"), cwd=d, capture_output=True, text=True,
            timeout=600, check=True,
        )  # fmt: skip
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def unmodified(hang_at: int, timeout_s: float) -> float:
    """bench/plain_ddp.py (never imports ftrun): hang -> every rank stepping again, in seconds."""
    with tempfile.TemporaryDirectory() as d:
        timeline = Path(d) / "timeline.jsonl"
        cmd = ftrun_cmd(
            Path(d), "--nproc-per-node", "2", "--max-restarts", "2", "--heartbeat-timeout", str(timeout_s),
            str(ROOT / "bench" / "plain_ddp.py"), "--steps", str(hang_at + 20), "--hang-at", str(hang_at),
            "--timeline", str(timeline), "--checkpoint", str(Path(d) / "ckpt.pt"),
        )  # fmt: skip
        subprocess.run(cmd, cwd=d, capture_output=True, timeout=300, check=True, env={**os.environ,
                       "FTRUN_CACHE_DIR": str(Path(d) / "cache")})  # fmt: skip
        records = [json.loads(line) for line in timeline.read_text().splitlines()]
    hung = next(r["wall"] for r in records if r["event"] == "hang")
    resumed = [
        min(r["wall"] for r in records if r["attempt"] == 1 and r["rank"] == k and r["event"] == "step") for k in (0, 1)
    ]
    return max(resumed) - hung


def spread(values: list[float], scale: float, unit: str) -> str:
    v = [x * scale for x in values]
    return f"median {statistics.median(v):.2f} {unit} (min {min(v):.2f}, max {max(v):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--demo-timeout", type=float, default=2.0, help="--out-of-section-timeout for the demo job")
    a = p.parse_args()

    c = cost()
    ft_med, ft_p99 = FT_LAUNCHER_HEARTBEAT_US
    print("cost per call in a worker under ftrun (us, median / p99 over 10,000 batches of 100):")
    print(f"  empty loop + call     {c['loop'][0]:.3f} / {c['loop'][1]:.3f}")
    print(f"  heartbeat()           {c['heartbeat'][0]:.3f} / {c['heartbeat'][1]:.3f}"
          f"   vs ft_launcher {ft_med} / {ft_p99} (quoted): ratio {c['heartbeat'][0] / ft_med:.3f}")  # fmt: skip
    print(f"  section start + end   {c['section'][0]:.3f} / {c['section'][1]:.3f}")

    lags, restarts = zip(*(detection() for _ in range(a.reps)), strict=True)
    print(f"detection, {a.reps} runs, 2 workers, --heartbeat-timeout 0.5:")
    print(f"  deadline -> verdict             {spread(list(lags), 1000, 'ms')}")
    print(f"  verdict -> new workers spawned  {spread(list(restarts), 1000, 'ms')}  (includes the stack dump)")

    totals = [demo(40, a.demo_timeout) for _ in range(a.reps)]
    print(f"demo DDP job (2 ranks), --hang-at 40, --out-of-section-timeout {a.demo_timeout:g}, {a.reps} runs:")
    print(f"  hang -> every rank stepping again   {spread(totals, 1, 's')}")
    print(f"  the same minus the timeout          {spread([t - a.demo_timeout for t in totals], 1, 's')}")

    auto = auto_cost()
    hook: list[float] = auto["hook"]  # type: ignore[assignment]
    print(f"automatic heartbeat (optimizer step hook) in a warm worker, installed: {auto['installed']}")
    print(f"  per step   {hook[0]:.3f} / {hook[1]:.3f} us (median / p99)")
    batch: dict[str, float] = auto["batch"]  # type: ignore[assignment]
    print(f"  per DataLoader batch (installed: {auto['batch_hooked']}), median of 10 passes over 20,000 items:")
    print(f"    torch's iterator {batch['torch']:.2f} us, wrapped {batch['ftrun']:.2f} us: "
          f"+{batch['ftrun'] - batch['torch']:.2f} us")  # fmt: skip
    totals = [unmodified(40, 3.0) for _ in range(a.reps)]
    print(f"unmodified DDP job (never imports ftrun), rank 1 hangs at step 40, --heartbeat-timeout 3, {a.reps} runs:")
    print(f"  hang -> every rank stepping again   {spread(totals, 1, 's')}")
    print(f"  the same minus the timeout          {spread([t - 3.0 for t in totals], 1, 's')}")


if __name__ == "__main__":
    main()
