"""The node's own faults never end the job: a log disk that fills up while the job writes to it, shared memory
with no room for a snapshot, limits on open files and processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftrun.worker import snapshot
from tests.integration.harness import WAIT_S, as_nobody, ftrun_argv, until

CHATTY = """
import os, sys
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(150):
    print(f"rank {rank} step {step} " + "x" * 20_000, flush=True)  # 20 KB a step
    if attempt == 0 and rank == 1 and step == 100:
        raise RuntimeError("bad batch at step 100")
print(f"rank {rank} done", file=sys.stderr, flush=True)
"""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: the log directory fills up while the job runs (rank 1 alone fills it before its failure)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.parametrize("redirects", [(), ("--redirects", "3")], ids=["shown", "files-only"])
def test_a_full_log_disk_ends_nothing(tmp_path: Path, small_disk: Path, redirects: tuple[str, ...]) -> None:
    """2 ranks print 20 KB a step onto a 1 MiB log disk; rank 1 raises at step 100. The workers are drained
    as before, the failure is reported and restarted, the job finishes, and ftrun says once what it could not
    write, with no traceback of its own. With the output kept off the console (``--redirects 3``), the workers
    never write the full disk themselves (their print would raise), and the report still has the traceback
    the disk could not take."""
    (tmp_path / "w.py").write_text(CHATTY)
    flags = ("--nproc-per-node", "2", "--max-restarts", "1", *redirects, "w.py")
    argv = ftrun_argv(tmp_path, *flags, logs=str(small_disk))
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=WAIT_S * 2)
    assert r.returncode == 0, r.stderr[-3000:]
    said = r.stderr.count("ftrun: cannot write ")
    assert 1 <= said <= 3, r.stderr[-3000:]  # once (again only after writing worked for a while), not per write
    assert "No space left on device" in r.stderr
    assert "Exception in thread" not in r.stderr
    assert "ROOT CAUSE  rank 1" in r.stderr
    assert "RuntimeError: bad batch at step 100" in r.stderr  # the console or the report has it
    assert "its logs lack " in r.stderr  # the report says what the rank's log files lack
    if redirects:
        root = r.stderr[r.stderr.index("ROOT CAUSE  rank 1") :]
        assert "RuntimeError: bad batch at step 100" in root, root[:3000]  # from memory: the disk was full
        assert "step" not in r.stdout
        return
    assert "rank 0 done" in r.stderr
    assert "rank 1 done" in r.stderr
    assert "rank 0 step 149 " in r.stdout  # the last step of both ranks reached the console
    assert "rank 1 step 149 " in r.stdout


def test_a_snapshot_that_shared_memory_has_no_room_for_is_skipped_and_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """/dev/shm full (here a 1 MiB tmpfs): no snapshot, no SIGBUS at a write through the map, said once."""
    torch = pytest.importorskip("torch")
    small = tmp_path / "shm"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        monkeypatch.setenv(snapshot.ENV_DIR, str(small))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setattr(snapshot, "_writer", snapshot._Writer())
        for step in (1, 2):
            snapshot.snapshot(step, {"w": torch.ones(1 << 20)})  # 4 MiB
            snapshot.wait()
        said = capsys.readouterr().err
        assert said.count("ftrun.snapshot: rank 0 skipped step 1's snapshot") == 1
        assert "No space left on device" in said or "MiB free" in said
        assert "skipped step 2" not in said
        assert not list(small.glob("step-*/rank-*"))
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_a_snapshot_memory_larger_than_shared_memory_is_said_at_start(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text("print('ran', flush=True)\n")
    argv = ftrun_argv(tmp_path, "--snapshot-memory", "100T", "w.py")
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    assert "ftrun: --snapshot-memory is 102400.00 GiB but /dev/shm holds " in r.stderr


def test_a_limit_on_open_files_too_low_for_the_workers_is_refused_at_once_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text("print('ran', flush=True)\n")
    argv = ftrun_argv(tmp_path, "--nproc-per-node", "8", "--max-restarts", "1", "w.py")

    def run(files: int) -> subprocess.CompletedProcess[str]:
        limited = ["prlimit", f"--nofile={files}:{files}", "--", *argv]
        return subprocess.run(limited, cwd=tmp_path, capture_output=True, text=True, timeout=WAIT_S)

    r = run(64)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("ftrun: error: the open-files limit: 64 (ulimit -n), and an agent with 8 workers")
    assert "Traceback" not in r.stderr
    assert "ran" not in r.stdout
    fits = run(256)
    assert fits.returncode == 0, fits.stderr  # where it fits, the job runs, restarts and all
    assert fits.stdout.count("ran") == 8


# Both ranks up; once the user's process limit is full (another program of the user's took the rest), rank 1
# fails: the restart meets the full limit.
NEEDS_TASKS = """
import os, pathlib, sys, time
rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
print("rank", rank, "restart", restart, flush=True)
if restart == "0":
    pathlib.Path(f"up-{rank}").touch()
    while not os.path.exists("full"):
        time.sleep(0.05)
    if rank == "1":
        sys.exit(3)
    time.sleep(60)
