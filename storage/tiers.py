"""The tier interface and the memory tiers: CacheTier (rows addressed through a hash table,
within a byte budget: the host tier on numpy, the GPU tier on cupy) and DirectTier (row i
holds key i, for use_hashtable=False).

Every tier speaks the same batched calls over arrays (HugeCTR's parameter server keeps one
backend interface the same way). Rows are full width: weights and optimizer state together,
and with steps_to_live > 0 the row's last-update step after them (TableConfig.stored_width):
tiers move rows as opaque float32 slots and never look inside.

- find(keys) -> (hit, rows, dirty): indices into keys of the hits, their rows, and whether
  each is newer than RocksDB. A miss is not an error; a backend failure is.
- find_into(keys, out, width) -> (out, missed): a lookup's find, the rows' first `width`
  columns written into out (or a new array), padding keys (< 0) zeroed; the compiled host
  tier writes its hits straight in. Tier gives it over find to every tier.
- insert(keys, rows, dirty, below): store (or overwrite) rows. What the tier cannot keep -
  rows it must evict to make room and rows that do not fit - it hands to `below` (which
  places them in the tiers below) *before* it changes anything: a row is let go of only once
  the tier below holds it, and if `below` raises, this tier is as it was.
- remove(keys) -> int: drop the rows of these keys (absent ones are skipped); returns how
  many were dropped. Eviction (steps_to_live, min_l2_norm) runs it on every tier.
- contains(keys) -> bool [n]: whether each key's row is held here, touching nothing.
- dirty_keys() -> keys of the rows newer than the tier below; dirty_rows(keys) -> (keys,
  rows, handle): those of `keys` still here and dirty, with their rows now; mark_clean(handle)
  after the caller has stored them below (under the same table lock, so nothing changed them
  in between). A flush walks a table's dirty keys in chunks this way, and releases the table
  lock between chunks.
- stats() -> dict; close().

Calls take and return numpy arrays whatever a tier keeps its rows in: the GPU tier moves keys
and rows across itself. The interface is declared (the ABC Tier); its optional capabilities:
- a tier whose trains_in_place is True implements train_resident (keys, grads, step, stamp)
  -> (indices of the keys whose rows it trained where they lie, an undo of that, the trained
  rows if a value went non-finite);
- a tier whose can_insert_initial(n) is True implements insert_initial(keys, out, stamp): a
  first touch's initial rows made where it stores them, their weights copied into out (the
  compiled host tier; see EmbeddingTable._first_touch);
- holds_none(keys) -> bool: True only if it knows, reading no row, that it holds none of
  keys (RocksDB from the range of keys it was ever written); False by default.

The last tier is durable (DurableTier): it also writes rows directly and exports them all.

"Dirty" means "newer than the copy in RocksDB": a clean row may be dropped by any cache tier.
"""

from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from tierps.core.codec import step_bits
from tierps.core.config import TableConfig
from tierps.core.xp import to_host
from tierps.storage import host_kernels
from tierps.storage.hash_table import HashTable

_INITIAL_ROWS = 1024
ARENA_GROWTH = 4  # a host arena's capacity grows this many times at a step (see _grow)
_DIRTY_FLAG_BYTES = 1
_FREE_LIST_BYTES = 8
SCRATCH_SHRINK_CALLS = 64  # see Scratch
# Linux's madvise advice to fault pages in for writing (5.14+); Python's mmap module names
# it only where it was built against headers that have it.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


@dataclass
class Spill:
    """Rows a tier hands to the tier below: evicted or not fitting."""

    keys: np.ndarray
    rows: np.ndarray
    dirty: np.ndarray

    @classmethod
    def empty(cls, width: int) -> Spill:
        return cls(np.empty(0, np.int64), np.empty((0, width), np.float32), np.empty(0, bool))

    @classmethod
    def concat(cls, parts: list[Spill]) -> Spill:
        return cls(
            np.concatenate([p.keys for p in parts]),
            np.concatenate([p.rows for p in parts]),
            np.concatenate([p.dirty for p in parts]),
        )


HandDown = Callable[[Spill], None]  # places a spill in the tiers below, or raises


