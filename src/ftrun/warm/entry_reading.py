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
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

# A step the zygote replays, in order: ["import", module], ["setenv", key, value], ["setdefault", key, value],
# ["putenv", key, value], ["unsetenv", key]. JSON-ready: the zygote reads them from its standard input.
Step = list[str]

ENV_METHODS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}
# Calls that change what a later import gives, by the called attribute's name (on any object: `logging.getLogger()
# .setLevel(...)`), and the modules any call of which may (`importlib.reload`, `runpy.run_module`).
STATE_SETTERS = {
    "set_default_dtype": "sets torch's default dtype",
    "set_default_device": "sets torch's default device",
    "set_default_tensor_type": "sets torch's default tensor type",
    "filterwarnings": "configures warnings",
    "simplefilter": "configures warnings",
    "resetwarnings": "configures warnings",
    "basicConfig": "configures logging",
    "dictConfig": "configures logging",
    "fileConfig": "configures logging",
    "setLevel": "configures logging",
    "addHandler": "configures logging",
    "disable": "configures logging",
    "chdir": "changes the working directory",
}
STATE_MODULES = {"importlib": "imports by importlib", "runpy": "runs a module by runpy", "imp": "imports by imp"}
HARMLESS_IMPORTLIB = {"import_module"}  # an import like any other: what it brings is learned from the workers
SYS_PATH = {"path", "meta_path", "path_hooks", "path_importer_cache"}


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
class Changes:
    """What the script (and the job's own modules it imports) changes anywhere, leading block aside: what a
    module the workers import later must not depend on to be preloaded. Each with the place that does it."""

    env: dict[str, str] = field(default_factory=dict)  # key -> file:line writing it (outside the replayed ones)
    env_unknown: str = ""  # file:line of a write whose key is computed: every key may change
    attributes: dict[str, str] = field(default_factory=dict)  # "module.path.attr" -> file:line setting it
    other: str = ""  # file:line and what, of a change no check can see (torch's default dtype, logging, ...)

    def as_json(self) -> dict[str, object]:
        return {"env": self.env, "env_unknown": self.env_unknown, "attributes": self.attributes, "other": self.other}


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
    modules = _module_names(tree)
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
    changes = _Collector(modules, replayed)
    changes.visit_tree(tree, filename)
    for name, (own_bytes, own_file) in _own_modules(tree, own_source):
        try:
            own_tree = ast.parse(own_bytes, own_file)
        except (SyntaxError, ValueError):
            changes.other = changes.other or f"{own_file}: its source (module {name}) does not parse"
            continue
        changes.modules = _module_names(own_tree)
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
        named = bool(args) and _literal(args[0]) is not None
        return _dotted(func) in ("os.environ.setdefault", "os.environ.pop", "os.putenv", "os.unsetenv") and named
    if not isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        return False
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for target in targets:
        if _is_environ_item(target):
            if _literal(target.slice) is None:  # type: ignore[attr-defined]
                return False
        elif not isinstance(target, ast.Attribute):
            return False
        else:
            dotted = _module_attribute(target, modules)
            if not dotted or dotted.startswith("sys."):
                return False
    return True


