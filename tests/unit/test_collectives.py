"""The rules of the no-flag hang watch: the flight recorder's summary (worker side) and which rank the others
wait for, and whether it moves (agent side)."""

from __future__ import annotations

import json

import pytest

from ftrun.monitor.collectives import (
    Patience,
    Progress,
    RankCollectives,
    Sample,
    culprits,
    stalls,
    suspects,
)
from ftrun.worker.collectives import group_counts, group_names, merged, summary, waited_since

# What torch 2.13's recorder said (onlyActive) on rank 0 of a gloo job while rank 1 slept before all_reduce #2.
RECORD = {
    "pg_status": {"0": {"last_completed_collective": "1", "last_enqueued_collective": "2"}},
    "entries": [
        {"collective_seq_id": 1, "profiling_name": "gloo:all_reduce", "retired": True, "is_p2p": False,
         "input_sizes": [[1000]], "input_dtypes": ["Float"], "process_group": ["0", "default_pg"],
         "time_created_ns": 1_000_000_000_000},
        {"collective_seq_id": 2, "profiling_name": "gloo:all_reduce", "retired": False, "is_p2p": False,
         "input_sizes": [[1000], [24]], "input_dtypes": ["Float", "Long"], "process_group": ["0", "default_pg"],
         "time_created_ns": 1_000_500_000_000},
    ],
}  # fmt: skip


def test_the_summary_keeps_per_group_the_collective_in_flight() -> None:
    s = summary(RECORD, now=1010.0, stack_since=1000.2, where="train.py:10")
    assert s["g"] == [["0", "default_pg", 2, 1, [2, "all_reduce", 4000 + 24 * 8, 1000.5]]]
    assert (s["t"], s["s"], s["w"]) == (1010.0, 1000.2, "train.py:10")


def test_a_group_with_nothing_in_flight_and_one_never_used() -> None:
    record = {"pg_status": {"0": {"last_completed_collective": "4", "last_enqueued_collective": "4"},
                            "1": {"last_completed_collective": "-1", "last_enqueued_collective": "-1"}}}  # fmt: skip
    assert summary(record, 1.0, 1.0, "")["g"] == [["0", "", 4, 4, None]]


def test_nccl_keeps_its_own_recorder_and_both_are_read() -> None:
    """What NCCL's recorder held on an H200 (torch 2.11) while all_reduce #26 waited behind a spinning kernel; the
    generic recorder (gloo's) had nothing of that group: the two read together show the collective in flight."""
    nccl = {
        "pg_status": {"0": {"last_enqueued_collective": 26, "last_started_collective": -1,
                            "last_completed_collective": 25}},
        "entries": [{"collective_seq_id": 26, "profiling_name": "nccl:all_reduce", "retired": False, "is_p2p": False,
                     "input_sizes": [[1]], "input_dtypes": ["Float"], "process_group": ["0", "default_pg"],
                     "time_created_ns": 1_795_749_369_975_421_899, "state": "scheduled"}],
    }  # fmt: skip
    generic = {"pg_status": {"0": {"last_enqueued_collective": -1, "last_completed_collective": -1}}, "entries": []}
    s = summary(merged([generic, nccl]), now=1_795_749_400.0, stack_since=1_795_749_370.0, where="")
    assert s["g"] == [["0", "default_pg", 26, 25, [26, "all_reduce", 4, 1_795_749_369.975421899]]]
    assert merged([nccl, generic])["pg_status"]["0"]["last_enqueued_collective"] == 26


def test_a_process_restarted_in_place_names_its_new_group_as_a_new_process_does() -> None:
    """What torch 2.13's recorder said on rank 0, restarted in place, while rank 1 slept before all_reduce #31 of
    the next attempt: the status is keyed by group id (the first attempt's default group 0, this one's 1), the
    entries by name too (both "0"), and the first attempt's collective, cut off by the interrupt, never retired."""
    record = {
        "pg_status": {"0": {"last_completed_collective": "5", "last_enqueued_collective": "6"},
                      "1": {"last_completed_collective": "30", "last_enqueued_collective": "31"}},
        "entries": [
            {"pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 6, "retired": False,
             "profiling_name": "gloo:all_reduce", "input_sizes": [[16]], "input_dtypes": ["Float"],
             "time_created_ns": 1_000_000_000_000},
            {"pg_id": 1, "process_group": ["0", "default_pg"], "collective_seq_id": 31, "retired": False,
             "profiling_name": "gloo:all_reduce", "input_sizes": [[16]], "input_dtypes": ["Float"],
             "time_created_ns": 1_030_000_000_000},
        ],
    }  # fmt: skip
    assert group_names(record) == {"0": ("0", "default_pg"), "1": ("0", "default_pg")}
    assert summary(record, 1040.0, 1030.0, "")["g"] == [["0", "default_pg", 31, 30, [31, "all_reduce", 64, 1030.0]]]
    counts_only = {"pg_status": record["pg_status"]}  # a read without entries: the names learnt before
    s = summary(counts_only, 1040.0, 1030.0, "", group_names(record))
    assert s["g"] == [["0", "default_pg", 31, 30, None]]


