"""Warm restarts: a worker forked from the pool behaves like a fresh process, and the pool never decides
the job's fate (a refused module, a dead zygote: fresh processes take over)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import (
    POOL,
    RUN_ID,
    WAITS_FOR_THE_POOL,
    Result,
    WriteScript,
    restarted_warm,
    run_ftrun,
)

WARM = ["--preload", "json,decimal", "--max-restarts", "1"]  # a pool (restarts to come) with a preload
COLD = ["--no-warm", "--max-restarts", "1"]
RUNS = (("warm", WARM, POOL), ("cold", COLD, {}))  # warm: attempt 1 runs once the pool was ready (restarted_warm)

FACTS = """
import json, os, signal, sys, warnings
def typed(x: int) -> None: ...
facts = {
    "annotations": repr(typed.__annotations__),  # no __future__ flag leaks in from ftrun's own code
    "name": __name__,
    "file": __file__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "own_session": os.getsid(0) == os.getpid() == os.getpgrp(),
    "parent": open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")[1:3] == [b"-m", b"ftrun"],
    "spec": __spec__ and (__spec__.name, __spec__.origin),
    "rank": os.environ["RANK"],
    "main_is_me": sys.modules["__main__"].__dict__ is globals(),
    "warnings_filters": len(warnings.filters),
    "stdin": sys.stdin.read(),
    # No thread of ftrun's: one that takes the GIL can make the main thread miss a signal before a blocking call.
    "threads": len(os.listdir("/proc/self/task")),
    "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
}
print(json.dumps(facts), flush=True)
print("to stderr", file=sys.stderr, flush=True)
"""


def spawned(r: Result) -> list[dict[str, Any]]:
    return [e for e in r.events() if e["kind"] == "worker_spawned"]


def facts(r: Result, attempt: int = 1, rank: int = 0) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(r.log(attempt, rank).splitlines()[0])
    return found


def test_a_warm_script_sees_what_a_fresh_one_sees(tmp_path: Path, script: WriteScript) -> None:
    script("sub/w.py", restarted_warm(FACTS))
    runs = {}
    for name, flags, env in RUNS:
        r = run_ftrun(
            tmp_path, "--log-dir", str(tmp_path / name), *flags, "--nproc-per-node", "2", "sub/w.py", "a b", env=env
        )
        r.run_dir = tmp_path / name / "t"
        assert r.returncode == 0, r.stderr
        assert [e["warm"] for e in spawned(r) if e["attempt"] == 1] == [name == "warm"] * 2
        assert r.log(1, 1, "stderr") == "to stderr\n"
        runs[name] = facts(r, rank=1)
    assert runs["warm"] == runs["cold"]
    assert runs["warm"]["name"] == "__main__"
    assert runs["warm"]["argv"] == ["sub/w.py", "a b"]
    assert runs["warm"]["path0"] == str((tmp_path / "sub").resolve())
    assert runs["warm"]["own_session"] is True
    assert runs["warm"]["parent"] is True  # the agent's own child, not the zygote's
    assert runs["warm"]["annotations"] == "{'x': <class 'int'>, 'return': None}"


def test_a_warm_module_with_relative_imports(tmp_path: Path, script: WriteScript) -> None:
    script("pkg/__init__.py", "")
    script("pkg/helper.py", "WHO = 'helper'\n")
    script("pkg/main.py", "from .helper import WHO\n" + restarted_warm(FACTS) + "print(WHO, __package__)\n")
    runs = {}
    for name, flags, env in RUNS:
        r = run_ftrun(tmp_path, "--log-dir", str(tmp_path / name), *flags, "-m", "pkg.main", "x", env=env)
        r.run_dir = tmp_path / name / "t"
        assert r.returncode == 0, r.stderr
        assert [e["warm"] for e in spawned(r) if e["attempt"] == 1] == [name == "warm"]
        lines = r.log(1, 0).splitlines()
        assert lines[1] == "helper pkg"
        runs[name] = json.loads(lines[0])
    assert runs["warm"] == runs["cold"]
    assert runs["warm"]["argv"] == [str(tmp_path / "pkg" / "main.py"), "x"]


ENDINGS = """
import os, signal, sys
import ftrun
how = sys.argv[1]

