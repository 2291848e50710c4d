"""The round rules at 100,000 nodes, simulated with a fake clock (ftrun.testing.round_sim): arrivals in waves,
spares beyond the maximum, deaths, and a member lost just as its round closed. Rounds close when the rules say;
no node is left out or counted twice; every node's work per round stays O(1)."""

from __future__ import annotations

import pytest

from ftrun.rendezvous.state import Rules
from ftrun.testing.round_sim import Check, RoundSim

N = 100_000


def ids(first: int, count: int) -> list[str]:
    return [f"n{i:06d}" for i in range(first, first + count)]


@pytest.mark.slow
def test_a_hundred_thousand_nodes_join_lose_members_and_take_spares() -> None:
    rules = Rules(min_nodes=N - 1000, max_nodes=N, last_call_s=30.0, join_timeout_s=600.0, max_restarts=10)
    sim = RoundSim(rules)
    sim.arrive(0.0, ids(0, N - 500))  # most arrive at once; the last call waits for more
    sim.arrive(10.0, ids(N - 500, 500))  # the rest: the job is full, it closes at once
    sim.run_until(10.0)
    assert [c.round for c in sim.closed] == [1]
    assert sim.closed[0].at == 10.0  # full at 10 s: closed then, not after the last call
    Check.settled(sim)

    sim.arrive(20.0, ids(N, 3))  # three spares: the job is full, they stand by
    sim.run_until(25.0)
    assert len(sim.closed) == 1
    assert len(sim.running()) == N

    member = sim.closed[0].roster.members[12_345]
    sim.die(30.0, [member])  # a member lost: the round reopens, the spares take its place
    sim.run_until(40.0)
    assert [c.round for c in sim.closed] == [1, 2]
    second = sim.closed[1].roster
    assert member not in second.members
    assert len(second.members) == N  # back to the maximum: a spare took the lost member's place
    assert second.members[:12_345] == sim.closed[0].roster.members[:12_345]  # survivors keep their ranks
    Check.settled(sim)

    # 600 members lost at once: the round reopens, the two spares join the survivors; once every live node is
    # back it closes, with no last call to wait out.
    sim.die(50.0, ids(0, 600))
    sim.run_until(85.0)
    third = sim.closed[-1]
    assert (third.round, third.at) == (3, 50.0)
    assert len(third.roster.members) == N - 600 + 2
    assert not set(ids(0, 600)) & set(third.roster.members)
    Check.settled(sim)

    # A newcomer scales the job up (round 4), and a member is lost right after that close, before it ran: round
    # 5 forms without it.
    sim.arrive(90.0, ids(N + 3, 1))
    victim = third.roster.members[50_000]
    sim.die(90.000001, [victim])
    sim.run_until(200.0)
    assert [(c.round, c.at) for c in sim.closed[3:]] == [(4, 90.0), (5, 90.000001)]
    assert victim in sim.closed[3].roster.members
    assert victim not in sim.closed[4].roster.members
    assert len(sim.closed[4].roster.members) == N - 600 + 2 + 1 - 1
    Check.settled(sim)
    Check.rounds(sim)
    # Each node decided a handful of times per round, not once per other node.
    assert sim.decisions < 12 * N * len(sim.closed)


def test_below_the_minimum_nobody_runs_until_enough_arrive() -> None:
    rules = Rules(min_nodes=10_000, max_nodes=12_000, last_call_s=30.0, join_timeout_s=600.0, max_restarts=3)
    sim = RoundSim(rules)
    sim.arrive(0.0, ids(0, 9_999))
    sim.run_until(100.0)
    assert sim.closed == []
    assert sim.running() == {}
    sim.arrive(100.0, ids(9_999, 1))
    sim.run_until(129.0)
    assert sim.closed == []  # enough, but the last call is not over
    sim.run_until(131.0)
    assert [c.at for c in sim.closed] == [130.0]
    Check.settled(sim)
    Check.rounds(sim)
