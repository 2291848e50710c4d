"""A warm worker is a fresh worker: everything a job can observe of how it was started, field by field, with
torch and numpy preloaded, in two attempts forked from the same zygote, against workers started fresh.

The allow-list below is the whole of the difference, each entry with its reason (the README repeats it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import POOL, WriteScript, restarted_warm, run_ftrun

PROBE = """
import gc, json, logging, os, random, resource, signal, sys, threading, time, warnings
import numpy as np
import torch
from threadpoolctl import threadpool_info
TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")
with open("/proc/self/environ", "rb") as f:
    proc_environ = dict(v.decode().partition("=")[::2] for v in f.read().split(b"\\0") if v)
OURS = "PYTHONPATH"
um = os.umask(0)
os.umask(um)
facts = {
    "numpy_random": float(np.random.rand()),
    "python_random": random.random(),
    "torch_seed": torch.initial_seed(),
    "str_hash": hash("ftrun"),
    "pools": sorted((i["internal_api"], i["num_threads"]) for i in threadpool_info()),
    "torch_threads": [torch.get_num_threads(), torch.get_num_interop_threads()],
    "environment": sorted(k for k in os.environ if not k.startswith("FTRUN_") and k != "WAIT_FOR_POOL"),  # the test's
    "ftrun_environment": sorted(k for k in os.environ if k.startswith("FTRUN_")),
    "flags": repr(sys.flags),
    "path": sys.path,
    "argv": sys.argv,
    "cmdline": open("/proc/self/cmdline").read().split("\\0"),  # ps, pgrep -f, nvidia-smi, psutil: argv as exec'd
    # what monitoring agents map a pid to its rank by: the variables the process started with, with their values
    # (a fresh worker starts with ftrun's boot directory on PYTHONPATH, which its sitecustomize takes off again)
    "proc_environ": sorted(k for k in proc_environ if not k.startswith("FTRUN_") and k not in ("WAIT_FOR_POOL", OURS)),
    "proc_environ_values": {k: proc_environ.get(k) == os.environ[k] for k in TORCHRUN},
    "comm": open("/proc/self/comm").read().strip(),  # ps -o comm, pgrep, top
    "main": sorted(k for k in vars(sys.modules["__main__"]) if k.startswith("__")),
    "warnings": [repr(f) for f in warnings.filters],
    "logging": [logging.getLogger().level, len(logging.getLogger().handlers)],
    "signals": {s.name: str(signal.getsignal(s)) for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")},
    "umask": um,
    "cwd": os.getcwd(),
    "descriptors": sorted(os.listdir("/proc/self/fd")),
    "threads": len(os.listdir("/proc/self/task")),
    "gc": [gc.isenabled(), gc.get_threshold()],
    "gc_frozen": gc.get_freeze_count() > 0,
    "switch_interval": sys.getswitchinterval(),
    "recursion_limit": sys.getrecursionlimit(),
    # what the script can observe of its imports: settings the preloaded modules made as they were imported
    "imported_settings": [str(torch.get_default_dtype()), torch.backends.cudnn.benchmark, np.get_printoptions(),
                          logging.getLogger("torch").level, torch.distributed.is_available()],
    "affinity": sorted(os.sched_getaffinity(0)),
    "scheduling": [os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)],
    # glibc's record of the thread's id (a raw clone left the zygote's: this raised EINVAL)
    "thread_cpu_clock": time.clock_gettime(time.pthread_getcpuclockid(threading.get_ident())) >= 0,
}
print(json.dumps(facts), flush=True)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
open(f"printed-{attempt}-{os.environ['RANK']}", "w").close()
deadline = time.monotonic() + 60  # both ranks have printed before the first one fails (and the other is stopped)
while not all(os.path.exists(f"printed-{attempt}-{r}") for r in (0, 1)) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(3 if attempt == "1" else 0)
"""

# Drawn from the OS per process: they must differ between every two workers, warm or fresh.
RANDOM = ("numpy_random", "python_random", "torch_seed")
ALLOWED = {
    # Python fixes a process's hash seed as it starts: every worker forked from one zygote shares it (set
    # PYTHONHASHSEED and fresh workers share one too).
    "str_hash": "shared by the warm workers of a zygote",
    # The zygote freezes what it preloaded out of the collector's reach, so that pages stay shared.
    "gc_frozen": "the preloaded objects are frozen",
    # --no-warm leaves out the warm pool's own variable (FTRUN_MODULES_FILE): ftrun's variables, not the job's.
    "ftrun_environment": "the warm pool's own variable",
}


def facts_of(tmp_path: Path, how: str, flags: list[str]) -> dict[tuple[int, int], dict[str, Any]]:
    for marker in tmp_path.glob("printed-*"):  # the previous run's: they would let a rank fail before the other printed
        marker.unlink()
    r = run_ftrun(tmp_path, "--log-dir", str(tmp_path / how), "--nproc-per-node", "2", "--max-restarts", "2", *flags,
                  "probe.py", timeout=300, env=POOL if how == "warm" else {})  # fmt: skip
    r.run_dir = tmp_path / how / "t"
    assert r.returncode == 0, r.stderr
    spawned = [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] > 0]
    assert spawned == [how == "warm"] * 4, spawned
    return {(a, rank): json.loads(r.log(a, rank).splitlines()[0]) for a in (1, 2) for rank in (0, 1)}


@pytest.mark.torch
def test_a_warm_worker_observes_what_a_fresh_one_does(
    tmp_path: Path, script: WriteScript, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # thread pools the zygote pinned to 1 must come back at 2
    script("probe.py", restarted_warm(PROBE))
    warm = facts_of(tmp_path, "warm", ["--preload", "numpy,torch"])
    fresh = facts_of(tmp_path, "fresh", ["--no-warm"])
    for name in RANDOM:
        assert len({f[name] for f in warm.values()}) == 4, (name, warm)  # every rank, every attempt its own
        assert len({f[name] for f in fresh.values()}) == 4, (name, fresh)
    differences = {
        (name, worker): (warm[worker][name], fresh[worker][name])
        for worker in warm
        for name in warm[worker]
        if name not in RANDOM and name not in ALLOWED and warm[worker][name] != fresh[worker][name]
    }
    assert differences == {}
    for worker, facts in warm.items():  # the file says the rank it is: monitoring agents read it
        assert all(facts["proc_environ_values"].values()), (worker, facts["proc_environ_values"])
    assert warm[1, 0]["pools"] == fresh[1, 0]["pools"]
    assert ["openblas", 2] in warm[1, 0]["pools"]  # (JSON makes the pairs lists)


AT_FORK = """
import ctypes, os
ran = {"c": 0, "python": 0}
_child = ctypes.CFUNCTYPE(None)(lambda: ran.__setitem__("c", ran["c"] + 1))
ctypes.CDLL("libc.so.6").__register_atfork(None, None, _child, None)  # pthread_atfork, as C libraries call it
os.register_at_fork(after_in_child=lambda: ran.__setitem__("python", ran["python"] + 1))
"""

USES_AT_FORK = """
import json
import at_fork
print(json.dumps(at_fork.ran), flush=True)
"""


def test_the_at_fork_handlers_of_preloaded_libraries_run_in_a_warm_worker(
    tmp_path: Path, script: WriteScript, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library that fixes its state after a fork (C or Python handlers) finds it fixed in every warm worker."""
    script("lib/at_fork.py", AT_FORK)
    script("w.py", restarted_warm(USES_AT_FORK))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "lib"))
    r = run_ftrun(tmp_path, "--max-restarts", "1", "--preload", "at_fork", "w.py", env=POOL)
    assert r.returncode == 0, r.stderr
    assert [e["warm"] for e in r.events() if e["kind"] == "worker_spawned" and e["attempt"] == 1] == [True]
    ran = json.loads(r.log(1, 0))
    assert ran["c"] >= 1, ran
    assert ran["python"] >= 1, ran