def test_the_entries_are_read_only_where_a_collective_has_been_in_flight_since_the_last_read() -> None:
    """A whole dump holds the GIL for tens of milliseconds: read every second, it cost a job 12-30% of its steps."""
    assert group_counts(RECORD) == {"0": (2, 1)}
    in_flight, busy, idle = {"0": (2, 1)}, {"0": (9, 8)}, {"0": (2, 2)}
    assert not waited_since({}, in_flight)  # the first read: nothing to compare with
    assert not waited_since(idle, in_flight)  # entered since, as a step does
    assert not waited_since(in_flight, busy)  # collectives finished since: a job at work
    assert waited_since(in_flight, in_flight)  # #2 in flight a whole poll
    assert waited_since(in_flight, {"0": (5, 1)})  # more entered behind it, none finished
    assert not waited_since(idle, idle)  # nothing in flight
    assert waited_since({"0": (4, 4), "1": (3, 2)}, {"0": (6, 6), "1": (3, 2)})  # one group of several


def rank(n: int, groups: list[list[object]], read_at: float = 100.0, stack_since: float = 0.0) -> RankCollectives:
    raw = json.dumps({"t": read_at, "s": stack_since, "w": f"train.py:{n}", "g": groups}).encode()
    return RankCollectives.parse(n, raw)


def waits(seq: int, since: float, group: str = "0") -> list[object]:
    return [group, "default_pg", seq, seq - 1, [seq, "all_reduce", 4 << 20, since]]


def test_the_rank_that_never_entered_is_named_with_the_collective() -> None:
    now = 100.0
    ranks = [rank(0, [waits(7, 80.0)]), rank(1, [waits(7, 81.0)]), rank(2, [["0", "default_pg", 6, 6, None]])]
    [stall] = stalls(ranks, now)
    assert stall.missing == (2,)
    assert stall.seq == 7
    said = stall.describe(2, "12:01:03")
    assert said == "rank 2 never entered all_reduce #7 (default_pg, 4.0 MB) that ranks 0-1 entered at 12:01:03"


def test_nobody_is_missing_when_every_rank_is_in_the_collective_or_none_waits_long() -> None:
    assert stalls([rank(0, [waits(7, 99.5)]), rank(1, [["0", "", 6, 6, None]])], 100.0) == []  # 0.5 s: a step
    [stall] = stalls([rank(0, [waits(7, 80.0)]), rank(1, [waits(7, 80.0)])], 100.0)
    assert stall.missing == ()
    said = stall.describe(1, "12:01:03")  # judged as a whole, once none of them moves: named the one that stopped first
    assert said.startswith("ranks 0-1 entered all_reduce #7 (default_pg, 4.0 MB) at ")
    assert said.endswith("; it never finished (rank 1 stopped moving first)")


def test_a_rank_that_entered_the_collective_a_moment_ago_waits_in_it_too() -> None:
    """Rank 1 waits 20 s in #7; rank 0 entered it 1 s ago: nobody is missing, and both wait in it (a verdict
    that named rank 1 alone as having entered it was seen in CI on a loaded machine)."""
    [stall] = stalls([rank(0, [waits(7, 99.0)]), rank(1, [waits(7, 80.0)])], 100.0)
    assert (stall.missing, [r for r, _ in stall.waiting]) == ((), [0, 1])
    assert stall.since == 80.0
    assert stall.describe(1, "12:01:03").startswith("ranks 0-1 entered all_reduce #7")


def test_a_rank_stuck_in_a_collective_of_another_group_is_still_the_one_missing() -> None:
    """Every stack is in a collective: ranks 0-1 in the default group's #7, rank 2 in group 1's #3, which
    waits for rank 1 (a deadlock by order): the default group's missing member is rank 2."""
    ranks = [
        rank(0, [waits(7, 80.0)]),
        rank(1, [waits(7, 80.0), ["1", "pair", 2, 2, None]]),
        rank(2, [["0", "default_pg", 6, 6, None], waits(3, 80.0, group="1")]),
    ]
    found = [(s.group, s.missing) for s in stalls(ranks, 100.0)]
    assert found == [("0", (2,)), ("1", (1,))]  # the one most ranks wait in first: rank 2 went astray


