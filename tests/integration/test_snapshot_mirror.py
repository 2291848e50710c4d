"""Snapshots copied to the next node (real sockets on 127.0.0.1): the newest whole step goes, to and from the
job's nodes only; a head changed on the way is never kept; a node fetches a rank's file from the node holding
it."""

from __future__ import annotations

import contextlib
import pickle
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftrun.job.snapshot_mirror import SnapshotMirror, held
from ftrun.worker import snapshot_file as file
from ftrun.worker.snapshot_file import peer_path

KEY = b"k" * 32


def whole(directory: Path, step: int, rank: int) -> bytes:
    planned = file.begin(step, [], pickle.dumps({"step": step, "pad": b"x" * 100_000}), file.World(2, rank))
    view = planned.make(directory)
    file.seal(view, planned.data_end)
    view.close()
    return file.path_of(directory, step, rank).read_bytes()


def newest_first(directory: Path, steps: tuple[int, ...], rank: int) -> None:
    """Steps written whole elsewhere, then moved in newest first: the pacing node never sees an older one as its
    newest (written in order, a loaded machine let its copier start on the older one between the two)."""
    staging = directory.with_name(f"{directory.name}-staging")
    for step in steps:
        whole(staging, step, rank)
    for step in sorted(steps, reverse=True):
        (staging / file.STEP_DIR.format(step)).rename(directory / file.STEP_DIR.format(step))


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[SnapshotMirror, SnapshotMirror]]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = SnapshotMirror.serve(tmp_path / "a", "127.0.0.1", KEY)
    b = SnapshotMirror.serve(tmp_path / "b", "127.0.0.1", KEY)
    yield a, b
    a.close()
    b.close()


def until(condition: object, what: str, bound_s: float = 10.0) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {bound_s} s: {what}"
        time.sleep(0.05)


def test_the_newest_whole_step_goes_to_the_next_node_and_old_ones_are_pruned(
    tmp_path: Path, nodes: tuple[SnapshotMirror, SnapshotMirror]
) -> None:
    a, b = nodes
    for step in (1, 2, 3):
        sent = [whole(tmp_path / "a", step, r) for r in (0, 1)]
    a.send_to(lambda: b.address, ranks=[0, 1], every_s=0.05)
    until(lambda: held(tmp_path / "b") == {0: {3}, 1: {3}}, "step 3 of ranks 0 and 1 on b")
    assert peer_path(tmp_path / "b", 3, 1).read_bytes() == sent[1]
    for step in (4, 5):
        whole(tmp_path / "a", step, 0)
        whole(tmp_path / "a", step, 1)
        until(lambda s=step: all(s in held(tmp_path / "b").get(r, set()) for r in (0, 1)), f"step {step} on b")
    a.stop_sending()
    assert held(tmp_path / "b") == {0: {4, 5}, 1: {4, 5}}  # the newest two of each rank


def test_a_node_fetches_a_ranks_file_from_the_node_holding_it(
    tmp_path: Path, nodes: tuple[SnapshotMirror, SnapshotMirror]
) -> None:
    a, b = nodes
    original = whole(tmp_path / "b", 7, 3)  # b's own; a takes rank 3 over
    assert a.fetch(b.address, 7, 3)
    assert file.path_of(tmp_path / "a", 7, 3).read_bytes() == original
    assert not a.fetch(b.address, 8, 3)  # b has none
    assert not file.path_of(tmp_path / "a", 8, 3).exists()


def test_what_is_not_the_jobs_is_never_kept_or_served(
    tmp_path: Path, nodes: tuple[SnapshotMirror, SnapshotMirror]
) -> None:
    _, b = nodes
    whole(tmp_path / "a", 2, 0)
    (tmp_path / "c").mkdir()
    stranger = SnapshotMirror.serve(tmp_path / "c", "127.0.0.1", b"s" * 32)
    try:
        stranger_sends = SnapshotMirror.serve(tmp_path / "a", "127.0.0.1", b"s" * 32)
        stranger_sends.send_to(lambda: b.address, ranks=[0], every_s=0.05)
        time.sleep(0.5)  # several sends refused: nothing to await but their absence
        stranger_sends.close()
        assert held(tmp_path / "b") == {}
        assert not list((tmp_path / "b").rglob("*.part"))
        whole(tmp_path / "b", 4, 1)
        assert not stranger.fetch(b.address, 4, 1)  # b serves nobody without the job's key
    finally:
        stranger.close()