def literal_env_steps(node: ast.stmt) -> list[Step] | None:  # noqa: PLR0911 - one return per form
    """The steps replaying ``node`` when it is an environment write of literal strings only (``os.environ["K"] =
    "V"``, ``os.environ.setdefault("K", "V")``, ``os.environ.update({"K": "V"})``, ``os.putenv``, ``del
    os.environ["K"]``, ``os.environ.pop("K", None)``, ``os.unsetenv``); None for any other statement."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and _is_environ_item(node.targets[0]):
        key, value = _literal(node.targets[0].slice), _literal(node.value)  # type: ignore[attr-defined]
        return [["setenv", key, value]] if key is not None and value is not None else None
    if isinstance(node, ast.Delete) and all(_is_environ_item(t) for t in node.targets):
        keys = [_literal(t.slice) for t in node.targets]  # type: ignore[attr-defined]
        return None if None in keys else [["unsetenv", k] for k in keys if k is not None]
    if not isinstance(node, ast.Expr) or not isinstance(node.value, ast.Call):
        return None
    call = node.value
    func = _dotted(call.func)
    if func == "os.environ.update":
        return _update_keywords(call)
    args = [_literal(a) for a in call.args]
    if None in args or call.keywords:
        return None
    if func == "os.environ.setdefault" and len(args) == 2:
        return [["setdefault", args[0], args[1]]]  # type: ignore[list-item]
    if func == "os.putenv" and len(args) == 2:  # the C library's environment only, not os.environ
        return [["putenv", args[0], args[1]]]  # type: ignore[list-item]
    if func == "os.unsetenv" and len(args) == 1:
        return [["unsetenv", args[0]]]  # type: ignore[list-item]
    if func == "os.environ.pop" and len(args) in (1, 2):
        return [["unsetenv", args[0]]]  # type: ignore[list-item]
    return None


def _update_keywords(call: ast.Call) -> list[Step] | None:
    """``os.environ.update({"K": "V"}, K2="V2")`` with literals only."""
    steps: list[Step] = []
    if len(call.args) > 1:
        return None
    if call.args:
        d = call.args[0]
        if not isinstance(d, ast.Dict) or None in d.keys:
            return None
        for k, v in zip(d.keys, d.values, strict=True):
            key, value = (_literal(k) if k is not None else None), _literal(v)
            if key is None or value is None:
                return None
            steps.append(["setenv", key, value])
    for kw in call.keywords:
        value = _literal(kw.value)
        if kw.arg is None or value is None:
            return None
        steps.append(["setenv", kw.arg, value])
    return steps


def _stop(filename: str, node: ast.stmt, lines: list[str], why: str) -> Stop:
    text = lines[node.lineno - 1].strip() if 0 < node.lineno <= len(lines) else ""
    return Stop(filename, node.lineno, text, why)


def _run_at_top(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements run as the script starts, in order: the module body, and the bodies of its top-level
    ``if`` (``if __name__ == "__main__":`` too: it runs) and ``try`` blocks (each branch, in the order written:
    a statement in any of them may run). ``if TYPE_CHECKING:`` never runs."""
    for node in body:
        if isinstance(node, ast.If):
            if _dotted(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
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
        if _is_environ_item(t):
            return "sets the environment to a computed value"
        if isinstance(t, ast.Attribute | ast.Subscript):
            dotted = _module_attribute(t, modules)
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
    dotted = _module_attribute(func, modules)
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


class _Collector:
    """What a source changes anywhere (function bodies too), the statements replayed aside."""

    def __init__(self, modules: dict[str, str], replayed: set[int]) -> None:
        self.modules = modules
        self.replayed = replayed
        self.env: dict[str, str] = {}
        self.env_unknown = ""
        self.attributes: dict[str, str] = {}
        self.other = ""

    def visit_tree(self, tree: ast.Module, filename: str) -> None:
        replayed = {id(n) for node in ast.walk(tree) if id(node) in self.replayed for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in replayed:
                continue
            place = f"{filename}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.stmt) and literal_env_steps(node) is not None:
                for step in literal_env_steps(node) or []:
                    self.env.setdefault(step[1], place)
                continue
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.Delete):
                targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
                for target in targets:
                    self._target(target, place)
            elif isinstance(node, ast.Call):
                self._call(node, place)

    def _target(self, target: ast.expr, place: str) -> None:
        for t in target.elts if isinstance(target, ast.Tuple | ast.List) else [target]:
            if _is_environ_item(t):
                key = _literal(t.slice)  # type: ignore[attr-defined]
                if key is None:
                    self.env_unknown = self.env_unknown or place
                else:
                    self.env.setdefault(key, place)
            elif isinstance(t, ast.Attribute):
                dotted = _module_attribute(t, self.modules)
                if dotted and not dotted.startswith("sys."):
                    self.attributes.setdefault(dotted, place)
                elif dotted.startswith("sys.modules"):
                    self.other = self.other or f"{place} changes sys.modules"
            elif isinstance(t, ast.Subscript) and _module_attribute(t, self.modules).startswith("sys.modules"):
                self.other = self.other or f"{place} changes sys.modules"

    def _call(self, call: ast.Call, place: str) -> None:
        func = call.func
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and call.args:
            if _module_attribute(call.args[0], self.modules):
                self.other = self.other or f"{place} calls {func.id}() on a module"
            return
        if not isinstance(func, ast.Attribute):
            return
        dotted = _module_attribute(func, self.modules)
        parts = dotted.split(".")
        if (dotted.startswith("os.environ.") and func.attr in ENV_METHODS) or dotted in ("os.putenv", "os.unsetenv"):
            key = _literal(call.args[0]) if call.args else None
            if func.attr in ("update", "clear", "popitem") or key is None:
                keys = _update_keywords(call) if func.attr == "update" else None
                if keys is None:
                    self.env_unknown = self.env_unknown or place
                for step in keys or []:
                    self.env.setdefault(step[1], place)
            elif func.attr in ENV_METHODS | {"putenv", "unsetenv"}:
                self.env.setdefault(key, place)
        elif len(parts) >= 3 and parts[0] == "sys" and parts[1] == "modules":
            self.other = self.other or f"{place} changes sys.modules"
        elif parts[0] in STATE_MODULES and not (len(parts) == 2 and parts[1] in HARMLESS_IMPORTLIB):
            if parts[0] != "runpy":  # runpy runs a module, whose imports are checked as any later import
                self.other = self.other or f"{place} {STATE_MODULES[parts[0]]}"
        elif func.attr in STATE_SETTERS and func.attr != "chdir":
            self.other = self.other or f"{place} {STATE_SETTERS[func.attr]}"

    def result(self) -> Changes:
        return Changes(self.env, self.env_unknown, self.attributes, self.other)


def _module_names(tree: ast.Module) -> dict[str, str]:
    """The names the source binds to modules by its imports (anywhere): alias -> module (``import a.b`` binds
    ``a``; ``import a.b as c``, ``c`` -> ``a.b``; ``from a import b`` binds ``b`` -> ``a.b``, a module or not)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    names[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if a.name != "*":
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _module_attribute(node: ast.expr, modules: dict[str, str]) -> str:
    """``torch.backends.cudnn.benchmark`` for a chain of attributes (or an item) rooted at a name bound to a
    module, with the alias resolved; "" for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in modules:
        return ""
    return ".".join([modules[node.id], *reversed(parts)])


def _is_environ_item(node: ast.expr) -> bool:
    return isinstance(node, ast.Subscript) and _dotted(node.value) == "os.environ"


def _dotted(node: ast.expr) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def _literal(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _own_modules(
    tree: ast.Module, own_source: Callable[[str], tuple[bytes, str] | None], limit: int = 200
) -> Iterator[tuple[str, tuple[bytes, str]]]:
    """The job's own modules the source imports (anywhere, and theirs in turn), at most ``limit``."""
    seen: set[str] = set()
    queue = [tree]
    while queue and len(seen) < limit:
        for node in ast.walk(queue.pop()):
            for name in _import_names(node):
                if name in seen or len(seen) >= limit:
                    continue
                seen.add(name)
                found = own_source(name)
                if found is not None:
                    yield name, found
                    with contextlib.suppress(SyntaxError, ValueError):
                        queue.append(ast.parse(found[0], found[1]))


def _import_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names if a.name != "*")]
    return []