class Tier(ABC):
    """A tier of one table's rows (see the module docstring for each call's contract)."""

    name: str

    @abstractmethod
    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...
    @abstractmethod
    def insert(
        self, keys: np.ndarray, rows: np.ndarray, dirty: np.ndarray, below: HandDown
    ) -> None: ...
    @abstractmethod
    def remove(self, keys: np.ndarray) -> int: ...
    @abstractmethod
    def contains(self, keys: np.ndarray) -> np.ndarray:
        """bool [n]: whether each key's row is held here (no hit counted, nothing touched)."""

    @abstractmethod
    def dirty_keys(self) -> np.ndarray: ...
    @abstractmethod
    def dirty_rows(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, Any]: ...
    @abstractmethod
    def mark_clean(self, handle: Any) -> None: ...
    @abstractmethod
    def stats(self) -> dict[str, int]: ...
    @abstractmethod
    def close(self) -> None: ...

    def find_into(
        self, keys: np.ndarray, out: np.ndarray | None, width: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """A lookup's find: (out, missed). out[i] = the first `width` columns of the row of
        keys[i] for each key held here, zeros where keys[i] < 0 (padding), left as it was
        for the others, whose indices are `missed` (keys >= 0 not held here). out: a
        float32 [n, width] array to write into, or None for a new one (a tier may then
        give its own array). Hits and misses count as in find. This one runs find and
        copies, except where no out is given and every key is held: then it gives find's
        rows themselves (no copy where `width` is the whole row; e.g. a table with RocksDB
        alone); a tier may write the rows straight in."""
        valid = keys >= 0
        everything = bool(valid.all())
        live = None if everything else np.flatnonzero(valid)
        hit, rows, _ = self.find(keys if live is None else keys[live])
        if out is None and live is None and hit.size == keys.size:
            return np.ascontiguousarray(rows[:, :width]), np.empty(0, dtype=np.int64)
        if out is None:
            out = np.empty((keys.size, width), dtype=np.float32)
        if live is not None:
            out[~valid] = 0
            hit = live[hit]
        out[hit] = rows[:, :width]
        missed = valid.copy() if live is not None else np.ones(keys.size, dtype=bool)
        missed[hit] = False
        return out, np.flatnonzero(missed)

    @property
    def trains_in_place(self) -> bool:
        """Whether train_resident runs the optimizer on rows where they lie (a capability:
        False unless a tier overrides both)."""
        return False

    def holds_none(self, keys: np.ndarray) -> bool:
        """True only if none of keys is held here, known without reading a row and
        touching nothing (a first touch asks the tiers below this way: see
        EmbeddingTable.lookup). False: some may be; this one does not know."""
        return False

    def can_insert_initial(self, count: int) -> bool:
        """Whether insert_initial can store `count` new keys' rows now, with no eviction
        (a capability: False unless a tier overrides both)."""
        return False

    def insert_initial(self, keys: np.ndarray, out: np.ndarray, stamp: np.ndarray | None) -> None:
        """Store the initial rows of distinct keys none of which is held here, made where
        they are stored, as dirty; their weights also into out [n, dim] (a copy). See
        CacheTier.insert_initial; only where can_insert_initial(keys.size)."""
        raise NotImplementedError(f"the {self.name} tier does not make rows in place")

    def train_resident(
        self, keys: np.ndarray, grads: np.ndarray, step: int, stamp: int | None
    ) -> tuple[np.ndarray, Callable[[], None] | None, np.ndarray | None]:
        """See CacheTier.train_resident; only a tier whose trains_in_place is True has it."""
        raise NotImplementedError(f"the {self.name} tier does not train rows in place")


class DurableTier(Tier):
    """The bottom tier: holds every row after a flush."""

    @abstractmethod
    def write(self, keys: np.ndarray, rows: np.ndarray) -> None: ...
    @abstractmethod
    def export(self, chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]: ...


def host_rows_for_budget(budget_bytes: int, row_bytes: int, max_load: float = 0.5) -> int:
    """The most rows whose arena, dirty flags, free list and hash index fit in the budget."""

    def cost(rows: int) -> int:
        per_row = row_bytes + _DIRTY_FLAG_BYTES + _FREE_LIST_BYTES
        return rows * per_row + HashTable.nbytes_for(rows, max_load)

    low, high = 0, budget_bytes // row_bytes + 1  # cost(low) <= budget < cost(high)
    if cost(low) > budget_bytes:
        return 0
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if cost(mid) <= budget_bytes else (low, mid)
    return low


class MappedArena:
    """A host arena's memory: float32 rows of `width` in an anonymous private mapping.
    Its pages are zero and take memory only when first written, so capacity above the rows
    in use is address space, not memory. It grows in place (mremap): the rows in use are
    neither copied nor zeroed again, and never held twice. Page-aligned, so a row of 64
    bytes is one cache line, not two (a numpy array starts 16 bytes into one): host
    lookups at dim 16 measured 1.6x faster. Huge pages follow the system's policy: no
    MADV_HUGEPAGE. On the development VM (THP on madvise) advising them made a fresh
    process's first touch of 1M keys 1.2-2.3x slower (their faults cost 3-4x the system
    time of small pages' there) and lookups of 1M resident rows 1.2-1.6x faster (768 MB
    arena: 110 -> 70 ms; fewer TLB misses); on a THP=always system rows get them anyway."""

    def __init__(self, rows: int, width: int) -> None:
        self.width = width
        self.rows = rows
        self._map = self._mapping(rows)

    def _mapping(self, rows: int) -> mmap.mmap:
        size = max(rows * self.width * 4, mmap.PAGESIZE)  # a mapping is never empty
        try:
            mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as error:
            raise MemoryError(f"host arena of {rows} rows ({size} bytes): {error}") from error
        return mapping

    def view(self) -> np.ndarray:
        """The rows as a float32 [rows, width] array (writable; page-aligned)."""
        count = self.rows * self.width
        return np.frombuffer(self._map, np.float32, count=count).reshape(self.rows, self.width)

    def populate(self, start: int, stop: int) -> None:
        """Fault in rows [start, stop) for writing in one call (MADV_POPULATE_WRITE), before
        a block of new rows is copied in: a first touch of 1M rows of 768 bytes spent most
        of its time in one page fault per 4 KiB page, which the kernel then takes in one
        pass (781 MB: 0.43 -> 0.31 s on the development VM). A hint: on a kernel without
        it (before Linux 5.14) or short of memory, the copy faults the pages in as before."""
        row_bytes = self.width * 4
        begin = start * row_bytes // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(stop * row_bytes, len(self._map))
        if end <= begin:
            return
        try:
            self._map.madvise(MADV_POPULATE_WRITE, begin, end - begin)
        except (OSError, ValueError):
            pass  # no such advice here, or no memory now: the copy's own faults decide

    def grow(self, rows: int, used: int) -> None:
        """Hold `rows` rows, keeping the first `used`. The caller drops its view first (a
        mapping viewed by an array cannot move); if another view is still alive, or the
        system has no mremap, the rows in use are copied to a new mapping instead. Out of
        memory raises MemoryError and leaves it as it was."""
        try:
            self._map.resize(max(rows * self.width * 4, mmap.PAGESIZE))
        except (BufferError, SystemError):
            old = self.view()
            mapping = self._mapping(rows)
            count = used * self.width
            np.frombuffer(mapping, np.float32, count=count)[:] = old[:used].reshape(-1)
            self._map = mapping
        except OSError as error:
            raise MemoryError(f"host arena grown to {rows} rows: {error}") from error
        self.rows = rows


def refused_rows(
    train: Callable[..., int],
    arena: np.ndarray,
    ids: np.ndarray,
    grads: np.ndarray,
    hyper: np.ndarray,
    size: int,
    width: int,
) -> np.ndarray:
    """A refused push's trained rows [n, width] for its refusal to name: the rows `ids` of
    the arena (put back already by the training loop) trained again on a copy by the same
    loop (`train`, host_kernels.fused_trainer's), so the same arithmetic, unchecked."""
    n = ids.shape[0]
    trained = np.take(arena, ids, axis=0)
    train(
        trained,
        np.arange(n),
        grads,
        hyper,
        size,
        False,
        np.empty((n, width), dtype=np.float32),  # the loop's saved values and flags: unused
        np.empty(n, dtype=bool),
        np.empty(0, np.float32),
        False,
        width,
        np.empty(n, dtype=bool),
    )
    return trained[:, :width]


class Scratch:
    """A tier's working rows for a push (train_resident's saved values; its contents are
    the caller's until its push ends), kept between pushes: fresh pages every push would be
    zeroed by the kernel first. Grown geometrically, never beyond `limit` floats but to a
    push's need; shrunk to twice the need after SCRATCH_SHRINK_CALLS calls in a row that use
    under a quarter of it. Working memory beside a tier's budget, as a numpy update's
    temporaries are (a tier's stats()["scratch_bytes"])."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buffer = np.empty(0, dtype=np.float32)  # cache-line aligned once grown
        self._small_calls = 0

    def rows(self, rows: int, width: int) -> np.ndarray:
        """A float32 [rows, width] view of the scratch."""
        need = rows * width
        have = self.buffer.size
        if need > have:
            grown = max(need, min(2 * have, self.limit))
            self.buffer = host_kernels.aligned_empty(grown, 1)[:, 0]
            self._small_calls = 0
        elif 4 * need < have:
            self._small_calls += 1
            if self._small_calls >= SCRATCH_SHRINK_CALLS:
                self.buffer = host_kernels.aligned_empty(2 * need, 1)[:, 0]
                self._small_calls = 0
        else:
            self._small_calls = 0
        return self.buffer[:need].reshape(rows, width)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)


class CacheTier(Tier):
    """Rows in one arena [rows, row_width], addressed through a HashTable, within a byte
    budget: the host tier (numpy, host_cache_bytes) and the GPU tier (cupy, gpu_cache_bytes)
    are this one class over two array modules.

    Calls take and return numpy arrays, as every tier's do; a GPU tier copies keys and rows
    to the device on the way in and found rows back on the way out, and keeps its index,
    arena, dirty flags and free list on the device. A host arena (MappedArena) grows with
    the rows it holds (see _grow), never beyond the rows the budget allows, so a table's
    memory is what its rows take whatever its budget; a GPU tier (on cupy, or
    preallocate=True) takes its whole budget when made. Freed rows are reused first. When
    full, the rows with the lowest LRU/LFU score spill to the tier below; rows of the batch
    being stored are never chosen.

    train_resident runs the optimizer in place on the rows held here (the GPU tier's fused
    update; see EmbeddingTable.apply_checked_gradients).
    """

    def __init__(
        self,
        config: TableConfig,
        budget_bytes: int,
        *,
        xp: ModuleType = np,
        name: str = "host",
        trains_in_place: bool = False,
        kernels: Any = None,
        preallocate: bool = False,
    ) -> None:
        self.xp = xp
        self.name = name
        self._trains_in_place = trains_in_place  # the cascade runs train_resident on it first
        self.config = config
        self.width = config.stored_width
        self.max_rows = host_rows_for_budget(budget_bytes, config.stored_bytes)
        # A device tier takes its whole budget now: out of memory shows when the table is
        # made, never in the middle of a call holding rows evicted but not yet handed down.
        whole = preallocate or xp is not np
        start = self.max_rows if whole else min(_INITIAL_ROWS, self.max_rows)
        # kernels as HashTable's: None runs the compiled GPU kernels on cupy (the array code
        # on numpy); a kernels.Launcher runs them through it (tests: a host build on numpy)
        self.index = HashTable(start, eviction=config.eviction, xp=xp, kernels=kernels)
        self._mapped = MappedArena(start, self.width) if xp is np else None
        self.arena = (
            self._mapped.view()
            if self._mapped is not None
            else xp.empty((start, self.width), dtype=xp.float32)
        )
        self.dirty = xp.zeros(start, dtype=bool)
        self._free = xp.empty(0, dtype=xp.int64)  # row ids released by eviction
        self._high = 0  # row ids >= _high were never used
        self._scratch = Scratch(self.max_rows * self.width)  # see _scratch_rows
        self.hits = 0
        self.misses = 0

    @property
    def rows(self) -> int:
        return self.index.size

    @property
    def trains_in_place(self) -> bool:
        return self._trains_in_place

    def _grow(self, rows: int) -> None:
        """Numpy only: a device tier is allocated whole and never grows. The arena's
        mapping grows in place (MappedArena: memory only for the rows written), so its
        capacity may run ahead of the rows: it grows ARENA_GROWTH times at a step, never
        beyond the budget's rows. The dirty flags (a byte a row) move to a new array,
        made first: if anything runs out of memory, the tier is as it was."""
        used = self._high
        dirty = np.zeros(rows, dtype=bool)
        dirty[:used] = self.dirty[:used]
        self.arena = None  # type: ignore[assignment]  # a viewed mapping cannot move
        try:
            self._mapped.grow(rows, used)
        finally:
            self.arena = self._mapped.view()
        self.dirty = dirty

    @property
    def compiled(self) -> bool:
        """Whether this is a host tier running the compiled host kernels."""
        return self.index.compiled_on_host

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        xp = self.xp
        if self.compiled:  # one pass: probe, copy the row and its flag, touch
            slots, rows, dirty, hits = self.index.lookup_rows(keys, self.arena, self.dirty)
            self.hits += hits
            self.misses += keys.size - hits
            if hits == keys.size:
                return np.arange(keys.size), rows, dirty
            hit = np.flatnonzero(slots >= 0)
            return hit, rows[hit], dirty[hit]
        keys_here = xp.asarray(keys)
        if self.index.uses_kernels:  # one kernel finds the slots and copies the rows out
            slots, rows = self.index.find_rows(keys_here, self.arena)
        else:
            slots, rows = self.index.find(keys_here), None
        hit = xp.flatnonzero(slots >= 0)
        everything = hit.size == keys.size
        self.hits += hit.size
        self.misses += keys.size - hit.size
        hit_slots = slots if everything else slots[hit]
        self.index.touch(hit_slots)
        ids = self.index.values[hit_slots]
        if rows is None:
            found = xp.take(self.arena, ids, axis=0)
        else:
            found = rows if everything else rows[hit]
        return to_host(hit), to_host(found), to_host(self.dirty[ids])

    def find_into(
        self, keys: np.ndarray, out: np.ndarray | None, width: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Tier.find_into; compiled on the host, in one pass that writes the rows' first
        `width` columns straight into out (no row array, no dirty flags read; a new out
        starts on a cache line, so that a large one is streamed)."""
        if not self.compiled:
            return super().find_into(keys, out, width)
        if out is None:
            out = host_kernels.aligned_empty(keys.size, width)
        missed, hits = self.index.lookup_into(keys, self.arena, out)
        self.hits += hits
        self.misses += missed.size
        return out, missed

    def insert(
        self, keys: np.ndarray, rows: np.ndarray, dirty: np.ndarray, below: HandDown
    ) -> None:
        """Store rows of unique keys; present keys are overwritten in place. Rows this tier
        cannot keep - the lowest-scored rows evicted to make room, and new rows beyond its
        capacity - go to `below` first; only when it returns does this tier let go of the
        victims and write the rows. If `below` raises, or an allocation before it fails (out
        of memory on a GPU), nothing here has changed. After `below` returns, the call only
        writes into arrays that exist: nothing there can run out of memory."""
        xp = self.xp
        keys, rows, dirty = xp.asarray(keys), xp.asarray(rows), xp.asarray(dirty)
        slots = self.index.find(keys)
        present = slots >= 0
        if bool(present.all()):  # an update of resident rows (a push): no masked copies
            ids = self.index.values[slots]
            self.arena[ids] = rows
            self.dirty[ids] = self.dirty[ids] | dirty  # see below: never cleared here
            self.index.touch(slots)
            return
        new = xp.flatnonzero(~present)
        room = self.max_rows - self.index.size
        victims = xp.empty(0, dtype=xp.int64)
        if new.size > room:
            victims = self.index.eviction_candidates(new.size - room, slots[present])
        fits = min(new.size, room + int(victims.size))
        placed, overflow = new[:fits], new[fits:]
        every = fits == keys.shape[0]  # all new and all kept (a first touch): no copies
        victim_ids = self.index.values[victims]
        spill = Spill.concat(
            [
                Spill(
                    to_host(self.index.keys_at(victims)),
                    to_host(xp.take(self.arena, victim_ids, axis=0)),
                    to_host(self.dirty[victim_ids]),
                ),
                Spill(to_host(keys[overflow]), to_host(rows[overflow]), to_host(dirty[overflow])),
            ]
        )
        # Everything that allocates runs now, before the hand-down, and is undone if it or
        # the hand-down fails: the index rebuild (if due; built without the victims), the
        # new keys' slots (the victims keep theirs until the tier below holds them), their
        # row ids (victims' ids among them: their rows are copied into the spill above).
        rebuilt = self.index.prepare_room(fits, leaving=victims)
        before = self.index.saved()
        new_slots = None
        try:
            if rebuilt is not None:
                self.index.install(rebuilt)  # the victims are not in it
            old_slots = self.index.find(keys[present]) if rebuilt is not None else slots[present]
            ids, at, free_after, high_after = self._take_rows(fits, victim_ids)
            new_slots = self.index.insert_absent(keys if every else keys[placed], room_made=True)
            self.index.values[new_slots] = ids
            self.index.touch(old_slots)
            self.index.touch(new_slots)
            present_ids = self.index.values[old_slots]
            # A clean row handed down equals the copy here (clean: "equal to the tier
            # below"), which may be dirty still, not yet in RocksDB (a flush between
            # levels): a dirty flag is cleared only by mark_clean, once written below.
            present_rows, present_dirty = rows[present], self.dirty[present_ids] | dirty[present]
            placed_rows, placed_dirty = (rows, dirty) if every else (rows[placed], dirty[placed])
            if spill.keys.size:
                below(spill)  # the tier below holds the spill now, or this raised
        except BaseException:
            if rebuilt is not None:
                self.index.restore(before)
            elif new_slots is not None:
                self.index.remove_slots(new_slots)
            raise
        if rebuilt is None and victims.size:
            self.index.remove_slots(victims)
        self.dirty[victim_ids] = False
        self._free, self._high = free_after, high_after
        self.arena[present_ids] = present_rows
        self.dirty[present_ids] = present_dirty
        if isinstance(at, slice) and self._mapped is not None:  # a block of never used rows
            self._mapped.populate(at.start, at.stop)
        self.arena[at] = placed_rows
        self.dirty[at] = placed_dirty

    def can_insert_initial(self, count: int) -> bool:
        return (
            self.compiled
            and self._mapped is not None
            and count <= self.max_rows - self.index.size
            and host_kernels.initializes_in_place(self.config)
        )

    def insert_initial(self, keys: np.ndarray, out: np.ndarray, stamp: np.ndarray | None) -> None:
        """insert(keys, initial rows, dirty) of keys that are distinct and not held here (a
        find since the last change said so), without the rows array: the compiled
        initializer writes each row straight into the arena row it gets (freed rows first,
        then never used ones, as insert) and its weights into out [n, dim]. A never used
        row is still zero, so its zero state slots are not written again; a freed one is
        written whole. `stamp`: the step slots' values (steps_to_live > 0), else None.
        Nothing is evicted (only where can_insert_initial), so nothing is handed down; if
        an allocation fails (the index's rebuild, the arena's growth), the tier is as it
        was. The rows, dirty flags and index end as insert would leave them."""
        count = keys.shape[0]
        nothing = np.empty(0, dtype=np.int64)
        rebuilt = self.index.prepare_room(count, leaving=nothing)
        before = self.index.saved()
        try:
            if rebuilt is not None:
                self.index.install(rebuilt)
            ids, at, free_after, high_after = self._take_rows(count, nothing)
            new_slots = self.index.insert_absent(keys, room_made=True)
        except BaseException:
            if rebuilt is not None:
                self.index.restore(before)
            raise
        self.index.values[new_slots] = ids
        self.index.touch(nothing)  # insert's touch of the keys present (none): same ticks
        self.index.touch(new_slots)
        fresh = self._high
        self._free, self._high = free_after, high_after
        if high_after > fresh:  # the never used rows, one block after the freed ones
            self._mapped.populate(fresh, high_after)
        host_kernels.initial_rows_into(self.config, keys, self.arena, ids, fresh, stamp, out)
        self.dirty[at] = True

    def _take_rows(self, count: int, freeing: Any) -> tuple[Any, Any, Any, int]:
        """Row ids for `count` new rows - freed ones first, then those of `freeing` (rows
        let go of by this call), then never used ones - as an array and as what indexes
        the arena at them (a slice where they are one run of never used rows, as on a
        first touch: the rows are then copied in one block), with the free list and the
        high mark after taking them; nothing changes until the caller assigns those two.
        A host arena grows now, if it must, never beyond max_rows."""
        xp = self.xp
        free = xp.concatenate([self._free, freeing]) if freeing.size else self._free
        reused = free[:count]
        fresh = count - int(reused.shape[0])
        high = self._high + fresh
        if high > self.max_rows:
            raise RuntimeError(
                f"tier '{self.name}': expected at most {self.max_rows} rows in use, the call "
                f"needs {high} (a bookkeeping error; nothing was changed)"
            )
        if high > self.arena.shape[0]:
            self._grow(min(self.max_rows, max(high, ARENA_GROWTH * self.arena.shape[0])))
        never_used = xp.arange(self._high, high, dtype=xp.int64)
        if reused.shape[0] == 0:
            return never_used, slice(self._high, high), free[count:], high
        ids = xp.concatenate([reused, never_used])
        return ids, ids, free[count:], high

    def train_resident(
        self, keys: np.ndarray, grads: np.ndarray, step: int, stamp: int | None
    ) -> tuple[np.ndarray, Callable[[], None] | None, np.ndarray | None]:
        """Run the table's optimizer on the rows of the (unique) keys held here, in place,
        and mark them dirty. Returns (hit, undo, refused):
        - hit: the indices into keys of those trained (the others are the cascade's);
        - undo: puts the trained rows back as they were, for the cascade to call if storing
          the other keys fails, or another table of the same push is refused (so a failed
          push changes no row); None when none trained;
        - refused: None, or if the update made any weight or optimizer state value
          non-finite, the trained rows [hit.size, row_width] on the host, for the cascade
          to name in its refusal; the rows are put back already (and undo is None).
        `stamp`: the last-update step written into the rows' trailing step slots
        (steps_to_live > 0), or None. Hits are counted; misses are left to the find the
        cascade runs next for the other keys, so each key counts once."""
        if self.compiled:
            fused = host_kernels.fused_key_trainer(self.config.optimizer, step)
            if fused is not None:
                return self._train_compiled(keys, grads, step, stamp, *fused)
        xp = self.xp
        resident = self._touch_resident(keys)
        if resident is None:
            return np.empty(0, dtype=np.int64), None, None
        hit, everything, ids = resident
        hit = to_host(hit)
        before, was_dirty = xp.take(self.arena, ids, axis=0), self.dirty[ids].copy()

        def undo() -> None:
            self.arena[ids] = before
            self.dirty[ids] = was_dirty

        resident_grads = xp.asarray(grads if everything else grads[hit])
        optimizer = self.config.optimizer
        if not self._fused_apply(ids, resident_grads, step):
            rows = xp.take(self.arena, ids, axis=0)  # the generic path: gather, apply, scatter
            with np.errstate(over="ignore", invalid="ignore"):  # non-finite: refused below
                optimizer.apply(rows, resident_grads, step)
            self.arena[ids] = rows
        width = self.config.row_width
        trained = self.arena[ids, :width]
        if not bool(xp.isfinite(trained).all()):
            refused = to_host(trained)
            undo()
            return hit, None, refused
        if stamp is not None:
            self.arena[ids, width:] = xp.asarray(step_bits(stamp))
        self.dirty[ids] = True
        return hit, undo, None

    def _touch_resident(self, keys: np.ndarray) -> tuple[Any, bool, Any] | None:
        """For train_resident: (positions in keys of the keys resident here, whether that is
        every key, their row ids), each hit counted and its eviction score touched; None
        when no key is resident."""
        if self.compiled:  # one pass over the index: find, touch, row ids
            ids, hits = self.index.resident_ids(keys)
            if hits == 0:
                return None
            self.hits += hits
            if hits == keys.size:
                return np.arange(keys.size), True, ids
            hit = np.flatnonzero(ids >= 0)
            return hit, False, ids[hit]
        slots = self.index.find(self.xp.asarray(keys))
        hit = self.xp.flatnonzero(slots >= 0)
        if hit.size == 0:
            return None
        self.hits += hit.size
        everything = hit.size == keys.size
        hit_slots = slots if everything else slots[hit]
        self.index.touch(hit_slots)
        return hit, everything, self.index.values[hit_slots]

    def _train_compiled(
        self,
        keys: np.ndarray,
        grads: np.ndarray,
        step: int,
        stamp: int | None,
        train_keys: Callable[..., tuple[int, int]],
        hyper: np.ndarray,
    ) -> tuple[np.ndarray, Callable[[], None] | None, np.ndarray | None]:
        """train_resident on the host in one compiled pass that finds each key's row in
        the index and trains it (`train_keys`, the optimizer's loop from
        host_kernels.fused_key_trainer): each row's new values are checked finite before
        they are written, and only the values the update touches (row_width floats per
        row, the step slots) are saved, so a non-finite one puts the rows written before
        it back. The saved values and dirty flags make the undo: the cascade's other keys,
        or another table of the same push, may still fail after the pass."""
        n = keys.shape[0]
        keys = np.ascontiguousarray(keys, np.int64)
        grads = np.ascontiguousarray(grads, np.float32)
        width = self.config.row_width
        size = self.config.optimizer.size_factor
        stamp_bits = step_bits(stamp) if stamp is not None else np.empty(0, np.float32)
        touched = width if stamp is None else self.width  # the step slots too
        # the saved values go to this tier's scratch (kept: fresh pages every push would
        # be zeroed by the kernel first); the undo that reads it runs within this push
        backup = self._scratch_rows(n, touched)
        was_dirty = np.empty(n, dtype=bool)
        ids = np.empty(n, dtype=np.int64)
        hits, bad = train_keys(
            *self.index.walk(),
            keys,
            self.arena,
            grads,
            hyper,
            size,
            backup,
            was_dirty,
            stamp_bits,
            stamp is not None,
            width,
            self.dirty,
            ids,
        )
        self.hits += hits
        if hits == 0:
            return np.empty(0, dtype=np.int64), None, None
        everything = hits == n
        hit = np.arange(n) if everything else np.flatnonzero(ids >= 0)
        trained_ids = ids if everything else ids[hit]
        if bad >= 0:  # put back already; the trained rows, same arithmetic, for the refusal
            train, _ = host_kernels.fused_trainer(self.config.optimizer, step)  # type: ignore[misc]
            refused = refused_rows(train, self.arena, trained_ids, grads[hit], hyper, size, width)
            return hit, None, refused
        saved, saved_dirty = backup[:hits], was_dirty[:hits]

        def undo() -> None:
            self.arena[trained_ids, :touched] = saved
            self.dirty[trained_ids] = saved_dirty

        return hit, undo, None

    def _scratch_rows(self, rows: int, width: int) -> np.ndarray:
        """A float32 [rows, width] view of this tier's Scratch, up to the arena's size;
        dropped by close."""
        return self._scratch.rows(rows, width)

    def _fused_apply(self, ids: Any, grads: Any, step: int) -> bool:
        """The optimizer as one CuPy RawKernel over the rows `ids`, where there is one for
        it (storage/kernels.py); False: use the generic array code."""
        launch = self.index.launcher
        if launch is None:  # numpy, kernels=False, or no compiled kernels
            return False
        from tierps.storage import kernels

        return kernels.fused_apply(
            self.config.optimizer, self.arena, ids, grads, step, launch=launch
        )

    def _release(self, slots: Any) -> None:
        """Erase the keys of these (unique, live) slots and free their rows for reuse."""
        ids = self.index.values[slots]
        self.index.remove_slots(slots)
        self.dirty[ids] = False
        self._free = self.xp.concatenate([self._free, ids])

    def remove(self, keys: np.ndarray) -> int:
        """Drop the rows of keys held here (dirty or not: the caller removes them below too)."""
        xp = self.xp
        slots = self.index.find(xp.asarray(keys))
        slots = xp.unique(slots[slots >= 0])
        self._release(slots)
        return int(slots.size)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        return to_host(self.index.find(self.xp.asarray(keys)) >= 0)

    def dirty_keys(self) -> np.ndarray:
        keys, ids = self.index.export()
        return to_host(keys[self.dirty[ids]])

    def dirty_rows(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, Any]:
        """Those of keys still here and dirty, their rows now, and their row ids."""
        xp = self.xp
        keys_here = xp.asarray(keys)
        slots = self.index.find(keys_here)
        held = xp.flatnonzero(slots >= 0)
        ids = self.index.values[slots[held]]
        dirty = self.dirty[ids]
        ids, held = ids[dirty], held[dirty]
        return to_host(keys_here[held]), to_host(xp.take(self.arena, ids, axis=0)), ids

    def mark_clean(self, handle: Any) -> None:
        self.dirty[handle] = False

    def stats(self) -> dict[str, int]:
        return {
            "rows": self.rows,
            "capacity_rows": self.max_rows,
            "bytes": self._arena_bytes() + int(self._free.nbytes) + self.index.nbytes,
            # working memory of pushes, beside the budget: at most the arena's size again
            "scratch_bytes": self._scratch.nbytes,
            "dirty_rows": int(self.xp.count_nonzero(self.dirty[: self._high])),
            "hits": self.hits,
            "misses": self.misses,
        }

    def _arena_bytes(self) -> int:
        """Memory the arena and its dirty flags take: all of it on a device (allocated
        whole); on the host their rows below the high mark, the only ones ever written
        (the capacity above it is address space only: see _grow)."""
        if self.xp is not np:
            return int(self.arena.nbytes + self.dirty.nbytes)
        return self._high * (self.width * self.arena.itemsize + self.dirty.itemsize)

    def close(self) -> None:
        """Drop the arrays: a GPU tier's memory returns to cupy's pool now, not at exit."""
        self.arena = self.dirty = self._free = self._scratch = None  # type: ignore[assignment]
        self.index = self._mapped = None  # type: ignore[assignment]


def direct_arena_bytes(capacity: int, row_bytes: int) -> int:
    """Bytes a DirectTier of `capacity` rows takes: the arena and two flags per row."""
    return capacity * (row_bytes + 2 * _DIRTY_FLAG_BYTES)


class DirectTier(Tier):
    """Rows of keys in [0, capacity), row i of a preallocated arena [capacity, row_width]
    holding key i: no hash table (SOK's use_hashtable=False).

    Two flag arrays, one byte per row, say which rows are present (found here) and which are
    dirty (newer than RocksDB). A row not present is a miss, taken by the cascade to RocksDB
    and then to the initializer, exactly as for the host tier, so initial values stay a pure
    function of (seed, key). Nothing is ever evicted: the tier holds every row it is given,
    and host_cache_bytes does not apply (the store bounds the arena when the table is made).
    The arena is a MappedArena (zero pages, page-aligned rows), so the memory of rows never
    touched is only reserved until a row on its page is written. Huge pages measured 8%
    less CPU a DeepFM call here and 1.35x faster pushes of 1M rows (fewer TLB misses over
    rows scattered by key), but their faults stalled a first touch up to 2x (compaction on
    this VM's THP=madvise): not advised, as for the host arena.

    Keys are not checked here: EmbeddingTable refuses keys outside [0, capacity) before a
    call reaches any tier.

    With the compiled host kernels (`compiled`), a key being its own row id, a push trains
    the present rows where they lie in one pass (host_kernels' training loop of the
    optimizer): no gather into a copy, no scatter back; and a lookup copies them straight
    into the reply (k_take_rows).
    """

    name = "direct"

    def __init__(self, config: TableConfig, *, compiled: bool = False) -> None:
        self.config = config
        self.compiled = compiled
        self.width = config.stored_width
        self.capacity = config.capacity
        try:
            self._mapped = MappedArena(self.capacity, self.width)  # zero, page-aligned rows
        except MemoryError as error:
            raise MemoryError(f"table {config.name!r}: direct tier: {error}") from None
        self.arena = self._mapped.view()
        self.present = np.zeros(self.capacity, dtype=bool)
        self.dirty = np.zeros(self.capacity, dtype=bool)
        self._scratch = Scratch(self.capacity * self.width)  # train_resident's saved values
        self.rows = 0  # present rows
        self.hits = 0
        self.misses = 0

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        present = self.present[keys]
        if present.all():  # the common case once warm: no masked copies
            hit, ids = np.arange(keys.size), keys
        else:
            hit = np.flatnonzero(present)
            ids = keys[hit]
        self.hits += hit.size
        self.misses += keys.size - hit.size
        return hit, np.take(self.arena, ids, axis=0), self.dirty[ids]

    def find_into(
        self, keys: np.ndarray, out: np.ndarray | None, width: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Tier.find_into; compiled, in one pass that writes the present rows' first
        `width` columns straight into out (no row array, no dirty flags read)."""
        if not self.compiled:
            return super().find_into(keys, out, width)
        if out is None:
            out = host_kernels.aligned_empty(keys.size, width)
        missed = np.empty(keys.size, dtype=np.int64)
        keys = np.ascontiguousarray(keys, np.int64)
        hits, listed = host_kernels.k_take_rows(self.arena, self.present, keys, out, missed)
        self.hits += hits
        self.misses += listed
        return out, missed[:listed]

    @property
    def trains_in_place(self) -> bool:
        return self.compiled

    def train_resident(
        self, keys: np.ndarray, grads: np.ndarray, step: int, stamp: int | None
    ) -> tuple[np.ndarray, Callable[[], None] | None, np.ndarray | None]:
        """CacheTier.train_resident for the present rows of (unique) keys, a key being its
        own row id: the optimizer's compiled loop trains them in place, each row checked
        finite before it is written (a non-finite value puts back the rows written before
        it), the values it touches saved for the undo. An optimizer without a compiled
        loop trains none here: the cascade's array code takes every key."""
        nothing = np.empty(0, dtype=np.int64), None, None
        fused = host_kernels.fused_trainer(self.config.optimizer, step)
        if fused is None or keys.size == 0:
            return nothing
        train, hyper = fused
        present = self.present[keys]
        if present.all():  # the common case once warm: no masked copies
            hit, ids = np.arange(keys.size), keys
        else:
            hit = np.flatnonzero(present)
            if hit.size == 0:
                return nothing
            ids, grads = keys[hit], grads[hit]
        self.hits += hit.size
        n = hit.size
        ids = np.ascontiguousarray(ids, np.int64)
        grads = np.ascontiguousarray(grads, np.float32)
        width, size = self.config.row_width, self.config.optimizer.size_factor
        stamp_bits = step_bits(stamp) if stamp is not None else np.empty(0, np.float32)
        touched = width if stamp is None else self.width  # the step slots too
        backup = self._scratch.rows(n, touched)
        was_dirty = np.empty(n, dtype=bool)
        bad = train(
            self.arena,
            ids,
            grads,
            hyper,
            size,
            True,
            backup,
            was_dirty,
            stamp_bits,
            stamp is not None,
            width,
            self.dirty,
        )
        if bad >= 0:  # put back already; the trained rows, same arithmetic, for the refusal
            return hit, None, refused_rows(train, self.arena, ids, grads, hyper, size, width)

        def undo() -> None:
            self.arena[ids, :touched] = backup
            self.dirty[ids] = was_dirty

        return hit, undo, None

    def insert(
        self, keys: np.ndarray, rows: np.ndarray, dirty: np.ndarray, below: HandDown
    ) -> None:
        """keys must be unique. Every row is kept: nothing is ever handed below."""
        self.rows += keys.size - int(np.count_nonzero(self.present[keys]))
        self.arena[keys] = rows
        self.present[keys] = True
        self.dirty[keys] |= dirty  # cleared only by mark_clean (see CacheTier.insert)

    def remove(self, keys: np.ndarray) -> int:
        """Mark the rows of keys absent (their arena rows are left as they are, unread)."""
        keys = np.unique(keys)
        keys = keys[self.present[keys]]
        self.present[keys] = False
        self.dirty[keys] = False
        self.rows -= keys.size
        return int(keys.size)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        return self.present[keys]

    def dirty_keys(self) -> np.ndarray:
        return np.flatnonzero(self.dirty).astype(np.int64)  # a key is its own row id

    def dirty_rows(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, Any]:
        keys = keys[self.dirty[keys]]
        return keys, np.take(self.arena, keys, axis=0), keys

    def mark_clean(self, handle: Any) -> None:
        self.dirty[handle] = False

    def stats(self) -> dict[str, int]:
        return {
            "rows": self.rows,
            "capacity_rows": self.capacity,
            "bytes": int(self.arena.nbytes + self.present.nbytes + self.dirty.nbytes),
            # working memory of pushes, beside the arena: at most its size again
            "scratch_bytes": self._scratch.nbytes,
            "dirty_rows": int(np.count_nonzero(self.dirty)),
            "hits": self.hits,
            "misses": self.misses,
        }

    def close(self) -> None:
        """Drop the arrays: the arena's mapping goes back to the system now, not at exit."""
        self.arena = self.present = self.dirty = None  # type: ignore[assignment]
        self._mapped = self._scratch = None  # type: ignore[assignment]