def sample(at: float, cpu: float = 1.0, io: int = 0, stopped: bool = False, others: float = 0.0) -> Sample:
    return Sample(at, cpu, others, io, stopped)


def test_progress_stack_cpu_or_io_moving_is_progress() -> None:
    p = Progress()
    r = rank(2, [], read_at=130.0, stack_since=100.0)
    p.add(2, sample(100.0), r.where)
    for t in range(101, 131):
        p.add(2, sample(float(t)), r.where)
    assert p.quiet_since(r, 130.0) == 100.0  # nothing moved for 30 s
    p.add(2, sample(131.0, cpu=1.2), r.where)  # 0.2 s of CPU in 1 s: working
    assert p.quiet_since(r, 131.0) == 131.0
    p.add(2, sample(132.0, cpu=1.2, io=4096), r.where)
    assert p.quiet_since(r, 132.0) == 132.0
    moved = rank(2, [], read_at=140.0, stack_since=139.0)
    assert p.quiet_since(moved, 140.0) == 139.0


def test_io_that_only_polls_is_not_progress_but_a_slow_read_is() -> None:
    """NCCL's monitor asks the job's store every second whether to dump (some 100 bytes a second, for as long
    as the process lives): a rank stuck in a collective on NCCL would never look quiet if that counted."""
    p = Progress()
    r = rank(0, [], read_at=130.0, stack_since=100.0)
    for t in range(100, 131):
        p.add(0, sample(float(t), io=150 * (t - 100)), r.where)
    assert p.quiet_since(r, 130.0) == 100.0
    p.add(0, sample(131.0, io=150 * 31 + 20 * 1024), r.where)  # 20 KiB in a second: a slow read
    assert p.quiet_since(r, 131.0) == 131.0


def test_a_host_spinning_on_the_gpu_or_a_stopped_process_is_not_progress() -> None:
    p = Progress()
    where = "/usr/lib/python3/site-packages/torch/cuda/__init__.py:1040"
    r = rank(2, [], read_at=120.0)
    p.add(2, sample(100.0, cpu=1.0), where)
    p.add(2, sample(120.0, cpu=21.0), where)  # a core's worth of spinning in synchronize
    assert p.quiet_since(r, 120.0) == 100.0
    p.add(2, sample(121.0, cpu=22.0, stopped=True), "train.py:3")
    assert p.quiet_since(r, 121.0) == 100.0


def test_other_threads_waking_for_a_held_gil_are_not_progress_but_their_work_is() -> None:
    """A main thread holding the GIL in C: the process's other threads wake every 5 ms to ask for it, a few
    percent of a core under load. A worker thread doing the work the main thread waits for uses far more."""
    p = Progress()
    r = rank(2, [], read_at=0.0)
    for t in range(31):
        p.add(2, sample(100.0 + t, others=0.04 * t), "")  # 4% of a core
    assert p.quiet_since(r, 130.0) == 100.0
    p.add(2, sample(131.0, others=0.04 * 30 + 0.5), "")  # half a core
    assert p.quiet_since(r, 131.0) == 131.0


def test_a_summary_gone_stale_tells_no_stack_change() -> None:
    """Its watcher cannot run (the GIL held in C): the stack it last read is old news, CPU and I/O decide."""
    p = Progress()
    p.add(2, sample(100.0), "")
    stale = rank(2, [], read_at=95.0, stack_since=94.0)
    assert p.quiet_since(stale, 100.0 + Patience().quiet_s) == 100.0


@pytest.mark.parametrize("bad", [b"", b"[]", b'{"t": 1}', b'{"t":1,"s":1,"w":"","g":[["0","",1]]}'])
def test_an_unreadable_summary_is_a_value_error(bad: bytes) -> None:
    with pytest.raises(ValueError, match="summary of collectives"):
        RankCollectives.parse(0, bad)


def test_a_summary_left_in_a_collective_the_others_finished_is_not_a_wait() -> None:
    """Rank 2's watcher last wrote during all-reduce #2, then its main thread took the GIL for good: #2 finished
    everywhere (ranks 0-1 finished #5), so rank 2 is the one missing from #6, not a rank waiting in #2."""
    stale = ["0", "default_pg", 2, 1, [2, "all_reduce", 4096, 40.0]]
    ranks = [rank(0, [waits(6, 80.0)]), rank(1, [waits(6, 80.0)]), rank(2, [stale], read_at=41.0)]
    [stall] = stalls(ranks, 100.0)
    assert (stall.seq, stall.missing, [r for r, _ in stall.waiting]) == (6, (2,), [0, 1])


