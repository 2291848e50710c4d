"""ftrun against torchrun on a GPU node: cold start, every kind of fault, and where a restarted worker's seconds go.

One prepared call on a GPU machine (one H100 was lent for 15 minutes; no network there: torch, NCCL and
transformers preinstalled), and a dry run on a machine without a GPU (the cases that need one are skipped):

    python bench/gpu.py [--budget-s 330] [--cases crash,sigkill,...] [--out DIR] [--cuda-standin]
                        [--in-place exit,raise,leaks] [--watch-cost STEPS]

The job (bench/gpu_job.py) never imports ftrun: 2 ranks share GPU 0 over gloo with CUDA tensors (NCCL refuses
two ranks per GPU), checkpointing every step; rank 1 fails at step 20 of the first attempt. Cases:

    crash     os._exit(1)                sigkill    SIGKILL                      raise     an uncaught exception
    crash-late  os._exit(1) at step 400 (about 10 s in: the warm pool is ready, as for most real failures)
    hang      rank 1 sleeps in Python    gpu-hang   rank 1's GPU kernel spins while its host waits in synchronize()
    hang-noflag, gpu-hang-noflag  the same with no hang flag (ftrun's collectives watch; gloo's timeout 120 s)
    nccl-dump  one rank on NCCL, its GPU kernel spins before an all-reduce, no flag: NCCL's watchdog times the
               collective out at 20 s and dumps its flight recorder where ftrun told it (the report names it)
    nccl-pipe  the same with NCCL's timeout at 600 s: ftrun finds the hang first and asks for the dump through
               NCCL's debug pipe (on an H200 it did not, in 90 s: the run prints what each of the worker's
               threads and its I/O did meanwhile)
    transformers  the job imports transformers and accelerate (SIGKILL)
    helper    the job imports a module that initialises CUDA at import (SIGKILL); ftrun is told to preload it
    nccl      one rank on NCCL (SIGKILL)
    nccl-crash, nccl-sigkill, nccl-raise  2 ranks on NCCL, one per (stand-in) node: they share GPU 0, each with
               its own NCCL_HOSTID, so NCCL takes them for two hosts and talks over its socket transport
    nccl-kernel, nccl-never, nccl-spin  the same 2 ranks, no flag, NCCL's timeout 600 s: rank 1's kernel spins
               (its host in synchronize()), rank 1 sleeps before the all-reduce, rank 1 loops in Python
    nccl-slow-ckpt  rank 1 writes a checkpoint slowly for 40 s while rank 0 waits in NCCL: no hang, no restart

--in-place exit,raise,leaks: then in-process restart against process restart of the same job (bench/in_place.py
--nccl --compile: 2 nodes x 1 rank on NCCL sharing GPU 0, a torch.compile'd model; rank 1's process exits, or its
function raises), and 20 in-place restarts in a row with what rank 0 holds at the first and the last (its GPU
memory and pinned memory too), within what is left of the budget; with no GPU, the same on gloo and the CPU (a
dry run). --watch-cost STEPS: then what the hang watch costs a job of 20 all-reduces a step on NCCL (one rank,
bench/hangs.py --cost --job nccl), as the recorder ftrun turns on records every collective.

Launchers alternate case by case: ftrun as it comes (with --heartbeat-timeout 10: hangs found), and torchrun
with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (hangs end at the process group's timeout, 20 s here; the cases with
no flag run ftrun alone: torchrun ends them at the timeout by construction). Per run:
cold start (launch -> every rank stepped), recovery (the fault -> every rank stepping again), the restarted
workers' phases (process start, imports, CUDA context, process group, DDP, first step; the slowest rank's),
whether ftrun's restart was warm, and whether the final checksum equals a fault-free run's. --cuda-standin
preloads the stand-in CUDA driver (ftrun.testing.cuda_driver) into every run, for a dry run of a GPU node's
driver on a CPU machine. Prints figures (and writes results.json to --out); asserts nothing about time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB = HERE / "gpu_job.py"
FTRUN = [sys.executable, "-m", "ftrun", "--heartbeat-timeout", "10"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SAID = ("hang", "hung", "never entered", "never finished", "flight recorder", "fr_trace")
PHASES = ("start", "imported", "cuda", "pg", "ddp", "step")
# one rank on NCCL, its kernel spinning with an all-reduce queued behind it, no hang flag
NCCL_STUCK = {"fault": "gpu-hang-collective", "gpu": True, "nproc": 1, "backend": "nccl", "fault_rank": 0}
NCCL_STUCK |= {"noflag": True, "alone": True}
NCCL2 = {"gpu": True, "backend": "nccl"}  # 2 ranks sharing GPU 0, a NCCL host each
NCCL2_NOFLAG = {**NCCL2, "noflag": True, "pg_timeout": 600, "alone": True}
CASES: dict[str, dict[str, object]] = {
    "crash": {"fault": "exit"},
    "crash-late": {"fault": "exit", "fault_at": 400, "steps": 410},
    "sigkill": {"fault": "sigkill"},
    "raise": {"fault": "raise"},
    "hang": {"fault": "hang"},
    "gpu-hang": {"fault": "gpu-hang", "gpu": True},
    "hang-noflag": {"fault": "hang", "noflag": True, "pg_timeout": 120, "alone": True},
    "gpu-hang-noflag": {"fault": "gpu-hang", "gpu": True, "noflag": True, "pg_timeout": 120, "alone": True},
    "nccl-dump": NCCL_STUCK,
    "nccl-pipe": {**NCCL_STUCK, "pg_timeout": 600, "probe": True},
    "transformers": {"fault": "sigkill", "imports": "transformers,accelerate"},
    "helper": {"fault": "sigkill", "helper": True},
    "nccl": {"fault": "sigkill", "gpu": True, "nproc": 1, "backend": "nccl", "fault_rank": 0},
    "nccl-crash": {**NCCL2, "fault": "exit"},
    "nccl-sigkill": {**NCCL2, "fault": "sigkill"},
    "nccl-raise": {**NCCL2, "fault": "raise"},
    "nccl-kernel": {**NCCL2_NOFLAG, "fault": "gpu-hang"},
    "nccl-never": {**NCCL2_NOFLAG, "fault": "hang"},
    "nccl-spin": {**NCCL2_NOFLAG, "fault": "spin"},
    "nccl-slow-ckpt": {**NCCL2_NOFLAG, "fault": "slow-ckpt"},
}


@dataclass
class Run:
    case: str
    launcher: str
    cold_start_s: float | None = None
    recovery_s: float | None = None
    phases_s: dict[str, float] = field(default_factory=dict)  # the restarted workers: phase -> seconds it took
    warm: bool | None = None
    restarts: int = 0  # ftrun's: the attempts after the first
    found_s: float | None = None  # ftrun's first hang event, after the fault
    checksum: str | None = None
    wall_s: float = 0.0
    said: list[str] = field(default_factory=list)  # ftrun's console on the hang, the dump
    dumps: list[str] = field(default_factory=list)  # flight recorder dumps under the log directory
    error: str = ""


def job_args(case: dict[str, object], workdir: Path, fault: bool) -> list[str]:
    args = [str(JOB), "--timeline", str(workdir / "timeline.jsonl"), "--checkpoint", str(workdir / "ckpt.pt")]
    args += [
        "--checksum",
        str(workdir / "checksum"),
        "--pg-timeout",
        str(case.get("pg_timeout", 20)),
        "--backend",
        str(case.get("backend", "gloo")),
    ]
    if fault:
        args += ["--fault", str(case["fault"]), "--fault-rank", str(case.get("fault_rank", 1))]
        args += ["--fault-at", str(case.get("fault_at", 20))]
    if case.get("steps"):
        args += ["--steps", str(case["steps"])]
    if case.get("imports"):
        args += ["--imports", str(case["imports"])]
    if case.get("helper"):
        args.append("--helper")
    return args


def run(name: str, launcher: str, workdir: Path, env: dict[str, str], timeout_s: float, fault: bool = True) -> Run:
    case = CASES[name]
    workdir.mkdir(parents=True)
    nproc = str(case.get("nproc", 2))
    ftrun = [f for f in FTRUN if f not in ("--heartbeat-timeout", "10")] if case.get("noflag") else FTRUN
    cmd = [*ftrun, "--log-dir", str(workdir / "logs"), "--event-log", str(workdir / "events.jsonl")]
    if case.get("helper"):
        cmd += ["--preload", "gpuhelper"]  # as if ftrun had learned it: the module the pool must leave out
    if launcher == "torchrun":
        cmd = list(TORCHRUN)
    cmd += ["--nproc-per-node", nproc, "--max-restarts", "2", *job_args(case, workdir, fault)]
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))}
    if launcher == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    result = Run(name, launcher)
    launched = time.time()
    with (workdir / "launcher.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
        probe = ThreadProbe(proc.pid) if case.get("probe") and fault and launcher == "ftrun" else None
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            result.error = f"killed after {timeout_s:.0f} s"
        finally:
            with_group(proc.pid, signal.SIGKILL)
            proc.wait()
    result.wall_s = time.time() - launched
    if probe is not None:
        result.said += probe.stop()
    timeline = workdir / "timeline.jsonl"
    records = [json.loads(line) for line in timeline.read_text().splitlines()] if timeline.exists() else []
    measure(result, records, launched, int(nproc))
    if (workdir / "checksum").exists():
        result.checksum = (workdir / "checksum").read_text()
    events = workdir / "events.jsonl"
    if launcher == "ftrun" and events.exists():
        spawned = [json.loads(line) for line in events.read_text().splitlines() if '"worker_spawned"' in line]
        again = [e for e in spawned if e["attempt"] == 1]
        result.warm = all(e["warm"] for e in again) if again else None
        result.restarts = max((int(e["attempt"]) for e in spawned), default=0)
        hangs = [json.loads(line) for line in events.read_text().splitlines() if '"kind":"hang"' in line]
        faulted = [float(r["wall"]) for r in records if r["event"] == "fault"]  # type: ignore[arg-type]
        if hangs and faulted:
            result.found_s = float(hangs[0]["wall"]) - faulted[0]
    if launcher == "ftrun":
        console = (workdir / "launcher.log").read_text(errors="replace").splitlines()
        result.said = [line for line in console if any(w in line for w in SAID)][:6]
        result.dumps = sorted(str(p.relative_to(workdir)) for p in (workdir / "logs").rglob("flight_recorder/*"))
    if proc.returncode != 0 and not result.error:
        result.error = f"exit {proc.returncode}"
    if result.error:  # the temporary directory goes with the run: its console's end is kept here
        tail = (workdir / "launcher.log").read_text(errors="replace").splitlines()[-15:]
        result.error += "; the launcher's last lines:\n" + "\n".join("      " + line for line in tail)
    return result


def measure(result: Run, records: list[dict[str, object]], launched: float, nproc: int) -> None:
    def first(event: str, attempt: int) -> dict[object, float]:
        found: dict[object, float] = {}
        for r in records:
            if r["event"] == event and r["attempt"] == attempt:
                found.setdefault(r["rank"], float(r["wall"]))  # type: ignore[arg-type]
        return found

    stepped = first("step", 0)
    if len(stepped) == nproc:
        result.cold_start_s = max(stepped.values()) - launched
    fault = [float(r["wall"]) for r in records if r["event"] == "fault"]  # type: ignore[arg-type]
    # the first later attempt in which every rank stepped (a launcher's restart may itself fail once)
    attempts = sorted({int(r["attempt"]) for r in records if r["attempt"]})  # type: ignore[call-overload]
    stepping = [a for a in attempts if len(first("step", a)) == nproc]
    again = {phase: first(phase, stepping[0] if stepping else 1) for phase in PHASES}
    if fault and len(again["step"]) == nproc:
        result.recovery_s = max(again["step"].values()) - fault[0]
        previous = fault[0]
        for phase in PHASES:
            if len(again[phase]) == nproc:
                at = max(again[phase].values())
                result.phases_s[phase] = at - previous
                previous = at


class ThreadProbe:
    """What a worker's threads and I/O do while it hangs (the cases marked "probe"): every 5 s, the CPU seconds
    each thread (by its name) and each I/O counter gained, to see what the hang watch could take for progress."""

    def __init__(self, launcher_pid: int) -> None:
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(launcher_pid,), daemon=True)
        self._thread.start()

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join()
        return self.lines[-12:]

    def _run(self, launcher_pid: int) -> None:
        import psutil

        last: dict[str, float] = {}
        while not self._stop.wait(5.0):
            try:
                workers = [c for c in psutil.Process(launcher_pid).children(recursive=True)
                           if any("gpu_job" in a for a in c.cmdline())]  # fmt: skip
                now: dict[str, float] = {}
                for w in workers:
                    for t in w.threads():
                        comm = Path(f"/proc/{w.pid}/task/{t.id}/comm")
                        name = comm.read_text().strip() if comm.exists() else str(t.id)
                        key = f"{w.pid}:{'main' if t.id == w.pid else name}"
                        now[key] = now.get(key, 0.0) + t.user_time + t.system_time
                    io = w.io_counters()
                    now[f"{w.pid}:io rchar"], now[f"{w.pid}:io wchar"] = float(io.read_chars), float(io.write_chars)
            except (psutil.Error, OSError):
                continue
            gained = {k: v - last.get(k, 0.0) for k, v in now.items() if v - last.get(k, 0.0) > 0.01}
            self.lines.append("probe: " + ", ".join(f"{k} +{v:.2f}" for k, v in sorted(gained.items())))
            last = now


def with_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def describe(runs: list[Run], reference: str | None) -> str:
    r = runs[-1]
    rec = f"{r.recovery_s:6.2f} s" if r.recovery_s is not None else "  never"
    cold = f"{r.cold_start_s:6.2f} s" if r.cold_start_s is not None else "    n/a"
    phases = " ".join(f"{p} {s:.2f}" for p, s in r.phases_s.items())
    warm = "" if r.warm is None else (" warm" if r.warm else " COLD")
    warm += f" hang found {r.found_s:.1f} s after the fault" if r.found_s is not None else ""
    warm += f" restarts {r.restarts}" if r.launcher == "ftrun" else ""
    same = (
        ""
        if reference is None or r.checksum is None
        else (" checksum ok" if r.checksum == reference else " CHECKSUM DIFFERS")
    )
    error = f" {r.error}" if r.error else ""
    said = "".join(f"\n      | {line.strip()[:200]}" for line in r.said)
    dumps = f"\n      flight recorder dumps: {', '.join(r.dumps)}" if r.dumps else ""
    return f"  {r.launcher:8s} cold start {cold}  fault -> stepping {rec}{warm}{same}  [{phases}]{error}{said}{dumps}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--budget-s", type=float, default=330.0, help="start no run that may end after this")
    p.add_argument("--run-timeout-s", type=float, default=90.0)
    p.add_argument("--out", default=os.environ.get("OUT"), help="where results.json goes (default: $OUT)")
    p.add_argument("--cuda-standin", action="store_true", help="preload the stand-in CUDA driver (a CPU dry run)")
    p.add_argument(
        "--in-place",
        default="",
        help="exit,raise,leaks: in-place restart on NCCL, compiled "
        "(bench/in_place.py; leaks: 20 in a row, what rank 0 holds)",
    )
    p.add_argument("--in-place-reps", type=int, default=2)
    p.add_argument("--watch-cost", type=int, default=0, metavar="STEPS", help="then the hang watch's price on "
                   "NCCL (bench/hangs.py --cost --job nccl: 20 all-reduces a step, STEPS steps)")  # fmt: skip
    args = p.parse_args()
    began = time.monotonic()
    import torch

    gpu = torch.cuda.is_available()
    print(f"torch {torch.__version__}, {'GPU: ' + torch.cuda.get_device_name(0) if gpu else 'no GPU: a dry run'}")
    env = dict(os.environ)
    cases = [c for c in args.cases.split(",") if c]
    skipped = [c for c in cases if CASES[c].get("gpu") and not gpu]
    skipped += [c for c in cases if CASES[c].get("imports") and not all(
        importlib.util.find_spec(m) for m in str(CASES[c]["imports"]).split(","))]  # fmt: skip
    if skipped:
        print(f"skipped (nothing to run them on here): {', '.join(skipped)}")
    cases = [c for c in cases if c not in skipped]
    results: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="ftrun-gpu-") as tmp:
        if args.cuda_standin:
            from ftrun.testing import cuda_driver

            env["LD_PRELOAD"] = str(cuda_driver.build(Path(tmp) / "driver"))
        references: dict[tuple[object, ...], str | None] = {}
        longest = 30.0  # a guess until the first runs tell
        for i, name in enumerate(cases):
            key = (CASES[name].get("nproc", 2), CASES[name].get("backend", "gloo"), CASES[name].get("steps", 30))
            if key not in references:  # the fault-free run whose checksum the others must equal
                ref = run(name, "ftrun", Path(tmp) / f"reference-{len(references)}", env, args.run_timeout_s, False)
                references[key] = ref.checksum
                print(f"fault-free reference ({key[0]} ranks, {key[1]}, {key[2]} steps): checksum {ref.checksum}, "
                      f"cold start {ref.cold_start_s or float('nan'):.2f} s", flush=True)  # fmt: skip
                longest = max(longest, ref.wall_s * 2)
            print(f"{name}:", flush=True)
            order = ["ftrun", "torchrun"] if i % 2 == 0 else ["torchrun", "ftrun"]
            if CASES[name].get("alone"):
                order = ["ftrun"]
            for launcher in order:
                if time.monotonic() - began + longest > args.budget_s:
                    print(f"  {launcher}: not run, the budget ({args.budget_s:.0f} s) would be spent", flush=True)
                    continue
                results.append(run(name, launcher, Path(tmp) / f"{name}-{launcher}", env, args.run_timeout_s))
                longest = max(longest, results[-1].wall_s)
                print(describe(results, references[key]), flush=True)
        summary(results)
        for crash_by in filter(None, args.in_place.split(",")):
            in_place(crash_by, gpu, args.in_place_reps, args.budget_s - (time.monotonic() - began))
        if args.watch_cost:
            watch_cost(args.watch_cost, gpu, args.budget_s - (time.monotonic() - began))
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
            # each run's console, events and timeline, to read what the figures do not say
            big = ["--exclude=*.pt", "--exclude=*.slow"]  # checkpoints
            subprocess.run(["tar", "czf", str(out / "runs.tgz"), "-C", tmp, *big, "."], check=False)


def in_place(crash_by: str, gpu: bool, reps: int, left_s: float) -> None:
    """Issue 50's GPU goal: a rank fails, then every rank steps again, in place against process restart."""
    argv = [str(HERE / "in_place.py"), "--compile"]
    argv += ["--leaks", "20"] if crash_by == "leaks" else ["--crash-by", crash_by, "--reps", str(reps)]
    argv += ["--nccl", "--timeout", "120"] if gpu else []  # without a GPU: the same on gloo (a dry run of this call)
    bench(f"in place ({crash_by})", argv, left_s)


