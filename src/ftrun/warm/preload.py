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
from ftrun.warm.entry_reading import NOTHING, EntryReading, read_entry
from ftrun.worker.compile_probes import INDUCTOR_USED

MAX_MODULES_REPORT_BYTES = 16 << 20  # {module: file} for every module a worker imported (torch: ~2,000)
CACHE_VERSION = 2  # 2: the files the workers found, checked by the zygote before they are used
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


def read_modules_report(path: Path) -> tuple[list[str], dict[str, str | None]] | None:
    """A worker's report of its imported modules ({name: file}): the installed ones, and where each top-level
    module was found (what a zygote's own import must find too); None if absent or unreadable."""
    try:
        data = object_or_none(path.read_bytes(), limit=MAX_MODULES_REPORT_BYTES)
    except OSError:
        return None
    if data is None:
        return None
    files = {k: v if isinstance(v, str) else None for k, v in data.items()}
    return installed_modules(list(data), files), {k: v for k, v in files.items() if "." not in k}


def script_directory(entry: Entrypoint, cwd: Path) -> Path:
    """sys.path[0] of the worker: the script's directory (as `python SCRIPT`), or the cwd (`python -m`)."""
    return Path(os.path.realpath(cwd / entry.target)).parent if entry.kind is EntrypointKind.SCRIPT else cwd


def read_entry_script(entry: Entrypoint, cwd: Path, python: str) -> EntryReading:
    """What the entry script (or module) does before and around its imports (:mod:`ftrun.warm.entry_reading`),
    read without running it, its steps kept to installed modules. Only for this interpreter's own scripts:
    another interpreter has other packages."""
    if python != sys.executable or entry.kind not in (EntrypointKind.SCRIPT, EntrypointKind.MODULE):
        return NOTHING
    source = _module_file(entry.target, cwd) if entry.kind is EntrypointKind.MODULE else cwd / entry.target
    if source is None:
        return NOTHING
    first = str(script_directory(entry, cwd))

    def own_source(name: str) -> tuple[bytes, str] | None:
        """The job's own module ``name``: found in the script's directory, before any installed one."""
        found = _module_file(name, Path(first), path=[first], main=False)
        if found is None:
            return None
        with contextlib.suppress(OSError):
            return found.read_bytes(), str(found)
        return None

    try:
        reading = read_entry(source.read_bytes(), str(source), own_source)
    except (OSError, SyntaxError, ValueError):
        return NOTHING
    imports = reading.imports
    tree_compiles = "torch" in {n.split(".")[0] for n in [*imports, *reading.later]} and _compiles(source)
    path = [first, *sys.path[1:]]
    installed = set(installed_modules(imports, {n: _origin(n.split(".")[0], path) for n in imports}))
    steps = [s for s in reading.steps if s[0] != "import" or s[1] in installed]
    checked = installed_modules(reading.later, {n: _origin(n.split(".")[0], path) for n in reading.later})
    later = checked + (list(INDUCTOR_IMPORTS) if tree_compiles else [])  # at its first compile: checked too
    leading = set(imports)
    kept_out = [m for m in reading.kept_out if m not in leading and _origin(m.split(".")[0], path) is not None]
    return EntryReading(steps, reading.stop, kept_out, reading.changes, later)


def _compiles(source: Path) -> bool:
    try:
        return compiles_with_inductor(ast.parse(source.read_bytes(), str(source)))
    except (OSError, SyntaxError, ValueError):
        return False


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


def _origin(top: str, path: Sequence[str] | None = None) -> str | None:
    """Where the top-level module ``top`` would be imported from on ``path`` (found, not imported)."""
    if top in sys.builtin_module_names:
        return None
    spec = importlib.machinery.PathFinder.find_spec(top, list(sys.path if path is None else path))
    return spec.origin if spec is not None and spec.origin not in (None, "built-in", "frozen") else None


def _module_file(name: str, cwd: Path, *, path: Sequence[str] | None = None, main: bool = True) -> Path | None:
    """The file ``python -m name`` runs (``main``; else the module's or package's own file), found part by part
    without importing the packages, on ``path`` (default: the cwd, then sys.path)."""
    search = [str(cwd), *sys.path] if path is None else list(path)
    spec = None
    parts = name.split(".")
    for i in range(len(parts)):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    if spec.submodule_search_locations and main:  # a package: python -m runs its __main__
        found = Path(spec.origin).parent / "__main__.py"
        return found if found.is_file() else None
    return Path(spec.origin) if Path(spec.origin).is_file() else None


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

    def load(self) -> tuple[list[str], float | None, dict[str, str | None]]:  # noqa: PLR0911 - one per flaw
        """The modules, the seconds preloading them took, and where the workers found each top-level module
        (([], None, {}) when unknown): a zygote preloading them checks that this run's imports find the same."""
        if self.path is None:
            return [], None, {}
        try:
            doc: Any = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return [], None, {}
        if not isinstance(doc, dict) or doc.get("v") != CACHE_VERSION:
            return [], None, {}
        modules, seconds, files = doc.get("modules"), doc.get("import_s"), doc.get("files")
        if not isinstance(modules, list) or not all(isinstance(m, str) and m.isascii() for m in modules):
            return [], None, {}
        if not isinstance(files, dict):
            return [], None, {}
        found = {str(k): v if isinstance(v, str) else None for k, v in files.items()}
        if isinstance(seconds, int | float) and not isinstance(seconds, bool) and seconds >= 0:
            return modules, float(seconds), found
        return modules, None, found

    def save(self, modules: Sequence[str], import_s: float | None, files: Mapping[str, str | None]) -> None:
        """Write atomically; a cache that cannot be written only costs the next run's first restart."""
        if self.path is None:
            return
        tops = {m.split(".")[0] for m in modules}
        found = {k: v for k, v in files.items() if k in tops}
        doc = {"v": CACHE_VERSION, "modules": list(modules), "import_s": import_s, "files": found}
        with contextlib.suppress(OSError):
            make_dir(self.path.parent)
            write_atomically(self.path, json.dumps(doc))
