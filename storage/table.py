"""One embedding table of one shard: the tier cascade.

This is the one place that walks the tiers. A lookup finds keys in the top tier, takes its
misses to the next, and so on; keys found nowhere get their initial row, a pure function of
(seed, key). Rows found below the top are promoted; whatever a tier cannot keep spills to
the tier below it. Updates run on the gathered rows and are stored back at the top.

Keys that no stored tier holds go to the table's fallbacks (storage/fallbacks.py): the
admission filter, the adaptive buckets and, last, the initializer, each answering some keys
and passing the rest on. Every gathered row carries its origin (RowOrigin: a tier, the
initializer, an admission refusal, a bucket), and lookup and apply_gradients act on the
origin alone. With an admission filter (admit_after > 0), the final misses of a training
lookup or a push are sighted by the filter: only the keys it admits get their initial row;
the others read default_value (REFUSED) and are neither stored nor trained.

With eviction (steps_to_live, min_l2_norm), `evict` removes stale or small rows from every
tier. A table's current step is the largest step pushed to it; with steps_to_live > 0 every
stored row carries its last-update step after its row_width slots (TableConfig.stored_width):
the step of the last push that updated it, or the current step when it was created by a
lookup, assigned or restored. The cascade alone reads and writes it; tiers move it as part of
the row. Rows stamped before the table's first push (step 0) count as updated at the first
step pushed (first_step), so a snapshot loaded into a new table does not age from step 0.

With adaptive embedding (hash_bucket_size, promote_after; storage/adaptive.py), the same last
step sights the final misses of a training lookup or a push in a counter: a key promoted now
gets its own row, initialised from its bucket row's current weights with fresh optimizer
state; the others read their bucket's row (BUCKET, never stored), and a push trains the
bucket rows with their summed gradients instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from tierps.core.codec import step_bits
from tierps.core.compiled import all_distinct, distinct_nonnegative
from tierps.core.config import TableConfig, WritePolicy
from tierps.core.errors import BackendError, InvalidArgumentError
from tierps.core.validation import (
    DEFAULT_MAX_STEP_LEAP,
    as_keys,
    as_out,
    as_rows,
    check_step,
    check_step_leap,
    first_non_finite,
)
from tierps.storage import fallbacks, host_kernels
from tierps.storage.adaptive import BucketRows
from tierps.storage.admission import CounterFilter, make_filter
from tierps.storage.changes import ChangeJournal, Cursor
from tierps.storage.fallbacks import Fallback, Gathered, RowOrigin
from tierps.storage.tiers import DurableTier, Spill, Tier

log = logging.getLogger(__name__)

DEFAULT_CHUNK_ROWS = 65536
FLUSH_CHUNK_BYTES = 4 << 20  # a flush moves dirty rows down in chunks of this size
Chunk = tuple[np.ndarray, np.ndarray]  # (keys [c], rows [c, row_width])


# RowOrigin's values as plain ints: numpy compares an array with an IntEnum member ~5x slower
_TIER, _INITIALIZER, _REFUSED, _BUCKET = (
    int(origin)
    for origin in (RowOrigin.TIER, RowOrigin.INITIALIZER, RowOrigin.REFUSED, RowOrigin.BUCKET)
)


def _where(mask: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """The rows of each array where mask is True; the arrays themselves (no copy) when it
    is True everywhere, as for a push whose keys all have rows."""
    if mask.all():
        return arrays
    return tuple(array[mask] for array in arrays)


class _Push:
    """A push, all or nothing (`with _Push(table, step) as push:`, under the table lock):
    entering moves the table's clock (eviction) and opens its fallbacks' sightings; leaving
    by an exception (a refusal, a failed store) runs the undos the body registered (rows
    trained in place, bucket rows) in reverse, rolls the sightings back and puts the clock
    back. A class, not a generator: a warm push's overhead is a few microseconds."""

    __slots__ = ("table", "step", "stamp", "undo", "clock", "initialized")

    def __init__(self, table: EmbeddingTable, step: int) -> None:
        self.table = table
        self.step = step
        self.stamp: int | None = None  # the last-update step of its rows (steps_to_live)
        self.undo: list[Callable[[], None]] = []  # run in reverse if the push fails

    def __enter__(self) -> _Push:
        table = self.table
        self.clock = table.current_step, table.first_step, table.leap_step
        self.initialized = table.initialized
        stamp = table._advance_clock(self.step)
        self.stamp = stamp if table.step_slots else None
        for fallback in table.fallbacks:
            fallback.begin()
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        table = self.table
        if kind is None:
            for fallback in table.fallbacks:
                fallback.commit()
            return
        try:
            for undo in reversed(self.undo):
                undo()
        finally:  # the soft state goes back even if an undo failed (a GPU error)
            for fallback in table.fallbacks:
                fallback.rollback()
            table.initialized = self.initialized
            table.current_step, table.first_step, table.leap_step = self.clock