def watch_cost(steps: int, gpu: bool, left_s: float) -> None:
    """What the hang watch costs a job of many small collectives on NCCL, whose flight recorder ftrun turns on
    (torch leaves NCCL's off): step times with it off, on, ftrun's default, and torchrun's."""
    argv = [str(HERE / "hangs.py"), "--cost", "--reps", "1", "--steps", str(steps), "--buckets", "20"]
    argv += ["--step-time", "0.002", "--job", "nccl" if gpu else "ddp"]  # without a GPU: gloo (a dry run)
    bench("the hang watch's price", argv, left_s)


def bench(what: str, argv: list[str], left_s: float) -> None:
    """Another benchmark of bench/, stopped (SIGINT: it stops its agents on the way out) at the budget."""
    if left_s < 60:
        print(f"\n{what}: not run, {left_s:.0f} s of the budget left", flush=True)
        return
    print(f"\n{what}: {' '.join(argv)}", flush=True)
    proc = subprocess.Popen([sys.executable, *argv])
    try:
        proc.wait(left_s)
    except subprocess.TimeoutExpired:
        print(f"  stopped at the budget ({left_s:.0f} s)", flush=True)
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def summary(results: list[Run]) -> None:
    print("\nftrun / torchrun, fault -> every rank stepping again (and cold start):")
    for name in dict.fromkeys(r.case for r in results):
        mine = {r.launcher: r for r in results if r.case == name}
        ours, peer = mine.get("ftrun"), mine.get("torchrun")
        if ours is None or peer is None:
            continue
        parts = []
        if ours.recovery_s and peer.recovery_s:
            parts.append(
                f"recovery {ours.recovery_s:.2f} / {peer.recovery_s:.2f} s = {ours.recovery_s / peer.recovery_s:.2f}"
            )
        if ours.cold_start_s and peer.cold_start_s:
            parts.append(f"cold start {ours.cold_start_s:.2f} / {peer.cold_start_s:.2f} s = "
                         f"{ours.cold_start_s / peer.cold_start_s:.2f}")  # fmt: skip
        print(f"  {name:13s} " + "; ".join(parts))
    cold = [r.cold_start_s for r in results if r.launcher == "ftrun" and r.cold_start_s]
    if cold:
        print(f"  ftrun cold start over all runs: median {statistics.median(cold):.2f} s")


if __name__ == "__main__":
    main()
