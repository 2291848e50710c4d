"""Worker output: files always, console per --redirects/--tee/--local-ranks-filter, nothing lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import WriteScript, run_ftrun

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


def test_tee_prefixes_lines_with_the_rank(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", HELLO)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--tee", "3", "w.py")
    assert sorted(r.stdout.splitlines()) == ["[0]:out 0", "[1]:out 1"]
    assert {"[0]:err 0", "[1]:err 1"} <= set(r.stderr.splitlines())
    assert r.log(0, 0) == "out 0\n"  # files hold the raw output


def test_redirects_keep_output_off_the_console(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", HELLO)
    r = run_ftrun(tmp_path, "--nproc-per-node", "2", "--redirects", "1", "w.py")
    assert r.stdout == ""
    assert "err 0" in r.stderr.splitlines()
    assert r.log(0, 0) == "out 0\n"


def test_local_ranks_filter(tmp_path: Path, script: WriteScript) -> None:
    script("w.py", HELLO)
    r = run_ftrun(tmp_path, "--nproc-per-node", "3", "--tee", "3", "--local-ranks-filter", "1", "w.py")
    assert r.stdout.splitlines() == ["[1]:out 1"]
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
