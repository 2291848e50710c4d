"""Failure reports from worker records: root cause first, ftrun's own stops set apart."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from ftrun.observe.reporting import FailureReport, build_report, render, write_json
from ftrun.procs.logs import RankPaths
from ftrun.procs.workers import ProcessPhase, Worker, WorkerState
from ftrun.worker.errorfile import exception_record


def worker(
    tmp_path: Path,
    rank: int,
    state: WorkerState,
    returncode: int,
    exit_mono: float,
    stderr: str = "",
) -> Worker:
    paths = RankPaths.under(tmp_path, rank)
    paths.dir.mkdir(parents=True)
    paths.stderr.write_text(stderr)
    return Worker(
        rank=rank,
        local_rank=rank,
        attempt=0,
        paths=paths,
        argv=["x"],
        env={},
        state=state,
        exit_mono=exit_mono,
        exit_wall=1_700_000_000.0 + exit_mono,
        returncode=returncode,
    )


def build(workers: list[Worker]) -> FailureReport:
    return build_report(workers, run_id="r", attempt=0, will_restart=False, master_port=1, host="h")


def report_of(workers: list[Worker], port: int = 29500) -> str:
    r = build_report(workers, run_id="r", attempt=0, will_restart=True, master_port=port, host="h")
    return render(r)


def test_earliest_failure_is_the_root_cause(tmp_path: Path) -> None:
    late = worker(tmp_path, 0, WorkerState.FAILED, 1, 5.0, "RuntimeError: Connection closed by peer\n")
    early = worker(tmp_path, 1, WorkerState.FAILED, -signal.SIGSEGV, 4.0)
    stopped = worker(tmp_path, 2, WorkerState.STOPPED, -signal.SIGTERM, 5.1)
    r = build_report([late, early, stopped], run_id="r", attempt=0, will_restart=False, master_port=1, host="h")
    assert r.root_cause.rank == 1
    assert r.root_cause.signal == "SIGSEGV"
    assert [o.rank for o in r.other_failures] == [0]
    assert [o.rank for o in r.stopped_by_ftrun] == [2]
    text = render(r)
    assert text.index("ROOT CAUSE  rank 1") < text.index("ALSO FAILED rank 0") < text.index("STOPPED BY FTRUN rank 2")
    assert "killed by SIGSEGV" in text


def test_stderr_tail_stands_in_for_a_missing_error_file(tmp_path: Path) -> None:
    tb = "Traceback (most recent call last):\n  File 'train.py', line 3\nValueError: bad shape\n"
    text = report_of([worker(tmp_path, 0, WorkerState.FAILED, 1, 1.0, "noise\n" * 50 + tb)])
    assert "last 20 lines of stderr" in text
    assert "ValueError: bad shape" in text


def test_a_fatal_errors_list_of_extension_modules_is_cut_to_its_count(tmp_path: Path) -> None:
    modules = ", ".join(f"pkg{i}._ext" for i in range(87))
    dump = (
        "Fatal Python error: Aborted\n\nCurrent thread 0x00007f (most recent call first):\n"
        '  File "/job/train.py", line 3 in inner\n\n'
        f"Extension modules: {modules} (total: 87)\n"
    )
    text = report_of([worker(tmp_path, 0, WorkerState.FAILED, -signal.SIGABRT, 1.0, dump)])
    assert "Fatal Python error: Aborted" in text
    assert "Extension modules: pkg0._ext, pkg1._ext, ... (total: 87)" in text
    assert "pkg50._ext" not in text


def test_error_file_traceback_wins(tmp_path: Path) -> None:
    w = worker(tmp_path, 0, WorkerState.FAILED, 1, 1.0, "unrelated\n")
    try:
        raise OSError("disk full")
    except OSError as e:
        w.paths.error_file.write_text(json.dumps(exception_record(e, 0)))
    text = report_of([w])
    assert "traceback (from ftrun error file" in text
    assert "OSError: disk full" in text


def test_corrupt_error_file_is_reported_not_fatal(tmp_path: Path) -> None:
    w = worker(tmp_path, 0, WorkerState.FAILED, 1, 1.0, "boom\n")
    w.paths.error_file.write_text("{garbage")
    text = report_of([w])
    assert "error file unreadable" in text
    assert "boom" in text


def test_port_in_use_is_named(tmp_path: Path) -> None:
    w = worker(tmp_path, 0, WorkerState.FAILED, 1, 1.0, "OSError: [Errno 98] Address already in use\n")
    assert "MASTER_PORT 29544 was already in use" in report_of([w], port=29544)


def test_json_report(tmp_path: Path) -> None:
    w = worker(tmp_path, 0, WorkerState.FAILED, 3, 1.0)
    r = build_report([w], run_id="r", attempt=2, will_restart=False, master_port=1, host="h")
    write_json(r, tmp_path / "report.json")
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["attempt"] == 2
    assert doc["root_cause"]["exit_code"] == 3


def test_the_first_exception_wins_over_the_first_exit(tmp_path: Path) -> None:
    """The rank that raised first is the root cause even when a peer it broke exits before it."""
    raised_first = worker(tmp_path, 1, WorkerState.FAILED, 1, 5.0)  # slow teardown: exits last
    broken_peer = worker(tmp_path, 0, WorkerState.FAILED, 1, 4.0)
    for w, offset in ((raised_first, 3.0), (broken_peer, 3.5)):
        try:
            raise RuntimeError(f"rank {w.rank}")
        except RuntimeError as e:
            doc = exception_record(e, w.rank)
        doc["ftrun"]["timestamp"] = 1_700_000_000.0 + offset
        w.paths.error_file.write_text(json.dumps(doc))
    r = build_report([broken_peer, raised_first], run_id="r", attempt=0, will_restart=True, master_port=1, host="h")
    assert r.root_cause.rank == 1
    assert [o.rank for o in r.other_failures] == [0]


def test_a_sigkill_gets_the_oom_hint_only_when_the_kernel_counted_an_oom_kill(tmp_path: Path) -> None:
    killed = worker(tmp_path, 0, WorkerState.FAILED, -signal.SIGKILL, 1.0)
    quiet = build_report([killed], run_id="r", attempt=0, will_restart=False, master_port=1, host="h")
    assert quiet.hint is None
    oom = build_report([killed], run_id="r", attempt=0, will_restart=False, master_port=1, host="h", oom_killed=True)
    assert oom.hint is not None
    assert "out-of-memory killer" in oom.hint


def test_a_stopped_ranks_secondary_error_is_one_line_of_the_report(tmp_path: Path) -> None:
    root = worker(tmp_path, 1, WorkerState.FAILED, 1, 1.0, "ValueError: bad batch\n")
    echo = (
        "[rank0]: Traceback (most recent call last):\n[rank0]:   x\n[rank0]: RuntimeError: Connection closed by peer\n"
    )
    stopped = worker(tmp_path, 0, WorkerState.STOPPED, -signal.SIGTERM, 1.1, echo)
    text = report_of([root, stopped])
    assert "a secondary error, after the root cause: RuntimeError: Connection closed by peer" in text
    assert "[rank0]: Traceback" not in text


def test_a_lost_exit_status_is_reported_as_unknown_never_invented(tmp_path: Path) -> None:
    w = worker(tmp_path, 0, WorkerState.FAILED, 1, 1.0)
    w.phase = ProcessPhase.STATUS_LOST  # reaped, its status lost (AttemptProcesses' move)
    assert w.exit_code is None
    assert w.signal is None
    text = report_of([w])
    assert "exit status unknown" in text
    assert "exit code" not in text.split("ROOT CAUSE")[1].splitlines()[0]


def test_the_flight_recorder_torch_dumped_at_a_timeout_is_named_with_how_to_read_it(tmp_path: Path) -> None:
    """NCCL's watchdog dumps it where ftrun pointed torch (TORCH_FR_DUMP_TEMP_FILE: the attempt's directory)."""
    timed_out = worker(tmp_path, 1, WorkerState.FAILED, -signal.SIGABRT, 1.0, "Watchdog caught collective timeout\n")
    later = worker(tmp_path, 0, WorkerState.FAILED, -signal.SIGABRT, 2.0)
    assert "flight recorder" not in report_of([timed_out, later])
    timed_out.paths.flight_recorder.parent.mkdir()
    dump = timed_out.paths.flight_recorder.with_name("rank_1")
    dump.write_bytes(b"\x80pickled")
    text = report_of([timed_out, later])
    said = f"torch dumped its flight recorder at the timeout: {dump} (read all ranks': python -m torch.distributed"
    assert said in text
    assert text.count("flight recorder") == 1  # rank 0's was not written


def test_an_exception_groups_summary_is_the_group_and_its_first_sub_exception(tmp_path: Path) -> None:
    tb = (
        "[rank1]:   + Exception Group Traceback (most recent call last):\n"
        '[rank1]:   |   File "/tmp/job.py", line 10, in <module>\n'
        '[rank1]:   |     raise ExceptionGroup("two failed", [ValueError("a"), KeyError("b")])\n'
        "[rank1]:   | ExceptionGroup: two failed (2 sub-exceptions)\n"
        "[rank1]:   +-+---------------- 1 ----------------\n"
        "[rank1]:     | ValueError: a\n"
        "[rank1]:     +---------------- 2 ----------------\n"
        "[rank1]:     | KeyError: 'b'\n"
        "[rank1]:     +------------------------------------\n"
    )
    r = build([worker(tmp_path, 1, WorkerState.FAILED, 1, 1.0, tb)])
    assert r.root_cause.last_error == "ExceptionGroup: two failed (2 sub-exceptions); the first: ValueError: a"


def test_a_last_line_longer_than_what_is_read_of_the_log_is_shown_by_its_start(tmp_path: Path) -> None:
    tb = "Traceback (most recent call last):\n  File 'train.py', line 3\nValueError: " + "x" * 2_000_000 + "\n"
    r = build([worker(tmp_path, 0, WorkerState.FAILED, 1, 1.0, tb)])
    assert r.root_cause.last_error is not None
    assert r.root_cause.last_error.startswith("ValueError: xxx")
    assert r.root_cause.last_error.endswith("[... cut: a line of 2000012 bytes, whole in the log]")
    assert "wrote nothing" not in render(r)
    assert r.root_cause.cause.endswith("x [...]")
    assert len(r.root_cause.summary()) < 500


ECHO = "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5555\n"


def test_a_rank_that_ended_its_script_before_its_peers_echo_is_the_root_cause(tmp_path: Path) -> None:
    """Uneven data: rank 0's broken collective is the echo of ranks that had ended (rank 1 cut in its teardown,
    rank 2 exited 0 before): the first of them to end is the root cause, rank 0's error the next line."""
    echo = worker(tmp_path, 0, WorkerState.FAILED, 1, 5.0, ECHO)
    ended = worker(tmp_path, 1, WorkerState.STOPPED, -signal.SIGTERM, 5.1)
    ended.script_over, ended.script_ended_wall = True, 3.0
    finished = worker(tmp_path, 2, WorkerState.SUCCEEDED, 0, 4.0)
    running = worker(tmp_path, 3, WorkerState.STOPPED, -signal.SIGTERM, 5.1)
    r = build([echo, ended, finished, running])
    assert (r.root_cause.rank, r.root_cause.left) == (1, "rank 0")
    assert [o.rank for o in r.other_failures] == [0]
    assert r.hint is not None
    assert r.hint.startswith("rank 0's error is the echo: it called a collective with ranks 1, 2, whose script")
    assert r.root_cause.summary().startswith("rank 1 (local rank 1, pid 0 on ")
    assert "its script ended while rank 0 still called collectives with it" in r.root_cause.summary()
    text = render(r)
    assert "ROOT CAUSE  rank 1 (local rank 1, pid 0) on " in text
    assert "ALSO FAILED rank 0 (local rank 0, pid 0): exit code 1" in text
    assert "STOPPED BY FTRUN rank 1" not in text
    assert "STOPPED BY FTRUN rank 3 (local rank 3, pid 0): killed by SIGTERM\n" in text


