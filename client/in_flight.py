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
    """The senders that hold or send pushes of a client, and each one's tables (weakly: a
    sender that is gone has sent its pushes, tierps.client.torch's finalizer). Kept by
    sender, not by table: a client has a sender or two, and a call asks about every table
    of a step (twice the tables of a push then lookup), so one pass over the senders costs
    less than one over a set of senders for each table."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # id(sender) -> (a weak reference to it, its tables)
        self._senders: dict[int, tuple[weakref.ref[PushSender], set[str]]] = {}

    def add(self, tables: Iterable[str], sender: PushSender) -> None:
        """`sender` holds or sends a push to `tables`."""
        with self._lock:
            known = self._senders.get(id(sender))
            if known is not None and known[0]() is sender:
                known[1].update(tables)
            else:  # a new sender, or a new one at a gone sender's address
                self._senders[id(sender)] = (weakref.ref(sender), set(tables))

    def wait(self, tables: Iterable[str] | None = None) -> None:
        """Have every sender of a push to `tables` (None: to any table) send and finish
        it; at once on a module's background thread."""
        if getattr(_SENDER, "sends", False):
            return
        with self._lock:
            if not self._senders:
                return
            names = None if tables is None else set(tables)
            senders = []
            for key, (reference, sent_to) in list(self._senders.items()):
                sender = reference()
                if sender is None:  # gone, its pushes sent
                    del self._senders[key]
                elif sent_to and (names is None or not names.isdisjoint(sent_to)):
                    senders.append(sender)
        for sender in senders:
            sender.wait_for_pushes()
