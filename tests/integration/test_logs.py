"""Worker output: files always, console per --redirects/--tee/--local-ranks-filter, nothing lost."""

from __future__ import annotations

import os
import select
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.harness import RUN_ID, WriteScript, ftrun_argv, run_ftrun

HELLO = """
import os, sys
rank = os.environ["RANK"]
print(f"out {rank}")
print(f"err {rank}", file=sys.stderr)
"""


def test_default_shows_output_unprefixed_and_keeps_files(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", HELLO)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "w.py")
    assert r.returncode == 0
    assert sorted(r.stdout.splitlines()) == ["out 0", "out 1"]
    assert "err 1" in r.stderr.splitlines()
    assert r.log(0, 1) == "out 1\n"
    assert r.log(0, 1, "stderr") == "err 1\n"


def test_tee_prefixes_lines_as_torchrun_does(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", HELLO)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--tee", "3", "w.py")
    assert sorted(r.stdout.splitlines()) == ["[default0]:out 0", "[default1]:out 1"]  # role + local rank
    assert {"[default0]:err 0", "[default1]:err 1"} <= set(r.stderr.splitlines())
    assert r.log(0, 0) == "out 0\n"  # files hold the raw output


def test_torchs_prefix_template(tmp_path: Path, script: WriteScript, monkeypatch: pytest.MonkeyPatch) -> None:
    script("w.py", HELLO)
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${role_name}-r${rank}] ")
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--tee", "1", "--role", "trainer", "w.py")
    assert sorted(r.stdout.splitlines()) == ["[trainer-r0] out 0", "[trainer-r1] out 1"]


def test_duplicate_filters_copy_matching_lines_to_a_file(tmp_path: Path, script: WriteScript) -> None:
    script(
        "w.py",
        'import os, sys\nr = os.environ["RANK"]\nprint(f"loss {r}\\nnoise {r}")\nprint(f"warn {r}", file=sys.stderr)\n',
    )
    flags = ["--duplicate-stdout-filters", "loss", "--duplicate-stderr-filters", "warn,x", "--redirects", "3"]
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", *flags, "w.py")
    assert r.returncode == 0, r.stderr
    filtered = (r.run_dir / "attempt_0" / "filtered_stdout.log").read_text().splitlines()
    assert sorted(filtered) == ["[default0]:loss 0", "[default1]:loss 1"]
    assert sorted((r.run_dir / "attempt_0" / "filtered_stderr.log").read_text().splitlines()) == [
        "[default0]:warn 0",
        "[default1]:warn 1",
    ]
    assert r.log(0, 1) == "loss 1\nnoise 1\n"  # the rank's file keeps everything
    assert r.stdout == ""  # --redirects still keeps it off the console


def test_the_local_rank_macro_in_script_arguments(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", "import sys\nprint(sys.argv[1:])\n")
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "w.py", "--local-rank=${local_rank}", "x")
    assert sorted(r.stdout.splitlines()) == ["['--local-rank=0', 'x']", "['--local-rank=1', 'x']"]