@ftrun.record
def main():
    if how == "exit3":
        sys.exit(3)
    if how == "exit-message":
        sys.exit("goodbye")
    if how == "raise-recorded":
        raise ValueError("recorded boom")
    if how == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)

if how == "raise-plain":
    raise KeyError("plain boom")
main()
"""


def _a_thread(line: str) -> bool:
    """The fault handler's lines about other threads than the crashing one (the interpreter's own, which may not
    have run Python code yet: no frame), which say nothing of how the worker was started."""
    return "hread 0x" in line or "<no Python frame>" in line


@pytest.mark.parametrize("how", ["exit3", "exit-message", "raise-recorded", "raise-plain", "segv"])
def test_endings_are_the_same_warm_or_cold(tmp_path: Path, script: WriteScript, how: str) -> None:
    script("w.py", restarted_warm(ENDINGS))
    roots = {}
    for name, flags, env in RUNS:
        r = run_ftrun(tmp_path, "--log-dir", str(tmp_path / name), *flags, "w.py", how, env=env)
        r.run_dir = tmp_path / name / "t"
        assert r.returncode == 1
        assert [e["warm"] for e in spawned(r) if e["attempt"] == 1] == [name == "warm"]
        root: dict[str, Any] = r.report(1)["root_cause"]  # type: ignore[assignment]
        error = root["error"]
        roots[name] = (
            root["exit_code"],
            root["signal"],
            error and (error["exc_type"], error["message"]),
            # file paths, lines and the fault handler's other threads aside
            [ln for ln in root["stderr_tail"] if ln.strip() and "line" not in ln and not _a_thread(ln)],
        )
        stderr = r.log(1, 0, "stderr")
        traceback, _, fault = stderr.partition("Fatal Python error")
        assert "zygote" not in traceback  # the traceback starts in the user's code
        if fault:  # the fault handler's stack of the crashing thread, most recent call first: the user's frame
            current = fault[fault.index("Current thread") :].splitlines()
            assert current[1].strip().startswith(f'File "{tmp_path / "w.py"}"'), fault
    assert roots["warm"] == roots["cold"]


def test_a_preloaded_module_that_starts_a_thread_is_left_out_and_the_rest_stays_warm(
    tmp_path: Path, script: WriteScript
) -> None:
    script(
        "threaded.py", "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    )
    script("w.py", restarted_warm("print('ran', flush=True)\n"))
    r = run_ftrun(
        tmp_path, "--preload", "json,threaded,decimal", "--nproc-per-node", "2", "--max-restarts", "1", "w.py", env=POOL
    )
    assert r.returncode == 0, r.stderr
    assert "warm pool: importing 'threaded' started a thread" in r.stderr
    assert "the rest is preloaded" in r.stderr
    assert "warm pool off" not in r.stderr
    assert [e["warm"] for e in spawned(r) if e["attempt"] == 1] == [True, True]
    assert r.log(1, 1) == "ran\n"


KILLS_THE_POOL = (
    WAITS_FOR_THE_POOL
    + """
import os, signal, sys, time
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    agent = os.getppid()
    # For a second: a zygote still starting has not its own command line yet, and would escape one look.
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
                ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if b"ftrun.warm.zygote" in cmdline and ppid == agent and int(pid) != os.getpid():  # zygotes, standbys
                os.kill(int(pid), signal.SIGKILL)
                print("killed the pool", flush=True)
        time.sleep(0.02)
    sys.exit(3)
wait_for_the_pool()  # a new zygote took the killed ones' place
print("attempt 1 ran", flush=True)
"""
)


def test_a_dead_zygote_is_replaced_and_the_job_goes_on(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", KILLS_THE_POOL)
    r = run_ftrun(tmp_path, *WARM, "--max-restarts", "2", "--verbose", "w.py")  # the pool's own story
    assert r.returncode == 0, r.stderr
    assert set(r.log(0, 0).splitlines()) == {"killed the pool"}  # the base zygote, and the one preloading
    assert r.log(1, 0) == "attempt 1 ran\n"
    assert "warm pool: the zygote" in r.stderr
    assert "a new zygote is on its way" in r.stderr
    ready = [e for e in r.events() if e["kind"] == "pool_ready"]
    assert len(ready) >= 1
    assert ready[0]["rss_kb"] > 0
    assert "MiB resident" in r.stderr


@pytest.mark.parametrize("warm", ["--warm=auto", "--no-warm"])
def test_cpu_binding_is_in_place_before_the_workers_code_runs(
    tmp_path: Path, script: WriteScript, monkeypatch: pytest.MonkeyPatch, warm: str
) -> None:
    """What --numa-binding hands each worker (FTRUN_CPU_AFFINITY), applied warm and cold, on this GPU-less machine."""
    script("w.py", "import os\nprint(sorted(os.sched_getaffinity(0)))\n")
    monkeypatch.setenv("FTRUN_CPU_AFFINITY", "1")
    r = run_ftrun(tmp_path, warm, "w.py")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[1]"


STUCK_AT_TEARDOWN = """
import atexit, os, sys, time
if os.environ["RANK"] == "1":
    atexit.register(time.sleep, 600)  # the interpreter's teardown never ends (as torch's gloo race can make it)