class EmbeddingTable:
    """Rows of one table over an ordered list of tiers; the last one is durable and, after
    a flush, complete. Every public call is batched and thread-safe."""

    def __init__(
        self,
        config: TableConfig,
        tiers: list[Tier],
        *,
        where: str,
        buckets: BucketRows | None = None,
        max_step_leap: int = DEFAULT_MAX_STEP_LEAP,
    ) -> None:
        self.config = config
        self.tiers = tiers
        self.durable: DurableTier = tiers[-1]  # type: ignore[assignment]
        self.where = where  # "table 'x' on shard 0"
        self._lock = threading.RLock()
        # which life of these rows the store holds (store.Generation), set when it opens them
        self.generation: Any = None
        self.initialized = 0  # rows generated by the initializer (looked up or created)
        self.created = 0  # of those, rows stored
        self.spilled = 0  # rows a tier handed to the tier below
        # use_hashtable=False: rows are addressed by key, so keys must lie in [0, capacity)
        self.key_limit: int | None = None if config.use_hashtable else config.capacity
        # admit_after > 0: counts sightings of keys without a row (soft state: in memory only)
        self.admission = make_filter(config)
        self.lookups_default = 0  # looked-up keys (with repeats) answered with default_value
        self.gradients_dropped = 0  # distinct keys of pushes whose gradients were dropped
        # hash_bucket_size, promote_after > 0: shared bucket rows and the sighting counts of
        # keys without a row of their own (the store passes it with its durable column family)
        if buckets is None and config.promote_after:
            buckets = BucketRows(config)
        self.buckets = buckets if config.promote_after else None
        # what answers the keys no stored tier holds, in order (storage/fallbacks.py)
        self.fallbacks: list[Fallback] = []
        if self.admission is not None:
            self.fallbacks.append(
                fallbacks.Admission(self.admission, config.stored_width, config.default_value)
            )
        if self.buckets is not None:
            self.fallbacks.append(fallbacks.Buckets(self.buckets, config.stored_width, self._fresh))
        self.fallbacks.append(fallbacks.Initializer(self._fresh))
        # eviction: steps of pushes (0: none yet; the store keeps them across restarts)
        self.codec = config.codec  # the stored row's layout: weights, state, step stamp
        self.step_slots = self.codec.step_slots
        self.current_step = 0  # the largest step pushed (the clock)
        self.max_step_leap = max_step_leap  # how far one push may move it (0: no limit)
        self.first_step = 0  # the smallest step pushed
        self.evictions = 0  # evict calls that ran
        self.evicted_total = 0  # rows removed by them
        self.evicted_last = 0  # rows removed by the latest one
        # the keys whose rows changed, for incremental snapshots and replicas (changes.py)
        self.changes = ChangeJournal()

    # -- the cascade ---------------------------------------------------------------------

    def _gather(self, keys: np.ndarray, *, sight: bool = False, first: int = 0) -> Gathered:
        """Rows of keys [n] (duplicates allowed) and where each came from (Gathered): the
        stored tiers top down from tier `first` (those above have been asked), then the
        fallbacks (storage/fallbacks.py) for the keys that no tier holds, each answering
        some and passing the rest on; the last, the Initializer, answers all. `sight`: the
        call is a sighting of its final misses (a training lookup or a push)."""
        n = keys.size
        rows = np.empty((n, self.config.stored_width), dtype=np.float32)
        origin = np.zeros(n, dtype=np.int8)  # _TIER
        level = np.full(n, -1, dtype=np.int8)
        dirty = np.ones(n, dtype=bool)  # a row made now is newer than RocksDB's (none)
        pending = np.arange(n)
        for here, tier in enumerate(self.tiers[first:], start=first):
            if pending.size == 0:
                return Gathered(rows, origin, level, dirty)
            hit, found, found_dirty = tier.find(keys[pending])
            if hit.size == n:  # all found in one tier: keep its array as it is
                return Gathered(found, origin, np.full(n, here, np.int8), found_dirty)
            at = pending[hit]
            rows[at], level[at], dirty[at] = found, here, found_dirty
            pending = np.delete(pending, hit)
        for fallback in self.fallbacks:
            if pending.size == 0:
                break
            answer = fallback.answer(keys[pending], sight=sight)
            self.initialized += int(np.count_nonzero(answer.origin == _INITIALIZER))
            if answer.index.size == n:  # nothing was stored (a first touch): no copy
                return Gathered(answer.rows, answer.origin, level, dirty)
            at = pending[answer.index]
            rows[at], origin[at] = answer.rows, answer.origin
            pending = np.delete(pending, answer.index)
        return Gathered(rows, origin, level, dirty)

    def _fresh(self, keys: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        """Stored rows [n, stored_width] of keys: initial (or the given) weights, fresh
        optimizer state, and the current step as their last-update step."""
        rows = host_kernels.initial_rows(self.config, keys, weights)
        return self.codec.widen(rows, self.current_step)

    def _store(self, keys: np.ndarray, rows: np.ndarray, dirty: np.ndarray) -> None:
        """Put unique keys' rows in the top tier; what it cannot keep flows down. A
        write-through table writes the dirty rows to RocksDB first, as one atomic batch: if
        that fails, no tier has changed."""
        buckets = self.buckets
        if self.config.write_policy is WritePolicy.WRITE_THROUGH and (
            dirty.any() or (buckets is not None and buckets.dirty.any())
        ):
            # the bucket rows this push trained go in the same atomic batch as its rows
            trained = None if buckets is None else buckets.dirty_rows()
            self.durable.write(keys[dirty], rows[dirty], also=trained)
            if buckets is not None and trained is not None:
                buckets.dirty[trained[1]] = False
            try:
                self._place(Spill(keys, rows, np.zeros_like(dirty)), 0)
            except Exception as error:  # noqa: BLE001 - out of memory in a cache tier
                # RocksDB holds the rows: the call succeeded. A cache tier that could not
                # take them drops its older copies, so reads come from RocksDB.
                for tier in self.tiers[:-1]:
                    tier.remove(keys)
                log.warning("%s: rows written but not cached: %s", self.where, error)
            return
        self._place(Spill(keys, rows, dirty), 0)

    def _place(self, spill: Spill, level: int) -> None:
        """Store a spill in tier `level`. The tier hands what it cannot keep to the tiers
        below before it lets go of anything (Tier.insert), so a failed write below leaves
        every row where it was and raises."""
        if spill.keys.size == 0:
            return

        def below(rows: Spill) -> None:
            self._place(rows, level + 1)
            self.spilled += rows.keys.size

        self.tiers[level].insert(spill.keys, spill.rows, spill.dirty, below)

    # -- public calls ----------------------------------------------------------------------

    def check_key_range(self, keys: np.ndarray, call: str = "lookup") -> None:
        """Refuse (InvalidArgumentError) a key >= capacity of a table with
        use_hashtable=False, naming the first such key and its index; keys < 0 are padding
        and pass. Every public call runs this before anything changes; a caller checking
        several tables' batches before serving any may run it first."""
        if self.key_limit is None or keys.size == 0 or keys.max() < self.key_limit:
            return  # one pass in the usual case: every key in range
        beyond = keys >= self.key_limit
        if beyond.any():
            index = int(np.argmax(beyond))
            raise InvalidArgumentError(
                f"{self.where}: {call}: field 'keys' expected values in [0, {self.key_limit}) "
                f"(use_hashtable=False, capacity={self.key_limit}: rows are addressed by key; "
                f"keys < 0 are padding), got key {int(keys[index])} at index {index}"
            )

    def lookup(self, keys: Any, *, create: bool = True, out: Any = None) -> np.ndarray:
        """Weights float32 [n, dim] of keys (int64 [n], any integer array-like; duplicates
        allowed), in their order. Keys < 0 are padding and give zeros. create=True
        (training) stores rows for new keys; create=False (evaluation, serving) returns
        their initial values and stores nothing.

        out: where to write them, a writable C-contiguous float32 array [n, dim] (a view of
        a caller's reply buffer, say), returned; else a new array. The compiled host tier
        writes its hits straight into it; rows from below are copied in. A refused call
        (InvalidArgumentError) leaves it as it was; a failed one may leave it half written.

        Example (dim 4)::

            rows = table.lookup(np.array([7, -1, 7, 12]))  # float32 [4, 4]; rows[1] == 0

        With admission (admit_after > 0), a key without a row reads default_value in every
        element and nothing is stored for it, unless this call admits it: a training lookup
        is a sighting of each distinct such key (counted once however often it repeats), and
        the admit_after-th sighting gives the key its initial row, stored and returned.
        create=False lookups neither count nor admit.

        With adaptive embedding (promote_after > 0), a key without a row of its own reads
        its bucket's weights, unless this training lookup is its promote_after-th sighting:
        then it gets its own row, initialised from the bucket's current weights (fresh
        optimizer state), stored and returned. create=False lookups neither count nor
        promote."""
        keys = as_keys(f"{self.where}: lookup", keys)
        self.check_key_range(keys, "lookup")
        dim = self.config.dim
        given = out is not None
        if given:
            out = as_out(f"{self.where}: lookup", out, keys.size, dim)
        with self._lock:
            out, missed = self.tiers[0].find_into(keys, out, dim)
            if missed.size == 0:
                return out
            everything = missed.size == keys.size
            if everything and create and self._first_touch(keys, out):
                return out
            rows = self._lookup_rows(keys if everything else keys[missed], create, first=1)
        if everything and not given and rows.shape[1] == dim:  # e.g. a first touch: no copy
            return rows
        out[missed] = rows[:, :dim]
        return out

    def _first_touch(self, keys: np.ndarray, out: np.ndarray) -> bool:
        """A training lookup of keys >= 0 that the top tier holds none of (its find_into
        missed them all), done as _lookup_rows would do it without its rows array: the top
        tier makes the keys' initial rows where it stores them and writes their weights
        into out (Tier.insert_initial: no copy of a first touch's rows). Only when nothing
        but the initializer can answer and nothing evicts: the initializer is the only
        fallback (no admission, no buckets), write-back (write-through writes rows to
        RocksDB first), the keys are distinct, no tier below holds any of them
        (Tier.holds_none), and the top tier has room for every new row. Those tiers are
        then asked (find) as the cascade asks them, for their miss counts. False: it did
        not apply and nothing was done (the cascade then runs)."""
        top = self.tiers[0]
        if (
            len(self.fallbacks) != 1
            or type(self.fallbacks[0]) is not fallbacks.Initializer
            or self.config.write_policy is WritePolicy.WRITE_THROUGH
            or not top.can_insert_initial(keys.size)
            or not all(tier.holds_none(keys) for tier in self.tiers[1:])
            or not all_distinct(keys)
        ):
            return False
        for tier in self.tiers[1:]:
            hit, _, _ = tier.find(keys)
            if hit.size:  # holds_none said none: a tier that breaks its contract
                raise RuntimeError(
                    f"{self.where}: the {tier.name} tier holds {hit.size} of a first touch's "
                    f"keys after saying it held none (a bookkeeping error; nothing stored)"
                )
        stamp = step_bits(self.current_step) if self.step_slots else None
        top.insert_initial(keys, out, stamp)
        self.initialized += keys.size
        self.created += keys.size
        self.changes.record(keys)
        return True

    def peek(self, keys: Any) -> Gathered:
        """Full rows float32 [n, stored_width] of keys >= 0 (int64 [n]) as the tiers hold
        them now (weights, optimizer state, step stamp), with each row's RowOrigin: what an
        evaluation lookup would read, storing, promoting and sighting nothing (a tier's find
        still counts its hits and refreshes recency): read_stored, tests and debugging."""
        keys = as_keys(f"{self.where}: peek", keys)
        self.check_key_range(keys, "peek")
        with self._lock:
            initialized = self.initialized
            try:
                return self._gather(keys, sight=False)
            finally:
                self.initialized = initialized

    def _lookup_rows(self, keys: np.ndarray, create: bool, *, first: int = 0) -> np.ndarray:
        """lookup's rows [n, stored_width] of keys >= 0, under the table lock, from tier
        `first` down (the tiers above have been asked). Rows found below the top move up;
        in training, rows initialised now are stored, all or nothing: if storing fails,
        the call's sightings roll back and it raises. An evaluation lookup
        (create=False) that cannot move its rows up (a full disk under the evictions)
        still answers: it stores nothing, and nothing was let go of."""
        with self._sightings(create):
            rows, origin, level, dirty = self._gather(keys, sight=create, first=first)
            made = origin == _INITIALIZER
            promote = (level > 0) | made if create else level > 0
            created = 0
            if promote.any():
                if promote.all() and all_distinct(keys):  # e.g. a first touch: no copies
                    moved, moved_rows, moved_dirty = keys, rows, dirty
                    created = int(np.count_nonzero(made))
                else:
                    moved, first = np.unique(keys[promote], return_index=True)
                    picked = np.flatnonzero(promote)[first]
                    moved_rows, moved_dirty = rows[picked], dirty[picked]
                    created = int(np.count_nonzero(made[picked]))
                try:
                    self._store(moved, moved_rows, moved_dirty)
                except BackendError as error:
                    if create:
                        raise
                    log.warning(
                        "%s: lookup answered without caching its rows: %s", self.where, error
                    )
                if created:  # new rows; a promoted one did not change
                    self.changes.record(keys[made])
        self.created += created
        self.lookups_default += int(np.count_nonzero(origin == _REFUSED))
        if self.buckets is not None:
            self.buckets.lookups += int(np.count_nonzero(origin == _BUCKET))
        return rows

    def check_gradients(
        self, keys: Any, grads: Any, step: Any
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """(keys, grads, step) as apply_gradients takes them, or InvalidArgumentError: int64
        keys, finite gradients of the table's dim, a step in [1, 2**53) (MAX_STEP in
        core/validation.py) and at most max_step_leap past the table's clock
        (check_step_leap; the first push of a table, at clock 0, may start anywhere)."""
        where = f"{self.where}: apply_gradients"
        keys = as_keys(where, keys)
        self.check_key_range(keys, "apply_gradients")
        grads = as_rows(where, "grads", grads, keys.size, self.config.dim)
        step = check_step(where, step)
        check_step_leap(where, step, self.current_step, self.max_step_leap)
        return keys, grads, step

    # A leap held back by the eviction guard (_advance_clock): its step, 0 when none. Soft
    # state, like the admission counts: a restart forgets it.
    leap_step = 0

    def _advance_clock(self, step: int) -> int:
        """Move the table's clock for a push at `step`; returns the step its rows are
        stamped with. The eviction guard: with steps_to_live = L, a push L or more steps
        ahead of the clock (a leap; the first push of a table is none) would alone make
        every row it does not update stale, and the next evict would remove them all (a
        step of 10**12 once did). Its rows are trained and stamped with its step, but the
        clock stays until a later push at another step confirms the leap by leaping too,
        to within L of it; a push that does not leap forgets it. A push at the very step
        held back confirms nothing: the same step again (a repeated push, another worker
        of that step) is no sign that the trainer moved on. So one stray push, or one key
        pushed twice, cannot age a table, while a trainer that really moved on (a shard
        that got none of the table's keys for L pushes, or missed them while down) moves
        the clock at its next step. How far a push may leap at all is bounded before this
        runs (check_step_leap)."""
        self.first_step = min(self.first_step, step) if self.first_step else step
        limit = self.config.steps_to_live
        if limit and self.current_step and step - self.current_step >= limit:
            if not (self.leap_step and 0 < abs(step - self.leap_step) < limit):
                self.leap_step = step  # held back: the clock stays
                return step
        self.leap_step = 0
        self.current_step = max(self.current_step, step)
        return self.current_step

    def apply_gradients(self, keys: Any, grads: Any, step: int) -> int:
        """Run the table's optimizer on the rows of keys (int64 [n]) with grads (float32
        [n, dim], finite), wherever the rows live. Gradients of duplicate keys are summed
        first; keys < 0 are ignored; unseen keys are created. `step` (from 1) is the
        optimizer step, used by Adam's bias correction. Returns the number of distinct keys
        updated.

        Example (dim 4)::

            table.apply_gradients(np.array([7, 7, 12]), np.ones((3, 4), np.float32), step=1)
            # -> 2: key 7 trained with the gradient 2.0, key 12 with 1.0

        A push whose update would make any stored value non-finite (weights or optimizer
        state, a bucket row's too: Adam's v from a finite 1e20 gradient is inf in float32)
        is refused whole with InvalidArgumentError naming the first such key, and changes
        nothing: no row, no optimizer state, no admission or promotion count, not the
        table's step. So is a push whose step is out of bounds (check_gradients).

        With admission (admit_after > 0), a push is a sighting of each distinct key without
        a row; a key this sighting does not admit has its gradient dropped (not applied,
        counted in gradients_dropped); the admit_after-th sighting creates the key's initial
        row and applies this gradient to it. Keys with a row always train.

        With adaptive embedding (promote_after > 0), a push is likewise a sighting of each
        distinct key without a row of its own; the keys it does not promote train their
        bucket rows instead: the gradients of one bucket's keys are summed and the bucket
        gets one optimizer step. A key promoted by this push gets its own row from its
        bucket's weights before this push's bucket update, and this gradient trains that
        row. Keys trained through a bucket count in the returned number."""
        return self.apply_checked_gradients(*self.check_gradients(keys, grads, step))

    def apply_checked_gradients(self, keys: np.ndarray, grads: np.ndarray, step: int) -> int:
        """apply_gradients of what check_gradients returned: a caller that checks every
        batch of a call before applying any (the shard) checks each batch once. All or
        nothing: a refusal or a failure undoes every step (_Push)."""
        push = self.begin_push(step)
        try:
            updated = self.prepare_push(push, keys, grads)()
        except BaseException as error:
            self.end_push(push, error)
            raise
        self.end_push(push, None)
        return updated

    def begin_push(self, step: int) -> _Push:
        """The first of a push's three parts, for a caller that makes several tables' pushes
        one unit (the shard): take the table's lock in this thread and open the push (the
        clock moves, sightings open). Then prepare_push (on any thread: it takes no lock),
        its result's store(), and end_push in this thread, whatever happened."""
        self._lock.acquire()
        try:
            return _Push(self, step).__enter__()
        except BaseException:
            self._lock.release()
            raise

    def end_push(self, push: _Push, error: BaseException | None) -> None:
        """Close a push begun by begin_push: kept if error is None, else undone (rows
        trained in place, bucket rows, sightings, the clock); the lock is let go."""
        try:
            if error is None:
                push.__exit__(None, None, None)
            else:
                push.__exit__(type(error), error, error.__traceback__)
        finally:
            self._lock.release()

    def prepare_push(self, push: _Push, keys: np.ndarray, grads: np.ndarray) -> Callable[[], int]:
        """Everything of a push up to its store, under begin_push's lock: the updated rows
        computed on copies and checked (a value made non-finite is refused here, with
        InvalidArgumentError); what it changed already (rows trained in place, bucket rows)
        registered on the push's undo. Returns store(), which writes the rows and returns
        the distinct keys updated; until it runs, no stored row has changed.

        The picture: rows a top tier trains where they lie (GPU, compiled host) are trained there;
        the rest are gathered, split by origin, updated on copies and stored."""
        where = f"{self.where}: apply_gradients"
        step = push.step
        keys, grads = self._summed_by_key(keys, grads)
        pushed = keys  # what this push may change: recorded once stored (changes.py)
        keys, grads, resident = self._train_resident(where, push, keys, grads, step)
        if keys.size == 0:

            def trained_in_place() -> int:
                self.changes.record(pushed)
                return resident

            return trained_in_place
        gathered = self._gather(keys, sight=True)  # gather
        origin = gathered.origin  # split by origin
        own = (origin == _TIER) | (origin == _INITIALIZER)
        shared = origin == _BUCKET
        own_keys, own_grads, rows = _where(own, keys, grads, gathered.rows)
        rows = self._update(where, own_keys, own_grads, rows, step)  # update
        if push.stamp is not None:  # the clock's step, even for a push with an older one
            self.codec.stamp(rows, push.stamp)
        if shared.any():  # a write-through table writes them with the rows (_store)
            push.undo.append(self._train_buckets(where, keys[shared], grads[shared], step))

        def store() -> int:
            self._store(own_keys, rows, np.ones(own_keys.size, dtype=bool))  # store
            self.changes.record(pushed)
            self.gradients_dropped += int(np.count_nonzero(origin == _REFUSED))
            self.created += int(np.count_nonzero(origin == _INITIALIZER))
            return resident + int(np.count_nonzero(own | shared))

        return store

    def _summed_by_key(self, keys: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Distinct keys >= 0 and their summed gradients (keys < 0 dropped). Keys that are
        already distinct (the client dedups) keep their order and gradients as given."""
        if distinct_nonnegative(keys):  # the common case, told in one compiled call
            return keys, grads
        valid = keys >= 0
        if not valid.all():
            keys, grads = keys[valid], grads[valid]
        distinct = all_distinct(keys)  # None: not known without the sort below
        if not distinct:
            unique, inverse = np.unique(keys, return_inverse=True)
            distinct = unique.size == keys.size
        if distinct:
            return keys, grads
        # sum in order of arrival; 1-D np.add.at has a fast path that 2-D lacks (4x)
        dim = self.config.dim
        summed = np.zeros((unique.size, dim), dtype=np.float32)
        flat = (inverse[:, None] * dim + np.arange(dim)).reshape(-1)
        np.add.at(summed.reshape(-1), flat, grads.reshape(-1))
        return unique, summed

    def _update(
        self, where: str, keys: np.ndarray, grads: np.ndarray, rows: np.ndarray, step: int
    ) -> np.ndarray:
        """The optimizer on copies of stored rows [n, stored_width] of distinct keys, or
        InvalidArgumentError naming the first value it made non-finite (nothing changed)."""
        with np.errstate(over="ignore", invalid="ignore"):  # refused just below
            self.config.optimizer.apply(rows, grads, step)
        self._refuse_non_finite(where, keys, rows, step)
        return rows

    @contextmanager
    def _sightings(self, sight: bool = True) -> Iterator[None]:
        """A call's sightings (the fallbacks' soft state) and initialised rows: committed if
        the body returns, rolled back if it raises. sight=False: a call that sights nothing
        (an evaluation lookup)."""
        fallbacks = self.fallbacks if sight else []
        initialized = self.initialized
        for fallback in fallbacks:
            fallback.begin()
        try:
            yield
        except BaseException:
            for fallback in fallbacks:
                fallback.rollback()
            self.initialized = initialized
            raise
        for fallback in fallbacks:
            fallback.commit()

    def _train_buckets(
        self, where: str, keys: np.ndarray, grads: np.ndarray, step: int
    ) -> Callable[[], None]:
        """BucketRows.apply, put back and refused if a bucket row went non-finite; returns
        what puts the trained bucket rows back as they were (if storing the push's rows
        fails)."""
        buckets = self.buckets
        assert buckets is not None
        index = np.unique(buckets.of(keys))
        saved = buckets.rows[index], buckets.dirty[index], buckets.gradients, buckets.updates

        def put_back() -> None:
            buckets.rows[index], buckets.dirty[index] = saved[0], saved[1]
            buckets.gradients, buckets.updates = saved[2], saved[3]

        buckets.apply(keys, grads, step)
        try:
            self._refuse_non_finite(where, index, buckets.rows[index], step, bucket=True)
        except InvalidArgumentError:
            put_back()
            raise
        return put_back

    def _refuse_non_finite(
        self,
        where: str,
        keys: np.ndarray,
        rows: np.ndarray,
        step: int,
        *,
        bucket: bool = False,
    ) -> None:
        """InvalidArgumentError naming the first key (bucket: bucket index) whose updated
        row [n, >= row_width] holds a non-finite weight or optimizer state value (the step
        slots after row_width are int64 bits, not numbers)."""
        values = rows[:, : self.config.row_width]
        bad = first_non_finite(values)
        if bad is None:
            return
        row, column = bad
        what = f"bucket row {int(keys[row])}" if bucket else f"key {int(keys[row])}"
        part = "weights" if column < self.config.dim else "optimizer state"
        raise InvalidArgumentError(
            f"{where}: expected an update that keeps every stored value finite, got "
            f"{values[row, column]!r} in the {part} of {what} (column {column}) after "
            f"{type(self.config.optimizer).__name__} at step {step}; the gradients are too "
            f"large for float32 rows: the whole push is refused and nothing was changed"
        )

    def _train_resident(
        self, where: str, push: _Push, keys: np.ndarray, grads: np.ndarray, step: int
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Train the rows of distinct keys held by a top tier that trains in place (the GPU
        or compiled host tier's fused optimizer, rows not moved; its undo goes to the
        push). Returns the other keys, their gradients and how many were trained here;
        refuses (InvalidArgumentError, rows already put back) a value made non-finite. A
        write-through table does not train in place: each update must reach RocksDB."""
        top = self.tiers[0]
        if not top.trains_in_place or self.config.write_policy is WritePolicy.WRITE_THROUGH:
            return keys, grads, 0
        resident, undo, refused = top.train_resident(keys, grads, step, push.stamp)
        if refused is not None:
            self._refuse_non_finite(where, keys[resident], refused, step)
        if undo is not None:
            push.undo.append(undo)
        if resident.size == 0:
            return keys, grads, 0
        if resident.size == keys.size:  # all trained here (a warm cache): nothing left
            return keys[:0], grads[:0], int(resident.size)
        rest = np.ones(keys.size, dtype=bool)
        rest[resident] = False
        return keys[rest], grads[rest], int(resident.size)

    def check_values(self, keys: Any, values: Any) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) as assign takes them, or InvalidArgumentError."""
        where = f"{self.where}: assign"
        keys = as_keys(where, keys)
        self.check_key_range(keys, "assign")
        return keys, as_rows(where, "values", values, keys.size, self.config.dim)

    def assign(self, keys: Any, values: Any) -> int:
        """Set the weights of keys (int64 [n]) to values (float32 [n, dim]) and reset their
        optimizer state to its initial value.
        Where a key repeats, its last value wins; keys < 0 are ignored. Returns the number
        of distinct keys set."""
        return self.assign_checked(*self.check_values(keys, values))

    def assign_checked(self, keys: np.ndarray, values: np.ndarray) -> int:
        """assign of what check_values returned (checked once, as apply_checked_gradients)."""
        if keys.size and keys.min() >= 0 and all_distinct(keys):  # e.g. a replica's batch
            unique, weights = keys, values
        else:
            valid = np.flatnonzero(keys >= 0)[::-1]  # reversed: np.unique keeps the last
            unique, first = np.unique(keys[valid], return_index=True)
            weights = values[valid[first]]
        with self._lock:
            rows = self._fresh(unique, weights=weights)
            self._store(unique, rows, np.ones(unique.size, dtype=bool))
            self.changes.record(unique)
        return int(unique.size)

    def restore(self, keys: Any, rows: Any) -> None:
        """Store full rows (weights and optimizer state, [n, row_width]) of distinct keys as
        they are: how a snapshot is loaded. Their last-update step is the current step."""
        where = f"{self.where}: restore"
        keys = as_keys(where, keys)
        rows = as_rows(where, "rows", rows, keys.size, self.config.row_width)
        if np.unique(keys).size != keys.size or (keys.size and keys.min() < 0):
            raise InvalidArgumentError(f"{where}: keys expected distinct and >= 0")
        self.check_key_range(keys, "restore")
        with self._lock:
            rows = self.codec.widen(rows, self.current_step)
            self._store(keys, rows, np.ones(keys.size, dtype=bool))
            self.changes.record(keys)

    def flush(
        self,
        chunk_bytes: int = FLUSH_CHUNK_BYTES,
        pause_s: float = 0.0,
        stop: Callable[[], bool] | None = None,
    ) -> bool:
        """Write every row newer than RocksDB down to it (bucket rows included), in chunks of
        about chunk_bytes; True when done. Each chunk is written below and only then marked
        clean, under the table lock; the lock is let go between chunks, so data calls wait
        at most one chunk's write (a background flush passes small chunks). A row changed
        between chunks is simply dirty again and goes in a later flush. If a write fails,
        this raises and every row not yet written is still dirty where it was. pause_s:
        sleep this long between chunks, so that calls waiting for the lock get it (Python's
        locks are not fair: without a pause the flushing thread takes the lock again at
        once). stop: asked between chunks; if it says True, the flush returns False there,
        the rows not yet written still dirty (a background flush yields to a snapshot)."""
        chunk_rows = max(1, chunk_bytes // self.config.stored_bytes)
        with self._lock:
            if self.buckets is not None:
                self.buckets.flush()
        for level, tier in enumerate(self.tiers[:-1]):
            with self._lock:
                keys = tier.dirty_keys()
            for start in range(0, keys.size, chunk_rows):
                if stop is not None and stop():
                    return False
                with self._lock:
                    held, rows, handle = tier.dirty_rows(keys[start : start + chunk_rows])
                    self._place(Spill(held, rows, np.ones(held.size, dtype=bool)), level + 1)
                    tier.mark_clean(handle)
                if pause_s and not (stop is not None and stop()):
                    time.sleep(pause_s)
        return True

    def clock(self) -> tuple[int, int]:
        """(current_step, first_step), read under the table lock (a push moves them)."""
        with self._lock:
            return self.current_step, self.first_step

    def export(
        self, chunk_rows: int = DEFAULT_CHUNK_ROWS
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every stored row as (keys [c], rows [c, row_width]) chunks, weights and optimizer
        state side by side, in key order, as of the call: it flushes, then reads a RocksDB
        snapshot, so later updates do not show and the table stays usable meanwhile."""
        with self._lock:
            self.flush()
            chunks = self.durable.export(chunk_rows)
        if not self.step_slots:
            return chunks
        width = self.config.row_width
        return ((keys, np.ascontiguousarray(rows[:, :width])) for keys, rows in chunks)

    def export_stored(
        self, chunk_rows: int = DEFAULT_CHUNK_ROWS
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """export's chunks with each row's last-update step: (keys [c], rows [c,
        row_width], steps int64 [c], or None without steps_to_live), as of the call."""
        with self._lock:  # now, not at the first chunk: the cut is the call
            self.flush()
            chunks = self.durable.export(chunk_rows)
        width = self.config.row_width
        return (
            (
                keys,
                np.ascontiguousarray(rows[:, :width]),
                self.codec.steps(rows) if self.step_slots else None,
            )
            for keys, rows in chunks
        )

    def export_state(self) -> dict[str, Any]:
        """The training state a snapshot carries besides the rows, copied as of the call
        (take it in the same cut as export_stored): the step clock, the adaptive bucket
        rows and promotion counts, the admission counts (exact counter: [n, 3] int64 rows
        of key, count, latest call, with the counter's call clock; Bloom filter: its
        counters). Figures (sightings, lookups answered by buckets, ...) and the eviction
        guard's held-back leap are not training state and are not carried."""
        with self._lock:
            state: dict[str, Any] = {
                "current_step": int(self.current_step),
                "first_step": int(self.first_step),
            }
            if self.buckets is not None:
                state["buckets"] = self.buckets.rows.copy()
                state["promotion"] = self.buckets.counts.export_counts()
                state["promotion_calls"] = int(self.buckets.counts.calls)
            if self.admission is not None:
                if isinstance(self.admission, CounterFilter):
                    state["admission"] = self.admission.export_counts()
                    state["admission_calls"] = int(self.admission.calls)
                else:
                    state["admission"] = np.array(self.admission.counters)
        return state

    def restore_state(self, state: dict[str, Any]) -> None:
        """Put back what export_state gave (as a snapshot load resolved it for this shard):
        the step clock, and the admission and promotion counts (soft state, in memory).
        Bucket rows are not set here: a load stages them in the table's durable bucket
        column family, which the table reads when it opens."""
        with self._lock:
            self.current_step = int(state.get("current_step", 0))
            self.first_step = int(state.get("first_step", 0))
            self.leap_step = 0
            if self.buckets is not None and "promotion" in state:
                self.buckets.counts.import_counts(state["promotion"], state["promotion_calls"])
            if self.admission is not None and "admission" in state:
                if isinstance(self.admission, CounterFilter):
                    self.admission.import_counts(state["admission"], state["admission_calls"])
                else:
                    self.admission.import_counters(state["admission"])

    @property
    def evicts(self) -> bool:
        """Whether evict can remove anything: steps_to_live or min_l2_norm is set."""
        return bool(self.config.steps_to_live or self.config.min_l2_norm)

    def doomed(self, rows: np.ndarray) -> np.ndarray:
        """Which stored rows [n, stored_width] eviction removes now (bool [n]): stale ones
        (current_step - max(last-update step, first_step) >= steps_to_live) and those whose
        weights' L2 norm (in float64) is below min_l2_norm."""
        out = np.zeros(rows.shape[0], dtype=bool)
        if self.config.steps_to_live:
            updated = np.maximum(self.codec.steps(rows), self.first_step)
            out |= self.current_step - updated >= self.config.steps_to_live
        if self.config.min_l2_norm:
            weights = rows[:, : self.config.dim].astype(np.float64)
            out |= np.sqrt(np.einsum("ij,ij->i", weights, weights)) < self.config.min_l2_norm
        return out

    def evict(self, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> int:
        """Remove every row that `doomed` picks from every tier; returns how many. Flushes
        first, so RocksDB holds every row at its newest, then scans it in chunks (a RocksDB
        iterator opened now) and removes each chunk's doomed keys from each tier. A removed
        key reads its initial row again, as a key never seen. Calls on this table wait
        meanwhile. A table with neither steps_to_live nor min_l2_norm removes nothing (0)."""
        if not self.evicts:
            return 0
        removed = 0
        with self._lock:
            self.flush()
            for keys, rows in self.durable.export(chunk_rows):
                doomed = self.doomed(rows)
                if doomed.any():
                    gone = keys[doomed]
                    for tier in self.tiers:
                        tier.remove(gone)
                    self.changes.record(gone)
                    removed += gone.size
            self.evictions += 1
            self.evicted_total += removed
            self.evicted_last = removed
        return removed

    def remove(self, keys: Any) -> None:
        """Remove the rows of keys (int64 [n]; absent keys and keys < 0 are ignored) from
        every tier: they read their initial row again, as keys never seen. A replica's
        resync removes this way the rows its training shard no longer holds."""
        keys = as_keys(f"{self.where}: remove", keys)
        self.check_key_range(keys, "remove")
        keys = np.unique(keys[keys >= 0])
        if keys.size == 0:
            return
        with self._lock:
            for tier in self.tiers:
                tier.remove(keys)
            self.changes.record(keys)

    def cursor(self) -> Cursor:
        """The change journal's head: every change of this table so far (changes.py)."""
        with self._lock:
            return self.changes.cursor()

    def changed_since(self, cursor: Cursor) -> tuple[np.ndarray, Cursor] | None:
        """(the distinct keys, ascending, whose rows changed after cursor; the cursor that
        covers them), or None where this table's journal cannot tell (another journal: a
        restart or a load since; or older than the journal holds). Read their rows with
        read_stored: a row read after this call is at least as new as the change."""
        with self._lock:
            return self.changes.since(cursor)

    def read_stored(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the keys of distinct keys >= 0 that have a stored row, those rows float32
        [k, stored_width] as the tiers hold them now, the keys without one), storing,
        promoting and sighting nothing, as peek."""
        gathered = self.peek(keys)
        held = gathered.origin == _TIER
        return keys[held], gathered.rows[held], keys[~held]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            admission = None
            if self.admission is not None:
                admission = {
                    **self.admission.stats(),
                    "lookups_default": self.lookups_default,
                    "gradients_dropped": self.gradients_dropped,
                }
            eviction = None
            if self.evicts:
                eviction = {
                    "removed_total": self.evicted_total,
                    "last_removed": self.evicted_last,
                    "runs": self.evictions,
                    "current_step": self.current_step,
                    "first_step": self.first_step,
                }
            adaptive = None if self.buckets is None else self.buckets.stats()
            return {
                "name": self.config.name,
                "initialized": self.initialized,
                "created": self.created,
                "spilled": self.spilled,
                "tiers": {tier.name: tier.stats() for tier in self.tiers},
                "admission": admission,  # the filter's figures; None without one
                "eviction": eviction,  # None without steps_to_live or min_l2_norm
                "adaptive": adaptive,  # bucket figures; None without promote_after
            }

    def close(self) -> None:
        if self.buckets is not None:
            self.buckets.close()
        for tier in self.tiers:
            tier.close()
