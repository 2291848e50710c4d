"""What the interrupt's thread breaks in a rank blocked in C: which of torch's backends it aborts, and how (pure
logic over stand-ins for torch's objects: NCCL needs a GPU; bench/gpu.py --in-place runs the real one)."""

from __future__ import annotations

import sys
import types

import pytest

from ftrun.worker import interrupt


class FakeNccl:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def _group_start(self) -> None:
        self.calls.append("group start")

    def _group_end(self) -> None:
        self.calls.append("group end")

    def abort(self) -> None:
        self.calls.append(f"abort {self.name}")


class FakeGroup:
    def __init__(self, cuda_backend: object | None) -> None:
        self.cuda_backend = cuda_backend

    def _get_backend(self, device: str) -> object:
        if device != "cuda" or self.cuda_backend is None:
            raise RuntimeError("no backend for this device")  # as torch: a gloo-only group has none for CUDA
        return self.cuda_backend


def fake_torch(monkeypatch: pytest.MonkeyPatch, groups: list[FakeGroup]) -> None:
    c10d = types.ModuleType("torch.distributed.distributed_c10d")
    c10d.ProcessGroupNCCL = FakeNccl  # type: ignore[attr-defined]
    c10d._world = types.SimpleNamespace(pg_map=dict.fromkeys(groups))  # type: ignore[attr-defined]
    torch = types.ModuleType("torch")
    torch.device = lambda name: name  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.distributed.distributed_c10d", c10d)
    monkeypatch.setitem(sys.modules, "torch", torch)


def test_every_nccl_communicator_is_aborted_inside_one_group_call_and_gloo_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    fake_torch(monkeypatch, [FakeGroup(FakeNccl("world", calls)), FakeGroup(None), FakeGroup(FakeNccl("tp", calls))])
    interrupt._abort_nccl()
    assert calls == ["group start", "abort world", "abort tp", "group end"]


def test_without_nccl_nothing_is_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch(monkeypatch, [FakeGroup(None)])
    interrupt._abort_nccl()  # raises nothing, calls nothing
    monkeypatch.delitem(sys.modules, "torch.distributed.distributed_c10d")
    interrupt._abort_nccl()