def test_a_closed_console_harms_neither_ftrun_nor_the_workers(tmp_path: Path, script: WriteScript) -> None:
    """``ftrun ... | head -1``: the reader goes away; the job still finishes and its files are whole."""
    script("w.py", "import os\nfor i in range(20000):\n    print(f'line {i}', flush=True)\nprint('done')\n")
    argv = ftrun_argv(tmp_path, "--nproc-per-node", "2", "w.py")
    head = f"{shlex.join(argv)} | head -1; exit ${{PIPESTATUS[0]}}"
    done = subprocess.run(["bash", "-c", head], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "line 0\n"
    run_dir = tmp_path / "logs" / RUN_ID
    for rank in (0, 1):
        assert (run_dir / "attempt_0" / str(rank) / "stdout.log").read_text().splitlines()[-1] == "done"


def test_redirects_keep_output_off_the_console(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", HELLO)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--redirects", "1", "w.py")
    assert r.stdout == ""
    assert "err 0" in r.stderr.splitlines()
    assert r.log(0, 0) == "out 0\n"


def test_local_ranks_filter(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", HELLO)
    r = run_ftrun(tmp_path, "--nproc-per-node", "3", "--tee", "3", "--local-ranks-filter", "1", "w.py")
    assert r.stdout.splitlines() == ["[default1]:out 1"]
    assert r.log(0, 2) == "out 2\n"


@pytest.mark.parametrize("flags", [[], ["--tee", "3"], ["--redirects", "3"]])
def test_no_line_lost_when_a_worker_is_killed(tmp_path: Path, script: WriteScript, flags: list[str]) -> None:
    script(
        "w.py",
        """
        import os, signal, sys
        for i in range(20000):
            print(f"line {i}")
            print(f"eline {i}", file=sys.stderr)
        os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    r = run_ftrun(tmp_path, *flags, "w.py")
    assert r.returncode == 1
    assert r.log(0, 0).splitlines()[-1] == "line 19999"
    assert len(r.log(0, 0).splitlines()) == 20000
    assert len(r.log(0, 0, "stderr").splitlines()) == 20000
    if flags != ["--redirects", "3"]:
        assert len([ln for ln in r.stdout.splitlines() if "line " in ln]) == 20000


LONG_LINES = """
import sys
sys.stdout.write("x" * 1_000_000)  # one line of a MiB, no end yet
sys.stdout.write("\\n")
for i in range(3):
    sys.stdout.write(f"progress {i}\\r")  # a progress bar: its lines end in \\r only
sys.stdout.write("done\\n")
"""


def test_a_huge_line_is_shown_cut_and_kept_whole_and_carriage_returns_end_lines(
    tmp_path: Path, script: WriteScript
) -> None:
    """The agent never keeps more than MAX_LINE of a line unended (it once kept and re-scanned it all)."""
    from ftrun.procs.logs import MAX_LINE

    script("w.py", LONG_LINES)
    r = run_ftrun(tmp_path, "--tee", "1", "w.py")
    assert r.returncode == 0, r.stderr
    raw = (r.run_dir / "attempt_0" / "0" / "stdout.log").read_bytes()
    assert raw == b"x" * 1_000_000 + b"\n" + b"".join(b"progress %d\r" % i for i in range(3)) + b"done\n"
    shown = r.stdout.split("\n")
    xs = [line for line in shown if line.startswith("[default0]:x")]
    assert sum(len(line) - len("[default0]:") for line in xs) == 1_000_000  # all of it, in pieces
    assert all(len(line) - len("[default0]:") <= MAX_LINE + 65536 for line in xs)
    assert len(xs) > 1
    # Each \r-ended line with its own prefix (read here in text mode, where \r becomes \n).
    assert "[default0]:progress 0\n[default0]:progress 1\n[default0]:progress 2\n[default0]:done" in r.stdout


PROMPT = """
import os, sys, time
sys.stdout.write("ready? ")  # a prompt: no line ends until the answer comes
sys.stdout.flush()
while not os.path.exists("answered"):
    time.sleep(0.02)
print("yes", flush=True)
"""


def test_a_line_left_unfinished_is_shown_as_it_is_and_its_end_follows(tmp_path: Path, script: WriteScript) -> None:
    """A prompt (pdb's "(Pdb) ") waits for an answer the person gives only once they see it: the console shows
    the unfinished line after a moment, and the rest of it when it comes, unprefixed (--tee 3 prefixes lines)."""
    script("w.py", PROMPT)
    proc = subprocess.Popen(ftrun_argv(tmp_path, "--tee", "3", "w.py"), cwd=tmp_path, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    seen = b""
    try:
        deadline = time.monotonic() + 30
        while b"ready? " not in seen and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                seen += os.read(proc.stdout.fileno(), 65536)
        assert seen == b"[default0]:ready? ", seen  # shown before the line ended: nothing else waits for it
        (tmp_path / "answered").touch()
        seen += proc.stdout.read()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
    assert seen == b"[default0]:ready? yes\n", seen
    assert (tmp_path / "logs" / RUN_ID / "attempt_0" / "0" / "stdout.log").read_text() == "ready? yes\n"
