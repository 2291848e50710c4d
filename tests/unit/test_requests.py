"""Workload control requests: what a worker may ask, checked where it asks; the same checks where it is read."""

from __future__ import annotations

import re

import pytest

from ftrun.worker.requests import MAX_REASON_BYTES, Action, Request, decode, encode


@pytest.mark.parametrize("action", [a.value for a in Action if a is not Action.PEER_FAILED])
def test_a_request_round_trips(action: str) -> None:
    assert decode(encode(action, "ECC errors on GPU 3")) == Request(Action(action), "ECC errors on GPU 3")


@pytest.mark.parametrize(
    ("action", "reason", "says"),
    [
        ("reboot", "x", "unknown workload control action 'reboot'; one of: exclude_node, stop_job, restart, peer"),
        (None, "x", "unknown workload control action None"),
        ("stop_job", 7, "the reason must be a str, not int"),
        ("stop_job", "  ", "give a reason"),
        ("stop_job", "é" * (MAX_REASON_BYTES // 2 + 1), f"bytes of UTF-8; at most {MAX_REASON_BYTES}"),
    ],
)
def test_a_bad_request_names_what_is_wrong(action: object, reason: object, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        encode(action, reason)


@pytest.mark.parametrize("raw", [b"", b"[1]", b'{"action": "stop_job"}', b'{"action": "x", "reason": "y"}'])
def test_garbage_in_a_slot_is_not_a_request(raw: bytes) -> None:
    with pytest.raises(ValueError, match=r"JSON|action|reason"):
        decode(raw)


def test_describe_says_what_was_asked() -> None:
    assert Request(Action.STOP_JOB, "NaN").describe() == "stopped the job: NaN"


def test_a_peer_failure_names_the_peer() -> None:
    assert decode(encode("peer_failed", "silent for 2 s", 3)) == Request(Action.PEER_FAILED, "silent for 2 s", 3)
    assert Request(Action.PEER_FAILED, "silent", 3).describe() == "lost its peer rank 3: silent"
    with pytest.raises(ValueError, match="names the peer's rank"):
        encode("peer_failed", "silent", None)
