"""The warm pool's process (the zygote): imports the modules to preload, then forks standby workers.

Run by the agent as ``python -m ftrun.warm.zygote FD`` with the JSON list of
modules to preload on stdin; FD is its end of a SOCK_SEQPACKET socket pair. It answers once with ``ready`` (or
``refused``, naming the module, if importing it started a thread: fork would copy a process whose other threads
vanish, with their locks held; or initialised CUDA: a forked child cannot use it), then serves standby
requests.

A standby is a worker forked ahead of time, before anyone knows its rank: each
request passes one end of a socket pair, the standby keeps it and sleeps on it
until the agent sends what it must run (environment, directory, arguments) with
its stdout and stderr as passed descriptors. A restart then costs one message per
worker, not a fork. Each standby becomes the agent's own child: forked twice
(glibc's fork, at-fork handlers and all) and re-parented to the agent, a child
subreaper; it stays in the zygote's process group until it becomes a worker (the
agent tells the pool's processes from a worker's strays by that group). The agent watches it with a pidfd and reaps its
real exit status, exactly as for a fresh process. The worker then becomes what
``python -u SCRIPT`` or ``python -u -m MODULE`` would have been.
Single-threaded, and imports nothing but what it is asked to and ftrun's own
worker start-up (which every watched worker imports anyway).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import importlib
import importlib.machinery
import io
import json
import os
import signal
import socket
import sys
import time
import types
import warnings
from typing import Any

from ftrun.worker import compile_probes, import_watch, jemalloc, procfs
from ftrun.worker.forkable import unforkable
from ftrun.worker.fresh import ZYGOTE_THREADS, find_pools, physical_cores, redraw_randomness, restore_threads
from ftrun.worker.messages import Message, receive, send

Filters = list[Any]  # warnings.filters as the preloaded modules left them, which each worker starts with
ADOPTION_WAIT_S = 5.0
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
THIS_FILE = __file__
STARTUP_MODULES = (
    "ftrun.worker.client",
    "ftrun.worker.autobeat",
    "ftrun.worker.imports",
)  # what set_up imports (no torch, no thread)


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def preload(names: list[str], *, leading: bool = True) -> tuple[list[str], dict[str, str], str | None, str]:
    """Import ``names`` in order; returns (loaded, failed: name -> error, refusal or None, the module refused;
    a refusal by the pool's rule, not for the fork's sake, is said in RULE_REFUSALS).
    ``leading``: the script's leading block (its own imports come next; only the rank's values and the files
    are checked), else modules the workers import later, checked against what the script changes anywhere."""
    loaded, failed = [], {}
    known = jemalloc.mapped_libraries()  # the libraries a jemalloc that starts a thread could be in: those after
    for name in names:
        refusal, root = "", name
        try:
            refusal, root = checked_import(name, leading=leading)
        except Exception as e:  # a module that cannot be preloaded is imported by the worker itself
            failed[name] = f"{type(e).__name__}: {e}"[:200]
            continue
        loaded.append(name)
        jemalloc.stop_background_threads(known)  # pyarrow's, polars': started again in each worker
        if refusal:  # this zygote can no longer serve; it goes on to judge the rest, so that one more does
            RULE_REFUSALS[root] = refusal
        refusal = unforkable()
        if refusal:
            return loaded, failed, refusal, name
    if RULE_REFUSALS:
        first = next(iter(RULE_REFUSALS))
        return loaded, failed, RULE_REFUSALS[first], first
    return loaded, failed, None, ""


def checked_import(name: str, *, leading: bool) -> tuple[str, str]:
    """Import ``name`` watching what it reads; why a worker's own import would differ ("": it would not), and
    the outermost package this import loaded (what is left to the workers then: its parts share its import)."""
    if name in sys.modules:  # imported with an earlier one (most of a report's modules are): judged with it
        return "", name
    before = len(sys.modules)  # modules are added at the end: what this import loaded comes after
    watched = {} if leading else dict(filter(None, map(import_watch.owner_of, GUARDS.attributes)))
    with import_watch.watching(watched) as reads:
        importlib.import_module(name)
    new = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())[before:]}
    parts = name.split(".")
    root = next((".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in new), name)
    return import_watch.verdict(name, reads, GUARDS, new, leading=leading), root


def replay(steps: list[list[str]]) -> list[str]:
    """The script's leading block, as it runs it: its literal environment writes made, in order, before the
    imports that follow them; returns the imports done (stopped at the first refusal, see :func:`preload`)."""
    done: list[str] = []
    for step in steps:
        if step[0] == "import":
            if step[1] not in done:
                done.append(step[1])
            continue
        key = step[1]
        REPLAYED.add(key)
        if key in THREAD_PINS:  # the zygote's pools stay pinned (safe to fork); each worker sizes them so
            THREAD_STEPS.append(step)
            continue
        if step[0] == "setenv":
            os.environ[key] = step[2]
        elif step[0] == "setdefault":
            os.environ.setdefault(key, step[2])
        elif step[0] == "putenv":
            os.putenv(key, step[2])
        else:
            os.environ.pop(key, None)
    return done


def main() -> int:
    claim_the_title()
    sock = socket.socket(fileno=int(sys.argv[1]))
    plan: Message = json.loads(sys.stdin.buffer.read() or b"{}")
    started = time.monotonic()
    idle = "--idle" in sys.argv[2:]
    if idle:  # preload on CPU time nobody else wants: never slow down the workers it will serve
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    preload(list(STARTUP_MODULES))  # a worker's start-up attaches them: paid once here, not at each restart
    # torch.cuda.is_available() (which libraries call at import) asks NVML, not the CUDA driver: a driver
    # initialised here would not survive the fork. The workers get the variable as the job set it, or not.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    global GUARDS  # noqa: PLW0603 - the zygote's one record of them, set once as it starts
    GUARDS = import_watch.Guards.from_json(plan.get("guards") or {})
    if plan.get("cwd"):  # where the script's imports look first, as for the worker: its directory and cwd
        os.chdir(plan["cwd"])
    if plan.get("path0") is not None:
        sys.path[0] = plan["path0"]
    return serve(sock, list(plan.get("steps") or []), list(plan.get("checked") or []), started, idle=idle)


def serve(
    sock: socket.socket, steps: list[list[str]], checked: list[str], started: float, *, idle: bool, inherited: int = 0
) -> int:
    """Preload the leading block's ``steps``, then the ``checked`` modules (at idle CPU priority where ``idle``;
    ``inherited``: how many its parent had), say ready or refused, then serve the agent's requests: standby
    workers, and bigger zygotes grown from this one."""
    started_with = dict(os.environ)
    loaded, failed, refusal, culprit = preload(replay(steps))
    if not refusal:
        more, more_failed, refusal, culprit = preload(checked, leading=False)
        loaded, failed = loaded + more, {**failed, **more_failed}
    if not refusal:
        failed.update(compile_probes.ask_in_advance())  # what the preloaded compiler works out once per process
        refusal, culprit = unforkable() or None, "torch._inductor"
    # What the preloaded modules set in the environment at import, a fresh worker's imports set too (the
    # script's own writes, replayed, are the script's to make again).
    IMPORTS_SET.update({k: v for k, v in os.environ.items() if started_with.get(k) != v and k not in REPLAYED})
    # As a fresh worker has them once it imported the same modules (torch and numpy add theirs at import).
    filters = list(warnings.filters)
    if idle:
        try:  # its forks must run at normal priority
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except PermissionError:
            refusal = "cannot return to normal CPU priority after preloading (RLIMIT_NICE)"
    if refusal:
        by_rule = dict(RULE_REFUSALS) if culprit in RULE_REFUSALS else {}
        send(sock, {"refused": refusal, "module": culprit, "by_rule": by_rule})
        while (leftover := receive(sock))[0] is not None:  # exiting with requests unread would reset the
            for fd in leftover[1]:  # socket before the agent read the refusal: wait for it to hang up
                os.close(fd)
        return 1
    physical_cores()  # counted here once, for every worker
    find_pools()  # the BLAS/OpenMP pools preloading loaded, which each worker sizes as a fresh process would
    ENVIRONMENT.update(os.environ)
    # What preloading left as garbage goes; the rest is frozen: the workers' garbage collections never write
    # to the preloaded objects, so their pages stay shared with the zygote instead of being copied, worker by
    # worker, at each full collection. Not when workers wait for this zygote (the first attempt's: it runs at
    # normal priority): the collection takes ~130 ms after importing torch, and the garbage frozen with the rest
    # costs only the zygote's memory, its pages shared, never copied.
    if idle:
        gc.collect()
    gc.freeze()
    send(sock, {"ready": True, "loaded": inherited + len(loaded), "failed": failed,
                "import_s": time.monotonic() - started, "rss_kb": rss_kb()})  # fmt: skip
    return serve_requests(sock, filters)


def serve_requests(sock: socket.socket, filters: Filters) -> int:
    """Fork what the agent asks for, until it hangs up."""
    while True:
        message, fds = receive(sock)
        if message is None:
            return 0  # the agent is gone or closed the pool
        if message.get("script"):
            precompile(message["script"])
        if "grow" in message:  # answered by the new zygote on its own socket, never here
            with contextlib.suppress(OSError):
                fork_standby(sock, message, fds, filters, grow=True)  # in the new zygote it never returns
            for fd in fds:
                os.close(fd)
            continue
        try:
            reply = fork_standby(sock, message, fds, filters)  # in the standby it never returns
        except OSError as e:
            reply = {"error": f"fork failed: {e}"}
        for fd in fds:
            os.close(fd)
        send(sock, reply)


def fork_standby(
    sock: socket.socket, request: Message, fds: list[int], filters: Filters, *, grow: bool = False
) -> Message:
    """Fork a standby worker that waits on ``fds[0]`` for what to run; returns its pid for the agent. ``grow``:
    fork a zygote instead, which imports what the request adds to this one's preload (see :func:`grown`)."""
    if len(fds) != 1:
        return {"error": f"expected the standby's socket, got {len(fds)} descriptors"}
    # Two forks, the first one gone at once: the standby is re-parented to the agent (a child subreaper), which
    # watches it and reaps its real status as for a fresh process. glibc's fork, not a raw clone(CLONE_PARENT)
    # in one step: it runs the C libraries' at-fork handlers and gives the child its own thread id in glibc's
    # records (with the zygote's, time.pthread_getcpuclockid() and pthread_setaffinity_np() missed their mark).
    read_end, write_end = os.pipe()
    first = os.fork()
    if first == 0:  # the intermediate: fork the standby, tell the zygote its pid, vanish
        os.close(read_end)
        intermediate = os.getpid()  # not getppid() in the standby: this process may be gone by then
        second = os.fork()
        if second == 0:
            os.close(write_end)
            if grow:
                grown(sock, request, fds[0], intermediate)  # never returns
            stand_by(sock, request["agent_pid"], fds[0], filters, intermediate)  # never returns
        os.write(write_end, str(second).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as r:
        told = r.read()
    os.waitpid(first, 0)
    return {"pid": int(told)} if told else {"error": "fork failed"}


def grown(parent: socket.socket, request: Message, fd: int, intermediate: int) -> None:
    """In a zygote forked from a ready one: the agent's child, in a process group of its own (for its standbys),
    it tells the agent its pid, imports only the modules it adds to its parent's (torch, imported once per
    node, not once per zygote), then serves as any zygote."""
    code = 1
    try:
        parent.close()
        os.setsid()
        adopt(request["agent_pid"], intermediate)
        sock = socket.socket(fileno=fd)
        send(sock, {"pid": os.getpid()})
        idle = bool(request.get("idle"))
        if idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        if isinstance(request.get("files"), dict):  # what the workers' imports found, as of now
            global GUARDS  # noqa: PLW0603 - this zygote's own from here on
            found = import_watch.Guards.from_json({"files": request["files"]}).files
            GUARDS = dataclasses.replace(GUARDS, files={**GUARDS.files, **found})
        code = serve(sock, [], list(request["grow"]), time.monotonic(), idle=idle, inherited=int(request["inherited"]))
    except SystemExit:
        raise  # a worker forked from this zygote ends as Python ends (its atexit handlers run)
    except BaseException as e:  # nothing of the parent's loop may run here
        with contextlib.suppress(OSError):
            os.write(2, f"ftrun: a zygote grown from another failed: {e!r}\n".encode())
    os._exit(code)


def stand_by(zygote: socket.socket, agent_pid: int, fd: int, filters: Filters, intermediate: int | None) -> None:
    """In the standby: become the agent's watched child, wait for the work, then run it as a worker."""
    try:
        zygote.close()
        adopt(agent_pid, intermediate)
        standby = socket.socket(fileno=fd)
        request, fds = receive(standby)
        standby.close()
        if request is None:
            os._exit(0)  # the agent no longer needs this standby
        set_up(request, fds, filters)
    except BaseException as e:  # nothing of the zygote's loop may run in the worker
        os.write(2, f"ftrun: the warm worker could not be set up: {e!r}\n".encode())
        os._exit(1)
    try:
        code = run(request["kind"], request["target"], request["args"])
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):  # sys.exit("message"): printed as Python does, but
            print(e.code, file=sys.stderr)  # now, so that it is in the log before the agent hears of the end
        code = exit_code(e.code)
        ended(code)
        raise SystemExit(code) from None
    ended(code)
    sys.exit(code)


