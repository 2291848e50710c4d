"""Command line: torchrun's flags (both spellings) parsed into a LaunchConfig.

Only parsing lives here; every value is checked by :mod:`ftrun.cli.flags`. A bad
flag prints one line naming it and the fix, and exits 2 before anything starts.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path

import psutil

from ftrun import config as cfg
from ftrun.cli import flags, nvidia_ft, rdzv_flags
from ftrun.cli.argparser import build_parser, from_the_environment
from ftrun.cli.config_file import read_config_file
from ftrun.cli.hang_flags import HANG_KEYS, parse_hang
from ftrun.cli.node_flags import NODE_KEYS, parse_health, parse_stragglers
from ftrun.cli.slurm import slurm_step
from ftrun.errors import ConfigError, FtrunError
from ftrun.node import addresses
from ftrun.node.devices import accelerators_visible
from ftrun.store.url import StoreUrl

EXIT_USAGE = 2


def parse(argv: Sequence[str], environ: Mapping[str, str], cwd: Path) -> cfg.LaunchConfig:
    """Parse and validate ``argv``; raises ConfigError naming the flag and the fix, or the ``PET_*`` variable
    a torchrun flag's value came from (under the Kubeflow operator the flag is on no command line)."""
    try:
        return _parse(argv, environ, cwd)
    except ConfigError as e:
        variable = from_the_environment(argv, environ).get(e.flag)
        if variable is None:
            raise
        fix = e.fix.replace(f"pass e.g. {e.flag} ", f"set e.g. {variable}=").replace(
            f"pass {e.flag} ", f"set {variable}="
        )
        raise ConfigError(f"{variable} (for {e.flag})", e.problem, fix) from None


