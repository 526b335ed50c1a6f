"""The gate of a shard: many data calls at once, or one exclusive section (a snapshot cut, a
load, a drop) that sees no data call half done."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Gate:
    """Many data calls at once, or one exclusive section (a snapshot cut, a load, a drop).
    An exclusive waiter blocks new data calls, so it is never starved."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        """A data call's section: waits while an exclusive section runs or waits."""
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._cond.notify_all()

    def contended(self) -> bool:
        """Whether an exclusive section waits: long shared work (a background flush) should
        let go at its next chance, as new data calls already wait behind it. Read without
        the lock: a hint, and an int read is atomic."""
        return self._waiting > 0

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """A section alone: waits until every running data call has left."""
        with self._cond:
            self._waiting += 1
            while self._exclusive or self._active:
                self._cond.wait()
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
