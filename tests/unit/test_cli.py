"""Parsing and validating the command line, torchrun-compatible. No processes are started."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest

from ftrun.cli import main as cli
from ftrun.cli.flags import omp_threads, parse_snapshot_memory
from ftrun.cli.rdzv_flags import parse_rdzv_conf, store_token
from ftrun.config import EntrypointKind, LaunchConfig, RdzvConf, Std
from ftrun.errors import ConfigError
from ftrun.node.addresses import parse_endpoint
from ftrun.node.devices import count_gpus


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


def parse(tmp_path: Path, *argv: str, environ: dict[str, str] | None = None) -> LaunchConfig:
    return cli.parse(list(argv), environ or {}, tmp_path)


def test_defaults(tmp_path: Path, script: Path) -> None:
    c = parse(tmp_path, "train.py", "--lr", "0.1")
    assert c.entrypoint.kind is EntrypointKind.SCRIPT
    assert c.entrypoint.args == ("--lr", "0.1")
    assert c.nproc_per_node == 1
    assert c.max_restarts == 0
    assert c.master_port is None
    assert c.term_timeout_s == 30.0  # torchrun's shutdown timeout
    assert c.signals_to_handle == {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}
    assert c.role == "default"
    assert c.rdzv.conf == RdzvConf()
    assert c.run_id == "none"  # torchrun's: nodes started with the same command meet
    assert parse(tmp_path, "--standalone", "train.py").run_id.startswith("ftrun-")  # torchrun draws one too


@pytest.mark.parametrize("spelling", ["--nproc-per-node", "--nproc_per_node"])
def test_both_spellings(tmp_path: Path, script: Path, spelling: str) -> None:
    assert parse(tmp_path, spelling, "3", "train.py").nproc_per_node == 3
    assert parse(tmp_path, f"{spelling}=2", "train.py").nproc_per_node == 2


def test_flags_after_the_script_belong_to_the_script(tmp_path: Path, script: Path) -> None:
    c = parse(tmp_path, "train.py", "--nproc-per-node", "8")
    assert c.nproc_per_node == 1
    assert c.entrypoint.args == ("--nproc-per-node", "8")


def test_torchrun_flags_are_accepted(tmp_path: Path, script: Path) -> None:
    c = parse(
        tmp_path,
        "--nnodes=1:1",
        "--node_rank=0",
        "--master_addr=127.0.0.1",
        "--master_port=29999",
        "--standalone",
        "--max_restarts=3",
        "--monitor_interval=1",
        "--role=trainer",
        "--log_dir=logs",
        "-r",
        "0:1,1:2",
        "-t",
        "3",
        "--local_ranks_filter=0",
        "--start_method=fork",
        "--local_addr=127.0.0.1",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        "--rdzv_id=job7",
        "--rdzv_conf=join_timeout=900,last_call_timeout=5,keep_alive_max_attempt=4",
        "--nproc_per_node=2",
        "--term-timeout=2.5",
        "--event-log=ev.jsonl",
        "train.py",
    )
    assert c.master_port == 29999
    assert c.max_restarts == 3
    assert c.role == "trainer"
    assert c.logs.base_dir == (Path.cwd() / "logs")
    assert c.logs.redirects == {0: Std.OUT, 1: Std.ERR}
    assert c.logs.tee == {0: Std.ALL, 1: Std.ALL}
    assert c.logs.local_ranks_filter == {0}
    assert c.run_id.startswith("ftrun-")  # --standalone draws its own id, whatever --rdzv-id says (as torchrun)
    assert c.rdzv.backend == "c10d"
    assert c.rdzv.store is not None
    assert c.rdzv.store.endpoints == (("127.0.0.1", 0),)  # --standalone: this machine, a free port (as torchrun)
    assert c.rdzv.conf.join_timeout_s == 900
    assert c.rdzv.conf.last_call_timeout_s == 5
    assert c.rdzv.conf.keep_alive_max_attempt == 4
    assert c.term_timeout_s == 2.5


def test_module_and_no_python(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    assert parse(tmp_path, "-m", "pkg.train", "x").entrypoint.command("py") == [
        "py",
        "-u",
        "-m",
        "pkg.train",
        "x",
    ]
    exe = tmp_path / "run.sh"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    c = parse(tmp_path, "--no-python", str(exe), "a")
    assert c.entrypoint.command("py") == [str(exe), "a"]


def test_no_python_finds_commands_on_path(tmp_path: Path) -> None:
    c = parse(tmp_path, "--no-python", "true")
    assert c.entrypoint.kind is EntrypointKind.EXECUTABLE
    assert os.path.isabs(c.entrypoint.target)


def test_nproc_words(tmp_path: Path, script: Path) -> None:
    cpus = os.cpu_count() or 1
    assert parse(tmp_path, "--nproc-per-node", "cpu", "train.py").nproc_per_node == cpus
    assert parse(tmp_path, "--nproc-per-node", "auto", "train.py", environ={}).nproc_per_node in (
        cpus,
        count_gpus({}),
    )
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2"}
    assert parse(tmp_path, "--nproc-per-node", "gpu", "train.py", environ=env).nproc_per_node == 3


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--nproc-per-node", "0", "train.py"], "--nproc-per-node"),
        (["--nproc-per-node", "many", "train.py"], "--nproc-per-node"),
        (["--nproc-per-node", "gpu", "train.py"], "--nproc-per-node"),
        (["--nnodes", "3:1", "train.py"], "--nnodes"),
        (["--nnodes", "2:4", "train.py"], "--nnodes"),  # static needs a fixed count
        (["--nnodes", "2:4", "--rdzv-backend", "c10d", "train.py"], "--rdzv-endpoint"),
        (["--nnodes", "2", "--rdzv-backend", "c10d", "--standalone", "train.py"], "--standalone"),
        (["--nnodes", "2", "--rdzv-backend", "etcd", "train.py"], "--rdzv-endpoint"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379?bogus=1", "train.py"], "--rdzv-endpoint"),
        (["--nnodes", "a:b", "train.py"], "--nnodes"),
        (["--max-restarts", "-1", "train.py"], "--max-restarts"),
        (["--term-timeout", "soon", "train.py"], "--shutdown-timeout"),
        (["--signals-to-handle", "SIGKILL", "train.py"], "--signals-to-handle"),
        (["--signals-to-handle", "SIGNOPE", "train.py"], "--signals-to-handle"),
        (["--numa-binding", "everywhere", "train.py"], "--numa-binding"),
        (["--event-log-handler", "kafka", "train.py"], "--event-log-handler"),
        (["--nproc-per-node", "xpu", "train.py"], "--nproc-per-node"),
        (["-m", "no_such_module_xyz"], "--module"),
        (["--master-port", "70000", "train.py"], "--master-port"),
        (["--rdzv-conf", "join_timeout", "train.py"], "--rdzv-conf"),
        (["--rdzv-conf", "jion_timeout=5", "train.py"], "--rdzv-conf"),
        (["--rdzv-conf", "join_timeout=-5", "train.py"], "--rdzv-conf join_timeout"),
        (["--rdzv-backend", "zookeeper", "train.py"], "--rdzv-backend"),
        (["--rdzv-id", "../x", "train.py"], "--rdzv-id"),
        (["--redirects", "4", "train.py"], "--redirects"),
        (["--tee", "5:1", "train.py"], "--tee"),
        (["--local-ranks-filter", "a", "train.py"], "--local-ranks-filter"),
        (["--start-method", "vfork", "train.py"], "--start-method"),
        (["--node-rank", "1", "train.py"], "--node-rank"),
        (["missing.py"], "SCRIPT"),
        ([], "SCRIPT"),
        (["--no-python", "no-such-binary-xyz"], "--no-python"),
        (["-m", "--no-python", "x"], "--module"),
        (["--bogus", "train.py"], "--bogus"),
        (["train.py", "--nproc-per-node"], None),
        (["--nproc-per-node"], "--nproc-per-node"),
        (["--snapshot-memory", "lots", "train.py"], "--snapshot-memory"),
        (["--snapshot-memory", "150%", "train.py"], "--snapshot-memory"),
        (["--snapshot-memory", "0G", "train.py"], "--snapshot-memory"),
    ],
)
def test_bad_input_names_the_flag(
    tmp_path: Path, script: Path, gpu_free: None, argv: list[str], flag: str | None
) -> None:
    if flag is None:  # flags after the script are the script's, whatever they look like
        parse(tmp_path, *argv)
        return
    with pytest.raises(ConfigError) as e:
        parse(tmp_path, *argv)
    assert e.value.flag == flag
    assert e.value.fix  # every error says how to fix it
    assert "\n" not in str(e.value)


def test_snapshot_memory_is_a_size_or_a_share_of_ram() -> None:
    ram = 64 << 30
    assert parse_snapshot_memory(None, ram) == 16 << 30  # a quarter of the node's RAM
    assert parse_snapshot_memory("50%", ram) == 32 << 30
    assert parse_snapshot_memory("8G", ram) == parse_snapshot_memory("8GiB", ram) == 8 << 30
    assert parse_snapshot_memory("512m", ram) == 512 << 20
    assert parse_snapshot_memory("1000", ram) == 1000


@pytest.fixture
def gpu_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """'gpu' must fail on this machine; make sure no /dev/nvidia* leaks in."""
    monkeypatch.setattr(cli.flags, "count_gpus", lambda environ: 0)


def test_non_executable_no_python_binary(tmp_path: Path) -> None:
    exe = tmp_path / "tool"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o644)
    with pytest.raises(ConfigError, match="not executable"):
        parse(tmp_path, "--no-python", str(exe))


def test_rdzv_conf_accepts_torchrun_keys() -> None:
    conf = parse_rdzv_conf(
        "timeout=10, read_timeout=3,is_host=true,use_agent_store=false,close_timeout=1,exit_barrier_timeout=7"
    )
    assert conf.exit_barrier_timeout_s == 7
    assert RdzvConf().exit_barrier_timeout_s == 300  # torchrun's default
    assert conf.join_timeout_s == 10
    assert conf.read_timeout_s == 3
    assert conf.is_host is True
    assert conf.close_timeout_s == 1
    assert conf.notices == (
        "--rdzv-conf use_agent_store has no effect: ftrun never shares its rendezvous store with the workers",
    )


def test_rdzv_conf_keys_about_torchs_tcpstore_are_said_to_have_no_effect() -> None:
    [notice] = parse_rdzv_conf("use_libuv=1").notices
    assert notice.startswith("--rdzv-conf use_libuv has no effect")
    assert parse_rdzv_conf("").notices == ()
    assert parse_rdzv_conf("").read_timeout_s is None  # the dead-node detection time


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", ("", None)), ("node0", ("node0", None)), ("node0:29400", ("node0", 29400)), ("[::1]:5", ("::1", 5))],
)
def test_rdzv_endpoint(text: str, expected: tuple[str, int | None]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", [":29400", "node0:port", "node0:99999", "[::1", "[::1]x"])
def test_bad_rdzv_endpoint(text: str) -> None:
    with pytest.raises(ConfigError, match="--rdzv-endpoint"):
        parse_endpoint(text)


def test_omp_threads_follows_torchrun() -> None:
    assert omp_threads({}, 2) == {"OMP_NUM_THREADS": "1"}
    assert omp_threads({}, 1) == {}
    assert omp_threads({"OMP_NUM_THREADS": "4"}, 2) == {}


def test_console_routing(tmp_path: Path, script: Path) -> None:
    logs = parse(
        tmp_path, "--nproc-per-node", "3", "-r", "1", "-t", "0:2", "--local-ranks-filter", "0,1", "train.py"
    ).logs
    assert not logs.console(0, Std.OUT)  # redirected
    assert logs.console(0, Std.ERR)
    assert logs.prefixed(0, Std.ERR)
    assert not logs.prefixed(1, Std.ERR)
    assert logs.console(1, Std.ERR)
    assert not logs.console(2, Std.ERR)  # filtered out


def test_store_token_sources(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("from-file\n")
    assert store_token(None, str(tmp_path / "tok"), {"FTRUN_TOKEN": "env"}) == "from-file"
    assert store_token("flag", None, {"FTRUN_TOKEN": "env"}) == "flag"
    assert store_token(None, None, {"FTRUN_TOKEN": "env"}) == "env"
    assert store_token(None, None, {}) is None
    with pytest.raises(ConfigError, match="token_file"):
        store_token(None, str(tmp_path / "missing"), {})


def test_multi_node_modes(tmp_path: Path, script: Path) -> None:
    c = parse(tmp_path, "--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0", "train.py")
    assert c.elastic
    assert c.rdzv.store is not None
    assert (c.rdzv.store.display, c.rdzv.store.tls) == ("tcp://node0:29400", False)
    c = parse(tmp_path, "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379,e2:2379", "train.py")
    assert c.elastic
    assert c.rdzv.store is not None
    assert c.rdzv.store.display == "etcd://e1:2379,e2:2379"
    # parsed once, here: TLS from --rdzv-conf is the URL's, which the store, its server and its successor read
    c = parse(
        tmp_path,
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "node0",
        "--rdzv-conf",
        "protocol=https",
        "train.py",
    )
    assert c.rdzv.store is not None
    assert (c.rdzv.store.scheme, c.rdzv.store.tls) == ("tcps", True)
    moved = c.rdzv.store.at("node3", 29400)  # a successor's, TLS kept
    assert (moved.display, moved.tls) == ("tcps://node3:29400", True)
    assert f"{moved}" == "tcps://node3:29400"  # in a message: the URL, never the fields (a password)
    secret = c.rdzv.store.__class__("etcd", (("e1", 2379),), user="u", password="hunter2")
    assert "hunter2" not in f"{secret} {secret!r}"
    c = parse(tmp_path, "--nnodes", "2", "--node-rank", "1", "--master-addr", "node0", "train.py")
    assert not c.elastic  # static: the flags place this node
    assert c.rdzv.store is None
    assert (c.node_rank, c.master_addr, c.master_port) == (1, "node0", 29500)
    # torchrun's static rendezvous meets at --rdzv-endpoint when one is given, over --master-addr/--master-port
    c = parse(
        tmp_path, "--nnodes", "2", "--node-rank", "1", "--master-addr", "x", "--rdzv-endpoint", "node0:1234", "train.py"
    )
    assert (c.rdzv.store, c.master_addr, c.master_port) == (None, "node0", 1234)
    with pytest.raises(ConfigError, match="has no port, which a static rendezvous"):
        parse(tmp_path, "--nnodes", "2", "--rdzv-endpoint", "node0", "train.py")
    c = parse(tmp_path, "--standalone", "--rdzv-backend", "c10d", "train.py")
    assert not c.elastic


def test_hang_settings_from_flags_over_the_config_file(tmp_path: Path, script: Path) -> None:
    (tmp_path / "ft.toml").write_text(
        'heartbeat_timeout = 60\nsafety_factor = 3\nhang_signal = "SIGABRT"\n'
        "[section_timeouts]\nstep = 30\nnever_used = 5\n"  # a section the job never opens is fine
    )
    c = parse(
        tmp_path, "--config", str(tmp_path / "ft.toml"), "--heartbeat-timeout", "9",
        "--section-timeout", "step=2", "--section-timeout", "save=120", "train.py",
    )  # fmt: skip
    t = c.hang.timeouts
    assert (t.initial_heartbeat, t.heartbeat, t.out_of_section) == (None, 9.0, None)
    assert t.sections == {"step": 2.0, "never_used": 5.0, "save": 120.0}
    assert c.hang.safety_factor == 3.0
    assert c.hang.hang_signal == 6
    assert not parse(tmp_path, "train.py").hang.timeouts.any  # unset: off


def test_hangs_are_watched_with_no_flag_unless_turned_off(tmp_path: Path, script: Path) -> None:
    assert parse(tmp_path, "train.py").hang.collectives
    assert not parse(tmp_path, "--no-hang-detection", "train.py").hang.collectives
    (tmp_path / "ft.toml").write_text("hang_detection = false\n")
    assert not parse(tmp_path, "--config", str(tmp_path / "ft.toml"), "train.py").hang.collectives


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heartbeat-timeout", "0"], "--heartbeat-timeout: must be a finite number of seconds > 0"),
        (["--out-of-section-timeout", "-3"], "--out-of-section-timeout: must be a finite number of seconds > 0"),
        (["--section-timeout", "step"], "--section-timeout: expected NAME=SECONDS"),
        (["--section-timeout", "step=0"], "--section-timeout step: must be a finite number of seconds > 0"),
        (["--safety-factor", "nan"], "--safety-factor: must be a finite number"),
        (["--hang-signal", "SIGNOPE"], "--hang-signal: unknown signal 'SIGNOPE'"),
        (["--config", "missing.toml"], "--config: cannot read"),
    ],
)
def test_bad_hang_settings_are_named(tmp_path: Path, script: Path, argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(tmp_path, *argv, "train.py")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("heartbeat_timeout = [", "is not valid TOML"),
        ("heartbeat = 5", "unknown key\\(s\\) in .*: heartbeat; did you mean heartbeat_timeout"),
        ("heartbeat_timeout = -1", "heartbeat_timeout in .*ft.toml: must be a finite number of seconds > 0"),
        ("section_timeouts = 5", "section_timeouts in .*ft.toml: must be a table"),
        ("hang_detection = 0", "hang_detection in .*ft.toml: must be true or false"),
    ],
)
def test_a_bad_config_file_is_named(tmp_path: Path, script: Path, body: str, message: str) -> None:
    (tmp_path / "ft.toml").write_text(body)
    with pytest.raises(ConfigError, match=message):
        parse(tmp_path, "--config", str(tmp_path / "ft.toml"), "train.py")


def test_straggler_and_health_settings_from_flags_over_a_toml_or_yaml_file(tmp_path: Path, script: Path) -> None:
    default = parse(tmp_path, "train.py")
    assert (default.stragglers.enabled, default.stragglers.threshold, default.stragglers.exclude) == (True, 0.05, False)
    assert (default.health.checks, default.health.interval_s) == ((), 60.0)
    (tmp_path / "ft.yaml").write_text(
        "heartbeat_timeout: 30\nstraggler_action: exclude\nstraggler_threshold: 0.2\n"
        "health_check: [./gpu-burn.sh, 'builtin:writable=/ckpt']\nhealth_check_interval: 300\n"
    )
    c = parse(tmp_path, "--config", str(tmp_path / "ft.yaml"), "--straggler-threshold", "0.1", "train.py")
    assert (c.stragglers.enabled, c.stragglers.threshold, c.stragglers.exclude) == (True, 0.1, True)
    assert (c.health.checks, c.health.interval_s) == (("./gpu-burn.sh", "builtin:writable=/ckpt"), 300.0)
    assert c.hang.timeouts.heartbeat == 30.0
    (tmp_path / "ft.toml").write_text('stragglers = false\nhealth_check = "builtin:gpu"\n')
    c = parse(tmp_path, "--config", str(tmp_path / "ft.toml"), "--health-check", "./mine.sh", "train.py")
    assert not c.stragglers.enabled
    assert c.health.checks == ("./mine.sh",)  # the flags win over the file
    assert not parse(tmp_path, "--no-stragglers", "train.py").stragglers.enabled


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--straggler-threshold", "0"], "--straggler-threshold: expected a share above 0"),
        (["--straggler-threshold", "ten"], "--straggler-threshold: expected a share above 0"),
        (["--straggler-action", "kill"], "--straggler-action: unknown action 'kill'"),
        (["--health-check", "builtin:fan"], "--health-check: no built-in check 'fan'"),
        (["--health-check", "builtin:writable"], "builtin:writable needs a directory"),
        (["--health-check-interval", "0"], "--health-check-interval: must be a finite number of seconds > 0"),
    ],
)
def test_bad_straggler_and_health_settings_are_named(
    tmp_path: Path, script: Path, argv: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(tmp_path, *argv, "train.py")


def test_a_bad_yaml_config_file_is_named(tmp_path: Path, script: Path) -> None:
    (tmp_path / "ft.yml").write_text("- a list\n")
    with pytest.raises(ConfigError, match="holds a YAML list, not a mapping"):
        parse(tmp_path, "--config", str(tmp_path / "ft.yml"), "train.py")
    (tmp_path / "ft.yml").write_text("health_check: [1, 2]\n")
    with pytest.raises(ConfigError, match="--health-check: expected commands"):
        parse(tmp_path, "--config", str(tmp_path / "ft.yml"), "train.py")


def test_warm_pool_flags(tmp_path: Path, script: Path) -> None:
    default = parse(tmp_path, "train.py").warm
    assert (default.enabled, default.auto, default.preload) == (True, True, ())
    c = parse(tmp_path, "--preload", "torch, torch._dynamo", "--warm", "preload", "train.py").warm
    assert (c.enabled, c.auto, c.preload) == (True, False, ("torch", "torch._dynamo"))
    assert parse(tmp_path, "--no-warm", "train.py").warm.enabled is False
    with pytest.raises(ConfigError, match="--preload: 'torch-nightly' is not a module name"):
        parse(tmp_path, "--preload", "torch-nightly", "train.py")
    with pytest.raises(ConfigError, match="--warm: unknown mode 'hot'"):
        parse(tmp_path, "--warm", "hot", "train.py")


def test_torchruns_environment_defaults(tmp_path: Path, script: Path) -> None:
    env = {"PET_NPROC_PER_NODE": "2", "PET_MAX_RESTARTS": "3", "PET_STANDALONE": "1", "PET_RDZV_CONF": "join_timeout=9"}
    c = parse(tmp_path, "train.py", environ=env)
    assert (c.nproc_per_node, c.max_restarts, c.standalone, c.rdzv.conf.join_timeout_s) == (2, 3, True, 9)
    assert parse(tmp_path, "--nproc-per-node", "4", "train.py", environ=env).nproc_per_node == 4  # flags win
    assert parse(tmp_path, "train.py", environ={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}).term_timeout_s == 7
    assert parse(tmp_path, "train.py", environ={"PET_SHUTDOWN_TIMEOUT": "8"}).term_timeout_s == 8
    with pytest.raises(ConfigError, match="PET_STANDALONE"):
        parse(tmp_path, "train.py", environ={"PET_STANDALONE": "yes"})


def test_signals_shutdown_and_the_term_timeout_alias(tmp_path: Path, script: Path) -> None:
    c = parse(tmp_path, "--signals-to-handle", "SIGTERM,USR1,10", "--term-timeout", "2", "train.py")
    assert c.signals_to_handle == {signal.SIGTERM, signal.SIGUSR1}
    assert c.term_timeout_s == 2
    assert parse(tmp_path, "--shutdown_timeout", "0", "train.py").term_timeout_s == 0


def test_torchrun_output_flags(tmp_path: Path, script: Path) -> None:
    c = parse(tmp_path, "--duplicate-stdout-filters", "loss,,x,acc", "--tee", "3", "train.py")
    assert c.logs.stdout_filters == ("loss,x", "acc")  # a double comma is a comma inside one filter
    assert c.logs.stderr_filters == ()
    assert c.logs.prefix("default", 5, 1) == "[default1]:"  # torchrun's default prefix
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${role_name}/${rank}]"}
    assert parse(tmp_path, "train.py", environ=env).logs.prefix("trainer", 5, 1) == "[trainer/5]"


def test_flags_that_cannot_apply_say_so(tmp_path: Path, script: Path, gpu_free: None) -> None:
    c = parse(tmp_path, "--numa-binding", "node", "--logs-specs", "mine", "train.py")
    assert any(n.startswith("--numa-binding node cannot apply: no NVIDIA GPU") for n in c.notices)
    assert any(n.startswith("--logs-specs mine has no effect") for n in c.notices)
    assert parse(tmp_path, "--event-log-handler", "console", "train.py").echo_events
    c = parse(tmp_path, "--nproc-per-node", "2", "--local-ranks-filter", "5,7", "train.py")
    assert "--local-ranks-filter 5,7: no local rank here is one of them (this node's are 0-1)" in " ".join(c.notices)
    c = parse(tmp_path, "--nproc-per-node", "2", "--local-ranks-filter", "1,7", "train.py")
    assert not any("--local-ranks-filter" in n for n in c.notices)


def test_environment_of_the_launcher(tmp_path: Path, script: Path) -> None:
    assert parse(tmp_path, "train.py", environ={"LOGLEVEL": "WARNING"}).quiet
    assert not parse(tmp_path, "train.py", environ={"LOGLEVEL": "info"}).quiet
    assert not parse(tmp_path, "train.py").verbose
    assert parse(tmp_path, "--verbose", "train.py").verbose
    assert parse(tmp_path, "train.py", environ={"LOGLEVEL": "DEBUG"}).verbose
    with pytest.raises(ConfigError, match="LOGLEVEL"):
        parse(tmp_path, "train.py", environ={"LOGLEVEL": "LOUD"})
    (tmp_path / "py").write_text("#!/bin/sh\n")
    (tmp_path / "py").chmod(0o755)
    assert parse(tmp_path, "train.py", environ={"PYTHON_EXEC": str(tmp_path / "py")}).python == str(tmp_path / "py")
    with pytest.raises(ConfigError, match="PYTHON_EXEC"):
        parse(tmp_path, "train.py", environ={"PYTHON_EXEC": "no-such-python-xyz"})


def test_standalone_says_once_that_it_draws_its_own_run_id(tmp_path: Path, script: Path) -> None:
    c = parse(tmp_path, "--standalone", "--rdzv-id", "mine", "train.py")
    assert c.run_id != "mine"
    assert c.notices == (f"--rdzv-id mine has no effect with --standalone (as in torchrun): the run is {c.run_id}",)
    assert parse(tmp_path, "--standalone", "train.py").notices == ()


def test_a_typo_gets_a_did_you_mean(tmp_path: Path, script: Path) -> None:
    with pytest.raises(ConfigError) as e:
        parse(tmp_path, "--nproc-per-nodee", "2", "train.py")
    assert e.value.fix == "did you mean --nproc-per-node?"


def test_an_unambiguous_prefix_of_a_flag_stands_for_it_as_in_torchrun(tmp_path: Path, script: Path) -> None:
    assert parse(tmp_path, "--nproc-per-nod", "2", "train.py").nproc_per_node == 2
    assert parse(tmp_path, "--nproc", "3", "--max-rest", "4", "train.py").max_restarts == 4  # both spellings: one flag
    assert parse(tmp_path, "--nproc_per", "2", "train.py", "--nproc", "9").entrypoint.args == ("--nproc", "9")
    with pytest.raises(ConfigError) as e:
        parse(tmp_path, "--no", "train.py")
    assert e.value.fix == "spell more of the flag"
    assert "--no_warm" in e.value.problem


def test_max_restarts_below_zero_suggests_zero(tmp_path: Path, script: Path) -> None:
    with pytest.raises(ConfigError, match="pass --max-restarts 0 or more"):
        parse(tmp_path, "--max-restarts", "-1", "train.py")


def test_virtual_local_rank_needs_a_gpu_per_worker(tmp_path: Path, script: Path) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "3,5"}
    assert parse(tmp_path, "--virtual-local-rank", "--nproc-per-node", "2", "train.py", environ=env).virtual_local_rank
    with pytest.raises(ConfigError, match="--virtual-local-rank"):
        parse(tmp_path, "--virtual-local-rank", "--nproc-per-node", "3", "train.py", environ=env)


def test_nvidia_ft_launcher_settings_mean_the_same(tmp_path: Path, script: Path) -> None:
    (tmp_path / "ft.yaml").write_text(
        "trainer:\n"
        "  fault_tolerance:\n"
        "    initial_rank_heartbeat_timeout: 600\n"
        "    rank_heartbeat_timeout: null\n"
        "    rank_section_timeouts: {step: 30, eval: null}\n"
        "    rank_termination_signal: SIGKILL\n"
        "    enable_nic_monitor: true\n"
        "    workload_check_interval: 5\n"
    )
    c = parse(tmp_path, "--ft-cfg-path", "ft.yaml", "--ft-rank-heartbeat-timeout", "90", "train.py")
    t = c.hang.timeouts
    assert (t.initial_heartbeat, t.heartbeat, dict(t.sections)) == (600, 90, {"step": 30})
    assert c.hang.hang_signal == signal.SIGKILL
    assert "--ft-cfg-path: not applied (nothing to do in ftrun): enable_nic_monitor" in c.notices
    # ftrun's own flags win over NVIDIA's names; NVIDIA's section format is NAME:SECONDS
    c = parse(tmp_path, "--heartbeat-timeout", "5", "--ft-rank-heartbeat-timeout", "90",
              "--ft-rank-section-timeouts", "step:12,io:None", "train.py")  # fmt: skip
    assert (c.hang.timeouts.heartbeat, dict(c.hang.timeouts.sections)) == (5, {"step": 12})
    (tmp_path / "other.yaml").write_text("a: 1\n")
    with pytest.raises(ConfigError, match="no fault_tolerance: section"):
        parse(tmp_path, "--ft-cfg-path", "other.yaml", "train.py")


@pytest.mark.parametrize(
    ("argv", "config", "environ", "said"),
    [
        (["--rdzv-conf", "join_timeout=abc"], None, {}, "pass e.g. --rdzv-conf join_timeout=5"),
        (["--section-timeout", "step=soon"], None, {}, "pass e.g. --section-timeout step=30"),
        ([], 'heartbeat_timeout = "thirty"\n', {}, "write e.g. heartbeat_timeout = 5 in "),
        ([], None, {"PET_NPROC_PER_NODE": "x"}, "PET_NPROC_PER_NODE (for --nproc-per-node): "),
        ([], None, {"PET_NPROC_PER_NODE": "x"}, "set e.g. PET_NPROC_PER_NODE=2"),
        (["--nproc-per-node", "0"], None, {"PET_NPROC_PER_NODE": "x"}, "--nproc-per-node: must be >= 1"),
    ],
)
def test_a_hint_is_written_as_the_value_is_given(
    tmp_path: Path, script: Path, argv: list[str], config: str | None, environ: dict[str, str], said: str
) -> None:
    """Where the value came from (a flag with KEY=VALUE, a config file, a PET_* variable) is named, and the fix
    is written the way that source writes it."""
    if config is not None:
        (tmp_path / "ftrun.toml").write_text(config)
        argv = [*argv, "--config", str(tmp_path / "ftrun.toml")]
    with pytest.raises(ConfigError) as e:
        parse(tmp_path, *argv, str(script), environ=environ)
    assert said in str(e.value)


def test_the_hang_timeout_comes_from_the_flag_or_the_config_file(tmp_path: Path, script: Path) -> None:
    assert parse(tmp_path, str(script)).hang.quiet_s == 20.0
    assert parse(tmp_path, "--hang-timeout", "4", str(script)).hang.quiet_s == 4.0
    (tmp_path / "ftrun.toml").write_text("hang_timeout = 6\n")
    assert parse(tmp_path, "--config", "ftrun.toml", str(script)).hang.quiet_s == 6.0
    with pytest.raises(ConfigError, match="--hang-timeout"):
        parse(tmp_path, "--hang-timeout", "0", str(script))


def test_the_hang_notice_reads_as_sentences(tmp_path: Path, script: Path) -> None:
    from ftrun.monitor.watch import watching

    said = "hangs: a rank its peers wait for in a collective, showing no progress for 20 s, is stopped and named"
    assert watching(parse(tmp_path, str(script))) == (
        f"{said} (--hang-timeout S; sooner: --heartbeat-timeout S); --no-hang-detection turns this off"
    )
    assert watching(parse(tmp_path, "--heartbeat-timeout", "30", str(script))) == (
        f"{said}; the timeouts given are watched too; --no-hang-detection turns this off"
    )
    assert watching(parse(tmp_path, "--no-hang-detection", str(script))) == "hangs: not watched"
