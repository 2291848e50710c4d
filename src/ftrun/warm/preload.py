"""What the warm pool should preload, known before the first crash, with no help from the job.

Three sources, merged in this order: ``--preload``; what the same job imported on
this machine before (a small cache keyed by the interpreter and the script or
module); what the entry script imports at its top level (read with ``ast``,
never run). While the job runs, the workers' own reports (every module they
imported, written as they meet their peers, at their first step and at exit) add
the rest.

Only modules of the standard library and of installed packages are preloaded,
never the job's own code: it may read the rank at import, or change between runs.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.machinery
import json
import os
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ftrun.config import Entrypoint, EntrypointKind
from ftrun.jsonobject import object_or_none
from ftrun.private import make_dir, write_atomically
from ftrun.worker.compile_probes import INDUCTOR_USED

MAX_MODULES_REPORT_BYTES = 16 << 20  # {module: file} for every module a worker imported (torch: ~2,000)
CACHE_VERSION = 1
# What a compile with inductor imports at its first call, nearly all of it (the rest is the compile's own work);
# the cache module also has the zygote ask inductor's probes of the machine (worker/compile_probes.py).
INDUCTOR_IMPORTS = ("torch._dynamo", "torch._inductor.compile_fx", INDUCTOR_USED)


def installed_modules(names: Sequence[str], files: Mapping[str, str | None]) -> list[str]:
    """The modules worth preloading, in the order given (import side effects then happen as they did in the
    worker): from the standard library or installed packages, never the job's own, never ftrun's."""
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    keep = []
    for name in names:
        path = files.get(name)
        if name in ("__main__", "__mp_main__") or name.startswith("ftrun") or not path:
            continue
        if any(path.startswith(root + os.sep) for root in roots):
            keep.append(name)
    return list(dict.fromkeys(keep))


def read_modules_report(path: Path) -> list[str] | None:
    """A worker's report of its imported modules ({name: file}), filtered; None if absent or unreadable."""
    try:
        data = object_or_none(path.read_bytes(), limit=MAX_MODULES_REPORT_BYTES)
    except OSError:
        return None
    if data is None:
        return None
    return installed_modules(list(data), {k: v if isinstance(v, str) else None for k, v in data.items()})


def entry_imports(entry: Entrypoint, cwd: Path, python: str) -> list[str]:
    """The installed modules the entry script (or module) imports at its top level, read without running it.
    Only for this interpreter's own scripts: another interpreter has other packages."""
    if python != sys.executable or entry.kind not in (EntrypointKind.SCRIPT, EntrypointKind.MODULE):
        return []
    source = _module_file(entry.target, cwd) if entry.kind is EntrypointKind.MODULE else cwd / entry.target
    if source is None:
        return []
    try:
        tree = ast.parse(source.read_bytes(), str(source))
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in _top_level(tree.body):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    if "torch" in {n.split(".")[0] for n in names} and compiles_with_inductor(tree):
        names += INDUCTOR_IMPORTS
    return installed_modules(names, {n: _origin(n.split(".")[0]) for n in names})


def first_step_imports_known(modules: Sequence[str]) -> bool:
    """Whether ``modules`` hold what workers import lazily at their first step, as a whole run's cache does:
    inductor's, named by a script whose source compiles with it."""
    return set(INDUCTOR_IMPORTS) <= set(modules)


def compiles_with_inductor(tree: ast.Module) -> bool:
    """Whether the script calls ``torch.compile(...)`` or an object's ``.compile(...)`` (an ``nn.Module``'s)
    with inductor, the default backend, anywhere in its source; never a module's other than torch's
    (``re.compile``), never with another backend named (``backend="aot_eager"``)."""
    modules = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules -= {"torch"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or node.func.attr != "compile":
            continue
        if isinstance(node.func.value, ast.Name) and node.func.value.id in modules:
            continue
        backend = next((k.value for k in node.keywords if k.arg == "backend"), None)
        if not isinstance(backend, ast.Constant) or backend.value == "inductor":
            return True
    return False


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements run at import: the module body and the branches of its top-level if/try blocks."""
    found: list[ast.stmt] = []
    for node in body:
        found.append(node)
        if isinstance(node, ast.If):
            found += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            found += _top_level(node.body) + _top_level(node.orelse) + _top_level(node.finalbody)
    return found


def _origin(top: str) -> str | None:
    """Where the top-level module ``top`` would be imported from (found, not imported)."""
    if top in sys.builtin_module_names:
        return None
    spec = importlib.machinery.PathFinder.find_spec(top, sys.path)
    return spec.origin if spec is not None and spec.origin not in (None, "built-in", "frozen") else None


def _module_file(name: str, cwd: Path) -> Path | None:
    """The file ``python -m name`` runs, found part by part without importing the packages."""
    path = [str(cwd), *sys.path]
    spec = None
    parts = name.split(".")
    for i in range(len(parts)):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), path)
        if spec is None:
            return None
        path = list(spec.submodule_search_locations or [])
    if spec is None or not spec.origin:
        return None
    if spec.submodule_search_locations:  # a package: python -m runs its __main__
        main = Path(spec.origin).parent / "__main__.py"
        return main if main.is_file() else None
    return Path(spec.origin)


class Cache:
    """What the workers of one job imported last time on this machine, and how long preloading it took.

    Keyed by the interpreter and the resolved script (or module name and cwd, which decides what ``-m``
    finds): a rerun, or the next job of a sweep from its own directory, is warm from its first failure.
    """

    def __init__(self, directory: Path | None, python: str, entry: Entrypoint, cwd: Path) -> None:
        if entry.kind is EntrypointKind.SCRIPT:
            target = str((cwd / entry.target).resolve())
        else:
            target = f"{entry.target}\0{cwd.resolve()}"
        key = hashlib.sha256(f"{python}\0{entry.kind.value}\0{target}".encode()).hexdigest()[:24]
        self.path = None if directory is None else directory / f"{key}.json"

    def load(self) -> tuple[list[str], float | None]:
        """The modules and the seconds preloading them took (([], None) when unknown)."""
        if self.path is None:
            return [], None
        try:
            doc: Any = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return [], None
        if not isinstance(doc, dict) or doc.get("v") != CACHE_VERSION:
            return [], None
        modules = doc.get("modules")
        seconds = doc.get("import_s")
        if not isinstance(modules, list) or not all(isinstance(m, str) and m.isascii() for m in modules):
            return [], None
        if isinstance(seconds, int | float) and not isinstance(seconds, bool) and seconds >= 0:
            return modules, float(seconds)
        return modules, None

    def save(self, modules: Sequence[str], import_s: float | None) -> None:
        """Write atomically; a cache that cannot be written only costs the next run's first restart."""
        if self.path is None:
            return
        with contextlib.suppress(OSError):
            make_dir(self.path.parent)
            write_atomically(
                self.path, json.dumps({"v": CACHE_VERSION, "modules": list(modules), "import_s": import_s})
            )
