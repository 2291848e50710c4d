"""The agent of an elastic job: the rendezvous, not the local policy, says when workers run.

Every node runs one of these. The loop asks the rendezvous what to do (run in a
round, stop, wait, finish, fail), does it, and sleeps in one select() on its
workers, the signal pipe and the rendezvous' fd until something changes.
What only this node can see (its workers failed, or all succeeded) goes back
into the rendezvous, which turns it into a new round for every node or the end
of the job. The restart budget is the job's (in the round record), not this node's.
"""

from __future__ import annotations

import os
import secrets
import socket

from ftrun.agent import env as worker_env
from ftrun.agent import policy
from ftrun.agent.agent import Agent
from ftrun.agent.workers import WorkerGroup, WorkerState
from ftrun.events import EventKind
from ftrun.ports import reserve_port
from ftrun.rendezvous.driver import Local, Me, Rendezvous, Timing
from ftrun.rendezvous.state import Action, Assignment, Rules
from ftrun.store.base import open_store


def node_id(host: str) -> str:
    """Unique per agent even for several agents on one host, or in containers that all have pid 1."""
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


class ElasticAgent(Agent):
    def _run_job(self) -> int:
        c = self.config
        conf = c.rdzv.conf
        timing = Timing(conf.keep_alive_interval_s, conf.keep_alive_max_attempt)
        url = c.rdzv.store_url
        if self.store_server is not None:  # hosted here: the real port, should the endpoint have said :0
            url = f"tcp://{self.store_server.host}:{self.store_server.port}"
        # Past the lease's TTL an unreachable store means this node is out of the job anyway.
        store = open_store(url, token=c.rdzv.token, retry_deadline_s=max(timing.ttl_s, 1.0))
        rules = Rules(c.nnodes.min, c.nnodes.max, conf.last_call_timeout_s, conf.join_timeout_s, c.max_restarts)
        me = Me(node_id(self._host), c.local_addr or socket.getfqdn(), c.nproc_per_node)
        self._say(f"node {me.node_id} joining {c.nnodes.min}:{c.nnodes.max} nodes at {url}")
        self._group = WorkerGroup(self._spawner, self._clock, self._wakeup.fd)  # empty until the first round
        rdzv = Rendezvous(
            store,
            c.run_id,
            me,
            rules,
            timing,
            clock=self._clock,
            offer_port=lambda: reserve_port("", self._clock.wall()),
            log=self._say,
        )
        ended = False
        try:
            rdzv.start()
            code = self._follow(rdzv)
            ended = code in (0, 1)
            return code
        finally:
            if ended and self.store_server is not None:
                # The store lives in this process: let the other nodes read how the job ended first.
                left = rdzv.wait_for_departures(conf.close_timeout_s)
                if left:
                    self._say(f"{left} node(s) still registered after close_timeout; closing the store anyway")
            rdzv.close(leave=True)
            store.close()

    def _follow(self, rdzv: Rendezvous) -> int:  # noqa: PLR0912 - one branch per rendezvous action
        local = Local()
        report_owed = False
        attempts = 0
        while True:
            step = rdzv.next(local)
            d = step.decision
            self._note(d.reason)
            if report_owed:
                self._report_failure(will_restart=d.action is not Action.FAIL)
                report_owed = False
            if d.action is Action.RUN:
                assert d.assignment is not None
                if d.assignment.round != local.running_round:
                    self._run_round(d.assignment, attempts)
                    attempts += 1
                    local = Local(running_round=d.assignment.round)
            elif d.action is Action.STOP:
                signals = self._stop_workers()
                local = Local()
                if signals:
                    return self._finish(128 + signals[0], "interrupted")
                continue
            elif d.action is Action.FINISHED:
                return self._finish_own_workers()
            elif d.action is Action.FAIL:
                self._stop_workers()
                return self._finish(1, "failed")
            assert self._group is not None
            timeout = max(0.0, step.wake_at - self._clock.monotonic())
            hang_check = self._hangs.wake_in(self._next_deadline)
            if (
                hang_check is not None
                and local.running_round is not None
                and not (local.local_failure or local.job_done)
            ):
                timeout = min(timeout, hang_check)
            exited, woken = self._group.wait(timeout, also=rdzv.fileno())
            for w in exited:
                self._exited(w)
            if woken and (signals := [e.signal for e in self._signals()]):
                self._say(f"signal {signals[0]}; stopping the workers and leaving the job")
                self._stop_workers()
                if report_owed:
                    self._report_failure(will_restart=False)
                return self._finish(128 + signals[0], "interrupted")
            if local.running_round is None or local.local_failure or local.job_done:
                continue
            failed = [w for w in exited if w.state is WorkerState.FAILED] + self._check_workers()
            if failed:
                self._say(f"local rank {failed[0].local_rank} failed; stopping the other workers")
                self._stop_workers()
                report_owed = True
                local = Local(running_round=local.running_round, local_failure=True)
            elif self._group.workers and all(w.state is WorkerState.SUCCEEDED for w in self._group.workers):
                local = Local(running_round=local.running_round, job_done=True)

    def _run_round(self, a: Assignment, attempt: int) -> None:
        c = self.config
        self._emit(
            EventKind.RENDEZVOUS,
            round=a.round,
            group_rank=a.group_rank,
            group_world_size=a.group_world_size,
            world_size=a.world_size,
            master_addr=a.master_addr,
            master_port=a.master_port,
        )
        self._say(
            f"round {a.round}: group rank {a.group_rank} of {a.group_world_size}, "
            f"ranks {a.rank_offset}..{a.rank_offset + c.nproc_per_node - 1} of {a.world_size}, "
            f"master {a.master_addr}:{a.master_port}"
        )
        placement = worker_env.Placement(a.group_rank, a.group_world_size, a.rank_offset, a.world_size)
        self._start_attempt(attempt, placement, a.master_addr, a.master_port, a.restarts)

    def _stop_workers(self) -> list[int]:
        """Stop this node's workers if any run; returns the signals to ftrun that came meanwhile."""
        assert self._group is not None
        if not self._group.running:
            return []
        return [e.signal for e in self._stop_group() if isinstance(e, policy.Interrupted)]

    def _finish_own_workers(self) -> int:
        """The job succeeded somewhere: let this node's workers finish too, then exit with their result."""
        assert self._group is not None
        while self._group.running:
            exited, woken = self._group.wait(None)
            for w in exited:
                self._exited(w)
            if woken and self._signals():
                self._stop_workers()
                break
        if any(w.state is WorkerState.FAILED for w in self._group.workers):
            self._report_failure(will_restart=False)
            return self._finish(1, "failed")
        return self._finish(0, "succeeded")
