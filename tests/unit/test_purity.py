"""Pure modules import no clock, process, socket or store backend (DESIGN.md, house conventions)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ftrun

PURE = ["agent/policy.py", "agent/env.py", "store/kv.py", "rendezvous/state.py", "monitor/watchdog.py"]
FORBIDDEN = {"time", "os", "socket", "subprocess", "selectors", "signal", "threading", "asyncio"}
BACKENDS = {"ftrun.store.memory", "ftrun.store.tcp", "ftrun.store.tcp_server", "ftrun.store.etcd", "ftrun.store.retry"}


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports(module: str) -> None:
    tree = ast.parse((Path(ftrun.__file__).parent / module).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    bad = {m for m in imported if m.split(".")[0] in FORBIDDEN or m in BACKENDS}
    assert not bad, f"{module} must stay pure but imports {sorted(bad)}"
