"""In the zygote: what each preloaded import reads of the process's state, and whether a fresh worker's own
import would have read the same (the proof the pool's rule asks of a module the workers import after the
script's leading block: docs/WARM_RESTARTS.md, "What may be preloaded").

While a module is imported under :func:`watching`, ``os.environ`` records the keys read by name (``get``,
``[]``, ``in``, ``os.getenv``), told apart from a scan of the whole environment (``dict(os.environ)``,
``.items()``: tqdm and fsspec look for their prefixes so, which names no key), and the module attributes the
script sets (``torch.backends.cudnn.benchmark``) record whether anything read them. Nothing of it is left once
the import returns: the classes are put back before any worker is forked.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

THIS_FILE = __file__
# os.py's and the mapping ABCs' frames, as their code names its file ("<frozen os>": Python 3.11 freezes them)
PASSING_FRAMES = {os.getenv.__code__.co_filename, Mapping.get.__code__.co_filename}


@dataclass
class Reads:
    """What one import read: environment keys by name (key -> the value it saw, None: unset), and the set
    attributes of modules (``module.attr``) anything asked for."""

    env: dict[str, str | None] = field(default_factory=dict)
    attributes: set[str] = field(default_factory=set)


def _reader() -> types.FrameType | None:
    """The frame that asked, past os.py and the mapping ABCs (os.getenv, Mapping.get, dict's own calls)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in PASSING_FRAMES | {THIS_FILE}:
        frame = frame.f_back
    return frame


@contextmanager
def watching(attributes: Mapping[str, object] = {}) -> Iterator[Reads]:
    """Record what the code run inside reads. ``attributes``: "module.attr" -> the module object holding it."""
    reads = Reads()
    scanners: set[int] = set()  # frames that iterated over the environment: their reads are a scan
    environ_class = type(os.environ)

    class RecordingEnviron(environ_class):  # type: ignore[misc,valid-type]
        def __getitem__(self, key: str) -> str:
            try:
                value: str = super().__getitem__(key)
            except KeyError:
                self._note(key, None)
                raise
            self._note(key, value)
            return value

        def __contains__(self, key: object) -> bool:
            found: bool = super().__contains__(key)
            if isinstance(key, str):
                reads.env.setdefault(key, super().get(key))
            return found

        def __iter__(self) -> Iterator[str]:
            frame = _reader()
            if frame is not None:
                scanners.add(id(frame))
            keys: Iterator[str] = super().__iter__()
            return keys

        def _note(self, key: str, value: str | None) -> None:
            frame = _reader()
            if frame is None or id(frame) not in scanners:
                reads.env.setdefault(key, value)

    watched: list[tuple[types.ModuleType, type]] = []
    by_module: dict[int, set[str]] = {}
    for dotted, module in attributes.items():
        if isinstance(module, types.ModuleType):
            by_module.setdefault(id(module), set()).add(dotted.rsplit(".", 1)[1])
            if all(m is not module for m, _ in watched):
                watched.append((module, type(module)))
    for module, cls in watched:
        names = by_module[id(module)]
        prefix = module.__name__

        def __getattribute__(
            self: types.ModuleType, name: str, _cls: type = cls, _names: set[str] = names, _prefix: str = prefix
        ) -> object:
            if name in _names:
                reads.attributes.add(f"{_prefix}.{name}")
            return _cls.__getattribute__(self, name)  # type: ignore[call-arg,arg-type]

        try:
            module.__class__ = type(f"Watched{cls.__name__}", (cls,), {"__getattribute__": __getattribute__})
        except TypeError:  # a module type that cannot be swapped: its readers cannot be known
            reads.attributes.add(f"{prefix}.?")
    os.environ.__class__ = RecordingEnviron
    try:
        yield reads
    finally:
        os.environ.__class__ = environ_class
        for module, cls in watched:
            object.__setattr__(module, "__class__", cls)


def owner_of(dotted: str) -> tuple[str, object] | None:
    """The loaded module holding the attribute ``dotted`` names (``torch.backends.cudnn.benchmark`` ->
    ``torch.backends.cudnn``), None when none is loaded."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is not None:
            obj: object = module
            for part in parts[cut:-1]:
                obj = getattr(obj, part, None)
            return (dotted, obj) if isinstance(obj, types.ModuleType) else None
    return None


@dataclass(frozen=True)
class Guards:
    """What a module imported after the script's leading block must not depend on (from the agent): the
    environment keys the script writes (key -> file:line; ``env_unknown``: a write whose key is computed), the
    keys whose values differ from the zygote's in a worker (its rank's), the module attributes the script sets
    (-> file:line), the files the workers' own imports found (module -> file), and a change no check can see."""

    env: Mapping[str, str] = field(default_factory=dict)
    env_unknown: str = ""
    varying: frozenset[str] = frozenset()
    attributes: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str | None] = field(default_factory=dict)
    other: str = ""

    @classmethod
    def from_json(cls, doc: Mapping[str, object]) -> Guards:
        def strings(value: object) -> dict[str, str]:
            return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}

        files, varying = doc.get("files"), doc.get("varying")
        return cls(
            env=strings(doc.get("env")),
            env_unknown=str(doc.get("env_unknown") or ""),
            varying=frozenset(k for k in varying if isinstance(k, str)) if isinstance(varying, list) else frozenset(),
            attributes=strings(doc.get("attributes")),
            files={str(k): v if isinstance(v, str) else None for k, v in files.items()}
            if isinstance(files, dict)
            else {},
            other=str(doc.get("other") or ""),
        )


def verdict(  # noqa: PLR0911 - one return per reason
    module: str, reads: Reads, guards: Guards, new: Mapping[str, str | None], *, leading: bool
) -> str:
    """Why the import of ``module`` (which read ``reads`` and loaded the modules ``new``: name -> file) is not
    what a worker's own import would give ("" when it is). ``leading``: imported in the script's leading block,
    where the script changed nothing but what the zygote replayed: only the rank's own values and the files
    matter there."""
    for key in sorted(reads.env):
        if key in guards.varying:
            return f"reads {key} at import, whose value differs in each worker (no one zygote can import it for all)"
    for name, file in new.items():
        if name in guards.files and guards.files[name] != file:
            return f"finds {name} at {file}, where the workers' own import found {guards.files[name]}"
    if leading:
        return ""
    keep = f"to keep it warm, make that setting in the launch environment, or --preload {module}"
    if guards.other:
        return f"is imported after the script's top, and {guards.other} ({keep})"
    for key in sorted(reads.env):
        if key in guards.env:
            return f"reads {key} at import, which {guards.env[key]} sets ({keep})"
        if guards.env_unknown:
            return f"reads {key} at import, and {guards.env_unknown} sets a variable named at run time ({keep})"
    for dotted in sorted(reads.attributes):
        return f"reads {dotted} at import, which {guards.attributes.get(dotted, 'the script')} sets ({keep})"
    return ""
