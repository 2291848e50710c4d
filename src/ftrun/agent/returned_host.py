"""A lost store host that comes back with the job's command: one store, one job.

Kubernetes recreates a lost pod under its name and command (with a new address, its name following it); SLURM
requeues a node. The node that started again at the endpoint hosts a new, empty store there, while the
survivors train on the store one of them took over. The node hosting the job's store since then looks at the
endpoint every :data:`LOOK_EVERY_S`: a store of this job found there (another store than its own) is told where
the job's store is (``r/moved_to``), and the agents on it come to the job's store as newcomers
(:meth:`ftrun.rendezvous.driver.Rendezvous.next`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ftrun.errors import StoreError
from ftrun.rendezvous.records import Head, Keys, encode_head
from ftrun.store.base import Store
from ftrun.store.greeting import Greeting

# A recreated pod's agent waits a round's last call (30 s by default) before training alone in its own store:
# told within a second, it never does.
LOOK_EVERY_S = 0.5


class ReturnedHost:
    """``greet``: the greeting of whatever listens at the endpoint (OSError: nothing; StoreError: not a store);
    ``client``: a client of the store there."""

    def __init__(
        self,
        run_id: str,
        here: Head,
        store_id: str,
        greet: Callable[[], Greeting],
        client: Callable[[], Store],
        say: Callable[[str], None],
        endpoint: str,
    ) -> None:
        self._run_id = run_id
        self._here = here
        self._greet = greet
        self._client = client
        self._say = say
        self._endpoint = endpoint
        self._known = {store_id}  # this node's own store, and the stores told already
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ftrun-returned-host", daemon=True)

    def start(self) -> ReturnedHost:
        self._thread.start()
        return self

    def look(self) -> bool:
        """Tell a store of this job at the endpoint where the job's store is; whether one was told now."""
        try:
            greeting = self._greet()
        except (OSError, StoreError):
            return False  # nothing there yet, or something else (whoever starts there is told by its own checks)
        if greeting.job != self._run_id or greeting.store_id in self._known:
            return False
        try:
            store = self._client()
            try:
                store.put(Keys.of(self._run_id).moved_to, encode_head(self._here))
            finally:
                store.close()
        except (OSError, StoreError):
            return False  # looked at again in a moment
        self._known.add(greeting.store_id)
        self._say(
            f"a new store of this job is at the endpoint {self._endpoint} (the lost host's node started again with "
            f"the job's command): told it the job's store is here, on {self._here.node_id}; its agents join here"
        )
        return True

    def _watch(self) -> None:
        while not self._stop.wait(LOOK_EVERY_S):
            self.look()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
