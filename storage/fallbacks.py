"""What answers a key that no stored tier holds: the fallbacks at the bottom of the cascade.

EmbeddingTable._gather walks its stored tiers (GPU, host, RocksDB), then hands the keys that
none of them holds to its fallbacks, in order. Each fallback answers some of the keys it is
given and passes the rest on; the last one, the Initializer, answers every key. Each answer
says where its rows came from (RowOrigin), and the cascade acts on the origin alone:

- a lookup promotes rows found below the top and, in training, stores rows of origin
  INITIALIZER;
- a push trains rows of origin TIER and INITIALIZER and stores them, trains the bucket rows
  of keys of origin BUCKET, and drops the gradients of keys of origin REFUSED.

So a lifecycle policy (admission, adaptive buckets, a test's "refuse keys above K") is one
class here with `answer`, `begin`, `commit` and `rollback`, put in the table's `fallbacks`
list; `_gather` does not change.

Example: a policy that keeps keys above K out, asked before the table's own fallbacks::

    class RefuseAbove(Stateless):  # no soft state: begin, commit, rollback do nothing
        def __init__(self, limit, width, default_value=0.0):
            self.limit, self.width, self.default_value = limit, width, default_value

        def answer(self, keys, *, sight):
            index = np.flatnonzero(keys > self.limit)
            rows = np.full((index.size, self.width), self.default_value, np.float32)
            return Answer(index, rows, np.full(index.size, RowOrigin.REFUSED, np.int8))

    table.fallbacks.insert(0, RefuseAbove(1000, table.config.stored_width))
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import NamedTuple, Protocol

import numpy as np

from tierps.storage.adaptive import BucketRows
from tierps.storage.admission import AdmissionFilter

# rows [n, stored_width] of int64 keys [n]: initial weights (or the given [n, dim]), fresh
# optimizer state, the table's current step as their last-update step
FreshRows = Callable[[np.ndarray, np.ndarray | None], np.ndarray]


class RowOrigin(IntEnum):
    """Where a row that the cascade gathered came from (int8 values in Gathered.origin)."""

    TIER = 0  # a stored tier; Gathered.level says which (0: the top)
    INITIALIZER = 1  # made now: initial (or its bucket's) weights, fresh optimizer state
    REFUSED = 2  # kept out by a policy (admission): default_value, never stored or trained
    BUCKET = 3  # its adaptive bucket's row: never stored; a push trains the bucket instead


class Answer(NamedTuple):
    """A fallback's answer for some of the keys it was asked about."""

    index: np.ndarray  # int64 [a]: positions, in the keys asked, of the keys answered
    rows: np.ndarray  # float32 [a, stored_width]: their rows
    origin: np.ndarray  # int8 [a]: each row's RowOrigin


class Gathered(NamedTuple):
    """What EmbeddingTable._gather returns for keys [n] (duplicates allowed)."""

    rows: np.ndarray  # float32 [n, stored_width]: copies, the caller may change them
    origin: np.ndarray  # int8 [n]: RowOrigin of each row
    level: np.ndarray  # int8 [n]: index into the table's tiers of a TIER row, else -1
    dirty: np.ndarray  # bool [n]: whether each row is newer than RocksDB's copy


class Fallback(Protocol):
    """Answers keys that no stored tier holds, or passes them on to the next fallback.

    `answer` may change soft state (sighting counts) only between `begin` and `commit`:
    the cascade calls `rollback` instead of `commit` when the call is refused or fails after
    its sightings (nothing is then changed)."""

    def answer(self, keys: np.ndarray, *, sight: bool) -> Answer:
        """Rows for some of int64 keys [n] >= 0 (duplicates allowed). sight: the call is a
        sighting of these keys (a training lookup or a push), not an evaluation lookup."""
        ...

    def begin(self) -> None: ...
    def commit(self) -> None: ...
    def rollback(self) -> None: ...


def _origins(count: int, origin: RowOrigin) -> np.ndarray:
    return np.full(count, int(origin), dtype=np.int8)  # int(): numpy is slow with an enum


class Stateless:
    """The sighting hooks of a fallback that keeps no soft state: nothing to begin, keep or
    undo."""

    def begin(self) -> None:
        return None

    def commit(self) -> None:
        return None

    def rollback(self) -> None:
        return None


class Counted:
    """The sighting hooks of a fallback whose soft state is one counter (an admission
    filter, the promotion counts): begin, commit and rollback are the counter's."""

    counter: AdmissionFilter

    def begin(self) -> None:
        self.counter.begin()

    def commit(self) -> None:
        self.counter.commit()

    def rollback(self) -> None:
        self.counter.rollback()


class Initializer(Stateless):
    """The last fallback: every key gets its initial row (a pure function of seed and key)."""

    def __init__(self, fresh: FreshRows) -> None:
        self.fresh = fresh

    def answer(self, keys: np.ndarray, *, sight: bool) -> Answer:
        index = np.arange(keys.size)
        return Answer(index, self.fresh(keys, None), _origins(keys.size, RowOrigin.INITIALIZER))


class Admission(Counted):
    """admit_after > 0: a key is passed on to the initializer only when this sighting admits
    it; the others read default_value (REFUSED). An evaluation lookup admits none."""

    def __init__(self, admission: AdmissionFilter, width: int, default_value: float) -> None:
        self.counter = admission
        self.width = width
        self.default_value = default_value

    def answer(self, keys: np.ndarray, *, sight: bool) -> Answer:
        admitted = self.counter.observe(keys) if sight else np.zeros(keys.size, dtype=bool)
        index = np.flatnonzero(~admitted)
        rows = np.full((index.size, self.width), self.default_value, dtype=np.float32)
        return Answer(index, rows, _origins(index.size, RowOrigin.REFUSED))


class Buckets(Counted):
    """Adaptive embedding (promote_after > 0): answers every key. A key not promoted by this
    sighting reads its bucket's row (BUCKET); a promoted one gets its own row now, from its
    bucket's current weights with fresh optimizer state (INITIALIZER). An evaluation lookup
    promotes none."""

    def __init__(self, buckets: BucketRows, width: int, fresh: FreshRows) -> None:
        self.buckets = buckets
        self.counter = buckets.counts
        self.width = width
        self.fresh = fresh

    def answer(self, keys: np.ndarray, *, sight: bool) -> Answer:
        promoted = self.buckets.observe(keys) if sight else np.zeros(keys.size, dtype=bool)
        row_width = self.buckets.config.row_width
        rows = np.zeros((keys.size, self.width), dtype=np.float32)
        origin = _origins(keys.size, RowOrigin.BUCKET)
        shared = ~promoted
        rows[shared, :row_width] = self.buckets.read(keys[shared])
        if promoted.any():
            weights = self.buckets.read(keys[promoted])[:, : self.buckets.config.dim]
            rows[promoted] = self.fresh(keys[promoted], weights)
            origin[promoted] = RowOrigin.INITIALIZER
        return Answer(np.arange(keys.size), rows, origin)