def test_a_rank_whose_watcher_never_wrote_is_missing_from_the_default_group() -> None:
    """It holds its GIL since right after init_process_group: its watcher never ran."""
    [stall] = stalls([rank(0, [waits(6, 80.0)]), RankCollectives.unseen(1)], 100.0)
    assert stall.missing == (1,)
    assert stalls([rank(0, [waits(3, 80.0, group="5")]), RankCollectives.unseen(1)], 100.0)[0].missing == ()


def test_the_waits_before_a_verdict_follow_one_setting() -> None:
    assert (Patience().quiet_s, Patience().waited_s, Patience().unfinished_s) == (20.0, 10.0, 40.0)
    assert (Patience(4.0).waited_s, Patience(4.0).unfinished_s) == (2.0, 8.0)


def test_of_ranks_none_of_which_moves_the_one_that_stopped_first_is_blamed() -> None:
    summaries = {r: rank(r, [waits(7, 80.0)], stack_since=since) for r, since in ((0, 95.0), (1, 97.0), (2, 90.0))}
    [stall] = stalls(summaries.values(), 100.0)
    watched = suspects([stall], Patience(10.0))
    assert watched is not None
    assert (watched.ranks, watched.quiet_s, watched.whole) == ({0, 1, 2}, 20.0, True)
    quiet = {0: (25.0, False), 1: (25.0, True), 2: (25.0, False)}
    assert culprits(watched, quiet, summaries, 100.0, Patience(10.0)) == [1]  # a stopped process first
    quiet[1] = (25.0, False)
    assert culprits(watched, quiet, summaries, 100.0, Patience(10.0)) == [2]  # else the stack still longest
    quiet[0] = (3.0, False)
    assert culprits(watched, quiet, summaries, 100.0, Patience(10.0)) == []  # one moves: slow, not hung
    quiet[0] = None
    assert culprits(watched, quiet, summaries, 100.0, Patience(10.0)) == []  # one is gone: its exit tells


def calls(seq: int, op: str, nbytes: int) -> list[object]:
    return ["0", "default_pg", seq, seq - 1, [seq, op, nbytes, 80.0]]


def test_ranks_in_different_collectives_at_one_count_are_a_mismatch_and_the_odd_call_is_blamed() -> None:
    """Rank 2 left its loop a step early (its data was shorter) and waits in a barrier where the others wait in
    all_reduce #7: not a collective every rank entered that never finishes, but a mismatch, which never does."""
    ops = {0: ("all_reduce", 16), 1: ("all_reduce", 16), 2: ("barrier", 0)}
    summaries = {r: rank(r, [calls(7, op, n)], stack_since=90.0 + r) for r, (op, n) in ops.items()}
    [stall] = stalls(summaries.values(), 100.0)
    assert stall.missing == ()
    watched = suspects([stall], Patience(10.0))
    assert watched is not None
    quiet = dict.fromkeys(ops, (25.0, False))
    assert culprits(watched, quiet, summaries, 100.0, Patience(10.0)) == [2]  # not rank 0, whose stack is oldest
    said = stall.describe(2, "12:01:03")
    assert said == (
        "ranks 0-2 called different collectives as #7 of default_pg at 12:01:03 (ranks 0-1 all_reduce of 16 B; "
        "rank 2 barrier of 0 B): a mismatch, which never finishes (rank 2's call is the odd one)"
    )


def test_a_rank_still_in_a_collective_the_others_finished_is_named_with_it() -> None:
    """Rank 0's all_reduce #4 had 16 B, rank 1's 12 B: gloo finished rank 1's, never rank 0's; rank 1 waits
    in #5. Rank 0 never entered #5 indeed, and the verdict says where it is instead."""
    behind = ["0", "default_pg", 4, 3, [4, "all_reduce", 16, 80.0]]
    [stall] = stalls([rank(0, [behind]), rank(1, [calls(5, "all_reduce", 16)])], 100.0)
    assert stall.missing == (0,)
    assert stall.describe(0, "12:01:03") == (
        "rank 0 never entered all_reduce #5 (default_pg, 16 B) that rank 1 entered at 12:01:03: it is still in "
        "all_reduce #4 (16 B), which rank 1 finished (did the ranks' calls #4 match, in size and kind?)"
    )