def adopt(agent_pid: int, intermediate: int | None) -> None:
    """Wait until the agent is the parent (after a double fork), and die with it from then on."""
    deadline = time.monotonic() + ADOPTION_WAIT_S
    while intermediate is not None and os.getppid() == intermediate and time.monotonic() < deadline:
        time.sleep(0.0002)  # the intermediate exits at once; then the agent (subreaper) is the parent
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != agent_pid:
        os._exit(1)  # the agent died meanwhile (or adoption failed): never run unwatched


def exit_code(code: object) -> int:
    """What ``sys.exit(code)`` makes the process exit with."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def ended(code: int) -> None:
    """The agent learns the script is over: a hang in the teardown that follows is not a training hang. What the
    script wrote is flushed first: after a failure the agent may report (from the logs) at once."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        from ftrun.worker.client import script_ended

        script_ended(code)
    except Exception as e:
        os.write(2, f"ftrun: could not mark the script's end: {e!r}\n".encode())


def set_up(request: Message, fds: list[int], filters: Filters) -> None:
    """Become the worker ``request`` describes, as a fresh ``python -u`` would start."""
    if len(fds) != 3:
        raise ValueError(f"expected stdin, stdout and stderr descriptors, got {len(fds)}")
    os.setsid()  # out of the zygote's group: from now on a worker with its own process group
    for std, fd in enumerate(fds):  # ftrun's standard input, the rank's output and error pipes
        os.dup2(fd, std)
        os.close(fd)
    os.chdir(request["cwd"])
    become_environment({**IMPORTS_SET, **request["env"]})  # the rank's own values win (setdefault, mostly)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("FTRUN_CPU_AFFINITY"):  # --numa-binding, before the worker's code starts any thread
        from ftrun.node.numa import parse_cpus

        os.sched_setaffinity(0, parse_cpus(os.environ["FTRUN_CPU_AFFINITY"]))
    if os.environ.get("PYTHONFAULTHANDLER"):  # what a fresh interpreter does at start-up with it
        import faulthandler

        faulthandler.enable(all_threads=True)
    redraw_randomness()
    restore_threads(threads_env())
    jemalloc.start_again()
    if os.environ.get("FTRUN_MONITOR"):
        # Before the job's code: its stacks can be dumped even if it hangs in an import (no py-spy needed),
        # and every optimizer step is a heartbeat, with no change to the script.
        from ftrun.worker import autobeat, client

        client.attach()
        autobeat.install()
    warnings.filters[:] = filters  # type: ignore[index]
    warnings._filters_mutated()  # type: ignore[attr-defined]
    # `python -u`: unbuffered binary layer, text written through at once.
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr  # type: ignore[misc]
    procfs.show_as_fresh(fresh_argv(request), request["env"])  # /proc/PID/cmdline and environ


