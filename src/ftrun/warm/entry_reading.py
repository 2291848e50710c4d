"""What the entry script does before and around its imports, read with ``ast`` (never run): what a zygote may
preload ahead of it and still give each import what the script's own import would have given.

The rule (docs/WARM_RESTARTS.md, "What may be preloaded"): the script's *leading block*, its top-level
statements up to the first one that could change what a later import gives, is preloaded as the script runs it:
its imports in order, and its environment writes of literal values replayed in the same order before the
imports that follow them. The first statement that cannot be replayed (an environment write of a computed
value, a ``sys.path`` edit, an attribute set on an imported module, ``torch.set_default_dtype``, warnings or
logging configured, ``importlib``/``runpy``, a call of the script's own functions, an import of the job's own
modules, which may do any of it) is the *stop*: the top-level imports after it are left to the worker. What the
workers import later (lazily, or after the stop) is preloaded only where the zygote checks it against what the
script changes anywhere in its source (:class:`Changes`).

PURE: no file is read here; the caller hands the sources (:func:`read_entry`'s ``own_source`` finds the job's own
modules the script imports).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from ftrun.warm.script_changes import (
    ENV_METHODS,
    HARMLESS_IMPORTLIB,
    STATE_MODULES,
    STATE_SETTERS,
    SYS_PATH,
    Changes,
    Collector,
    Step,
    dotted_name,
    is_environ_item,
    literal,
    literal_env_steps,
    module_attribute,
    module_names,
    own_modules,
)


@dataclass(frozen=True)
class Stop:
    """The first top-level statement after which the script's imports are not preloaded: where and why."""

    file: str
    line: int
    text: str  # the statement's first line, as written
    why: str  # "sets the environment to a computed value", "writes torch.backends.cudnn.benchmark", ...

    @property
    def place(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class EntryReading:
    """``steps``: the leading block as the zygote replays it; ``stop``: where it ends (None: the whole top level
    is imports and literal settings); ``kept_out``: the modules imported at top level after the stop; ``changes``:
    what the script changes outside the replayed steps."""

    steps: list[Step]
    stop: Stop | None
    kept_out: list[str]
    changes: Changes
    later: list[str] = field(default_factory=list)  # what the workers import later, known ahead (inductor's)

    @property
    def imports(self) -> list[str]:
        return [s[1] for s in self.steps if s[0] == "import"]


NOTHING = EntryReading([], None, [], Changes())


def read_entry(
    source: bytes, filename: str, own_source: Callable[[str], tuple[bytes, str] | None] = lambda name: None
) -> EntryReading:
    """Read the entry's source (``filename`` names it in the stop's place). ``own_source(module)``: the source and
    file name of one of the job's own modules (not installed), None for any other: what it changes counts too."""
    tree = ast.parse(source, filename)
    modules = module_names(tree)
    steps: list[Step] = []
    stop: Stop | None = None
    kept_out: list[str] = []
    replayed: set[int] = set()  # ids of the statements replayed (their writes are not changes to guard against)
    lines = source.decode("utf-8", "replace").splitlines()
    judge = _Judge(modules, tree, lambda name: own_source(name) is not None)
    checking = False  # past a change every later import is checked against (a variable named, an attribute)
    later: list[str] = []
    for node in _run_at_top(tree.body):
        if stop is not None:
            kept_out += [n for n, _ in _imports(node)]
            continue
        imported = _imports(node)
        if imported:
            own = [n for n, level in imported if level or own_source(n) is not None]
            if own:
                stop = _stop(filename, node, lines, f"imports the job's own module {own[0]}, which may change them")
                kept_out += [n for n, level in imported if not level and n not in own]
                continue
            if checking:
                later += [n for n, _ in imported]
            else:
                steps += [["import", n] for n, _ in imported]
            continue
        env = None if checking else literal_env_steps(node)
        if env is not None:
            steps += env
            replayed.add(id(node))
            continue
        why = judge.statement(node)
        if why and _checkable(node, modules) and not judge.calls(_values(node)):
            checking = True  # what it writes is among the changes each later import is checked against
        elif why:
            stop = _stop(filename, node, lines, why)
    changes = Collector(modules, replayed)
    changes.visit_tree(tree, filename)
    for name, (own_bytes, own_file) in own_modules(tree, own_source):
        try:
            own_tree = ast.parse(own_bytes, own_file)
        except (SyntaxError, ValueError):
            changes.other = changes.other or f"{own_file}: its source (module {name}) does not parse"
            continue
        changes.modules = module_names(own_tree)
        changes.visit_tree(own_tree, own_file)
    return EntryReading(steps, stop, list(dict.fromkeys(kept_out)), changes.result(), list(dict.fromkeys(later)))


def _values(node: ast.stmt) -> list[ast.expr]:
    """What a write computes: its value, or its call's arguments."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        return [*node.value.args, *(k.value for k in node.value.keywords)]
    value = getattr(node, "value", None)
    return [value] if isinstance(value, ast.expr) else []


def _checkable(node: ast.stmt, modules: dict[str, str]) -> bool:
    """Whether every later import can be checked against what ``node`` changes: it writes variables it names
    (``os.environ["RUN_TAG"] = str(os.getpid())``) or attributes of imported modules (``utils.DEVICE = "cpu"``),
    whose readers the zygote sees (``ftrun.worker.import_watch``)."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        func, args = node.value.func, node.value.args
        named = bool(args) and literal(args[0]) is not None
        return dotted_name(func) in ("os.environ.setdefault", "os.environ.pop", "os.putenv", "os.unsetenv") and named
    if not isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        return False
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for target in targets:
        if is_environ_item(target):
            if literal(target.slice) is None:  # type: ignore[attr-defined]
                return False
        elif not isinstance(target, ast.Attribute):
            return False
        else:
            dotted = module_attribute(target, modules)
            if not dotted or dotted.startswith("sys."):
                return False
    return True


def _stop(filename: str, node: ast.stmt, lines: list[str], why: str) -> Stop:
    text = lines[node.lineno - 1].strip() if 0 < node.lineno <= len(lines) else ""
    return Stop(filename, node.lineno, text, why)


def _run_at_top(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements run as the script starts, in order: the module body, and the bodies of its top-level
    ``if`` (``if __name__ == "__main__":`` too: it runs) and ``try`` blocks (each branch, in the order written:
    a statement in any of them may run). ``if TYPE_CHECKING:`` never runs."""
    for node in body:
        if isinstance(node, ast.If):
            if dotted_name(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                continue
            yield from _run_at_top(node.body)
            yield from _run_at_top(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _run_at_top(node.body)
            for handler in node.handlers:
                yield from _run_at_top(handler.body)
            yield from _run_at_top(node.orelse)
            yield from _run_at_top(node.finalbody)
        else:
            yield node


def _imports(node: ast.stmt) -> list[tuple[str, int]]:
    """(module, level) of an import statement ([] for any other): ``from a.b import c`` imports ``a.b`` (and
    maybe ``a.b.c``, which the workers' reports tell)."""
    if isinstance(node, ast.Import):
        return [(a.name, 0) for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.module == "__future__":
            return []
        return [(node.module or "", node.level)] if node.module or node.level else []
    return []


COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try)
QUIET = (ast.Pass, ast.Global, ast.Nonlocal, ast.Break, ast.Continue, ast.Return, ast.Raise, ast.Assert)


class _Judge:
    """Whether a statement may change what a later import gives: the script's own functions it calls are read
    too (a call of one that only reads, waits or prints changes nothing), each once."""

    def __init__(self, modules: dict[str, str], tree: ast.Module, own: Callable[[str], bool]) -> None:
        self.modules = modules
        self.own = own
        self.defs: dict[str, ast.stmt] = {
            n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        }
        self.judged: dict[str, str] = {}

    def statement(self, node: ast.stmt) -> str:
        """Why ``node`` may change what a later import gives ("" when it cannot): definitions, docstrings,
        control flow, assignments to plain names, imports of installed modules and calls that change nothing."""
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return self.calls([*node.decorator_list])  # a definition runs nothing of its body
        if isinstance(node, ast.Import | ast.ImportFrom):  # (at top level: the steps; deeper: learned later)
            own = [n for n, level in _imports(node) if level or self.own(n)]
            return f"imports the job's own module {own[0]}, which may change them" if own else ""
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for target in targets:
                why = _written(target, self.modules)
                if why:
                    return why
        elif isinstance(node, COMPOUND):
            heads = [getattr(node, "test", None), getattr(node, "iter", None)]
            heads += [item.context_expr for item in getattr(node, "items", [])]
            why = self.calls([h for h in heads if h is not None])
            for child in ast.iter_child_nodes(node):
                handlers = child.body if isinstance(child, ast.ExceptHandler) else [child]
                for stmt in handlers:
                    why = why or (self.statement(stmt) if isinstance(stmt, ast.stmt) else "")
            return why
        elif not isinstance(node, (ast.Expr, *QUIET)):
            return f"runs a {type(node).__name__.lower()} statement"
        return self.calls([node])

    def calls(self, nodes: Sequence[ast.AST]) -> str:
        for call in (n for node in nodes for n in ast.walk(node) if isinstance(n, ast.Call)):
            why = self.call(call)
            if why:
                return why
        return ""

    def call(self, call: ast.Call) -> str:
        func = call.func
        if isinstance(func, ast.Name) and func.id in self.defs:
            if func.id not in self.judged:
                self.judged[func.id] = ""  # a recursive call is judged by the rest of the body
                body = self.defs[func.id]
                stmts = [s for n in ast.walk(body) if n is not body for s in [n] if isinstance(s, ast.stmt)]
                found = next((w for w in map(self.statement_alone, stmts) if w), "")
                self.judged[func.id] = f"calls {func.id}(), which {found}" if found else ""
            return self.judged[func.id]
        return _call_changes(call, self.modules)

    def statement_alone(self, node: ast.stmt) -> str:
        """A statement inside a function, its nested blocks judged as statements of their own."""
        if isinstance(node, COMPOUND):
            heads = [getattr(node, "test", None), getattr(node, "iter", None)]
            return self.calls([h for h in heads if h is not None])
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return ""  # its statements are walked as the body's
        return self.statement(node)


def _written(target: ast.expr, modules: dict[str, str]) -> str:
    """Why writing ``target`` may change a later import ("" for a plain name or an object's of the script)."""
    for t in target.elts if isinstance(target, ast.Tuple | ast.List) else [target]:
        if is_environ_item(t):
            return "sets the environment to a computed value"
        if isinstance(t, ast.Attribute | ast.Subscript):
            dotted = module_attribute(t, modules)
            if dotted.startswith("sys.") and dotted.split(".")[1] in SYS_PATH | {"modules"}:
                return f"changes {'.'.join(dotted.split('.')[:2])}"
            if dotted:
                return f"sets {dotted}, an attribute of an imported module"
    return ""


def _call_changes(call: ast.Call, modules: dict[str, str]) -> str:  # noqa: PLR0911 - one per kind
    func = call.func
    if isinstance(func, ast.Name):
        if func.id in ("exec", "eval", "setattr", "delattr"):
            return f"calls {func.id}()"
        return ""
    if not isinstance(func, ast.Attribute):
        return ""
    dotted = module_attribute(func, modules)
    parts = dotted.split(".")
    if (dotted.startswith("os.environ.") and func.attr in ENV_METHODS) or dotted in ("os.putenv", "os.unsetenv"):
        return "sets the environment to a computed value"
    if len(parts) >= 3 and parts[0] == "sys" and parts[1] in SYS_PATH | {"modules"}:
        return f"changes sys.{parts[1]}"
    if parts[0] in STATE_MODULES and not (len(parts) == 2 and parts[1] in HARMLESS_IMPORTLIB):
        return STATE_MODULES[parts[0]]
    if func.attr in STATE_SETTERS:
        return STATE_SETTERS[func.attr]
    return ""
