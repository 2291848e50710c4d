"""``ftrun.RankMonitorClient``: NVIDIA's client API on ftrun's, a migration path for code written against
ft_launcher (``nvidia_resiliency_ext.fault_tolerance.RankMonitorClient``).

Replace the import and keep the calls; each maps onto ftrun's worker API (which needs no monitor
process, no socket and no initialisation). Under ftrun the calls record into the worker's
shared-memory slot; outside it they do nothing, after one warning, as ftrun's own do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ftrun.worker import calculated, client, sections
from ftrun.worker.timeouts import Timeouts


class RankMonitorClient:
    """NVIDIA's method names and meanings; its state dicts load into ftrun and back."""

    def init_workload_monitoring(self) -> None:
        client.attach()

    def shutdown_workload_monitoring(self) -> None:
        """Nothing to close: ftrun's client is a mapping the agent reads."""

    def send_heartbeat(self) -> None:
        client.heartbeat()

    def start_section(self, section: str) -> None:
        sections.start_section(section)

    def end_section(self, section: str) -> None:
        sections.end_section(section)

    def end_all_sections(self) -> None:
        sections.end_all_sections()

    def calculate_and_set_hb_timeouts(self, skip_if_not_ready: bool = False) -> bool:
        """The initial-heartbeat and heartbeat timeouts from what was observed; False when there is not enough
        (raises ValueError then unless ``skip_if_not_ready``)."""
        fresh = self._fresh()
        if fresh.heartbeat is None:
            if skip_if_not_ready:
                return False
            raise ValueError("not enough heartbeats to calculate the heartbeat timeouts")
        self._widen(Timeouts(fresh.initial_heartbeat, fresh.heartbeat))
        return True

    def calculate_and_set_section_timeouts(
        self, selected_sections: Iterable[str] | None = None, calc_out_of_section: bool = True
    ) -> bool:
        """Section timeouts (only ``selected_sections``, when given) and the out-of-section one."""
        fresh = self._fresh()
        chosen = fresh.sections if selected_sections is None else {
            k: v for k, v in fresh.sections.items() if k in set(selected_sections)
        }  # fmt: skip
        out = fresh.out_of_section if calc_out_of_section else None
        if not chosen and out is None:
            return False
        self._widen(Timeouts(out_of_section=out, sections=chosen))
        return True

    def state_dict(self) -> Mapping[str, Any]:
        return calculated.monitor_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        calculated.load_monitor_state(dict(state))

    @staticmethod
    def _fresh() -> Timeouts:
        fresh: Timeouts = client._client.fresh_timeouts(None)
        return fresh

    @staticmethod
    def _widen(timeouts: Timeouts) -> None:
        current: Timeouts = client._client.calculated
        client._client.set_timeouts(current.widest(timeouts))