def claim_the_title() -> None:
    """setproctitle takes over the argv and environment area at its first call, which must come before anything
    sets a variable (libc then moves the environment, and the title could no longer be written). Only needed
    where the kernel refuses to show a worker's own ranges (:mod:`ftrun.worker.procfs`)."""
    with contextlib.suppress(ImportError), procfs.keeping_the_name():
        import setproctitle

        setproctitle.getproctitle()


def fresh_argv(request: Message) -> list[str]:
    """The command line a fresh worker has (`python3 -u train.py ARGS`): what ps, pgrep -f, htop and
    nvidia-smi show."""
    module = ["-m"] if request["kind"] == "module" else []
    return [sys.executable, "-u", *module, request["target"], *request["args"]]


ENVIRONMENT: dict[str, str] = {}  # the zygote's own environment, as its workers inherit it (plain dict: fast)
IMPORTS_SET: dict[str, str] = {}  # variables the preloaded modules set at import
GUARDS = import_watch.Guards()  # what the modules imported after the script's leading block must not depend on
RULE_REFUSALS: dict[str, str] = {}  # module -> why a worker's own import would differ (not for the fork's sake)
REPLAYED: set[str] = set()  # the variables the leading block's literal writes set (replayed before its imports)
THREAD_PINS = tuple(ZYGOTE_THREADS)  # the zygote's own pools' sizes, never the workers'
THREAD_STEPS: list[list[str]] = []  # the leading block's writes of those, applied to the pools' sizes in each worker


