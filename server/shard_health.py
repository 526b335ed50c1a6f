"""Whether a shard serves: not while a snapshot load swaps its tables in, nor while its store
cannot write; every change is told to one listener (the daemon wires it to gRPC health)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tierps.storage import EmbeddingStore

log = logging.getLogger("tierps.server")


class ShardHealth:
    """The serving state of the shard at `where` over `store`, told to on_serving_change."""

    def __init__(self, where: str, store: EmbeddingStore) -> None:
        self.where = where
        self.store = store
        # Told whether the shard serves: False while a snapshot loads or while the store
        # cannot write; the server wires it to health.
        self.on_serving_change: Callable[[bool], None] = lambda serving: None
        self._loading = False
        self._store_ok = True
        self._serving = True
        self._publish_lock = threading.Lock()  # one health change at a time, in order

    def set_store_ok(self, ok: bool) -> None:
        """Whether the store can write, as the maintenance thread last found it."""
        self._store_ok = ok
        self._publish()

    def set_loading(self, loading: bool) -> None:
        """Whether a load swaps tables in now (data calls wait meanwhile)."""
        self._loading = loading
        self._publish()

    def publish_serving(self) -> None:
        """Tell on_serving_change the state now: SERVING if the store can write and no
        load runs (a server starting up; later changes are told as they happen)."""
        with self._publish_lock:
            self._store_ok = self.store.writable  # now, not as of the last maintenance tick
            self._serving = self._store_ok and not self._loading
            self.on_serving_change(self._serving)

    def _publish(self) -> None:
        with self._publish_lock:
            serving = self._store_ok and not self._loading
            if serving != self._serving:
                self._serving = serving
                if not self._store_ok:
                    log.warning(
                        "%s: its store cannot write: %s", self.where, self.store.write_state.failure
                    )
                self.on_serving_change(serving)
