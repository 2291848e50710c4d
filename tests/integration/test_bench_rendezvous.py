"""The rendezvous benchmark's harness keeps working: a small job on the real embedded store, over two harness
processes with shared connections and pooled lease renewals, prints its row with a constant number of store
calls per node. The figures themselves are the benchmark's (README), never asserted here."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rendezvous.py"


def test_the_rendezvous_benchmark_forms_both_rounds_and_prints_its_row() -> None:
    bench = subprocess.Popen(
        [sys.executable, str(BENCH), "--sizes", "96", "--backends", "tcp", "--procs", "2", "--steppers", "2",
         "--idle", "0", "--torch-max", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = bench.communicate(timeout=300)
    finally:  # the store and the harness processes too, whatever happened
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)
        bench.wait()
    assert bench.returncode == 0, err
    row = next(line for line in out.splitlines() if line.startswith("tcp "))
    fields = row.split()
    assert fields[1] == "96"
    ops_mean, ops_max = (float(x) for x in fields[3].split("/"))
    assert 4.0 <= ops_mean <= 6.5  # register, list, watch, read its place...: a few calls, not one per node
    assert ops_max < 96  # the leader's: chunks of places, not a call per member
    assert re.fullmatch(r"\d+\.\d+", fields[5])  # the rejoin happened (a time, not an error)
