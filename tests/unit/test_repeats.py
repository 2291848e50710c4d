"""A line said again and again: shown a few times, then once a minute with the count it held."""

from __future__ import annotations

from ftrun.observe.repeats import Repeats


def test_a_flood_of_one_line_is_shown_a_few_times_then_once_a_minute() -> None:
    r = Repeats(shown=3, window_s=60.0)
    shown = [line for i in range(21_349) if (line := r.admit("the store is unreachable", i * 10.0 / 21_349))]
    assert shown == ["the store is unreachable"] * 3  # 10 s of a loop with no pause
    later = r.admit("the store is unreachable", 70.0)
    assert later is not None
    assert "said 21346 more times in the last" in later
    assert r.admit("the store is unreachable", 71.0) is None  # held again at once: the flood goes on


def test_different_lines_and_rare_repeats_are_all_shown() -> None:
    r = Repeats(shown=3, window_s=60.0)
    assert [r.admit(f"round {n}: member", n) for n in range(10)] == [f"round {n}: member" for n in range(10)]
    assert [r.admit("workers stopped", t) for t in (0, 100, 200, 300)] == ["workers stopped"] * 4


def test_memory_is_bounded() -> None:
    r = Repeats(remember=10)
    for n in range(1000):
        r.admit(f"line {n}", 0.0)
    assert len(r._seen) == 10