def threads_env() -> dict[str, str]:
    """The worker's environment with the leading block's thread counts written, as a fresh worker's pools
    (loaded by the imports that follow the writes) read them."""
    env = dict(os.environ)
    for step in THREAD_STEPS:
        if step[0] in ("setenv", "putenv"):
            env[step[1]] = step[2]
        elif step[0] == "setdefault":
            env.setdefault(step[1], step[2])
        else:
            env.pop(step[1], None)
    return env


def become_environment(env: dict[str, str]) -> None:
    """Make os.environ exactly ``env``, setting only what differs from the zygote's (most of it is the same,
    and each variable set or unset is a call to libc; comparing with os.environ itself costs 0.3 ms)."""
    inherited = ENVIRONMENT or dict(os.environ)
    for name in inherited.keys() - env.keys():
        del os.environ[name]
    for name, value in env.items():
        if inherited.get(name) != value:
            os.environ[name] = value


COMPILED: dict[str, tuple[tuple[int, int], types.CodeType]] = {}  # entry script -> (its stat, its code)


def precompile(path: str) -> None:
    """Compile the entry script here, once (again when it changed): every standby forked after has its code,
    and a restart does not pay for it (~5 ms per 1,000 lines). One that does not compile is left to the worker,
    which reports the error as Python would."""
    with contextlib.suppress(OSError, SyntaxError, ValueError):
        script_code(path)