def test_a_failure_of_its_own_after_a_rank_ended_gets_no_such_hint(tmp_path: Path) -> None:
    own = worker(tmp_path, 0, WorkerState.FAILED, 1, 5.0, "OSError: [Errno 28] No space left on device\n")
    finished = worker(tmp_path, 1, WorkerState.SUCCEEDED, 0, 4.0)
    r = build([own, finished])
    assert r.hint is None


def test_a_command_line_error_is_the_root_causes_headline(tmp_path: Path) -> None:
    usage = "usage: train.py [-h] --lr LR\ntrain.py: error: the following arguments are required: --lr\n"
    r = build([worker(tmp_path, 0, WorkerState.FAILED, 2, 1.0, usage)])
    assert r.root_cause.cause == "exit code 2: train.py: error: the following arguments are required: --lr"


def test_a_last_line_that_is_no_command_line_error_is_no_headline(tmp_path: Path) -> None:
    noise = "wandb: Find logs at: ./wandb/run-1/logs\n"
    for code in (1, 2):
        r = build([worker(tmp_path / str(code), 0, WorkerState.FAILED, code, 1.0, noise)])
        assert r.root_cause.cause == f"exit code {code}"


def test_a_tails_control_bytes_and_colours_are_left_out(tmp_path: Path) -> None:
    """torch's DataLoader writes a NUL ahead of a worker's traceback; a coloured logger, escape sequences."""
    err = "\x00[rank1]: Traceback (most recent call last):\n\x1b[31mRuntimeError: DataLoader worker killed\x1b[0m\n"
    r = build([worker(tmp_path, 1, WorkerState.FAILED, 1, 1.0, err)])
    assert r.root_cause.stderr_tail == (
        "[rank1]: Traceback (most recent call last):",
        "RuntimeError: DataLoader worker killed",
    )
    assert r.root_cause.last_error == "RuntimeError: DataLoader worker killed"