def test_a_mismatch_of_as_many_ranks_each_way_blames_the_rank_that_stopped_first() -> None:
    summaries = {r: rank(r, [calls(7, "all_reduce", 16 * (r + 1))], stack_since=95.0 - 5 * r) for r in (0, 1)}
    [stall] = stalls(summaries.values(), 100.0)
    watched = suspects([stall], Patience(10.0))
    assert watched is not None
    assert culprits(watched, {0: (25.0, False), 1: (25.0, False)}, summaries, 100.0, Patience(10.0)) == [1]
    assert stall.describe(1, "12:01:03").endswith(
        "(rank 0 all_reduce of 16 B; rank 1 all_reduce of 32 B): a mismatch, which never finishes "
        "(rank 1 stopped moving first)"
    )


def test_the_members_missing_from_a_collective_are_suspects_before_a_collective_every_member_entered() -> None:
    behind = ["0", "default_pg", 5, 5, None]  # rank 1 never entered the 6th
    summaries = {0: rank(0, [waits(6, 80.0)]), 1: rank(1, [behind]), 2: rank(2, [waits(6, 80.0)])}
    found = stalls(summaries.values(), 100.0)
    watched = suspects(found, Patience(10.0))
    assert watched is not None
    assert (watched.ranks, watched.quiet_s, watched.whole) == ({1}, 10.0, False)
    assert culprits(watched, {1: (12.0, False)}, summaries, 100.0, Patience(10.0)) == [1]
    assert culprits(watched, {1: (8.0, False)}, summaries, 100.0, Patience(10.0)) == []  # not quiet long enough
    assert culprits(watched, {1: (12.0, False)}, summaries, 84.0, Patience(10.0)) == []  # others waited 4 s only
    assert suspects([], Patience(10.0)) is None


def test_a_stack_that_only_comes_back_to_the_same_places_is_a_loop() -> None:
    from ftrun.worker.collectives import Places

    places = Places(0.0)
    spin = ((("job.py", 10),), (("<genexpr>", 10), ("job.py", 10)))
    for t in range(1, 30):
        places.add(spin[t % 2], float(t))
    assert places.since == 0.0  # round the same two places for 30 s
    for t, line in enumerate(range(20, 24), start=30):  # new places: working its way through something
        places.add((("job.py", line),), float(t))
    assert places.since == 31.0  # the fourth place


def test_a_slow_data_loader_is_never_a_loop() -> None:
    from ftrun.worker.collectives import Places

    places = Places(0.0)
    batch = (("dataset.py", 7), ("/site-packages/torch/utils/data/_utils/fetch.py", 52), ("train.py", 30))
    for t in range(1, 30):
        places.add(batch, float(t))
    assert places.since == 29.0


def test_cpu_time_going_round_a_loop_is_no_progress() -> None:
    progress = Progress()
    looping = rank(1, [], read_at=130.0, stack_since=129.0)
    looping = RankCollectives(1, 130.0, 129.0, looping.where, (), loop_from=100.0)
    assert looping.looping
    for t in (100.0, 110.0, 130.0):
        progress.add(1, Sample(t, main_cpu_s=t, other_cpu_s=0.0, io_bytes=0, stopped=False), "w.py:3", looping=True)
    assert progress.quiet_since(looping, 130.0) == 100.0  # a whole core busy, yet quiet for 30 s
    busy = Progress()
    for t in (100.0, 110.0, 130.0):
        busy.add(1, Sample(t, main_cpu_s=t, other_cpu_s=0.0, io_bytes=0, stopped=False), "w.py:3")
    assert busy.quiet_since(looping, 130.0) == 130.0  # the same CPU time outside a loop: progress


def test_a_rank_waiting_to_read_its_terminal_is_a_persons_pause_not_quiet() -> None:
    r = rank(1, [], read_at=130.0, stack_since=100.0)
    at_a_prompt, silent = Progress(), Progress()
    for t in (100.0, 115.0, 130.0):
        at_a_prompt.add(1, Sample(t, 1.0, 0.0, 0, stopped=False, waiting_for="a person at its terminal"), "cmd.py:126")
        silent.add(1, Sample(t, 1.0, 0.0, 0, stopped=False), "cmd.py:126")
    assert at_a_prompt.quiet_since(r, 130.0) == 130.0  # no CPU, no I/O, the same place: and yet not quiet
    assert silent.quiet_since(r, 130.0) == 100.0


def test_a_summary_without_loops_reads_as_before() -> None:
    r = rank(2, [], read_at=130.0, stack_since=100.0)
    assert r.new_place_since == 100.0
    assert not r.looping
