"""A wait said again while it lasts, on a clock the test moves: after the first delay, then at each interval."""

from __future__ import annotations

from ftrun.monitor.watch import NOTICE_AFTER_S, NOTICE_EVERY_S, MeetingNotice
from ftrun.reminder import Reminder


def test_a_wait_is_said_after_the_first_delay_then_at_each_interval_and_forgotten_when_over() -> None:
    r = Reminder(first_s=10.0, every_s=30.0)
    assert r.next_at() is None
    assert r.due(100.0, waiting=True) is None  # the wait begins
    assert r.next_at() == 110.0
    assert r.due(109.9, waiting=True) is None
    assert r.due(110.5, waiting=True) == 10.5
    assert r.due(111.0, waiting=True) is None  # not at every look
    assert r.next_at() == 140.5
    assert r.due(140.5, waiting=True) == 40.5
    assert r.due(141.0, waiting=False) is None  # over: forgotten
    assert r.next_at() is None
    assert r.due(200.0, waiting=True) is None  # a new wait counts afresh
    assert r.due(210.0, waiting=True) == 10.0


def test_a_new_wait_restarts_the_count() -> None:
    r = Reminder(first_s=30.0, every_s=30.0)
    r.restart(0.0)
    assert r.due(29.0, waiting=True) is None
    r.restart(29.0)  # what is waited for changed: said already, by whoever changed it
    assert r.due(58.0, waiting=True) is None
    assert r.due(59.0, waiting=True) == 30.0


def test_ranks_long_in_init_process_group_are_told_with_what_they_wait_for() -> None:
    notice = MeetingNotice("start the other node")
    assert notice.check(100.0, [0]) is None
    assert notice.check(100.0 + NOTICE_AFTER_S - 0.1, [0, 1]) is None  # a normal start-up says nothing
    first = notice.check(100.0 + NOTICE_AFTER_S, [1, 0])
    assert first == "rank(s) 0, 1 waiting 10 s in init_process_group for the other ranks: start the other node"
    assert notice.check(100.0 + NOTICE_AFTER_S + 1, [0]) is None
    again = notice.check(100.0 + NOTICE_AFTER_S + NOTICE_EVERY_S, [0])
    assert again is not None
    assert again.startswith("rank(s) 0 still waiting 40 s")
    assert notice.check(200.0, []) is None  # met: the next attempt's wait counts afresh
