"""Every test runs with its own warm-pool cache, so no test is warm from another's run."""

from __future__ import annotations

import resource
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

_CPU_AT_SETUP = pytest.StashKey[float]()


@pytest.fixture(autouse=True)
def own_warm_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTRUN_CACHE_DIR", str(tmp_path / "ftrun-cache"))


# --- the CPU each test spent: on 2 cores the integration tier is bound by CPU, not by its waits ---------------
# Its own and that of every process it started and reaped (ftrun's agents reap their workers and zygotes), from
# its setup to its teardown; carried to xdist's controller on the teardown report, listed by --durations.

CPU_KEY = "cpu_s"


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_AT_SETUP] = _cpu_s()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.when == "teardown" and _CPU_AT_SETUP in item.stash:
        report.user_properties.append((CPU_KEY, _cpu_s() - item.stash[_CPU_AT_SETUP]))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    shown = config.getoption("durations", None)
    if not shown:
        return
    spent = [
        (float(value), report.nodeid)  # type: ignore[arg-type]  # a property's value is any object
        for reports in terminalreporter.stats.values()
        for report in reports
        if isinstance(report, pytest.TestReport) and report.when == "teardown"
        for key, value in report.user_properties
        if key == CPU_KEY
    ]
    if not spent:
        return
    total = sum(v for v, _ in spent)
    title = f"most CPU: {min(shown, len(spent))} of {len(spent)} tests, {total:.0f} CPU-s in all (with their processes)"
    terminalreporter.write_sep("=", title)
    for value, nodeid in sorted(spent, reverse=True)[:shown]:
        terminalreporter.write_line(f"{value:7.2f} CPU-s {nodeid}")