print("work done", flush=True)
sys.exit(int(sys.argv[1]) if os.environ["RANK"] == "1" else 0)
"""


@pytest.mark.parametrize("code", [0, 4])
def test_a_teardown_stuck_after_the_script_ended_keeps_the_scripts_result(
    tmp_path: Path, script: WriteScript, code: int
) -> None:
    """Warm workers (the pool's zygote marks the script's end; a fresh worker's teardown is the interpreter's)."""
    script("w.py", restarted_warm(STUCK_AT_TEARDOWN))
    r = run_ftrun(tmp_path, *WARM, "--nproc-per-node", "2", "--teardown-timeout", "1", "w.py", str(code), env=POOL)
    assert r.returncode == (0 if code == 0 else 1), r.stderr
    assert [e["warm"] for e in spawned(r) if e["attempt"] == 1] == [True, True]
    exits = {e["rank"]: e["state"] for e in r.events() if e["kind"] == "worker_exited" and e["attempt"] == 1}
    assert exits[1] == ("succeeded" if code == 0 else "failed")  # the script's result, not the kill's
    assert not [e for e in r.events() if e["kind"] == "hang"]  # not a training hang
    if code:  # a failed script counts as exited at once; its teardown is left to finish, then ended
        assert "teardown still going --teardown-timeout after its script failed; ended" in r.stderr
        return
    stuck = next(e for e in r.events() if e["kind"] == "teardown_stuck")
    assert (stuck["rank"], stuck["end_code"]) == (1, code)
    assert "the interpreter's teardown is stuck" in r.stderr
    assert "stuck in interpreter teardown" in r.log(1, 1, "stderr")


FAILS_AT_ONCE = (
    WAITS_FOR_THE_POOL
    + """
import os, sys
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    wait_for_the_pool()
sys.exit(0 if os.environ["TORCHELASTIC_RESTART_COUNT"] == "3" else 3)
"""
)


def test_failures_right_after_a_restart_are_warm_before_the_pool_refilled(tmp_path: Path, script: WriteScript) -> None:
    """The standbys taken by a restart are forked again only once its workers had time to start; a failure
    before then forks them on the spot, from the same zygote."""
    script("w.py", FAILS_AT_ONCE)
    # The same failure before the first step, again and again: a crash loop, but these restarts are the point.
    r = run_ftrun(
        tmp_path, *WARM, "--nproc-per-node", "2", "--max-restarts", "3", "--crash-loop-limit", "0", "w.py", env=POOL
    )
    assert r.returncode == 0, r.stderr
    restarts = [e for e in spawned(r) if e["attempt"] > 0]
    assert len(restarts) == 6
    assert all(e["warm"] for e in restarts), restarts
    assert "3 restarts (warm)" in r.stderr


# Each worker notes when its process began (the fork, by the kernel's count) and, on attempt 0, when it failed.
NOTES_ITS_FORK = (
    WAITS_FOR_THE_POOL
    + """
import json, os, sys, time
with open("/proc/self/stat") as f:
    forked = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")  # since boot
note = {"forked": forked}
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    wait_for_the_pool()
    time.sleep(0.2)
    note["failed"] = time.clock_gettime(time.CLOCK_BOOTTIME)
