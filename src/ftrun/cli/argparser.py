"""The flags: torchrun's, in both spellings, with its PET_* environment defaults, and ftrun's own.

Values stay text here; :mod:`ftrun.cli.main` checks each through :mod:`ftrun.cli.flags`.
A flag argparse does not know becomes one ConfigError with a "did you mean"; an unambiguous prefix of a flag
stands for it, as in torchrun.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from ftrun.cli import nvidia_ft
from ftrun.cli.slurm import slurm_step
from ftrun.config import NO_RUN_ID
from ftrun.errors import ConfigError

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's --signals-to-handle


class _Parser(argparse.ArgumentParser):
    """argparse, but errors become one ConfigError instead of usage text on stderr."""

    def error(self, message: str) -> NoReturn:
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            flag = unknown.group(1)
            raise ConfigError(flag, "unknown flag", self._suggest(flag))
        ambiguous = re.match(r"ambiguous option: (\S+?)(?:=\S*)? could match (.*)", message)
        if ambiguous:
            raise ConfigError(ambiguous.group(1), f"could be any of {ambiguous.group(2)}", "spell more of the flag")
        named = re.match(r"argument ([^:/\s]+)\S*: (.*)", message)
        if named:
            raise ConfigError(named.group(1), named.group(2), "see `ftrun --help`")
        raise ConfigError("ftrun", message, "see `ftrun --help`")

    def _get_option_tuples(self, option_string: str) -> list[Any]:
        """A prefix of a flag stands for it, as in torchrun (argparse's abbreviations), and a prefix of both
        spellings of one flag (--nproc: --nproc-per-node and --nproc_per_node) is not ambiguous."""
        found = super()._get_option_tuples(option_string)
        return list({id(t[0]): t for t in found}.values())

    def _suggest(self, flag: str) -> str:
        known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        close = difflib.get_close_matches(flag.split("=", maxsplit=1)[0], known, n=1, cutoff=0.75)
        return f"did you mean {close[0]}?" if close else "see `ftrun --help` for the flags ftrun takes"


def _flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, *aliases: str, **kwargs: object
) -> None:
    """Add --dash-name and --underscore_name spellings, as torchrun accepts both."""
    underscored = "--" + name[2:].replace("-", "_")
    parser.add_argument(*dict.fromkeys([name, underscored]), *aliases, **kwargs)  # type: ignore[arg-type]


def build_parser(environ: Mapping[str, str] | None = None, version: str = "") -> argparse.ArgumentParser:
    """The parser; with ``environ``, ``PET_<FLAG>`` variables are the defaults of torchrun's flags
    (``PET_NPROC_PER_NODE=2`` means ``--nproc-per-node 2``), as in torchrun, and inside a SLURM job step the
    rendezvous flags' defaults come from SLURM's variables (:mod:`ftrun.cli.slurm`)."""
    p = _Parser(
        prog="ftrun",
        description="Fault-tolerant launcher for distributed training; a drop-in for torchrun.",
        epilog="also: ftrun status RUN_DIR (a job's view), ftrun report RUN_DIR... (a run's history), "
        "ftrun store (the embedded store on its own); each with --help",
    )
    p.add_argument("--version", action="version", version=f"ftrun {version}")
    _torchrun_flags(p)
    _ftrun_flags(p)
    _flag(p, "--module", "-m", action="store_true", help="run SCRIPT as a module (python -m)")
    _flag(p, "--no-python", action="store_true", help="run SCRIPT as an executable, not with python")
    p.add_argument("training_script", metavar="SCRIPT", nargs="?", default="", help="script, module or executable")
    p.add_argument("training_script_args", metavar="ARGS", nargs=argparse.REMAINDER, help="arguments of SCRIPT")
    if environ is not None:
        _environment_defaults(p, environ)
    return p


def _torchrun_flags(p: argparse.ArgumentParser) -> None:
    _flag(p, "--nnodes", default="1", help="number of nodes, N or MIN:MAX (elastic)")
    _flag(p, "--nproc-per-node", default="1", help="workers per node: an integer, auto, cpu, gpu or xpu")
    _flag(p, "--node-rank", default="0", help="rank of this node for --rdzv-backend static")
    _flag(p, "--master-addr", default="127.0.0.1", help="address of the rank 0 node (static rendezvous)")
    _flag(p, "--master-port", default=None, help="MASTER_PORT of the workers; default: a fresh free port")
    _flag(p, "--standalone", action="store_true", help="single-node job with a local rendezvous")
    _flag(p, "--max-restarts", default="0", help="restarts of the worker group before the job fails")
    _flag(p, "--monitor-interval", default="0.1", help="accepted for torchrun compatibility; ftrun is event-driven")
    _flag(p, "--role", default="default", help="role name of the workers (ROLE_NAME)")
    _flag(p, "--log-dir", default=None, help="base directory of the logs (default: <tmp>/ftrun)")
    _flag(p, "--redirects", "-r", default="0", help="streams kept off the console: 3 or 0:1,1:2 (1=out, 2=err)")
    _flag(p, "--tee", "-t", default="0", help="streams copied to the console with a [role+local rank]: prefix")
    _flag(p, "--local-ranks-filter", default="", help="show only these local ranks on the console, e.g. 0,1")
    _flag(p, "--duplicate-stdout-filters", default="", help="copy stdout lines containing any of A,B to a file")
    _flag(p, "--duplicate-stderr-filters", default="", help="copy stderr lines containing any of A,B to a file")
    _flag(p, "--run-path", action="store_true", help="run the script with runpy.run_path")
    _flag(p, "--start-method", default="spawn", help="accepted for torchrun compatibility (spawn|fork|forkserver)")
    _flag(p, "--local-addr", default=None, help="address other nodes reach this node at")
    _flag(p, "--rdzv-backend", default="static", help="static, c10d (alias tcp: the embedded store) or etcd")
    _flag(p, "--rdzv-endpoint", default="", help="HOST[:PORT] of the rendezvous store")
    _flag(p, "--rdzv-id", default=NO_RUN_ID, help="job id shared by all nodes (also names the log directory)")
    _flag(p, "--rdzv-conf", default="", help="KEY=VALUE,... e.g. join_timeout=900,last_call_timeout=10")
    _flag(p, "--signals-to-handle", default=DEFAULT_SIGNALS, help="signals passed on to the workers when stopping")
    _flag(
        p,
        "--shutdown-timeout",
        "--term-timeout",
        "--term_timeout",
        dest="shutdown_timeout",
        default=None,
        help="seconds from the first signal to SIGKILL when stopping workers (30, $TORCH_ELASTIC_SHUTDOWN_TIMEOUT)",
    )
    _flag(p, "--virtual-local-rank", action="store_true", help="LOCAL_RANK=0, one GPU per worker as device 0")
    _flag(p, "--numa-binding", default=None, help="bind workers to the CPUs near their GPU: node, socket, ...")
    _flag(p, "--logs-specs", default=None, help="accepted for torchrun compatibility (a torch LogsSpecs plugin)")
    _flag(p, "--event-log-handler", default="null", help="null or console: torch's events; ftrun's go to --event-log")


def _ftrun_flags(p: argparse.ArgumentParser) -> None:
    _flag(p, "--rdzv-token", default=None, help="shared secret of the embedded store (or FTRUN_TOKEN)")
    _flag(p, "--rdzv-token-file", default=None, help="file holding the shared secret (kept out of `ps`)")
    _flag(p, "--event-log", default=None, help="JSON-lines event log (default: <run log dir>/events.jsonl)")
    _flag(p, "--metrics-port", default=None, help="serve Prometheus metrics at [HOST:]PORT/metrics (all addresses)")
    _flag(
        p,
        "--snapshot-memory",
        default=None,
        help="shared memory for ftrun.snapshot, the node's ranks together: SIZE (e.g. 64G) or PERCENT%% of RAM (25%%)",
    )
    _flag(
        p,
        "--failure-domain",
        default=None,
        help="what this node shares a fate with (a rack, a switch, a zone): its snapshots are copied to a node of "
        "another where there is one",
    )
    _flag(
        p,
        "--crash-loop-limit",
        default="3",
        help="no restart after the same failure this many times in a row, before the first step or at the same "
        "named step (a missing module, a bad argument); 0: restart up to --max-restarts whatever the failure",
    )
    _flag(
        p,
        "--verbose",
        action="store_true",
        help="also say how ftrun works as it goes: the warm pool's zygotes, the rendezvous' steps (or LOGLEVEL=DEBUG)",
    )
    hang = p.add_argument_group("hang detection (flags override the --config file)")
    _flag(
        hang,
        "--no-hang-detection",
        action="store_true",
        help="do not watch for ranks the others wait for in a collective (on with no flag); timeouts still apply",
    )
    _flag(
        hang,
        "--hang-timeout",
        default=None,
        help="a rank its peers wait for in a collective is hung once it shows no progress this long (20 s)",
    )
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
    _flag(
        hang,
        "--learn-timeouts",
        default=None,
        metavar="STEPS",
        help="after STEPS optimizer steps, and every STEPS more, the heartbeat timeout becomes the longest gap seen"
        " x --safety-factor, at least --learned-timeout-floor (0: off)",
    )
    _flag(hang, "--learned-timeout-floor", default=None, help="the smallest heartbeat timeout learned (60 s)")
    _flag(hang, "--hang-signal", default=None, help="signal sent to a hung worker first (SIGTERM)")
    _flag(
        hang,
        "--teardown-timeout",
        default=None,
        help="seconds a warm worker whose script ended may take to exit before it is ended, its result kept (30)",
    )
    _flag(
        hang,
        "--config",
        default=None,
        help="TOML or YAML file of hang, straggler and health check settings (keys as the flags, underscored)",
    )
    node = p.add_argument_group("stragglers and node health (flags override the --config file)")
    _flag(node, "--no-stragglers", action="store_true", help="do not time the workers' steps nor name stragglers")
    _flag(
        node,
        "--straggler-threshold",
        default=None,
        help="name a rank computing this share longer per step than the others, and costing the job this share "
        "of its step time, window after window (0.05)",
    )
    _flag(
        node,
        "--straggler-action",
        default=None,
        help="report (default), or exclude: a straggler's node leaves the job when a spare node waits",
    )
    _flag(
        node,
        "--health-check",
        action="append",
        default=None,
        metavar="CMD",
        help="before joining and while training, this node must pass CMD (exit 0) or builtin:gpu|nic[=IF]|writable=DIR",
    )
    _flag(node, "--health-check-interval", default=None, help="seconds between health checks while training (60)")
    ft = p.add_argument_group("NVIDIA ft_launcher's hang settings (ftrun's own flags win)")
    _flag(ft, "--ft-cfg-path", default=None, help="ft_launcher YAML with a fault_tolerance: section")
    for name in nvidia_ft.NAMES:
        _flag(ft, nvidia_ft.flag(name), default=None, help=f"as ft_launcher's {name}")
    for name in nvidia_ft.NO_EFFECT:
        _flag(ft, nvidia_ft.flag(name), default=None, help="accepted; ftrun checks each deadline when it falls due")
    warm = p.add_argument_group("warm restarts")
    _flag(warm, "--preload", default="", metavar="MOD[,MOD...]", help="modules the warm pool imports before forking")
    _flag(
        warm,
        "--warm",
        default="auto",
        help="auto: also preload what the workers imported (default); preload: only --preload",
    )
    _flag(warm, "--no-warm", action="store_true", help="no warm pool: every worker is a fresh process")


# torchrun's flags: their PET_* variables are defaults (ftrun's own flags have none).
_PET = frozenset(
    {
        "nnodes",
        "nproc_per_node",
        "node_rank",
        "master_addr",
        "master_port",
        "standalone",
        "max_restarts",
        "monitor_interval",
        "role",
        "log_dir",
        "redirects",
        "tee",
        "local_ranks_filter",
        "duplicate_stdout_filters",
        "duplicate_stderr_filters",
        "run_path",
        "start_method",
        "local_addr",
        "rdzv_backend",
        "rdzv_endpoint",
        "rdzv_id",
        "rdzv_conf",
        "signals_to_handle",
        "shutdown_timeout",
        "virtual_local_rank",
        "module",
        "no_python",
        "event_log_handler",
    }
)


def from_the_environment(argv: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's flags whose value comes from a ``PET_*`` variable (not given on the command line before the
    script): the flag -> the variable, so that an error names where the value came from."""
    script = next((i for i, arg in enumerate(argv) if not arg.startswith("-") and arg.endswith(".py")), len(argv))
    given = {arg.split("=", 1)[0].replace("_", "-") for arg in argv[:script] if arg.startswith("--")}
    found = {}
    for dest in _PET:
        flag, variable = "--" + dest.replace("_", "-"), f"PET_{dest.upper()}"
        if variable in environ and flag not in given:
            found[flag] = variable
    return found


def _environment_defaults(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    defaults: dict[str, object] = {}
    for action in p._actions:
        value = environ.get(f"PET_{action.dest.upper()}")
        if action.dest not in _PET or value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            if value.strip() == "":  # the Kubeflow training operator's way of saying `standalone: true`
                value = "1"
            if value.strip() not in ("0", "1"):
                raise ConfigError(f"PET_{action.dest.upper()}", f"expected 0 or 1, got {value!r}", "set it to 1")
            defaults[action.dest] = value.strip() == "1"
        else:
            defaults[action.dest] = value
    step = slurm_step(environ)  # inside srun: the rendezvous from SLURM, unless PET_* or a flag says otherwise
    if step is not None and not any(k in defaults for k in step.flags()):
        defaults |= step.flags()
    if "shutdown_timeout" not in defaults and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in environ:
        defaults["shutdown_timeout"] = environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
    p.set_defaults(**defaults)
