"""The memory cgroup's room, read as the kernel shows it: the tightest limit of the cgroup and its ancestors."""

from __future__ import annotations

from pathlib import Path

from ftrun.node import memory_limit


def process(tmp_path: Path, mount: str, cgroups: str) -> Path:
    """A /proc/self of a process in ``cgroups`` with one cgroup hierarchy mounted (``mount``: its line)."""
    me = tmp_path / "self"
    me.mkdir()
    (me / "mountinfo").write_text(mount + "\n")
    (me / "cgroup").write_text(cgroups)
    return me


def cgroup(at: Path, limit: str, usage: int, names: tuple[str, str]) -> None:
    at.mkdir(parents=True, exist_ok=True)
    (at / names[0]).write_text(limit + "\n")
    (at / names[1]).write_text(f"{usage}\n")


def test_the_tightest_ancestor_of_a_v2_cgroup_is_the_limit(tmp_path: Path) -> None:
    hierarchy = tmp_path / "cg2"
    me = process(tmp_path, f"35 23 0:30 / {hierarchy} rw,nosuid - cgroup2 cgroup2 rw", "0::/pod/job\n")
    v2 = ("memory.max", "memory.current")
    cgroup(hierarchy / "pod" / "job", "max", 300, v2)  # no limit of its own
    cgroup(hierarchy / "pod", "1000", 600, v2)  # the pod's: 400 left
    assert memory_limit.room(me) == (1000, 600)


def test_v1_counts_from_the_mounts_root_and_no_limit_is_none(tmp_path: Path) -> None:
    hierarchy = tmp_path / "memory"
    mount = f"36 23 0:31 /docker {hierarchy} rw - cgroup cgroup rw,memory"
    me = process(tmp_path, mount, "4:memory:/docker/abc\n2:cpu:/docker/abc\n")
    v1 = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    cgroup(hierarchy / "abc", "9223372036854771712", 5, v1)  # v1's "no limit"
    assert memory_limit.room(me) is None
    cgroup(hierarchy / "abc", str(512 << 20), 100 << 20, v1)
    assert memory_limit.room(me) == (512 << 20, 100 << 20)