def script_code(path: str) -> types.CodeType:
    """The entry script's code: the zygote's when the file has not changed since, else compiled now."""
    stat = os.stat(path)
    stamp = (stat.st_mtime_ns, stat.st_size)
    found = COMPILED.get(path)
    if found is None or found[0] != stamp:
        with io.open_code(path) as f:  # dont_inherit: this module's own __future__ flags are not the script's
            found = COMPILED[path] = (stamp, compile(f.read(), path, "exec", dont_inherit=True))
    return found[1]


def run(kind: str, target: str, args: list[str]) -> int:
    """Run a script or module as __main__; an uncaught exception prints as Python would and returns 1."""
    try:
        main = types.ModuleType("__main__")  # a clean namespace, not the zygote's own __main__
        main.__builtins__ = __builtins__  # type: ignore[attr-defined]
        main.__annotations__ = {}  # as the interpreter makes __main__ at start-up
        sys.modules["__main__"] = main
        if kind == "module":
            import runpy

            sys.argv = [target, *args]  # runpy puts the module's file in argv[0], as `python -m` does
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            path = os.path.abspath(target)  # as Python >= 3.9 makes __main__.__file__
            main.__file__ = path
            main.__cached__ = None  # type: ignore[attr-defined]
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
            exec(script_code(path), main.__dict__)  # noqa: S102 - running the user's script is the point
    except SystemExit:
        raise
    except BaseException:
        kind_, value, tb = sys.exc_info()
        while tb is not None and tb.tb_frame.f_code.co_filename == THIS_FILE:
            tb = tb.tb_next  # the traceback starts where the user's code does, as with a fresh python
        if value is not None:
            value.__traceback__ = tb  # the hook prints the exception's own traceback, not its argument
        sys.last_type, sys.last_value, sys.last_traceback = kind_, value, tb  # as the interpreter keeps them
        if sys.version_info >= (3, 12):
            sys.last_exc = value  # type: ignore[attr-defined,unused-ignore]
        sys.excepthook(kind_, value, tb)  # type: ignore[arg-type]
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
