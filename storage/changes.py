"""Which keys of a table changed, and since when: the record that incremental snapshots and
replicas read (Monolith's touched-rows sync, without a message broker).

A table's `ChangeJournal` is a list of batches of keys, each numbered by a position that
grows by one per batch: the keys of a stored push, of a training lookup's new rows, of an
assign, a restore or an eviction's removals. It records keys only, never values: whoever
reads the changes since a position reads the rows as they are now, under the same table
lock that the writers held while they changed them and recorded the batch, so a reader that
moves its cursor to the journal's head has seen every change up to it, each at its newest.
Recording too much is harmless (a push that a refusal later undoes was recorded: its keys
are read again, unchanged); recording too little would lose an update, which is why the
table records inside the critical section that stores the rows.

A journal lives in memory, as long as its table object: a restart or a snapshot load makes a
new one, with a new id, and a cursor of another id is not valid here. Older batches merge
into one of their distinct keys (a cursor inside it is told a few keys too many); past
`max_keys` keys the oldest are let go, and a cursor older than what is held is not valid
either. A reader holding a cursor that is not valid starts over
from the whole table (a replica's resync, a full diff for an incremental snapshot).
"""

from __future__ import annotations

import bisect
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np

# 32 MiB of int64 keys a table at most: with merging (ChangeJournal), the distinct keys of
# a table changed since its oldest cursor; at 100,000 distinct key-updates a second, 40 s
DEFAULT_MAX_KEYS = 1 << 22
MAX_BATCHES = 4096  # then the oldest are merged: a follower's read stays short
MERGE_BATCHES = 64  # batches merged at a time: a merge's sort stays small


def _sorted_union(held: np.ndarray, more: np.ndarray) -> np.ndarray:
    """The sorted distinct keys of two sorted distinct arrays: more's new keys inserted into
    held in one pass (a sort of more alone, not of both)."""
    at = np.searchsorted(held, more)
    known = at < held.size
    known[known] = held[at[known]] == more[known]
    return np.insert(held, at[~known], more[~known])


@dataclass(frozen=True)
class Cursor:
    """A point in one table's journal: every change up to `position` of journal `journal`."""

    journal: str
    position: int

    def encoded(self) -> str:
        """`JOURNAL:POSITION`, as a snapshot header and the wire carry it."""
        return f"{self.journal}:{self.position}"

    @classmethod
    def decoded(cls, text: str) -> Cursor:
        journal, _, position = text.rpartition(":")
        if not journal or not position.isdigit():
            raise ValueError(f"expected a cursor JOURNAL:POSITION, got {text!r}")
        return cls(journal, int(position))