print(json.dumps(note), flush=True)
sys.exit(3 if "failed" in note else 0)
"""
)


def test_a_failure_before_the_refill_finds_standbys_forked_ahead(tmp_path: Path, script: WriteScript) -> None:
    """Each zygote keeps twice the node's workers forked ahead: a restart takes half, and a failure that comes
    before the refill (its workers' first step, say) still forks none on the spot."""
    script("w.py", NOTES_ITS_FORK)
    r = run_ftrun(tmp_path, *WARM, "--nproc-per-node", "2", "w.py", env=POOL)
    assert r.returncode == 0, r.stderr
    assert all(e["warm"] for e in spawned(r) if e["attempt"] == 1)
    # The first rank to fail has the other stopped, perhaps before it wrote its note.
    failed = min(json.loads(log)["failed"] for rank in (0, 1) if (log := r.log(0, rank)))
    for rank in (0, 1):
        assert json.loads(r.log(1, rank))["forked"] < failed - 0.1  # ten ticks of margin: forked before it


REWRITES_ITSELF = (
    WAITS_FOR_THE_POOL
    + """
import os, sys
print("version 1", flush=True)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    wait_for_the_pool()  # the zygote compiled this version
    with open(__file__, "a") as f:
        f.write("print('version 2, longer', flush=True)\\n")
    sys.exit(3)
"""
)


def test_the_script_precompiled_by_the_zygote_is_the_one_on_disk(tmp_path: Path, script: WriteScript) -> None:
    """The zygote compiles the entry script once for all its workers; a script changed since runs as changed."""
    script("w.py", REWRITES_ITSELF)
    r = run_ftrun(tmp_path, *WARM, "w.py", env=POOL)
    assert r.returncode == 0, r.stderr
    assert [e["warm"] for e in spawned(r) if e["attempt"] == 1] == [True]
    assert r.log(0, 0) == "version 1\n"
    assert r.log(1, 0) == "version 1\nversion 2, longer\n"


BREAKS_ITSELF = (
    WAITS_FOR_THE_POOL
    + """
import os
if os.environ.get("WAIT_FOR_POOL"):
    wait_for_the_pool()  # the zygote compiled this version
with open(__file__, "a") as f:
    f.write("print('never')\\ndef broken(:\\n")
raise SystemExit(3)
"""
)


def test_a_script_that_does_not_compile_fails_warm_as_it_does_cold(tmp_path: Path, script: WriteScript) -> None:
    tails = {}
    for name, flags, env in RUNS:
        script("w.py", BREAKS_ITSELF)  # attempt 0 breaks it, for attempt 1
        r = run_ftrun(tmp_path, "--log-dir", str(tmp_path / name), *flags, "w.py", env=env)
        r.run_dir = tmp_path / name / "t"
        assert r.returncode == 1
        assert [e["warm"] for e in spawned(r) if e["attempt"] == 1] == [name == "warm"]
        tails[name] = [ln for ln in r.log(1, 0, "stderr").splitlines() if "line" not in ln]
    assert tails["warm"] == tails["cold"]
    assert tails["warm"][-1].startswith("SyntaxError")


HOLDS_A_BIG_HEAP = """
import os, warnings
import torch.distributed  # its deprecated attributes warn when read (reduce_op)
warnings.simplefilter("error")  # a warning of ftrun's making would raise in the job
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
if attempt == "2":
    print("attempt 1 wrote:", open("out.txt").read(), flush=True)
    raise SystemExit(0)
heap = [(i,) for i in range(10_000_000)]  # ten million objects of the job's own
out = open("out.txt", "w")
out.write("its last line")  # buffered: still in the file object when the script fails
def fail():
    raise RuntimeError("boom")
fail()
"""


@pytest.mark.torch
def test_a_failure_flushes_the_jobs_files_silently_whatever_its_heap(tmp_path: Path, script: WriteScript) -> None:
    """The warm worker marks its script's end and flushes its files before the agent restarts (beside the
    interpreter's teardown): the next attempt reads what the failed one wrote, and nothing of ftrun's appears
    in the job's output though it holds ten million objects and a module whose attributes warn."""
    script("w.py", restarted_warm(HOLDS_A_BIG_HEAP))
    r = run_ftrun(
        tmp_path, "--preload", "json", "--max-restarts", "2", "w.py", env=POOL, timeout=240
    )  # torch: the job's
    assert r.returncode == 0, r.stderr
    assert [e["warm"] for e in spawned(r) if e["attempt"] in (1, 2)] == [True, True]
    assert r.log(2, 0) == "attempt 1 wrote: its last line\n"
    stderr = r.log(1, 0, "stderr").splitlines()
    assert stderr[0] == "Traceback (most recent call last):"
    assert stderr[-1] == "RuntimeError: boom"
    assert not [line for line in stderr if "Warning" in line]


NO_ZOMBIES = (
    WAITS_FOR_THE_POOL
    + """
import os, sys, time
wait_for_the_pool()  # the bigger zygote ready: the base one retires, its standbys let go
agent = os.getppid()
def zombies():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == agent:
            found.append(f"{pid} (group {fields[2]})")
    return found
# A standby let go is a zombie until the agent next reaps (every 2 s as it idles): watched for 6 s, none seen
# in the first 2 s may still be there at the end (before, the retired zygote's stood for the whole attempt).
seen, start = {}, time.monotonic()
while time.monotonic() < start + 6:
    for z in zombies():
        seen.setdefault(z, time.monotonic() - start)
    time.sleep(0.1)
left = [z for z in zombies() if seen.get(z, 6) < 2]
print("zombies outliving a reap:", len(left), flush=True)
print("seen:", seen, "left:", left, file=sys.stderr, flush=True)  # a standby's group is its zygote's pid
"""
)


def test_an_agent_keeps_no_zombie_children_in_a_fault_free_run(tmp_path: Path, script: WriteScript) -> None:
    """The standbys a retired zygote lets go and the warden's launcher are reaped as the agent idles, not at the
    first restart (a zombie alert would fire on every long fault-free run)."""
    script("w.py", NO_ZOMBIES)
    r = run_ftrun(tmp_path, "--preload", "json", "--nproc-per-node", "2", "--max-restarts", "1", "w.py")
    assert r.returncode == 0, r.stderr
    assert r.log(0, 0) == "zombies outliving a reap: 0\n", (r.log(0, 0, "stderr"), r.stderr)


CRASHES_AT_ONCE = """
import json, os
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    os._exit(3)  # before anything else: the pool must be ready from the first second
print("ran", flush=True)
"""


@pytest.mark.alone  # 2 workers on 2 cores: which start fresh depends on the cores being theirs
def test_the_pool_serves_from_the_first_attempt_and_a_crash_at_once_restarts_warm(
    tmp_path: Path, script: WriteScript
) -> None:
    """The entry script's imports are known before it runs: on a node with no core to spare, the first attempt
    starts a worker fresh only on a core that was idle of late, never the one the preloading zygote takes (as
    --verbose says: this tier follows a loaded one), and the others wait for it (one import, not one each),
    which is then ready for a failure at any moment, the first second included. On a rerun the job's cache
    knows what the workers imported over a whole run: every worker of the first attempt waits for it."""
    script("w.py", CRASHES_AT_ONCE)
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(cpus)[:2])  # 2 workers on 2 cores, whatever this machine has (ftrun inherits it)
    runs = {}
    try:
        for run in ("first", "rerun"):
            runs[run] = run_ftrun(tmp_path, "--log-dir", str(tmp_path / run), "--nproc-per-node", "2",
                                  "--max-restarts", "1", "--verbose", "w.py")  # fmt: skip
            runs[run].run_dir = tmp_path / run / RUN_ID
    finally:
        os.sched_setaffinity(0, cpus)
    first, rerun = runs["first"], runs["rerun"]
    for r in (first, rerun):
        assert r.returncode == 0, r.stderr
        assert r.log(1, 0) == "ran\n"
        assert "1 restart (warm)" in r.stderr
    said = re.search(
        r"warm pool: (\d) of the first workers start fresh beside the zygote \(([\d.]+) of 2", first.stderr
    )
    assert said is not None, first.stderr
    fresh = int(said[1])
    assert fresh == (1 if float(said[2]) >= 0.5 else 0), said[0]  # a core of its own, or none
    firsts = [False] * fresh + [True] * (2 - fresh)
    assert [(e["attempt"], e["warm"]) for e in spawned(first)] == [*((0, w) for w in firsts), (1, True), (1, True)]
    assert [(e["attempt"], e["warm"]) for e in spawned(rerun)] == [(0, True), (0, True), (1, True), (1, True)]
