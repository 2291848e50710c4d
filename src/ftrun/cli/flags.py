"""Flag values -> validated values: each parser takes the raw text and raises ConfigError naming the flag.

The environment is never read here: the CLI passes ``os.environ`` in, so a test
can give any environment.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from ftrun.config import Entrypoint, EntrypointKind, NodeRange, Std, WarmSpec
from ftrun.errors import ConfigError
from ftrun.node import numa
from ftrun.node.addresses import parse_port
from ftrun.node.devices import count_gpus, count_xpus
from ftrun.procs.signals import CAUGHT
from ftrun.procs.signals import name as signal_name

RDZV_BACKENDS = ("static", "c10d", "tcp", "etcd", "etcd-v2")
START_METHODS = ("spawn", "fork", "forkserver")

WARM_MODES = ("auto", "preload")


def parse_int(flag: str, text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(flag, f"expected an integer, got {text!r}", f"pass {flag} {minimum} or more") from None
    if value < minimum:
        raise ConfigError(flag, f"must be >= {minimum}, got {value}", f"pass {flag} {minimum} or more")
    return value


def parse_seconds(flag: str, text: str, *, allow_zero: bool = False, fix: str | None = None) -> float:
    """``fix``: how to write a good value where it is not ``FLAG 5`` (``--rdzv-conf join_timeout=5``, a key in
    a config file)."""
    fix = fix or f"pass e.g. {flag} 5"
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(flag, f"expected seconds as a number, got {text!r}", fix) from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(flag, f"must be a finite number of seconds {bound}, got {text!r}", fix)
    return value


def parse_nnodes(text: str) -> NodeRange:
    flag = "--nnodes"
    parts = text.split(":")
    if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(flag, f"expected N or MIN:MAX, got {text!r}", "pass e.g. --nnodes 1 or --nnodes 2:4")
    low, high = int(parts[0]), int(parts[-1])
    if low < 1:
        raise ConfigError(flag, f"the minimum must be >= 1, got {low}", "pass e.g. --nnodes 1")
    if low > high:
        raise ConfigError(flag, f"MIN {low} is larger than MAX {high}", f"pass --nnodes {high}:{low}")
    return NodeRange(low, high)


def parse_nproc(text: str, environ: Mapping[str, str], cpu_count: int) -> int:
    flag = "--nproc-per-node"
    if text == "cpu":
        return cpu_count
    if text == "xpu":
        xpus = count_xpus(environ)
        if not xpus:
            raise ConfigError(
                flag, "'xpu' asked for one worker per XPU, but no XPU is visible", "pass a number or 'cpu'"
            )
        return xpus
    if text in ("gpu", "auto"):
        gpus = count_gpus(environ) or (count_xpus(environ) if text == "auto" else 0)
        if gpus:
            return gpus
        if text == "auto":
            return cpu_count
        raise ConfigError(flag, "'gpu' asked for one worker per GPU, but no GPU is visible", "pass a number or 'cpu'")
    if not text.lstrip("-").isdigit():
        raise ConfigError(
            flag,
            f"expected a positive integer, 'auto', 'cpu', 'gpu' or 'xpu', got {text!r}",
            "pass e.g. --nproc-per-node 2",
        )
    return parse_int(flag, text, minimum=1)


def parse_std(flag: str, text: str, nproc: int) -> dict[int, Std]:
    """torchrun's format: ``3`` for every rank, or ``0:1,1:2`` per local rank."""
    fix = f"pass e.g. {flag} 3 (both streams) or {flag} 0:1,1:2 (per local rank; 1=stdout, 2=stderr, 3=both)"

    def one(value: str) -> Std:
        if value.strip() not in ("0", "1", "2", "3"):
            raise ConfigError(flag, f"expected a stream code 0-3, got {value!r}", fix)
        return Std(int(value))

    if ":" not in text:
        return dict.fromkeys(range(nproc), one(text))
    result = dict.fromkeys(range(nproc), Std.NONE)
    for item in text.split(","):
        rank_text, _, value = item.partition(":")
        if not rank_text.strip().isdigit():
            raise ConfigError(flag, f"expected LOCAL_RANK:CODE, got {item!r}", fix)
        rank = int(rank_text)
        if rank >= nproc:
            raise ConfigError(flag, f"local rank {rank} does not exist with {nproc} workers per node", fix)
        result[rank] = one(value)
    return result


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    if not text:
        return None
    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() for t in items):
        raise ConfigError(
            "--local-ranks-filter", f"expected comma-separated local ranks, got {text!r}", "pass e.g. 0,1"
        )
    return frozenset(int(t) for t in items)


