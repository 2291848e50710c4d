"""The pure hang verdicts: slots, now and timeouts in; verdicts and the next deadline out."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ftrun.monitor.watchdog import BLAME_WINDOW_S, Watched, published, scan
from ftrun.worker.layout import FLAG_EXITING, SlotView
from ftrun.worker.timeouts import MIN_CALCULATED_S, Timeouts, scaled


def slot(
    *,
    beats: int = 0,
    last_beat: float = 0.0,
    sections: tuple[tuple[str, float], ...] = (),
    idle_since: float = 0.0,
    timeouts: bytes = b"",
) -> SlotView:
    return SlotView(
        pid=100,
        attached=0.0,
        last_beat=last_beat,
        beats=beats,
        idle_since=idle_since,
        sections=sections,
        flags=0,
        timeouts_seq=1 if timeouts else 0,
        timeouts_json=timeouts,
    )


T = Timeouts(initial_heartbeat=10.0, heartbeat=2.0, out_of_section=5.0, sections={"step": 3.0})

CASES = [
    # (name, slot, now, expected verdict timers, expected next deadline)
    ("no client yet, before the initial timeout", None, 9.0, [], 10.0),
    ("no client yet, past the initial timeout", None, 10.0, ["initial heartbeat"], None),
    ("attached, no beat yet: initial timer and out of section", slot(idle_since=1.0), 6.5, ["out of section"], 10.0),
    ("before the first section ends, out of section is off", slot(beats=1, last_beat=20.0), 21.0, [], 22.0),
    ("beating on time", slot(beats=3, last_beat=20.0, idle_since=19.0), 21.0, [], 22.0),
    ("beat overdue", slot(beats=3, last_beat=20.0, idle_since=21.5), 22.5, ["heartbeat"], 26.5),
    ("inside a section on time", slot(beats=1, last_beat=30.0, sections=(("step", 30.0),)), 31.0, [], 32.0),
    (
        "inside a section too long (no out-of-section timer while inside)",
        slot(beats=1, last_beat=33.0, sections=(("step", 30.0),)),
        33.5,
        ["section 'step'"],
        35.0,
    ),
    (
        "a section without a timeout is not judged",
        slot(beats=1, last_beat=40.0, sections=(("io", 0.0),)),
        41.0,
        [],
        42.0,
    ),
    (
        "earliest deadline first",
        slot(beats=1, last_beat=10.0, sections=(("step", 9.5),)),
        20.0,
        ["heartbeat", "section 'step'"],
        None,
    ),
]


@pytest.mark.parametrize(("name", "s", "now", "timers", "next_deadline"), CASES, ids=[c[0] for c in CASES])
def test_verdicts(name: str, s: SlotView | None, now: float, timers: list[str], next_deadline: float | None) -> None:
    result = scan([Watched(0, 0.0, s)], now, T)
    assert [v.timeout for v in result.verdicts] == timers
    assert result.next_deadline == next_deadline


def test_a_worker_past_its_script_is_not_judged() -> None:
    exiting = replace(slot(beats=1, last_beat=1.0, idle_since=1.0), flags=FLAG_EXITING)
    assert scan([Watched(0, 0.0, exiting)], 100.0, T) == scan([], 100.0, T)


def test_calculated_timeouts_have_a_floor() -> None:
    assert scaled(Timeouts(heartbeat=1e-6, sections={"step": 1e-6}), 5.0) == Timeouts(
        heartbeat=MIN_CALCULATED_S, sections={"step": MIN_CALCULATED_S}
    )


def test_unset_timeouts_are_off() -> None:
    result = scan([Watched(0, 0.0, slot(beats=1, last_beat=1.0, sections=(("step", 1.0),)))], 1e9, Timeouts())
    assert result.verdicts == ()
    assert result.next_deadline is None


def test_the_first_rank_to_miss_comes_first() -> None:
    late = Watched(1, 0.0, slot(beats=1, last_beat=5.0, idle_since=100.0))
    later = Watched(0, 0.0, slot(beats=1, last_beat=6.0, idle_since=100.0))
    verdict = scan([later, late], 50.0, Timeouts(heartbeat=2.0)).verdicts
    assert [(v.local_rank, v.deadline) for v in verdict] == [(1, 7.0), (0, 8.0)]
    assert verdict[0].elapsed_s == pytest.approx(45.0)
    assert "heartbeat timeout of 2 s exceeded" in verdict[0].describe()


def test_calculated_timeouts_replace_configured_ones_and_ranks_agree_on_the_widest() -> None:
    configured = Timeouts(heartbeat=60.0, sections={"step": 30.0, "save": 100.0})
    rank0 = Timeouts(heartbeat=2.0, sections={"step": 1.0})
    rank1 = Timeouts(heartbeat=3.0, out_of_section=4.0)
    effective = configured.overridden_by(rank0.widest(rank1))
    assert effective == Timeouts(None, 3.0, 4.0, {"step": 1.0, "save": 100.0})


def test_scaled_observations() -> None:
    observed = Timeouts(initial_heartbeat=2.0, heartbeat=0.5, out_of_section=None, sections={"step": 0.2})
    # The start-up keeps a margin of 60 s over what was seen (a restart may load a checkpoint).
    assert scaled(observed, 5.0) == Timeouts(62.0, 2.5, None, {"step": 1.0})
    assert scaled(Timeouts(initial_heartbeat=20.0), 5.0).initial_heartbeat == 100.0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"heartbeat": -1}', "positive number"),
        (b'{"heartbeat": true}', "positive number"),
        (b'{"sections": {"step": "soon"}}', "positive number"),
        (b'{"exec": "rm -rf /"}', "unknown timeout key"),
    ],
)
def test_garbled_published_timeouts_are_refused_by_name(raw: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        published(slot(timeouts=raw))


def test_ranks_in_lockstep_blame_the_one_that_stopped_first() -> None:
    """Rank 1 hangs before its step; rank 0 enters the step and waits for it in a collective.
    Rank 0's heartbeat is a little older, so its deadline passes first: wait, then blame rank 1."""
    t = Timeouts(heartbeat=3.0)
    waiting = Watched(0, 0.0, slot(beats=55, last_beat=10.000, idle_since=9.990, sections=(("step", 10.010),)))
    hung = Watched(1, 0.0, slot(beats=55, last_beat=10.002, idle_since=10.001))
    first = scan([waiting, hung], 13.0005, t)
    assert [v.local_rank for v in first.verdicts] == [0]
    assert first.culprit(13.0005) is None  # rank 1's deadline is within the blame window
    later = scan([waiting, hung], 13.0005 + BLAME_WINDOW_S, t)
    culprit = later.culprit(13.0005 + BLAME_WINDOW_S)
    assert culprit is not None
    assert culprit.local_rank == 1


def test_a_lone_miss_is_acted_on_at_once() -> None:
    t = Timeouts(heartbeat=3.0)
    hung = Watched(1, 0.0, slot(beats=5, last_beat=10.0))
    busy = Watched(0, 0.0, slot(beats=9, last_beat=12.9))
    result = scan([busy, hung], 13.0, t)
    culprit = result.culprit(13.0)
    assert culprit is not None
    assert culprit.local_rank == 1
