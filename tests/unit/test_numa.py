"""--numa-binding's plan on a made-up machine (a sysfs tree in a temp dir): 2 sockets, 2 NUMA nodes, 4 GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftrun.node.numa import CannotBind, format_cpus, parse_cpus, plan

GPUS = {"0000:1b:00.0": 0, "0000:3d:00.0": 0, "0000:9a:00.0": 1, "0000:bc:00.0": 1}  # PCI order -> NUMA node


def machine(root: Path, gpus: dict[str, int] = GPUS, nodes: int = 2) -> Path:
    def write(path: str, text: str) -> None:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text + "\n")

    for bus, node in gpus.items():
        (root / "proc/driver/nvidia/gpus" / bus).mkdir(parents=True)
        write(f"sys/bus/pci/devices/{bus}/numa_node", str(node))
    for n in range(nodes):
        write(f"sys/devices/system/node/node{n}/cpulist", f"{8 * n}-{8 * n + 7}")
        for cpu in range(8 * n, 8 * n + 8):
            write(f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id", str(n))
            first = cpu - cpu % 4
            write(f"sys/devices/system/cpu/cpu{cpu}/cache/index3/shared_cpu_list", f"{first}-{first + 3}")
    return root


def test_cpu_lists_round_trip() -> None:
    assert parse_cpus("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpus(format_cpus({5, 1, 2})) == {1, 2, 5}


def test_node_mode_binds_each_worker_to_its_gpus_node(tmp_path: Path) -> None:
    cpus = plan("node", 4, {}, machine(tmp_path))
    assert cpus == [set(range(8)), set(range(8)), set(range(8, 16)), set(range(8, 16))]


def test_cuda_visible_devices_picks_the_gpus(tmp_path: Path) -> None:
    cpus = plan("node", 2, {"CUDA_VISIBLE_DEVICES": "3,0"}, machine(tmp_path))
    assert cpus == [set(range(8, 16)), set(range(8))]


def test_exclusive_and_core_complex_give_disjoint_cpus_on_a_shared_node(tmp_path: Path) -> None:
    root = machine(tmp_path)
    assert plan("exclusive", 4, {}, root) == [set(range(4)), set(range(4, 8)), set(range(8, 12)), set(range(12, 16))]
    assert plan("core-complex", 2, {}, root) == [set(range(4)), set(range(4, 8))]  # one L3 domain each


def test_socket_mode_takes_every_node_of_the_socket(tmp_path: Path) -> None:
    assert plan("socket", 1, {}, machine(tmp_path)) == [set(range(8))]


@pytest.mark.parametrize(
    ("setup", "environ", "why"),
    [
        (lambda root: machine(root, gpus={}), {}, "no NVIDIA GPU"),
        (lambda root: machine(root, nodes=1), {}, "1 NUMA node"),
        (machine, {"CUDA_VISIBLE_DEVICES": "GPU-1234"}, "not a list of GPU indices"),
    ],
)
def test_when_it_cannot_bind_it_says_why(tmp_path: Path, setup: object, environ: dict[str, str], why: str) -> None:
    root = setup(tmp_path)  # type: ignore[operator]
    with pytest.raises(CannotBind, match=why):
        plan("node", 2, environ, root)