def resolve_entrypoint(
    target: str, args: Sequence[str], *, module: bool, no_python: bool, run_path: bool, cwd: Path
) -> Entrypoint:
    if not target:
        raise ConfigError("SCRIPT", "no training script given", "usage: ftrun [flags] SCRIPT [script args]")
    if module and no_python:
        raise ConfigError("--module", "cannot be combined with --no-python", "drop one of the two flags")
    if module:
        if not module_exists(target, cwd):
            raise ConfigError(
                "--module", f"no module named {target!r}", "check the name (it is looked up from the cwd and sys.path)"
            )
        return Entrypoint(EntrypointKind.MODULE, target, tuple(args))
    if no_python and not run_path:
        # A name with a slash is a path (relative to the cwd), otherwise a command on PATH, as in a shell.
        found = str(cwd / target) if os.sep in target else shutil.which(target)
        if found is None or not Path(found).is_file():
            raise ConfigError("--no-python", f"executable {target!r} not found", "give a path or a command on PATH")
        if not os.access(found, os.X_OK):
            raise ConfigError("--no-python", f"{target!r} is not executable", f"run: chmod +x {target}")
        return Entrypoint(EntrypointKind.EXECUTABLE, found, tuple(args))
    script = cwd / target
    if not script.is_file():
        raise ConfigError("SCRIPT", f"training script {target!r} not found", "check the path (relative to the cwd)")
    kind = EntrypointKind.RUN_PATH if run_path else EntrypointKind.SCRIPT
    return Entrypoint(kind, str(script.resolve()) if run_path else target, tuple(args))


def module_exists(name: str, cwd: Path) -> bool:
    """Whether ``python -m name`` in ``cwd`` finds the module's top-level package, without importing anything
    (a package's ``__init__`` may import torch)."""
    import importlib.machinery
    import sys

    top = name.split(".", maxsplit=1)[0]
    if not all(part.isidentifier() for part in name.split(".")):
        return False
    if top in sys.builtin_module_names:
        return True
    return importlib.machinery.PathFinder.find_spec(top, [str(cwd), *sys.path]) is not None


def default_log_dir() -> Path:
    """One per user: in a shared temp dir, another user's run directories are none of this one's business."""
    return Path(tempfile.gettempdir()) / f"ftrun-{os.geteuid()}"


def omp_threads(environ: Mapping[str, str], nproc: int) -> dict[str, str]:
    """torchrun's rule: with several workers per node and no OMP_NUM_THREADS, use 1 each.

    Without it every worker starts one OpenMP thread per core and they fight.
    """
    if "OMP_NUM_THREADS" in environ or nproc <= 1:
        return {}
    return {"OMP_NUM_THREADS": "1"}


def parse_metrics(text: str | None) -> tuple[str, int] | None:
    """``--metrics-port [HOST:]PORT``: where the agent serves /metrics (None: it does not)."""
    if text is None:
        return None
    host, _, port = text.rpartition(":")
    return host.strip("[]"), parse_port("--metrics-port", port)


def parse_warm(no_warm: bool, warm: str, preload: str, environ: Mapping[str, str] | None = None) -> WarmSpec:
    """The warm pool's flags; its cache lives in $FTRUN_CACHE_DIR, else $XDG_CACHE_HOME/ftrun or ~/.cache/ftrun
    (``FTRUN_CACHE_DIR=`` empty: none)."""
    if warm not in WARM_MODES:
        raise ConfigError("--warm", f"unknown mode {warm!r}", "pass --warm auto, --warm preload, or --no-warm")
    modules = tuple(m.strip() for m in preload.split(",") if m.strip())
    for m in modules:
        if not all(part.isidentifier() for part in m.split(".")):
            raise ConfigError("--preload", f"{m!r} is not a module name", "pass e.g. --preload torch,numpy")
    env = environ or {}
    if "FTRUN_CACHE_DIR" in env:
        cache = Path(env["FTRUN_CACHE_DIR"]) / "warm" if env["FTRUN_CACHE_DIR"] else None
    else:
        base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
        cache = base / "ftrun" / "warm"
    return WarmSpec(enabled=not no_warm, preload=modules, auto=warm == "auto", cache_dir=cache)


def parse_filters(text: str) -> tuple[str, ...]:
    """--duplicate-std*-filters: comma-separated needles; ``,,`` is a comma inside one (as torchrun)."""
    placeholder = "\0"
    return tuple(item.replace(placeholder, ",") for item in text.replace(",,", placeholder).split(",") if item)


def parse_signals(flag: str, text: str) -> frozenset[int]:
    """``SIGTERM,SIGUSR1`` (names with or without SIG, or numbers) -> signal numbers ftrun can catch."""
    found = set()
    for item in filter(None, (t.strip() for t in text.split(","))):
        number = parse_signal_name(flag, item)
        if number not in CAUGHT:
            allowed = ", ".join(map(signal_name, CAUGHT))
            raise ConfigError(flag, f"ftrun cannot hand {item} on to the workers", f"use some of {allowed}")
        found.add(number)
    return frozenset(found)


def parse_signal_name(flag: str, text: str) -> int:
    name = text.strip().upper()
    if name.isdigit():
        number = int(name)
    else:
        try:
            number = signal.Signals[name if name.startswith("SIG") else "SIG" + name].value
        except KeyError:
            raise ConfigError(flag, f"unknown signal {text!r}", f"pass a name such as {flag} SIGTERM") from None
    if number not in {s.value for s in signal.Signals}:
        raise ConfigError(flag, f"unknown signal number {number}", f"pass a name such as {flag} SIGTERM")
    return number


DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # torchrun's: time for checkpoint-on-SIGTERM handlers


SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
DEFAULT_SNAPSHOT_MEMORY = "25%"


def parse_snapshot_memory(text: str | None, ram_bytes: int) -> int:
    """--snapshot-memory: bytes (a size with K, M, G or T, binary) or a percentage of the node's RAM."""
    given = (text or DEFAULT_SNAPSHOT_MEMORY).strip().upper().removesuffix("B").removesuffix("I")
    fix = "pass e.g. --snapshot-memory 64G or --snapshot-memory 25%"
    try:
        if given.endswith("%"):
            share = float(given[:-1])
            if not 0 < share <= 100:
                raise ValueError
            return int(ram_bytes * share / 100)
        unit = given[-1] if given and given[-1] in SIZE_UNITS else ""
        value = float(given.removesuffix(unit)) * SIZE_UNITS[unit]
    except ValueError:
        raise ConfigError("--snapshot-memory", f"expected a size or a percentage of RAM, got {text!r}", fix) from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError("--snapshot-memory", f"must be more than nothing, got {text!r}", fix)
    return int(value)


def parse_shutdown_timeout(text: str | None) -> float:
    """--shutdown-timeout (or --term-timeout, or $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, through the parser)."""
    if text is None:
        return DEFAULT_SHUTDOWN_TIMEOUT_S
    return parse_seconds("--shutdown-timeout", text, allow_zero=True)


def python_exec(environ: Mapping[str, str], current: str) -> str:
    """The workers' interpreter: $PYTHON_EXEC, as torchrun, else the one running ftrun."""
    chosen = environ.get("PYTHON_EXEC") or current
    if os.sep in chosen:
        if not os.access(chosen, os.X_OK):
            raise ConfigError("PYTHON_EXEC", f"{chosen} is not an executable", "point it at a python interpreter")
        return chosen
    found = shutil.which(chosen)
    if found is None:
        raise ConfigError("PYTHON_EXEC", f"{chosen!r} is not on PATH", "give the interpreter's full path")
    return found


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def parse_loglevel(environ: Mapping[str, str]) -> str:
    """$LOGLEVEL as torchrun reads it (INFO when unset). At WARNING and above ftrun says only what went wrong
    (failure reports, hangs, signals, notices) and the run's summary; at DEBUG, as with --verbose, also how it
    works as it goes."""
    level = environ.get("LOGLEVEL", "INFO").strip().upper()
    if level not in _LEVELS:
        raise ConfigError("LOGLEVEL", f"unknown level {level!r}", f"use one of {', '.join(_LEVELS)}")
    return level


def is_quiet(level: str) -> bool:
    return _LEVELS.index(level) >= _LEVELS.index("WARNING")


EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous")


def parse_event_log_handler(text: str) -> bool:
    """torch's event handler names; True: ``console``, every event is also printed to stderr."""
    if text not in EVENT_LOG_HANDLERS:
        raise ConfigError(
            "--event-log-handler", f"unknown handler {text!r}", f"use one of {', '.join(EVENT_LOG_HANDLERS)}"
        )
    return text == "console"


def not_applied(*, logs_specs: str | None) -> list[str]:
    """One line for each torchrun flag that cannot apply to ftrun."""
    notices = []
    if logs_specs:
        notices.append(
            f"--logs-specs {logs_specs} has no effect: ftrun writes its own per-rank logs under --log-dir "
            "(a torch LogsSpecs plugin is not loaded)"
        )
    return notices


def numa_binding(mode: str | None, nproc: int, environ: Mapping[str, str]) -> tuple[list[str], tuple[str, ...]]:
    """--numa-binding: each local rank's CPUs (cpulist text), or a line saying why it cannot apply here."""
    if mode is None:
        return [], ()
    if mode not in numa.MODES:
        raise ConfigError("--numa-binding", f"unknown mode {mode!r}", f"use one of {', '.join(numa.MODES)}")
    try:
        cpus = numa.plan(mode, nproc, environ)
    except numa.CannotBind as e:
        return [f"--numa-binding {mode} cannot apply: {e}; the workers run unbound"], ()
    return [], tuple(numa.format_cpus(c) for c in cpus)


def file_timer(environ: Mapping[str, str]) -> Path | None:
    """torch's FileTimer: the pipe to serve when TORCHELASTIC_ENABLE_FILE_TIMER=1 (TORCHELASTIC_TIMER_FILE, or a
    fresh path under the temp dir, as torchrun)."""
    if environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") != "1":
        return None
    chosen = environ.get("TORCHELASTIC_TIMER_FILE")
    if chosen:
        return Path(chosen).absolute()
    return Path(tempfile.gettempdir()) / f"watchdog_timer_{uuid.uuid4()}"
