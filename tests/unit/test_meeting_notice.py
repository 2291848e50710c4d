"""A long wait in init_process_group is said, with what it waits for, and said again while it lasts."""

from __future__ import annotations

from ftrun.agent.watch import NOTICE_AFTER_S, NOTICE_EVERY_S, MeetingNotice


def test_a_long_wait_is_said_then_repeated_and_forgotten_once_over() -> None:
    notice = MeetingNotice("start the other node")
    assert notice.check(100.0, [0]) is None  # the wait begins
    assert notice.check(100.0 + NOTICE_AFTER_S - 0.1, [0, 1]) is None  # a normal start-up says nothing
    first = notice.check(100.0 + NOTICE_AFTER_S, [1, 0])
    assert first == "rank(s) 0, 1 waiting 10 s in init_process_group for the other ranks: start the other node"
    assert notice.check(100.0 + NOTICE_AFTER_S + 1, [0]) is None  # not on every look
    again = notice.check(100.0 + NOTICE_AFTER_S + NOTICE_EVERY_S, [0])
    assert again is not None
    assert again.startswith("rank(s) 0 still waiting 40 s")
    assert notice.check(200.0, []) is None  # met: the next attempt's wait counts afresh
    assert notice.check(201.0, [0]) is None
    assert notice.check(201.0 + NOTICE_AFTER_S, [0]) is not None