"""
# Takes every task of the user's it can, again as they free, for argv[1] seconds.
TAKES_EVERY_TASK = """
import pathlib, sys, threading, time
hold, end = threading.Event(), time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    try:
        threading.Thread(target=hold.wait, daemon=True).start()
    except RuntimeError:
        pathlib.Path("full").touch()
        time.sleep(0.01)
"""


@pytest.fixture
def nobodys_dir() -> Iterator[Path]:
    """A working directory the user nobody can use (pytest's are root's own, 0700)."""
    found = Path(tempfile.mkdtemp(prefix="ftrun-nobody-"))
    found.chmod(0o777)
    try:
        yield found
    finally:
        shutil.rmtree(found, ignore_errors=True)


def test_a_process_limit_too_low_is_refused_at_once_and_a_full_one_at_a_restart_is_waited_out(
    nobodys_dir: Path,
) -> None:
    """As a user the kernel holds to RLIMIT_NPROC (root never is): a limit with no room for the agent and its
    workers is one line and exit 2 before anything starts; a limit filled by another program of the user's
    while the job restarts is waited out (the spawn and its output's threads tried again), not a traceback."""
    here = nobodys_dir
    for name, text in (("w.py", NEEDS_TASKS), ("hog.py", TAKES_EVERY_TASK)):
        (here / name).write_text(text)
        (here / name).chmod(0o644)
    env = {**os.environ, "FTRUN_CACHE_DIR": str(here / "cache")}
    argv = [sys.executable, "-m", "ftrun", "--log-dir", str(here / "logs"), "--rdzv-id", "t", "--no-warm",
            "--nproc-per-node", "2", "--max-restarts", "1", "w.py"]  # fmt: skip
    (here / "low").mkdir()
    low = as_nobody(argv, 10, here / "low")
    if isinstance(low, str):
        pytest.skip(low)
    r = subprocess.run(low, cwd=here, env=env, capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("ftrun: error: the process limit: 10 (ulimit -u): this user runs "), r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert "rank" not in r.stdout

    (here / "job").mkdir()
    (here / "hog").mkdir()
    job = subprocess.Popen(as_nobody(argv, 40, here / "job"), cwd=here, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    hog: subprocess.Popen[bytes] | None = None
    try:
        until(lambda: (here / "up-0").exists() and (here / "up-1").exists(), "both ranks up", WAIT_S)
        hog = subprocess.Popen(as_nobody([sys.executable, "hog.py", "3"], 40, here / "hog"), cwd=here,
                               start_new_session=True)  # fmt: skip
        out, err = job.communicate(timeout=WAIT_S)
    finally:
        for proc in (job, hog):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert job.returncode == 0, err
    assert "ftrun: restart 1 of 1" in err
    assert sorted(line for line in out.splitlines() if "restart 1" in line) == ["rank 0 restart 1", "rank 1 restart 1"]
    assert "Traceback" not in err


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A memory cgroup of ``limit`` bytes (v1's memory controller, else v2's); yields its cgroup.procs. Skips the
    test where neither can be made here."""
    made: Path | None = None
    for base, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                             (Path("/sys/fs/cgroup"), "memory.max")):  # fmt: skip
        if not (base / limit_file).exists() and not (base / "cgroup.subtree_control").exists():
            continue
        try:
            made = Path(tempfile.mkdtemp(prefix="ftrun-test-", dir=base))
            (made / limit_file).write_text(str(limit))
            break
        except OSError:
            if made is not None:
                made.rmdir()
            made = None
    if made is None:
        pytest.skip("no memory cgroup can be made here")
    try:
        yield made / "cgroup.procs"
    finally:
        deadline = time.monotonic() + WAIT_S
        while True:  # the killed processes leave it a moment later
            try:
                made.rmdir()
                break
            except OSError:
                assert time.monotonic() < deadline, f"{made} is still in use"
                time.sleep(0.1)


# Rank 1 allocates past the cgroup's limit on the first attempt.
EATS = """
import os, time
rank, restart = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
print("rank", rank, "restart", restart, flush=True)
if restart == "0" and rank == "1":
    eaten = []
    while True:  # past the cgroup's limit: the OOM killer ends this process
        eaten.append(bytearray(16 << 20))
        time.sleep(0.01)
time.sleep(2 if restart == "0" else 0.2)
"""


@pytest.mark.parametrize("limit_mib", [100, 600])
def test_a_memory_cgroup_with_no_room_is_refused_at_once_and_near_its_limit_a_worker_is_what_ends(
    tmp_path: Path, limit_mib: int
) -> None:
    """The agent started in a memory cgroup (a container's limit): with no room for the agent and 2 workers it
    refuses in one line, exit 2; with some, it says at start that the cgroup is tight, and a worker allocating
    past the limit is what the OOM killer ends: reported as such, restarted, the job finishes."""
    (tmp_path / "w.py").write_text(EATS)
    argv = ftrun_argv(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py")
    with memory_cgroup(limit_mib << 20) as procs:
        joined = ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]
        r = subprocess.run(joined, cwd=tmp_path, capture_output=True, text=True, timeout=WAIT_S)
    if limit_mib == 100:
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("ftrun: error: the memory cgroup: its limit is 100 MiB and "), r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        return
    assert r.returncode == 0, r.stderr
    assert "ftrun: the memory cgroup leaves " in r.stderr
    assert "ROOT CAUSE  rank 1" in r.stderr
    assert "out-of-memory killer killed a process" in r.stderr, r.stderr
    assert "ftrun: run succeeded (exit 0)" in r.stderr


SLOWER_CHATTY = """
import os, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(150):
    print(f"rank {rank} step {step} " + "x" * 20_000, flush=True)
    time.sleep(0.05)
    if attempt == 0 and rank == 1 and step == 100:
        raise RuntimeError("bad batch at step 100")
"""


@pytest.fixture
def failing_disk(tmp_path: Path) -> Iterator[Path]:
    """A log disk that fails as a real one does: ext4 (errors=remount-ro) on a loop device whose backing file
    lives on a 4 MiB tmpfs. Once ~3.5 MiB of logs are written back, the device fails writes with EIO and ext4
    turns itself read-only (EROFS from then on). The kernel writes dirty pages back within 30 s: the test
    syncs the disk every 0.3 s so that this comes while the job runs."""
    if not all(shutil.which(tool) for tool in ("losetup", "mkfs.ext4")):
        pytest.skip("needs losetup and mkfs.ext4")
    back, disk = tmp_path / "back", tmp_path / "disk"
    back.mkdir()
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(back)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    device = ""
    stop = threading.Event()
    try:
        image = back / "disk.img"
        subprocess.run(["truncate", "-s", "64M", str(image)], check=True)
        lazy = "lazy_itable_init=1,lazy_journal_init=1"  # mkfs writes little: the 4 MiB are left for the logs
        subprocess.run(["mkfs.ext4", "-q", "-F", "-E", lazy, str(image)], check=True)
        attached = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
        if attached.returncode:
            pytest.skip(f"no loop device: {attached.stderr.strip()}")
        device = attached.stdout.strip()
        subprocess.run(["mount", "-o", "errors=remount-ro", device, str(disk)], check=True)

        def write_back() -> None:
            while not stop.wait(0.3):
                os.sync()

        threading.Thread(target=write_back, daemon=True).start()
        yield disk
    finally:
        stop.set()
        subprocess.run(["umount", "-l", str(disk)], check=False)
        if device:
            subprocess.run(["losetup", "-d", device], check=False)
        subprocess.run(["umount", "-l", str(back)], check=False)


def test_a_log_disk_that_fails_and_turns_read_only_ends_nothing(tmp_path: Path, failing_disk: Path) -> None:
    """The chatty job, slower, on a log disk that fails with EIO mid-run and turns read-only: the failure is
    reported and restarted though the next attempt's directory cannot be made there (it is made elsewhere, and
    said), and the job finishes with no error of ftrun's own."""
    (tmp_path / "w.py").write_text(SLOWER_CHATTY)
    argv = ftrun_argv(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "w.py", logs=str(failing_disk))
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=WAIT_S * 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Read-only file system" in r.stderr or "Input/output error" in r.stderr, r.stderr[-3000:]
    assert "ROOT CAUSE  rank 1" in r.stderr
    assert "this attempt's files are in " in r.stderr, r.stderr[-3000:]
    assert "ftrun: run succeeded (exit 0) after 2 attempt(s)" in r.stderr
    assert "OSError" not in r.stderr
    assert "Exception in thread" not in r.stderr
