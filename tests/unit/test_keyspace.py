"""The job's keyspace: a part is named before it is used, and a key outside every part is told apart."""

from __future__ import annotations

import pytest

from ftrun.store import keyspace


def test_parts_and_keys_are_named_and_anything_else_is_outside() -> None:
    assert keyspace.prefix("job", "rdzv") == "/ftrun/job/rdzv/"
    assert keyspace.key("job", "peer_key") == "/ftrun/job/peer_key"
    assert keyspace.part_of("job", "/ftrun/job/snapshots/3/node-a") == "snapshots"
    assert keyspace.part_of("job", "/ftrun/job/peer_key") == "peer_key"
    for outside in ("/ftrun/job/bogus/x", "/ftrun/job/rdzv", "/ftrun/other/rdzv/x", "/elsewhere", "/ftrun/job/"):
        assert keyspace.part_of("job", outside) is None, outside
    with pytest.raises(ValueError, match="not a part of the job's keyspace"):
        keyspace.prefix("job", "bogus")
    with pytest.raises(ValueError, match="not a key of the job's keyspace"):
        keyspace.key("job", "rdzv")
