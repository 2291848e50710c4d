"""Command line: torchrun's flags (both spellings) parsed into a LaunchConfig.

Only parsing lives here; every value is checked by :mod:`ftrun.flags`. A bad
flag prints one line naming it and the fix, and exits 2 before anything starts.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from ftrun import addresses, flags
from ftrun import config as cfg
from ftrun.errors import ConfigError, FtrunError
from ftrun.hang_flags import HANG_KEYS, parse_hang

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but errors become one ConfigError instead of usage text on stderr."""

    def error(self, message: str) -> NoReturn:
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            raise ConfigError(unknown.group(1), "unknown flag", "see `ftrun --help` for the flags ftrun takes")
        named = re.match(r"argument ([^:/\s]+)\S*: (.*)", message)
        if named:
            raise ConfigError(named.group(1), named.group(2), "see `ftrun --help`")
        raise ConfigError("ftrun", message, "see `ftrun --help`")


def _flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, *aliases: str, **kwargs: object
) -> None:
    """Add --dash-name and --underscore_name spellings, as torchrun accepts both."""
    underscored = "--" + name[2:].replace("-", "_")
    parser.add_argument(*dict.fromkeys([name, underscored]), *aliases, **kwargs)  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ftrun",
        description="Fault-tolerant launcher for distributed training; a drop-in for torchrun.",
        allow_abbrev=False,
    )
    _flag(p, "--nnodes", default="1", help="number of nodes, N or MIN:MAX (elastic)")
    _flag(p, "--nproc-per-node", default="1", help="workers per node: an integer, auto, cpu or gpu")
    _flag(p, "--node-rank", default="0", help="rank of this node for --rdzv-backend static")
    _flag(p, "--master-addr", default="127.0.0.1", help="address of the rank 0 node (static rendezvous)")
    _flag(p, "--master-port", default=None, help="port for the workers' rendezvous; default: a fresh free port")
    _flag(p, "--standalone", action="store_true", help="single-node job with a local rendezvous")
    _flag(p, "--max-restarts", default="0", help="restarts of the worker group before the job fails")
    _flag(
        p,
        "--monitor-interval",
        default="0.1",
        help="accepted for torchrun compatibility; ftrun is event-driven",
    )
    _flag(p, "--role", default="default", help="role name of the workers (ROLE_NAME)")
    _flag(p, "--log-dir", default=None, help="base directory of the logs (default: <tmp>/ftrun)")
    _flag(p, "--redirects", "-r", default="0", help="streams kept off the console: 3 or 0:1,1:2 (1=out, 2=err)")
    _flag(p, "--tee", "-t", default="0", help="streams copied to the console with a [rank]: prefix")
    _flag(p, "--local-ranks-filter", default="", help="show only these local ranks on the console, e.g. 0,1")
    _flag(p, "--run-path", action="store_true", help="run the script with runpy.run_path")
    _flag(
        p,
        "--start-method",
        default="spawn",
        help="accepted for torchrun compatibility (spawn|fork|forkserver)",
    )
    _flag(p, "--local-addr", default=None, help="address other nodes reach this node at")
    _flag(p, "--rdzv-backend", default="static", help="static, c10d (alias tcp: the embedded store) or etcd")
    _flag(p, "--rdzv-endpoint", default="", help="HOST[:PORT] of the rendezvous store")
    _flag(p, "--rdzv-id", default="none", help="job id shared by all nodes (also names the log directory)")
    _flag(p, "--rdzv-conf", default="", help="KEY=VALUE,... e.g. join_timeout=900,last_call_timeout=10")
    _flag(p, "--rdzv-token", default=None, help="shared secret of the embedded store (or FTRUN_TOKEN)")
    _flag(p, "--rdzv-token-file", default=None, help="file holding the shared secret (kept out of `ps`)")
    _flag(p, "--term-timeout", default="5", help="seconds between SIGTERM and SIGKILL when stopping workers")
    _flag(p, "--event-log", default=None, help="JSON-lines event log (default: <run log dir>/events.jsonl)")
    hang = p.add_argument_group("hang detection (flags override the --config file)")
    _flag(hang, "--initial-heartbeat-timeout", default=None, help="seconds from start to the first heartbeat")
    _flag(hang, "--heartbeat-timeout", default=None, help="seconds allowed between heartbeats")
    _flag(
        hang,
        "--section-timeout",
        action="append",
        default=None,
        metavar="NAME=SECONDS",
        help="timeout of a section (repeatable)",
    )
    _flag(hang, "--out-of-section-timeout", default=None, help="seconds allowed while no section is open")
    _flag(hang, "--safety-factor", default=None, help="calculate_timeouts() multiplies what it saw by this (5)")
    _flag(hang, "--hang-signal", default=None, help="signal sent to a hung worker first (SIGTERM)")
    _flag(hang, "--config", default=None, help="TOML file with the hang settings (keys as the flags, underscored)")
    warm = p.add_argument_group("warm restarts")
    _flag(warm, "--preload", default="", metavar="MOD[,MOD...]", help="modules the warm pool imports before forking")
    _flag(
        warm,
        "--warm",
        default="auto",
        help="auto: also preload what the workers imported (default); preload: only --preload",
    )
    _flag(warm, "--no-warm", action="store_true", help="no warm pool: every worker is a fresh process")
    _flag(p, "--module", "-m", action="store_true", help="run SCRIPT as a module (python -m)")
    _flag(p, "--no-python", action="store_true", help="run SCRIPT as an executable, not with python")
    p.add_argument("training_script", metavar="SCRIPT", nargs="?", default="", help="script, module or executable")
    p.add_argument("training_script_args", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments of SCRIPT")
    return p


def parse(argv: Sequence[str], environ: Mapping[str, str], cwd: Path) -> cfg.LaunchConfig:
    """Parse and validate ``argv``; raises ConfigError naming the flag and the fix."""
    a = build_parser().parse_args(list(argv))
    nnodes = flags.parse_nnodes(a.nnodes)
    nproc = flags.parse_nproc(a.nproc_per_node, environ, os.cpu_count() or 1)
    node_rank = flags.parse_int("--node-rank", a.node_rank, minimum=0)
    if node_rank >= nnodes.max:
        raise ConfigError("--node-rank", f"{node_rank} is not below --nnodes {nnodes.max}", "pass --node-rank 0")
    master_port = None if a.master_port is None else addresses.parse_port("--master-port", a.master_port)
    if a.rdzv_backend not in flags.RDZV_BACKENDS:
        raise ConfigError(
            "--rdzv-backend",
            f"unknown backend {a.rdzv_backend!r}",
            f"use one of {', '.join(flags.RDZV_BACKENDS)}",
        )
    store_url = _check_nodes(a, nnodes)
    if a.rdzv_backend == "static" and nnodes.max > 1:
        master_port = master_port or addresses.DEFAULT_STATIC_MASTER_PORT  # every node must use the same one
    if a.start_method not in flags.START_METHODS:
        raise ConfigError(
            "--start-method",
            f"unknown start method {a.start_method!r}",
            f"use one of {', '.join(flags.START_METHODS)}",
        )
    run_id = flags.parse_run_id(a.rdzv_id, standalone=a.standalone)
    host, port = ("", None) if a.rdzv_backend.startswith("etcd") else addresses.parse_endpoint(a.rdzv_endpoint)
    token = flags.store_token(a.rdzv_token, a.rdzv_token_file, environ)
    rdzv = cfg.RdzvSpec(a.rdzv_backend, host, port, run_id, flags.parse_rdzv_conf(a.rdzv_conf), token, store_url)
    logs = cfg.LogSpec(
        base_dir=Path(a.log_dir).absolute() if a.log_dir else flags.default_log_dir(),
        redirects=flags.parse_std("--redirects", a.redirects, nproc),
        tee=flags.parse_std("--tee", a.tee, nproc),
        local_ranks_filter=flags.parse_ranks_filter(a.local_ranks_filter),
    )
    if logs.base_dir.exists() and not logs.base_dir.is_dir():
        raise ConfigError("--log-dir", f"{logs.base_dir} is a file", "pass a directory (it is created if missing)")
    entrypoint = flags.resolve_entrypoint(
        a.training_script,
        a.training_script_args,
        module=a.module,
        no_python=a.no_python,
        run_path=a.run_path,
        cwd=cwd,
    )
    return cfg.LaunchConfig(
        entrypoint=entrypoint,
        nnodes=nnodes,
        nproc_per_node=nproc,
        node_rank=node_rank,
        master_addr=a.master_addr,
        master_port=master_port or None,
        standalone=a.standalone,
        max_restarts=flags.parse_int("--max-restarts", a.max_restarts, minimum=0),
        monitor_interval_s=flags.parse_seconds("--monitor-interval", a.monitor_interval),
        role=a.role,
        logs=logs,
        run_id=run_id,
        start_method=a.start_method,
        local_addr=a.local_addr,
        rdzv=rdzv,
        term_timeout_s=flags.parse_seconds("--term-timeout", a.term_timeout, allow_zero=True),
        event_log=Path(a.event_log).absolute() if a.event_log else None,
        python=sys.executable,
        cwd=cwd,
        worker_base_env={**environ, **flags.omp_threads(environ, nproc)},
        warm=flags.parse_warm(a.no_warm, a.warm, a.preload),
        hang=parse_hang(
            {k: getattr(a, k.replace("section_timeouts", "section_timeout")) for k in HANG_KEYS},
            Path(a.config) if a.config else None,
        ),
    )


def _check_nodes(a: argparse.Namespace, nnodes: cfg.NodeRange) -> str:
    """Validate --nnodes against the rendezvous flags; returns the store URL ("" for static)."""
    if a.rdzv_backend == "static":
        if nnodes.min != nnodes.max:
            raise ConfigError(
                "--nnodes",
                f"static rendezvous needs a fixed node count, got {a.nnodes}",
                "pass --nnodes N, or an elastic range with --rdzv-backend c10d or etcd",
            )
        return ""
    if a.standalone:
        if nnodes.max != 1:
            raise ConfigError("--standalone", f"is for one node, got --nnodes {a.nnodes}", "drop --standalone")
        return ""
    if not a.rdzv_endpoint and nnodes.max > 1:
        raise ConfigError(
            "--rdzv-endpoint",
            f"a {a.nnodes}-node job needs the address where the nodes meet",
            "pass e.g. --rdzv-endpoint node0:29400 (the same on every node)",
        )
    return flags.rdzv_store_url(a.rdzv_backend, a.rdzv_endpoint, addresses.DEFAULT_STORE_PORT)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ftrun`` command; returns the process exit code."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["store"]:
        from ftrun.store.serve import main as store_main

        return store_main(args[1:], os.environ)
    try:
        config = parse(args, os.environ, Path.cwd())
    except ConfigError as e:
        print(f"ftrun: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    from ftrun.agent.launch import launch  # after validation: bad input starts nothing

    try:
        return launch(config)
    except FtrunError as e:
        print(f"ftrun: error: {e}", file=sys.stderr)
        return 1
