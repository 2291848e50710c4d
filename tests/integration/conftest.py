"""The integration tests' fixtures; the helpers they and the tests use are in harness.py."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftrun.testing.etcd import EtcdHarness
from tests.integration.harness import CONF, LiveFtrun, WriteScript


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A directory this session's xdist workers share (each one's own directories are below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if worker_id != "master" else base


@pytest.fixture
def live(tmp_path: Path) -> Iterator[list[LiveFtrun]]:
    """Start with ``live.append(LiveFtrun(tmp_path, ...))``; all are killed at teardown."""
    started: list[LiveFtrun] = []
    yield started
    for f in started:
        f.close()


@pytest.fixture
def script(tmp_path: Path) -> WriteScript:
    """``script("name.py", body)`` writes a worker script into tmp_path and returns its name."""

    def write(name: str, body: str) -> str:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(body))
        return name

    return write


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdHarness]:
    with EtcdHarness() as harness:
        yield harness


@pytest.fixture(scope="module")
def tcp_server() -> Iterator[str]:
    """A standalone embedded store shared by the module's tests: `ftrun store --port 0`; yields HOST:PORT."""
    yield from _store_process()


@pytest.fixture
def own_tcp_server() -> Iterator[str]:
    """A store for this test alone (its run ids are nobody else's)."""
    yield from _store_process()


@pytest.fixture(params=["tcp", "etcd"])
def rdzv(request: pytest.FixtureRequest) -> list[str]:
    """The rendezvous flags of one backend (the store already running)."""
    if request.param == "tcp":
        endpoint = request.getfixturevalue("tcp_server")
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-conf", f"{CONF},is_host=false"]
    etcd: EtcdHarness = request.getfixturevalue("etcd_server")
    return ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.url.removeprefix("etcd://"), "--rdzv-conf", CONF]


def _store_process() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, "-m", "ftrun", "store", "--port", "0"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        found = re.search(r"serving on (127\.0\.0\.1:\d+)", proc.stderr.readline())
        assert found
        yield found.group(1)
    finally:
        proc.kill()
        proc.wait(30)
        assert proc.stderr is not None
        proc.stderr.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first, each module's spread evenly among the others': xdist hands tests out in this order,
    so the longest do not end the tier with its other workers idle, and the tests that wait (partitions of 35 s)
    run beside tests that compute rather than beside each other (ci26: twice a minute of half-idle cores)."""
    here = Path(__file__).parent
    ours: list[pytest.Item] = []
    theirs: list[pytest.Item] = []
    for item in items:
        (ours if here in item.path.parents else theirs).append(item)
    slow = [item for item in ours if item.get_closest_marker("slow")]
    modules = Counter(item.path for item in slow)
    seen: Counter[Path] = Counter()
    where = {}
    for item in slow:
        where[item] = seen[item.path] / modules[item.path]  # 0 for each module's first, then evenly to 1
        seen[item.path] += 1
    first = sorted(slow, key=where.__getitem__)  # stable: ties keep the modules' order
    items[:] = theirs + first + [item for item in ours if item not in where]
