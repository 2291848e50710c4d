"""What a script's statements change that a later import could see: environment writes (the literal ones a
zygote can replay, as steps), module attributes set, settings no check can see; and what the whole source (with
the job's own modules it imports) changes anywhere, which every import after the leading block is checked
against (:mod:`ftrun.warm.entry_reading`).

PURE: no file is read here.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Callable, Iterator
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
class Changes:
    """What the script (and the job's own modules it imports) changes anywhere, leading block aside: what a
    module the workers import later must not depend on to be preloaded. Each with the place that does it."""

    env: dict[str, str] = field(default_factory=dict)  # key -> file:line writing it (outside the replayed ones)
    env_unknown: str = ""  # file:line of a write whose key is computed: every key may change
    attributes: dict[str, str] = field(default_factory=dict)  # "module.path.attr" -> file:line setting it
    other: str = ""  # file:line and what, of a change no check can see (torch's default dtype, logging, ...)

    def as_json(self) -> dict[str, object]:
        return {"env": self.env, "env_unknown": self.env_unknown, "attributes": self.attributes, "other": self.other}


def literal_env_steps(node: ast.stmt) -> list[Step] | None:  # noqa: PLR0911 - one return per form
    """The steps replaying ``node`` when it is an environment write of literal strings only (``os.environ["K"] =
    "V"``, ``os.environ.setdefault("K", "V")``, ``os.environ.update({"K": "V"})``, ``os.putenv``, ``del
    os.environ["K"]``, ``os.environ.pop("K", None)``, ``os.unsetenv``); None for any other statement."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and is_environ_item(node.targets[0]):
        key, value = literal(node.targets[0].slice), literal(node.value)  # type: ignore[attr-defined]
        return [["setenv", key, value]] if key is not None and value is not None else None
    if isinstance(node, ast.Delete) and all(is_environ_item(t) for t in node.targets):
        keys = [literal(t.slice) for t in node.targets]  # type: ignore[attr-defined]
        return None if None in keys else [["unsetenv", k] for k in keys if k is not None]
    if not isinstance(node, ast.Expr) or not isinstance(node.value, ast.Call):
        return None
    call = node.value
    func = dotted_name(call.func)
    if func == "os.environ.update":
        return update_keywords(call)
    args = [literal(a) for a in call.args]
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


def update_keywords(call: ast.Call) -> list[Step] | None:
    """``os.environ.update({"K": "V"}, K2="V2")`` with literals only."""
    steps: list[Step] = []
    if len(call.args) > 1:
        return None
    if call.args:
        d = call.args[0]
        if not isinstance(d, ast.Dict) or None in d.keys:
            return None
        for k, v in zip(d.keys, d.values, strict=True):
            key, value = (literal(k) if k is not None else None), literal(v)
            if key is None or value is None:
                return None
            steps.append(["setenv", key, value])
    for kw in call.keywords:
        value = literal(kw.value)
        if kw.arg is None or value is None:
            return None
        steps.append(["setenv", kw.arg, value])
    return steps


class Collector:
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
            if is_environ_item(t):
                key = literal(t.slice)  # type: ignore[attr-defined]
                if key is None:
                    self.env_unknown = self.env_unknown or place
                else:
                    self.env.setdefault(key, place)
            elif isinstance(t, ast.Attribute):
                dotted = module_attribute(t, self.modules)
                if dotted and not dotted.startswith("sys."):
                    self.attributes.setdefault(dotted, place)
                elif dotted.startswith("sys.modules"):
                    self.other = self.other or f"{place} changes sys.modules"
            elif isinstance(t, ast.Subscript) and module_attribute(t, self.modules).startswith("sys.modules"):
                self.other = self.other or f"{place} changes sys.modules"

    def _call(self, call: ast.Call, place: str) -> None:
        func = call.func
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and call.args:
            if module_attribute(call.args[0], self.modules):
                self.other = self.other or f"{place} calls {func.id}() on a module"
            return
        if not isinstance(func, ast.Attribute):
            return
        dotted = module_attribute(func, self.modules)
        parts = dotted.split(".")
        if (dotted.startswith("os.environ.") and func.attr in ENV_METHODS) or dotted in ("os.putenv", "os.unsetenv"):
            key = literal(call.args[0]) if call.args else None
            if func.attr in ("update", "clear", "popitem") or key is None:
                keys = update_keywords(call) if func.attr == "update" else None
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


def module_names(tree: ast.Module) -> dict[str, str]:
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


def module_attribute(node: ast.expr, modules: dict[str, str]) -> str:
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


def is_environ_item(node: ast.expr) -> bool:
    return isinstance(node, ast.Subscript) and dotted_name(node.value) == "os.environ"


def dotted_name(node: ast.expr) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def literal(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def own_modules(
    tree: ast.Module, own_source: Callable[[str], tuple[bytes, str] | None], limit: int = 200
) -> Iterator[tuple[str, tuple[bytes, str]]]:
    """The job's own modules the source imports (anywhere, and theirs in turn), at most ``limit``."""
    seen: set[str] = set()
    queue = [tree]
    while queue and len(seen) < limit:
        for node in ast.walk(queue.pop()):
            for name in import_names(node):
                if name in seen or len(seen) >= limit:
                    continue
                seen.add(name)
                found = own_source(name)
                if found is not None:
                    yield name, found
                    with contextlib.suppress(SyntaxError, ValueError):
                        queue.append(ast.parse(found[0], found[1]))


def import_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names if a.name != "*")]
    return []
