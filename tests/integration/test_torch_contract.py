"""torch's own public APIs, used the way their docs show, under ftrun: nothing to change in the script."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.harness import (
    POOL,
    PortTaken,
    Result,
    WriteScript,
    ftrun_argv,
    restarted_warm,
    run_ftrun,
    with_free_port,
)

pytestmark = pytest.mark.torch

FILE_TIMER = """
import os, time
import torch.distributed.elastic.timer as timer

timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
with timer.expires(after=1, scope="step"):
    if attempt == "0":
        time.sleep(120)  # stuck: the timer must end it
print("attempt", attempt, "done", flush=True)
"""


def test_torchs_file_timer_kills_a_stuck_worker_and_it_is_the_root_cause(
    tmp_path: Path, script: WriteScript, monkeypatch: pytest.MonkeyPatch
) -> None:
    script("w.py", FILE_TIMER)
    monkeypatch.setenv("TORCHELASTIC_ENABLE_FILE_TIMER", "1")
    monkeypatch.setenv("TORCHELASTIC_TIMER_FILE", str(tmp_path / "timer.pipe"))
    r = run_ftrun(tmp_path, "--max-restarts", "1", "w.py")
    assert r.returncode == 0, r.stderr
    [expired] = [e for e in r.events() if e["kind"] == "timer_expired"]
    assert (expired["rank"], expired["scope"], expired["signal"]) == (0, "step", "SIGKILL")
    root = r.report(0)["root_cause"]
    assert root["hang"] == "timer 'step' expired (torch FileTimer)"  # type: ignore[index]
    assert root["signal"] == "SIGKILL"  # type: ignore[index]
    assert "attempt 1 done" in r.log(1, 0)
    assert not (tmp_path / "timer.pipe").exists()  # the agent removed its pipe


LAUNCHED = """
import os
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    assert dist.is_torchelastic_launched()
    dist.init_process_group("gloo", init_method="env://")
    print("rank", dist.get_rank(), "of", dist.get_world_size(), "port", os.environ["MASTER_PORT"], flush=True)
    dist.destroy_process_group()

main()
"""


def test_env_init_with_the_master_port_given_in_an_elastic_job(tmp_path: Path, script: WriteScript) -> None:
    """Clusters whose firewall opens one port: --master-port is the port the workers get, elastic or not."""
    script("w.py", LAUNCHED)

    def attempt(port: int) -> tuple[Result, int]:
        r = run_ftrun(tmp_path, "--rdzv-backend", "c10d", "--master-port", str(port), "--nproc-per-node", "2", "w.py")
        if "already in use" in r.stderr:
            shutil.rmtree(r.run_dir)
            raise PortTaken(r.stderr)
        return r, port

    r, port = with_free_port(attempt)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [f"rank 0 of 2 port {port}", f"rank 1 of 2 port {port}"]


FABRIC = """
import torch
from lightning_fabric import Fabric
from lightning_fabric.plugins.environments import TorchElasticEnvironment

assert TorchElasticEnvironment.detect()  # Lightning sees a torchelastic launch
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()  # under a launcher: joins the group the launcher's environment describes
total = fabric.all_reduce(torch.tensor([float(fabric.global_rank + 1)]), reduce_op="sum")
print("rank", fabric.global_rank, "of", fabric.world_size, "sum", int(total.item()), flush=True)
"""


def test_lightning_detects_the_launch_and_trains_in_its_world(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", FABRIC)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "w.py")
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["rank 0 of 2 sum 3", "rank 1 of 2 sum 3"]


BREAKPOINT = """
answer = 6 * 7
breakpoint()  # pdb reads the worker's standard input: ftrun's, as a torchrun worker reads torchrun's
print("after the breakpoint", flush=True)
"""


@pytest.mark.parametrize("start", ["fresh", "warm"])
def test_a_breakpoint_in_a_worker_reads_ftruns_standard_input_and_shows_its_prompt(
    tmp_path: Path, script: WriteScript, start: str
) -> None:
    """The one-worker debugging run torchrun users know: pdb's prompt, which ends no line, is on the console,
    and what is typed at ftrun reaches it."""
    body = restarted_warm(BREAKPOINT) if start == "warm" else BREAKPOINT
    script("w.py", body)
    pool = [] if start == "warm" else ["--no-warm"]
    r = run_ftrun(tmp_path, *pool, "--max-restarts", "1", "w.py", env=POOL, stdin="p answer\nc\n")
    assert r.returncode == 0, r.stderr
    assert "(Pdb) 42\n(Pdb) after the breakpoint\n" in r.stdout, r.stdout
    spawned = [e["warm"] for e in r.events() if e["kind"] == "worker_spawned"]
    assert spawned[-1] == (start == "warm"), spawned


STDIN_SEEN = """
import os
print("stdin:", os.readlink("/proc/self/fd/0"), flush=True)
"""


def test_ftrun_started_with_its_standard_input_closed_gives_its_workers_dev_null(
    tmp_path: Path, script: WriteScript
) -> None:
    """Not the first file ftrun opens next (a worker's stacks.txt took fd 0: a worker reading its input read it)."""
    script("fresh.py", STDIN_SEEN)
    script("warm.py", restarted_warm(STDIN_SEEN))  # its first attempt fails once the pool is ready
    for flags in (["--no-warm", "fresh.py"], ["--max-restarts", "1", "warm.py"]):
        command = shlex.join(ftrun_argv(tmp_path, *flags))
        done = subprocess.run(["sh", "-c", f"exec {command} <&-"], cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, **POOL}, timeout=120, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["stdin: /dev/null"], (flags, done.stdout)