LOADED = """
import sys
print(" ".join(sorted(m for m in sys.modules if m == "ftrun" or m.startswith("ftrun."))), flush=True)
"""
# What a worker process may hold of ftrun: the worker side. A warm worker also holds the (empty) package of the
# zygote it was forked from, whose module is the process's __main__.
WORKER_SIDE = {"ftrun", "ftrun.errors", "ftrun.jsonobject"}


@pytest.mark.parametrize("how", ["warm", "fresh"])
def test_a_worker_process_loads_only_worker_side_ftrun_modules(tmp_path: Path, script: WriteScript, how: str) -> None:
    script("w.py", restarted_warm(LOADED))
    flags = ["--max-restarts", "1"] + (["--preload", "json"] if how == "warm" else ["--no-warm"])
    r = run_ftrun(tmp_path, *flags, "w.py", env=POOL if how == "warm" else {})
    assert r.returncode == 0, r.stderr
    loaded = set(r.stdout.split())
    assert "ftrun.worker.client" in loaded  # the walk sees what it should: the client attached before the job
    allowed = WORKER_SIDE | ({"ftrun.warm"} if how == "warm" else set())
    agent_side = {m for m in loaded if m not in allowed and not m.startswith("ftrun.worker.") and m != "ftrun.worker"}
    assert not agent_side, f"a {how} worker loaded agent-side modules: {sorted(agent_side)}"
    if how == "warm":
        assert "ftrun.worker.fresh" in loaded  # it was forked from a zygote (what a fresh process has, restored)
