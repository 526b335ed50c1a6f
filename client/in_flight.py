"""Pushes a client has been handed but not applied yet: a torch module's backward at
staleness 0 returns with its push held for the module's next lookup, or sent in its
background thread (tierps.client.torch). The client's later calls on the push's tables have
the module send and finish it first, so that a call made after backward sees its push as
it did when backward applied the push itself. A module's own background thread skips the
wait: it sends its calls in the order they were handed to it."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Protocol

_SENDER = threading.local()  # .sends: this thread is a module's background thread


def mark_sender_thread() -> None:
    """Mark the calling thread as a module's background thread (a ThreadPoolExecutor's
    initializer): its calls wait for no pending push, as it sends them in order itself."""
    _SENDER.sends = True


class PushSender(Protocol):
    """What holds or sends pushes for a client (a torch module)."""

    def wait_for_pushes(self) -> None:
        """Send a held push, and wait until the pushes in flight are done; their failures
        are the sender's to raise at its next call."""
        ...


class PendingPushes:
    """The senders that hold or send pushes of a client, by table (weakly: a sender that is
    gone has sent its pushes, tierps.client.torch's finalizer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_table: dict[str, weakref.WeakSet[PushSender]] = {}

    def add(self, tables: Iterable[str], sender: PushSender) -> None:
        """`sender` holds or sends a push to `tables`."""
        with self._lock:
            for table in tables:
                self._by_table.setdefault(table, weakref.WeakSet()).add(sender)

    def wait(self, tables: Iterable[str] | None = None) -> None:
        """Have every sender of a push to `tables` (None: to any table) send and finish
        it; at once on a module's background thread."""
        if getattr(_SENDER, "sends", False):
            return
        with self._lock:
            if not self._by_table:
                return
            names = list(self._by_table) if tables is None else tables
            senders = {s for name in names for s in self._by_table.get(name, ())}
        for sender in senders:
            sender.wait_for_pushes()