def flipping_proxy(target: str) -> tuple[socket.socket, threading.Thread]:
    """A TCP relay to ``target`` that flips one byte of what the client sends, inside the snapshot file's pickled
    head (just after its magic): as a party on the path would."""
    listener = socket.create_server(("127.0.0.1", 0))
    host, port = target.rsplit(":", 1)

    def relay(src: socket.socket, dst: socket.socket, flip: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                at = data.find(file.MAGIC) if flip else -1
                if at >= 0:
                    i = at + file.HEAD.size + 8
                    data, flip = data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :], False
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def both_ways(client: socket.socket) -> None:
        with client, socket.create_connection((host, int(port))) as server:
            back = threading.Thread(target=relay, args=(server, client, False), daemon=True)
            back.start()
            relay(client, server, True)
            back.join(10)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=both_ways, args=(listener.accept()[0],), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_a_head_changed_on_the_way_is_never_kept(tmp_path: Path, nodes: tuple[SnapshotMirror, SnapshotMirror]) -> None:
    a, b = nodes
    whole(tmp_path / "a", 2, 0)
    listener, _ = flipping_proxy(b.address)
    try:
        via = f"127.0.0.1:{listener.getsockname()[1]}"
        assert not a._put(via, 2, 0)  # the head's MAC does not match what came
        assert held(tmp_path / "b") == {}
        assert not list((tmp_path / "b").rglob("*.part"))
        assert a._put(b.address, 2, 0)  # straight: kept
        assert held(tmp_path / "b") == {0: {2}}
        assert not b.fetch(via, 9, 0)  # nothing to flip: b has no step 9, said plainly
    finally:
        listener.close()


def test_every_node_copies_the_step_the_pacing_node_chose_and_keeps_it(
    tmp_path: Path, nodes: tuple[SnapshotMirror, SnapshotMirror]
) -> None:
    """a paces the ring; b, a step ahead of a's copies, copies the step a began to copy to it (not its newest),
    and both keep their own files of it: a node lost while copies lag still meets a step every node has."""
    a, b = nodes
    for step in (1, 2, 3):
        whole(tmp_path / "a", step, 0)
    for step in (1, 2, 3, 4, 5):
        whole(tmp_path / "b", step, 1)
    b.send_to(lambda: a.address, ranks=[1], paces=False, every_s=0.05)
    a.send_to(lambda: b.address, ranks=[0], every_s=0.05)
    until(lambda: held(tmp_path / "a") == {1: {3}}, "b's step 3 (a's choice, not b's newest) on a")
    assert held(tmp_path / "b") == {0: {3}}
    pinned = {n: {s for s in range(1, 8) if file.is_pinned(tmp_path / n / file.STEP_DIR.format(s))} for n in "ab"}
    assert pinned == {"a": {3}, "b": {3}}
    newest_first(tmp_path / "a", (4, 5), 0)
    until(lambda: held(tmp_path / "a") == {1: {3, 5}}, "b's step 5 on a")
    for step in (6, 7):
        whole(tmp_path / "b", step, 1)
    newest_first(tmp_path / "a", (6, 7), 0)
    until(lambda: held(tmp_path / "a") == {1: {5, 7}}, "b's step 7 on a")
    a.stop_sending()
    b.stop_sending()
    for n in "ab":  # the two newest copied steps kept, no older one
        assert {s for s in range(1, 8) if file.is_pinned(tmp_path / n / file.STEP_DIR.format(s))} == {5, 7}


def test_a_copy_to_a_successor_that_stopped_answering_is_given_up_at_once_when_sending_stops(
    tmp_path: Path, nodes: tuple[SnapshotMirror, SnapshotMirror]
) -> None:
    """The successor took the connection, then went silent (cut off mid-copy): stopping the copies (the agent
    does before each restart) shuts that connection rather than waiting out its 60 s timeout."""
    a, _ = nodes
    whole(tmp_path / "a", 1, 0)
    silent = socket.create_server(("127.0.0.1", 0))
    taken = threading.Event()
    held_open: list[socket.socket] = []

    def take() -> None:
        conn, _ = silent.accept()
        held_open.append(conn)  # never read, never answered
        taken.set()

    threading.Thread(target=take, daemon=True).start()
    try:
        a.send_to(lambda: f"127.0.0.1:{silent.getsockname()[1]}", ranks=[0], every_s=0.05)
        assert taken.wait(10), "the copy never connected"
        stopping = threading.Thread(target=a.stop_sending, daemon=True)
        stopping.start()
        stopping.join(10)  # far less than the connection's 60 s timeout
        assert not stopping.is_alive(), "stop_sending waited for the silent successor"
    finally:
        for conn in held_open:
            conn.close()
        silent.close()
