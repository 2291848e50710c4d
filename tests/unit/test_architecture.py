"""The shape of the package, checked: no import cycle, pure modules pure all the way down, small modules,
composition in the agent (DESIGN.md, STYLE.md).

Imports are read from the source (every ``import`` statement, also inside functions and under
TYPE_CHECKING), so a cycle hidden in a function body counts as much as one at the top.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

import ftrun

ROOT = Path(ftrun.__file__).parent
PURE = [
    "ftrun.agent.driver",
    "ftrun.agent.static",
    "ftrun.agent.elastic",
    "ftrun.agent.env",
    "ftrun.store.kv",
    "ftrun.rendezvous.state",
    "ftrun.monitor.watchdog",
    "ftrun.worker.layout",
    "ftrun.monitor.blame",
    "ftrun.worker.requests",
    "ftrun.warm.policy",
    "ftrun.warm.entry_reading",
    "ftrun.warm.script_changes",
    "ftrun.rendezvous.succession",
    "ftrun.rendezvous.records",
    "ftrun.monitor.stragglers",
    "ftrun.monitor.collectives",
    "ftrun.worker.snapshot_budget",
    "ftrun.agent.snapshot_plan",
    "ftrun.observe.gpu_errors",
    "ftrun.observe.repeats",
    "ftrun.reminder",
]
# What a pure module may not reach, directly or through any ftrun module it imports.
FORBIDDEN = {
    "os", "mmap", "socket", "subprocess", "threading", "time", "tempfile", "select", "selectors",
    "signal", "ctypes", "asyncio", "secrets", "random",
}  # fmt: skip
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


@cache
def imports(name: str) -> frozenset[str]:
    """Every module ``name`` imports anywhere in its source (absolute names, ftrun's and others')."""
    path = modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            found.add(base)
            # ``from ftrun.agent import env`` imports the module ftrun.agent.env
            found |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules()}
    return frozenset(found)


def ftrun_imports(name: str) -> set[str]:
    return {m for m in imports(name) if m in modules() and m != name}


def test_the_walk_sees_the_package() -> None:
    assert "ftrun.agent.executor" in modules()
    assert "ftrun.agent.group" in ftrun_imports("ftrun.agent.launch")  # the walk reads real edges


def find_cycle() -> list[str] | None:
    """One import cycle among ftrun's modules, or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(ftrun_imports(m)):
            if state.get(n) == 1:
                return [*stack[stack.index(n) :], n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(modules()):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def reach(name: str) -> dict[str, list[str]]:
    """Every module ``name`` imports transitively, each with the chain that reaches it."""
    chains: dict[str, list[str]] = {name: [name]}
    todo = [name]
    while todo:
        m = todo.pop()
        for n in imports(m):
            if n not in chains:
                chains[n] = [*chains[m], n]
                if n in modules():
                    todo.append(n)
    return chains


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_are_pure_all_the_way_down(name: str) -> None:
    assert name in modules()
    bad = {m: chain for m, chain in reach(name).items() if m.split(".")[0] in FORBIDDEN}
    assert not bad, f"{name} must stay pure but reaches " + "; ".join(" -> ".join(c) for c in bad.values())


def test_the_purity_check_can_fail() -> None:
    assert "os" in reach("ftrun.procs.workers")  # the walk follows imports to the standard library


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_is_over_500_lines(name: str) -> None:
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by concept"


COMPOSITION_ROOTS = {"ftrun.agent.launch", "ftrun.cli.main"}  # they build the parts: they know them all
MAX_IMPORTS = 20  # ftrun modules a module may import (a hub that grows past it wants cutting along its seams)


@pytest.mark.parametrize("name", sorted(set(modules()) - COMPOSITION_ROOTS))
def test_no_module_but_the_composition_roots_is_a_hub(name: str) -> None:
    found = ftrun_imports(name)
    assert len(found) <= MAX_IMPORTS, f"{name} imports {len(found)} of ftrun's modules: {sorted(found)}"


def test_the_local_group_is_no_hub_again() -> None:
    """The group only drives its parts (narrator, spawning, link, watch, processes...); launch builds them."""
    found = ftrun_imports("ftrun.agent.group")
    assert len(found) <= 12, sorted(found)


def test_no_agent_class_inherits_another_of_ftrun() -> None:
    """Composition, never inheritance, for the agent: a class in ftrun.agent derives from nothing of ftrun's."""
    ours = set()
    for path in modules().values():
        ours |= {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
    ours = {n for n in ours if not n.endswith(("Error", "Exception"))}  # errors are types with a root
    for name, path in modules().items():
        if not name.startswith("ftrun.agent"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                assert not bases & ours, f"{name}.{node.name} inherits {bases & ours}"


# --- the house: packages by process boundary and concept (docs/ARCHITECTURE.md) ---------------------------

# modules directly under ftrun, below every package
BASICS = {"errors", "clock", "jsonobject", "reminder", "private", "strangers"}
# Which package (or module directly under ftrun) may import which. Each names only what lies below it.
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "clock": set(),
    "jsonobject": set(),
    "reminder": set(),
    "strangers": set(),  # every listener's door
    "private": {"errors"},
    "worker": {"errors", "jsonobject"},  # runs inside the workers: nothing of the agent's
    "config": {"store", "worker", "errors"},  # the parsed store URL it carries
    "node": {"errors"},
    "store": {"node", "clock", "errors", "jsonobject", "strangers"},
    "rendezvous": {"store", "clock", "errors", "jsonobject", "strangers"},
    "procs": {"private", "worker", "node", "config", "clock", "errors", "strangers"},
    "job": {"private", "store", "rendezvous", "worker", "clock", "errors", "jsonobject", "strangers"},
    "observe": {"private", "procs", "job", "store", "worker", "config", "clock", "errors", "jsonobject", "strangers"},
    "monitor": {"private", "procs", "observe", "worker", "config", "clock", "errors", "reminder", "jsonobject"},
    "warm": {"private", "procs", "worker", "node", "config", "clock", "errors", "jsonobject"},
    "agent": {"warm", "monitor", "observe", "job", "procs", "rendezvous", "store", "worker", "node", "config", *BASICS},
    "cli": {
        "agent",
        "warm",
        "monitor",
        "observe",
        "job",
        "procs",
        "rendezvous",
        "store",
        "worker",
        "node",
        "config",
        "ftrun",
        *BASICS,
    },
    "testing": {"procs", "node", "store", "rendezvous", "clock", "errors"},
    "ftrun": {"worker"},  # the package itself is the worker API
    "__main__": {"cli"},
}
MAX_TOP_LEVEL_MODULES = 8


def place(module: str) -> str:
    """The package a module is in, or its own name for a module directly under ftrun ("ftrun": the package)."""
    parts = module.split(".")
    return "ftrun" if len(parts) == 1 else parts[1]


def package_edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    for m in modules():
        for n in ftrun_imports(m):
            if place(m) != place(n):
                edges.setdefault((place(m), place(n)), []).append(f"{m} -> {n}")
    return edges


def test_every_place_has_its_rules() -> None:
    assert {place(m) for m in modules()} <= set(MAY_IMPORT)


@pytest.mark.parametrize("importer", sorted(MAY_IMPORT))
def test_packages_import_only_what_lies_below_them(importer: str) -> None:
    bad = {(a, b): why for (a, b), why in package_edges().items() if a == importer and b not in MAY_IMPORT[a]}
    assert not bad, "; ".join(f"{a} may not import {b} ({why[0]})" for (a, b), why in bad.items())


def test_no_cycle_between_packages() -> None:
    """The rules themselves form no cycle: every package can be put below the ones that import it."""
    placed: list[str] = []
    left = dict(MAY_IMPORT)
    while left:
        ready = [p for p, below in left.items() if below <= set(placed)]
        assert ready, f"a cycle among {sorted(left)}"
        placed += ready
        for p in ready:
            del left[p]


def test_the_package_rules_can_fail() -> None:
    assert ("agent", "warm") in package_edges()  # the walk sees real edges between packages
    assert "agent" not in MAY_IMPORT["worker"]


def test_no_wait_takes_only_descriptors_below_1024() -> None:
    """select(2) refuses a descriptor numbered past FD_SETSIZE (1,024), which an agent with a raised file limit
    and many connections reaches: every wait for a descriptor goes through ftrun.worker.readable (poll)."""
    pattern = re.compile(r"\bselect\.select\s*\(|\bfrom select import\b.*\bselect\b")
    found = [
        f"{name}:{n}"
        for name, path in modules().items()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line.split("#")[0])
    ]
    assert not found, f"select.select in {found}: use ftrun.worker.readable.wait_readable (poll takes any number)"
    assert pattern.search("ready = select.select([fd], [], [], 1)")  # the search can fail


def test_at_most_eight_modules_directly_under_ftrun() -> None:
    top = sorted(p.name for p in ROOT.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


OWNED = {"state", "phase", "ended_code", "waiting_stacks", "waiting_in"}  # a worker's lifecycle and findings


def state_writers() -> dict[str, list[int]]:
    """Where a worker's ``state``, ``phase`` or findings are assigned: every ``X.attr = ...`` (or a tuple of
    them) outside a class's own ``self.attr``."""
    found: dict[str, list[int]] = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for t in flat:
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr in OWNED
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                ):
                    found.setdefault(name, []).append(node.lineno)
    return found


def test_a_workers_state_has_one_owner() -> None:
    """procs.workers changes a worker's state and process phase; the hang watch, the requests and the reports
    only call its methods (blame, waits_for, script_ended)."""
    writers = state_writers()
    assert "ftrun.procs.workers" in writers  # the walk sees the owner's own writes
    assert set(writers) == {"ftrun.procs.workers"}, writers


# What a constructor may not do: anything seen outside the object (files, processes, threads, signal handlers,
# the network). Its own private handles (a pipe, an eventfd, a selector) are part of the object and allowed.
OUTSIDE_EFFECTS = {
    "signal.signal", "signal.set_wakeup_fd", "subprocess.Popen", "subprocess.run", "os.mkfifo", "os.mkdir",
    "os.makedirs", "os.fork", "os.kill", "tempfile.mkdtemp",
}  # fmt: skip
OUTSIDE_METHODS = {"start", "bind", "connect", "listen", "mkdir", "write_text", "write_bytes", "unlink", "spawn"}


def constructor_effects() -> list[str]:
    found = []
    for name, path in modules().items():
        if name.startswith("ftrun.testing"):
            continue  # test harnesses own temporary directories from the start
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for init in (f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"):
                for call in (n for n in ast.walk(init) if isinstance(n, ast.Call)):
                    what = ast.unparse(call.func)
                    opens_to_write = what in ("open", "os.open") or what.endswith(".open")
                    if (
                        what in OUTSIDE_EFFECTS
                        or what.rpartition(".")[2] in OUTSIDE_METHODS
                        or (opens_to_write and ("O_CREAT" in ast.unparse(call) or "'a'" in ast.unparse(call)))
                    ):
                        found.append(f"{name}.{cls.name}.__init__ calls {what} (line {call.lineno})")
    return found


def test_constructors_only_assign() -> None:
    """I/O seen outside the object happens in factories (``open``, ``start``, ``serve``) or in ``start()``."""
    assert not constructor_effects(), constructor_effects()


def test_the_constructor_check_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nclass C:\n    def __init__(self):\n        os.mkfifo('x')\n")
    tree = ast.parse(bad.read_text())
    calls = [ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert "os.mkfifo" in OUTSIDE_EFFECTS & set(calls)


# Who may parse JSON themselves: what ftrun wrote for itself, torch's flight recorder in the worker, and etcd's
# answers. Anything another process or
# node could have written (the store's records, a worker's slot or files, a datagram) goes through
# ftrun.jsonobject, bounded and checked to be an object.
OWN_JSON = {
    "ftrun.jsonobject", "ftrun.observe.events", "ftrun.warm.preload", "ftrun.warm.zygote", "ftrun.warm.zygotes",
    "ftrun.worker.client", "ftrun.worker.collectives", "ftrun.cli.report", "ftrun.store.etcd", "ftrun.node.ports",
    "ftrun.testing.etcd", "ftrun.worker.messages",
}  # fmt: skip


def json_parsers() -> set[str]:
    return {
        name
        for name, path in modules().items()
        if any(
            isinstance(n, ast.Call) and ast.unparse(n.func) in ("json.loads", "json.load")
            for n in ast.walk(ast.parse(path.read_text()))
        )
    }


def test_json_from_outside_is_read_in_one_place() -> None:
    assert "ftrun.jsonobject" in json_parsers()  # the walk sees calls
    assert json_parsers() <= OWN_JSON, json_parsers() - OWN_JSON


# Standard library modules newer than some Python 3 still in use, and the first version that has them.
NEWER_STDLIB = {"tomllib": (3, 11)}


def test_the_declared_python_floor_has_every_stdlib_module_ftrun_imports() -> None:
    """`--config x.toml` once crashed on the Python 3.10 the project declared (tomllib is 3.11's)."""
    pyproject = (Path(ftrun.__file__).parents[2] / "pyproject.toml").read_text()
    declared = pyproject.split('requires-python = ">=', 1)[1].split('"', 1)[0]
    floor = tuple(int(part) for part in declared.split("."))
    imported = {
        alias.name if isinstance(n, ast.Import) else f"{n.module}"
        for path in modules().values()
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Import | ast.ImportFrom)
        for alias in n.names
    }
    assert "tomllib" in imported  # the walk sees imports inside functions too
    for module, since in NEWER_STDLIB.items():
        if module in imported:
            assert floor >= since, f"{module} needs Python {since}, the project declares {declared}"


# Growth discipline (a ratchet: lower these as code is cleaned, never raise them): a line the formatter may not
# touch, and a value whose type nobody wrote down, are each a small debt; a module near a cap is split by concept.
MAX_FMT_SKIPS = 43
MAX_ANY_LINES = 269


def test_formatter_escapes_and_untyped_values_do_not_grow() -> None:
    sources = [p.read_text() for p in modules().values()]
    skips = sum(text.count("# fmt: skip") for text in sources)
    untyped = sum(1 for text in sources for line in text.splitlines() if re.search(r"\bAny\b", line))
    assert skips <= MAX_FMT_SKIPS, f"{skips} '# fmt: skip' in ftrun (at most {MAX_FMT_SKIPS}): let ruff format it"
    assert untyped <= MAX_ANY_LINES, f"{untyped} lines with Any in ftrun (at most {MAX_ANY_LINES}): type it"
