"""Pushes handed to a background sender before they are applied: a torch module's backward
at staleness 0 returns once its push is handed over (tierps.client.torch). The client's
later calls on the push's tables wait for it first, so that a call made after backward sees
its push as it did when backward applied the push itself; the senders' own threads skip the
wait, as each sends its calls in the order they were handed over."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for

_SENDER = threading.local()  # .sends: this thread is a background sender


def mark_sender_thread() -> None:
    """Mark the calling thread as a background sender (a ThreadPoolExecutor's initializer):
    its calls wait for no push in flight (it sends them in order itself)."""
    _SENDER.sends = True


class PushesInFlight:
    """The pushes of a client handed to background senders and not done yet, by table."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_table: dict[str, set[Future[object]]] = {}

    def add(self, tables: Iterable[str], pushed: Future[object]) -> None:
        """A push to `tables` is in flight until `pushed` is done."""
        names = list(tables)
        with self._lock:
            for table in names:
                self._by_table.setdefault(table, set()).add(pushed)
        pushed.add_done_callback(lambda done: self._remove(names, done))

    def _remove(self, tables: list[str], pushed: Future[object]) -> None:
        with self._lock:
            for table in tables:
                futures = self._by_table.get(table)
                if futures is not None:
                    futures.discard(pushed)
                    if not futures:
                        del self._by_table[table]

    def wait(self, tables: Iterable[str] | None = None) -> None:
        """Wait until the pushes in flight to `tables` (None: to any table) are done, their
        failures left to their senders; at once on a sender's thread."""
        if getattr(_SENDER, "sends", False):
            return
        with self._lock:
            if not self._by_table:
                return
            names = self._by_table if tables is None else tables
            pending = {f for name in names for f in self._by_table.get(name, ())}
        if pending:
            wait_for(pending)
