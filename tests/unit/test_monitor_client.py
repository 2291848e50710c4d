"""The worker's client against a real shared-memory table (agent and worker in one process here)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator

import pytest

from ftrun.monitor.table import MonitorTable
from ftrun.monitor.watchdog import published
from ftrun.worker import calculated, client
from ftrun.worker.layout import (
    IDLE,
    OFF_IDLE,
    OFF_STEP,
    STEP,
    CorruptSlot,
    collectives_buffer,
    slot_offset,
)
from ftrun.worker.timeouts import Timeouts

_attached: list[client._Attached] = []


@pytest.fixture
def table() -> Iterator[MonitorTable]:
    t = MonitorTable(2, tag="test")
    try:
        yield t
    finally:
        while _attached:  # no mapping or atexit handler outlives its test
            _attached.pop().close()
        t.close()


def attach(t: MonitorTable, slot: int = 1, **env: str) -> client._Attached:
    c = client._Attached.attach(str(t.path), slot, env)
    _attached.append(c)
    return c


def test_heartbeats_and_sections_land_in_the_workers_own_slot(table: MonitorTable) -> None:
    c = attach(table)
    assert table.read(1).pid == os.getpid()
    assert table.read(0).pid == 0  # the other slot is untouched
    c.heartbeat()
    c.heartbeat()
    c.start_section("step")
    c.start_section("io")  # sections nest and overlap
    view = table.read(1)
    assert view.beats == 2
    assert view.last_beat > 0
    assert [name for name, _ in view.sections] == ["step", "io"]
    c.end_section("step")
    assert [name for name, _ in table.read(1).sections] == ["io"]
    c.end_all_sections()
    after = table.read(1)
    assert after.sections == ()
    assert after.idle_since >= view.last_beat


def test_the_step_an_attempt_resumed_at_is_what_its_first_heartbeat_named(table: MonitorTable) -> None:
    c = attach(table)
    assert table.read(1).first_step == -1
    c.heartbeat(step=4)
    # The agent can read the slot between a heartbeat's two stores: the new step, the old beat count. Only
    # the step written with the first beat tells where the attempt resumed.
    STEP.pack_into(table._map, slot_offset(1) + OFF_STEP, 5)
    halfway = table.read(1)
    assert (halfway.step, halfway.beats, halfway.first_step) == (5, 1, 4)
    c.heartbeat(step=5)
    c.heartbeat()
    view = table.read(1)
    assert (view.step, view.beats, view.first_step) == (5, 3, 4)


def test_a_first_heartbeat_without_a_step_names_none(table: MonitorTable) -> None:
    c = attach(table)
    c.heartbeat()
    c.heartbeat(step=7)
    assert (table.read(1).step, table.read(1).first_step) == (7, -1)


def test_section_misuse_is_a_clear_error(table: MonitorTable) -> None:
    c = attach(table)
    c.start_section("step")
    with pytest.raises(ValueError, match="'step' is already open"):
        c.start_section("step")
    with pytest.raises(ValueError, match="'load' is not open"):
        c.end_section("load")
    with pytest.raises(ValueError, match="longer than"):
        c.start_section("x" * 100)


def test_calculated_timeouts_are_published_and_survive_in_a_state(table: MonitorTable) -> None:
    c = attach(table, FTRUN_SAFETY_FACTOR="4")
    c.heartbeat()
    c.start_section("step")
    c.end_section("step")
    c.heartbeat()
    calculated = c.calculate_timeouts(None)
    assert calculated.heartbeat is not None
    assert calculated.sections.keys() == {"step"}
    assert published(table.read(1)) == calculated
    # A restarted worker is handed the timeouts the agent kept.
    again = attach(table, FTRUN_MONITOR_TIMEOUTS=json.dumps(calculated.to_json()))
    assert again.calculated == calculated
    again.set_timeouts(Timeouts(heartbeat=7.0))
    assert published(table.read(1)) == Timeouts(heartbeat=7.0)


def test_a_corrupt_slot_is_refused_by_the_reader(table: MonitorTable) -> None:
    attach(table)
    mapping = table._map
    IDLE.pack_into(mapping, slot_offset(1) + OFF_IDLE, 0.0, 999, 0)  # 999 sections open: impossible
    with pytest.raises(CorruptSlot, match="impossible"):
        table.read(1)


def test_calls_return_at_once_after_the_agent_removed_the_table(table: MonitorTable) -> None:
    c = attach(table)
    table.close()  # the agent is gone: its memory file is closed, the worker's mapping stays
    c.heartbeat()
    c.start_section("step")
    c.end_section("step")


def test_a_foreign_state_is_refused() -> None:
    with pytest.raises(ValueError, match="not an ftrun monitor state"):
        calculated.load_monitor_state({"v": 99})


def test_a_state_saved_by_nvidias_rank_monitor_client_is_taken(table: MonitorTable) -> None:
    c = attach(table)
    client._client = c
    try:
        calculated.load_monitor_state(
            {"current_timeouts": {"initial": 600.0, "subsequent": 45.5, "were_calculated": True}}
        )
        assert published(table.read(1)) == Timeouts(initial_heartbeat=600.0, heartbeat=45.5)
        calculated.load_monitor_state({})  # NVIDIA's state when it had calculated nothing: nothing changes
        assert c.calculated == Timeouts(initial_heartbeat=600.0, heartbeat=45.5)
        with pytest.raises(ValueError, match="must be a positive number"):
            calculated.load_monitor_state({"current_timeouts": {"initial": -1, "subsequent": 1}})
    finally:
        client._client = client._NotYet()


def test_nvidias_rank_monitor_client_maps_onto_ftruns(table: MonitorTable) -> None:
    from ftrun import RankMonitorClient

    c = attach(table, FTRUN_SAFETY_FACTOR="4")
    client._client = c
    try:
        rmc = RankMonitorClient()
        client._client = c  # init_workload_monitoring() attaches from the environment; here, to the test's table
        assert rmc.calculate_and_set_hb_timeouts(skip_if_not_ready=True) is False  # no heartbeat yet
        with pytest.raises(ValueError, match="not enough heartbeats"):
            rmc.calculate_and_set_hb_timeouts()
        rmc.send_heartbeat()
        rmc.start_section("step")
        rmc.end_section("step")
        rmc.start_section("eval")
        rmc.end_all_sections()
        rmc.send_heartbeat()
        assert rmc.calculate_and_set_hb_timeouts() is True
        after_hb = published(table.read(1))
        assert after_hb is not None
        assert after_hb.heartbeat is not None
        assert not after_hb.sections
        assert rmc.calculate_and_set_section_timeouts(selected_sections=["step"], calc_out_of_section=False)
        after = published(table.read(1))
        assert after is not None
        assert set(after.sections) == {"step"}
        assert after.out_of_section is None
        state = rmc.state_dict()
        rmc.load_state_dict(state)
        assert published(table.read(1)) == after
        rmc.shutdown_workload_monitoring()
    finally:
        client._client = client._NotYet()


def test_learned_timeouts_come_after_the_steps_asked_for_with_a_floor_and_only_grow(
    table: MonitorTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(client, "_now", lambda: now[0])  # the worker's clock, moved by hand
    c = attach(table, FTRUN_LEARN_AFTER="3", FTRUN_LEARNED_FLOOR="0.5", FTRUN_SAFETY_FACTOR="2")
    c.auto_heartbeat()
    c.auto_heartbeat()
    c.auto_progress()  # a batch is progress, not a step
    assert published(table.read(1)) is None
    c.auto_heartbeat()  # step 3: learned; the gaps were tiny, so the floor
    assert published(table.read(1)) == Timeouts(heartbeat=0.5)
    c.auto_heartbeat()
    now[0] += 0.4  # a long gap (an evaluation, say): the next learning widens the timeout to 2 x 0.4 s
    c.auto_heartbeat()
    c.auto_heartbeat()  # step 6
    widened = published(table.read(1))
    assert widened is not None
    assert widened.heartbeat is not None
    assert widened.heartbeat == pytest.approx(0.8)  # exactly: the clock moved by hand
    c.heartbeat()  # the job beats on its own: nothing automatic counts any more
    for _ in range(6):
        c.auto_heartbeat()
    assert published(table.read(1)) == widened


def test_without_learning_automatic_steps_publish_nothing(table: MonitorTable) -> None:
    c = attach(table)
    for _ in range(50):
        c.auto_heartbeat()
    assert table.read(1).beats == 50
    assert published(table.read(1)) is None


def test_sections_from_several_threads_never_leave_the_slot_unreadable(table: MonitorTable) -> None:
    """Four threads open and close their own sections while the agent reads: every read is consistent, and at
    the end the slot is whole (an odd sequence number left by a race would make the rank unwatchable)."""
    import threading

    c = attach(table)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: a race shows at once
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for _ in range(3000):
                c.start_section(f"t{n}")
                c.end_section(f"t{n}")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    try:
        for t in threads:
            t.start()
        reads = 0
        while any(t.is_alive() for t in threads):
            # In one process the reader can hold the GIL while a writer is mid-write (never so across processes):
            # a copy that never came out whole in 100 tries is skipped here; one that parses wrong fails the test.
            if not isinstance(read_or_why(table), str):
                reads += 1
            time.sleep(0.0005)
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(switch)
    assert not errors
    assert reads > 0
    view = table.read(1)
    assert view.sections == ()
    assert view.idle_since > 0


def read_or_why(table: MonitorTable, *, confirm: bool = False) -> object:
    """A read of slot 1, or why it could not be copied whole (other CorruptSlot errors are raised)."""
    try:
        return table.read(1, confirm=confirm)
    except CorruptSlot as e:
        if "kept changing" in str(e):
            return str(e)
        raise


def test_a_collectives_summary_stopped_mid_write_leaves_the_last_one_whole_and_the_slot_readable(
    table: MonitorTable,
) -> None:
    """The watcher's thread can be stopped anywhere for good (the main thread takes the GIL and never gives it
    back): it writes outside the seqlock, into the buffer the head does not point to, then moves the head."""
    c = attach(table)
    c._collectives(b'{"n": 1}')
    c._collectives(b'{"n": 2, "longer": true}')
    view = table.read(1)
    assert (view.collectives_seq, view.collectives_json) == (2, b'{"n": 2, "longer": true}')
    at = slot_offset(1) + collectives_buffer(3)  # the next summary, stopped before the head moved to it
    c._map[at : at + 9] = b'{"n": 3, '
    assert table.read(1).collectives_json == b'{"n": 2, "longer": true}'
    c._collectives(b'{"n": 3}')
    assert table.read(1).collectives_json == b'{"n": 3}'