def _parse(argv: Sequence[str], environ: Mapping[str, str], cwd: Path) -> cfg.LaunchConfig:
    a = build_parser(environ, version()).parse_args(list(argv))
    notices: list[str] = []
    step = slurm_step(environ)
    if step is not None and all(getattr(a, dest) == value for dest, value in step.flags().items()):
        notices.append(step.describe())
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
    conf = rdzv_flags.parse_rdzv_conf(a.rdzv_conf)
    store = _check_nodes(a, nnodes, conf.etcd)
    master_addr = a.master_addr
    if a.rdzv_backend == "static" and a.rdzv_endpoint and not a.standalone:  # torchrun's: the master's address
        master_addr, master_port = _static_endpoint(a.rdzv_endpoint)
    if a.rdzv_backend == "static" and nnodes.max > 1:
        master_port = master_port or addresses.DEFAULT_STATIC_MASTER_PORT  # every node must use the same one
    if a.start_method not in flags.START_METHODS:
        raise ConfigError(
            "--start-method",
            f"unknown start method {a.start_method!r}",
            f"use one of {', '.join(flags.START_METHODS)}",
        )
    run_id = rdzv_flags.parse_run_id(a.rdzv_id, standalone=a.standalone)
    if a.standalone and a.rdzv_id not in (None, cfg.NO_RUN_ID):
        notices.append(f"--rdzv-id {a.rdzv_id} has no effect with --standalone (as in torchrun): the run is {run_id}")
    level = flags.parse_loglevel(environ)
    token = rdzv_flags.store_token(a.rdzv_token, a.rdzv_token_file, environ)
    rdzv = cfg.RdzvSpec(a.rdzv_backend, run_id, conf, token, store)
    logs = cfg.LogSpec(
        base_dir=Path(a.log_dir).absolute() if a.log_dir else flags.default_log_dir(),
        shared_base=not a.log_dir,
        redirects=flags.parse_std("--redirects", a.redirects, nproc),
        tee=flags.parse_std("--tee", a.tee, nproc),
        local_ranks_filter=flags.parse_ranks_filter(a.local_ranks_filter),
        prefix_template=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or cfg.DEFAULT_PREFIX_TEMPLATE,
        stdout_filters=flags.parse_filters(a.duplicate_stdout_filters),
        stderr_filters=flags.parse_filters(a.duplicate_stderr_filters),
    )
    notices += flags.not_applied(logs_specs=a.logs_specs)
    if logs.local_ranks_filter is not None and not logs.local_ranks_filter & set(range(nproc)):
        notices.append(
            f"--local-ranks-filter {a.local_ranks_filter}: no local rank here is one of them (this node's are "
            f"0-{nproc - 1}): no worker's output reaches the console (the logs have it)"
        )
    numa_notices, cpu_affinity = flags.numa_binding(a.numa_binding, nproc, environ)
    notices += numa_notices
    config_file = read_config_file(cwd / a.config, [*HANG_KEYS, *NODE_KEYS]) if a.config else {}
    hang, hang_notices = parse_hang(
        {k: getattr(a, k.replace("section_timeouts", "section_timeout")) for k in HANG_KEYS if k != "hang_detection"}
        | {"hang_detection": False if a.no_hang_detection else None},
        config_file,
        {name: getattr(a, f"ft_{name}") for name in nvidia_ft.NAMES},
        cwd / a.ft_cfg_path if a.ft_cfg_path else None,
        cwd / a.config if a.config else None,
    )
    notices += hang_notices
    if "TORCHELASTIC_HEALTH_CHECK_PORT" in environ:  # torch 2.13 starts nothing on it either
        notices.append("TORCHELASTIC_HEALTH_CHECK_PORT: no health-check server is started (torch 2.13 starts none)")
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
    if a.virtual_local_rank and "CUDA_VISIBLE_DEVICES" in environ:
        visible = [d for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
        if nproc > len(visible):
            raise ConfigError(
                "--virtual-local-rank",
                f"{nproc} workers but CUDA_VISIBLE_DEVICES names {len(visible)} GPU(s)",
                "pass as many --nproc-per-node as visible GPUs",
            )
    return cfg.LaunchConfig(
        entrypoint=entrypoint,
        nnodes=nnodes,
        nproc_per_node=nproc,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port or None,
        standalone=a.standalone,
        max_restarts=flags.parse_int("--max-restarts", a.max_restarts, minimum=0),
        crash_loop_limit=flags.parse_int("--crash-loop-limit", a.crash_loop_limit, minimum=0),
        monitor_interval_s=flags.parse_seconds("--monitor-interval", a.monitor_interval),
        role=a.role,
        logs=logs,
        run_id=run_id,
        start_method=a.start_method,
        local_addr=a.local_addr,
        rdzv=rdzv,
        term_timeout_s=flags.parse_shutdown_timeout(a.shutdown_timeout),
        signals_to_handle=(handled := flags.parse_signals("--signals-to-handle", a.signals_to_handle)),
        warning_signals=frozenset() if step is None else frozenset({signal.SIGUSR1, signal.SIGUSR2}) - handled,
        node_index=None if step is None else step.node_index,
        requeued=0 if step is None else step.requeued,
        event_log=Path(a.event_log).absolute() if a.event_log else None,
        python=flags.python_exec(environ, sys.executable),
        cwd=cwd,
        worker_base_env={**environ, **flags.omp_threads(environ, nproc)},
        virtual_local_rank=a.virtual_local_rank,
        quiet=flags.is_quiet(level),
        verbose=a.verbose or level == "DEBUG",
        notices=tuple(notices),
        echo_events=flags.parse_event_log_handler(a.event_log_handler),
        snapshot_memory=flags.parse_snapshot_memory(a.snapshot_memory, psutil.virtual_memory().total),
        failure_domain=a.failure_domain or "",
        file_timer=flags.file_timer(environ),
        cpu_affinity=cpu_affinity,
        launcher_error_file=Path(environ["TORCHELASTIC_ERROR_FILE"])
        if environ.get("TORCHELASTIC_ERROR_FILE")
        else None,
        warm=flags.parse_warm(a.no_warm, a.warm, a.preload, environ),
        hang=hang,
        stragglers=parse_stragglers(a.no_stragglers, a.straggler_threshold, a.straggler_action, config_file),
        health=parse_health(a.health_check, a.health_check_interval, config_file),
        metrics=flags.parse_metrics(a.metrics_port),
        accelerators=accelerators_visible(environ),
    )


def _static_endpoint(text: str) -> tuple[str, int]:
    """A static rendezvous's --rdzv-endpoint, as torchrun reads it: the master's HOST:PORT (over --master-addr and
    --master-port), the port required."""
    host, port = addresses.parse_endpoint(text)
    if port is None:
        raise ConfigError(
            "--rdzv-endpoint",
            f"{text!r} has no port, which a static rendezvous (the default --rdzv-backend) needs",
            "pass e.g. --rdzv-endpoint node0:29500, or --master-addr and --master-port",
        )
    return host, port


def _check_nodes(a: argparse.Namespace, nnodes: cfg.NodeRange, etcd: tuple[tuple[str, str], ...]) -> StoreUrl | None:
    """Validate --nnodes against the rendezvous flags; returns the store's URL (None for static)."""
    if a.rdzv_backend == "static":
        if nnodes.min != nnodes.max:
            raise ConfigError(
                "--nnodes",
                f"static rendezvous needs a fixed node count, got {a.nnodes}",
                "pass --nnodes N, or an elastic range with --rdzv-backend c10d or etcd",
            )
        return None
    if a.standalone:
        if nnodes.max != 1:
            raise ConfigError("--standalone", f"is for one node, got --nnodes {a.nnodes}", "drop --standalone")
        if a.rdzv_backend not in ("c10d", "tcp"):
            return None
        # As torchrun's: this machine, a free port, whatever the endpoint said.
        return rdzv_flags.rdzv_store_url(a.rdzv_backend, "127.0.0.1:0", addresses.DEFAULT_STORE_PORT, etcd)
    if not a.rdzv_endpoint and nnodes.max > 1:
        raise ConfigError(
            "--rdzv-endpoint",
            f"a {a.nnodes}-node job needs the address where the nodes meet",
            "pass e.g. --rdzv-endpoint node0:29400 (the same on every node)",
        )
    # One node with no endpoint: this machine, where the agent hosts the store (as torchrun's c10d).
    return rdzv_flags.rdzv_store_url(a.rdzv_backend, a.rdzv_endpoint, addresses.DEFAULT_STORE_PORT, etcd)


def version() -> str:
    try:
        return metadata.version("ftrun")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "unknown"


def _stdin_open() -> None:
    """ftrun started with its standard input closed (``<&-``, a daemon's) reads /dev/null there: else the first
    file it opens takes fd 0, and the workers, which inherit ftrun's standard input, would read that file."""
    try:
        os.fstat(0)
    except OSError:
        fd = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor: 0
        if fd != 0:
            os.dup2(fd, 0)
            os.close(fd)
        os.set_inheritable(0, True)  # os.open's descriptors close at exec: a fresh worker would find none


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ftrun`` command; returns the process exit code."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["store"]:
        from ftrun.cli.store import main as store_main

        return store_main(args[1:], os.environ)
    if args[:1] == ["report"]:
        from ftrun.cli.report import main as report_main

        return report_main(args[1:])
    if args[:1] == ["status"]:
        from ftrun.cli.status import main as status_main

        return status_main(args[1:], os.environ)
    _stdin_open()
    try:
        config = parse(args, os.environ, Path.cwd())
        from ftrun.agent.launch import launch  # after validation: bad input starts nothing

        return launch(config)
    except ConfigError as e:  # bad input, or found before anything started (a --master-port taken)
        print(f"ftrun: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except FtrunError as e:
        print(f"ftrun: error: {e}", file=sys.stderr)
        return 1