class ChangeJournal:
    """The keys a table changed, in batches numbered from 1 (0: before the first). Thread
    safe; the table records and reads it under its own lock (see the module's docstring).

    Bounded two ways, each step cheap (it runs inside a push, under the table lock). Past
    `max_batches` batches, the oldest MERGE_BATCHES are merged into one batch of their
    distinct keys (sorted), itself merged into the oldest merged batch by a sorted insert: a
    cursor inside the merged batch is told all of its keys, some changed before the cursor
    (more than needed, never less), and a journal of small batches holds at most the
    table's distinct changed keys. Past `max_keys` keys held, the oldest batches are let
    go (the merged one whole) and cursors before them are no longer valid."""

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS, max_batches: int = MAX_BATCHES) -> None:
        if max_keys < 1 or max_batches < 2:
            raise ValueError(
                f"max_keys expected >= 1 and max_batches >= 2, got {max_keys} and {max_batches}"
            )
        self.id = uuid.uuid4().hex
        self.max_keys = max_keys
        self.max_batches = max_batches
        self._lock = threading.Lock()
        # batches in position order: the last position each covers, when its first change
        # was recorded, its keys (a recorded batch covers one position, a merged one several)
        self._last: list[int] = []
        self._times: list[float] = []
        self._keys: list[np.ndarray] = []
        self._held = 0  # keys in _keys
        self._merged = False  # whether _keys[0] is a merged batch (sorted, distinct)
        self.head = 0  # the newest batch's position
        self.head_time = time.time()  # when it was recorded (the journal's start before one)
        self.oldest = 0  # a cursor at or after this position is valid

    def cursor(self) -> Cursor:
        """The cursor at the head: every change recorded so far."""
        with self._lock:
            return Cursor(self.id, self.head)

    def record(self, keys: np.ndarray) -> None:
        """Note that the rows of keys (int64, any order, repeats allowed; keys < 0 ignored)
        changed: stored, trained, assigned or removed. Call it where the rows changed, under
        the table lock, after the change is visible."""
        keys = np.asarray(keys, dtype=np.int64)
        if keys.size and keys.min() < 0:
            keys = keys[keys >= 0]
        if keys.size == 0:
            return
        keys = keys.copy()  # the caller's array may be a buffer it reuses
        with self._lock:
            self.head += 1
            self.head_time = time.time()
            self._last.append(self.head)
            self._times.append(self.head_time)
            self._keys.append(keys)
            self._held += keys.size
            while self._held > self.max_keys and len(self._keys) > 1:
                self.oldest = self._last.pop(0)
                self._times.pop(0)
                self._held -= self._keys.pop(0).size
                self._merged = False  # the merged batch, if any, was the oldest
            if len(self._keys) > self.max_batches:
                self._merge_oldest()

    def _merge_oldest(self) -> None:
        """The oldest MERGE_BATCHES batches after the merged one into it (or into a new
        merged batch): their distinct keys sorted, then inserted into the merged batch's in
        one pass over it."""
        start = 1 if self._merged else 0
        stop = min(len(self._keys) - 1, start + MERGE_BATCHES)  # the newest stays apart
        group = np.unique(np.concatenate(self._keys[start:stop]))
        first = 0 if self._merged else start
        replaced = sum(keys.size for keys in self._keys[first:stop])
        merged = _sorted_union(self._keys[0], group) if self._merged else group
        self._held += merged.size - replaced
        self._last[first:stop] = [self._last[stop - 1]]
        self._times[first:stop] = [self._times[first]]
        self._keys[first:stop] = [merged]
        self._merged = True

    def _answers(self, cursor: Cursor) -> bool:
        """Whether changes since cursor can be told (under the lock): same journal, not
        older than what is held, not beyond the head."""
        return cursor.journal == self.id and self.oldest <= cursor.position <= self.head

    def since(self, cursor: Cursor) -> tuple[np.ndarray, Cursor] | None:
        """(the distinct keys, ascending, changed after cursor; the cursor at the head), or
        None where cursor is not valid here (another journal, or older than what is held)."""
        with self._lock:
            if not self._answers(cursor):
                return None
            head = Cursor(self.id, self.head)
            if cursor.position == self.head:
                return np.empty(0, dtype=np.int64), head
            first = bisect.bisect_right(self._last, cursor.position)  # batches after cursor
            merged = self._keys[0] if first == 0 and self._merged else None
            picked = self._keys[first + (merged is not None) :]
        newer = np.unique(np.concatenate(picked)) if picked else np.empty(0, np.int64)
        return (newer if merged is None else _sorted_union(merged, newer)), head

    def time_of(self, position: int) -> float | None:
        """When the first change of the batch holding position was recorded (for a merged
        batch, its oldest change); None if not held."""
        with self._lock:
            index = bisect.bisect_left(self._last, position)
            if position > self.oldest and index < len(self._last):
                return self._times[index]
        return None

    def stats(self) -> dict[str, int | float | str]:
        with self._lock:
            return {
                "journal": self.id,
                "head": self.head,
                "head_time": self.head_time,
                "oldest": self.oldest,
                "keys_held": self._held,
                "batches": len(self._keys),
            }
