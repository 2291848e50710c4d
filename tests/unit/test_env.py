"""The worker environment: exactly torchrun's variables plus ftrun's own."""

from __future__ import annotations

from ftrun.agent.env import Placement, WorkerAssignment, assign, worker_env

TORCHRUN_VARS = {
    "PYTHONFAULTHANDLER",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
}


def assignment(**overrides: object) -> WorkerAssignment:
    a = assign(
        1,
        4,
        Placement(),
        role="trainer",
        master_addr="127.0.0.1",
        master_port=29511,
        restart_count=2,
        max_restarts=3,
        run_id="job7",
        error_file="/logs/1/error.json",
    )
    return WorkerAssignment(**{**{f: getattr(a, f) for f in a.__slots__}, **overrides})  # type: ignore[arg-type]


def test_exactly_the_contract_variables_are_added() -> None:
    env = worker_env({}, assignment())
    assert set(env) == TORCHRUN_VARS | {"FTRUN_ERROR_FILE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"}


def test_values_for_a_single_node_job() -> None:
    env = worker_env({"PATH": "/bin"}, assignment())
    assert env["PATH"] == "/bin"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
        "1",
        "1",
        "4",
        "4",
    )
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("0", "1")
    assert (env["ROLE_RANK"], env["ROLE_WORLD_SIZE"], env["ROLE_NAME"]) == ("1", "4", "trainer")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29511")
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert env["TORCHELASTIC_RUN_ID"] == "job7"
    assert env["TORCHELASTIC_ERROR_FILE"] == env["FTRUN_ERROR_FILE"] == "/logs/1/error.json"


def test_inherited_values_never_override_the_assignment() -> None:
    env = worker_env({"RANK": "7", "MASTER_PORT": "1"}, assignment())
    assert env["RANK"] == "1"
    assert env["MASTER_PORT"] == "29511"


def test_base_is_not_modified() -> None:
    base = {"HOME": "/root"}
    worker_env(base, assignment())
    assert base == {"HOME": "/root"}


def test_a_node_in_a_multi_node_job_offsets_its_ranks() -> None:
    # Per-node worker counts may differ (as torchrun): this node has 2 workers after nodes with 4 and 8.
    a = assign(
        1,
        2,
        Placement(group_rank=2, group_world_size=3, rank_offset=12, world_size=14),
        role="trainer",
        master_addr="10.0.0.1",
        master_port=29511,
        restart_count=0,
        max_restarts=0,
        run_id="job7",
        error_file="/e",
    )
    env = worker_env({}, a)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("13", "1", "14", "2")
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("2", "3")
    assert (env["ROLE_RANK"], env["ROLE_WORLD_SIZE"]) == ("13", "14")


def test_torchruns_extras_and_what_they_imply() -> None:
    env = worker_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}, assignment())
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # rank 0 hosts the job's TCPStore: nothing to share
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # the user's value wins, as in torchrun
    assert worker_env({}, assignment())["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_the_flight_recorder_the_hang_watch_reads_is_on_unless_the_job_sized_it() -> None:
    """Under torch's current names: the old ones (TORCH_NCCL_*) make every worker print a warning."""
    assert worker_env({}, assignment())["TORCH_FR_BUFFER_SIZE"] == "2000"
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        env = worker_env({name: "50"}, assignment())
        assert env[name] == "50"
        assert {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & set(env) == {name}


def test_the_recorder_dumped_at_a_timeout_goes_to_the_attempts_directory_unless_the_job_says_where() -> None:
    env = worker_env({}, assignment(flight_recorder_file="/logs/flight_recorder/rank_"))
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/logs/flight_recorder/rank_"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    own = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/mine/t_", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    env = worker_env(own, assignment(flight_recorder_file="/logs/flight_recorder/rank_"))
    assert "TORCH_FR_DUMP_TEMP_FILE" not in env
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


def test_nccls_debug_pipe_is_set_under_both_names_unless_the_job_set_one() -> None:
    env = worker_env({}, assignment(flight_recorder_pipe="/logs/flight_recorder/pipe_"))
    assert (
        env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == env["TORCH_FR_DEBUG_INFO_PIPE_FILE"] == "/logs/flight_recorder/pipe_"
    )
    env = worker_env({"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/mine/p_"}, assignment(flight_recorder_pipe="/l/pipe_"))
    assert env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == "/mine/p_"
    assert "TORCH_FR_DEBUG_INFO_PIPE_FILE" not in env


def test_virtual_local_rank_gives_each_worker_one_gpu_as_device_0() -> None:
    env = worker_env({"CUDA_VISIBLE_DEVICES": "4, 6"}, assignment(local_rank=1), virtual_local_rank=True)
    assert (env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"]) == ("0", "6")
    env = worker_env({}, assignment(local_rank=1), virtual_local_rank=True)
    assert (env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
