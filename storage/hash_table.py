"""Open-addressing hash table from int64 keys to int64 values, vectorised over batches.

Written once against the array module `xp` (numpy on the host; the GPU tier runs the same
code on cupy). Linear probing over a power-of-two slot array; every probe round handles all
keys still searching at once, so there is no per-key Python loop on any path.

New keys are placed by a claim round: every key that reached a free slot scatters its batch
index into that slot, reads it back, and the one whose index survived wins (whichever write
won, on numpy or cupy). Keys that lost move on; copies of the winner's key inside the same
batch find their key in the slot and share it. Duplicates in a batch and distinct new keys
that hash to the same empty slot are therefore both resolved without sorting.

Erased keys leave tombstones, which probing walks past and claims reuse. Two limits keep
probes short without rebuilding on every batch that evicts: live keys stay at or below
max_load of the slots (beyond that the table grows), and live keys plus tombstones at or below
the midpoint between max_load and 1 (beyond that it rebuilds at its size, dropping the
tombstones). A cache that evicts k keys and inserts k per batch while full at max_load then
rebuilds at most once every (1 - max_load) / 2 * slots / k batches, O(1) amortised per key,
instead of on every batch.

On cupy, find, insert and the claim run as CUDA kernels (storage/kernels.py: one thread per
key, atomicCAS on the slot key) when they compile there; the array code below stays the
reference they are tested against, the host path, and the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from tierps.core.config import Eviction
from tierps.core.hashing import hash_keys
from tierps.storage import host_kernels
from tierps.storage import kernels as _kernels

EMPTY = np.iinfo(np.int64).min  # a slot never used since the last rehash
TOMBSTONE = EMPTY + 1  # a slot whose key was erased: probing continues past it
_MIN_SLOTS = 16
_NO_SLOTS = np.empty(0, dtype=np.int64)  # k_lookup's outputs a call does not ask for
_NO_FLAGS = np.empty(0, dtype=bool)


@dataclass
class Rebuilt:
    """A hash table's arrays rebuilt by HashTable.prepare_room, not yet installed."""

    keys: Any
    values: Any
    scores: Any
    size: int


def _tombstone_limit(max_load: float) -> float:
    """The share of slots live keys and tombstones may use together before a rebuild."""
    return (1.0 + max_load) / 2.0


def _slots_for(n: int, max_load: float) -> int:
    """The power-of-two slot count that holds n keys at or below max_load."""
    return max(_MIN_SLOTS, 1 << max(0, int(np.ceil(n / max_load)) - 1).bit_length())


def _launcher_for(xp: ModuleType) -> _kernels.Launcher | None:
    """The launcher for arrays of module xp: the cupy one for cupy, the compiled host
    kernels for numpy (storage/host_kernels.py; None where numba is missing or
    TIERPS_HOST_KERNELS=0: the numpy array code), without importing cupy for numpy."""
    return host_kernels.host_launcher() if xp is np else _kernels.cupy_launcher()


def _pick_kernels(xp: ModuleType, kernels: Any) -> _kernels.Launcher | None:
    """The kernel launcher a table uses, None for the array code (see HashTable)."""
    if kernels is None:
        return _launcher_for(xp)
    if kernels is False:
        return None
    if kernels is True:
        found = _launcher_for(xp)
        if found is None:
            source = host_kernels if xp is np else _kernels
            reason = source.unavailable_reason()
            raise RuntimeError(
                f"HashTable: field 'kernels' asked for the compiled kernels, but they are "
                f"unavailable: {reason}"
            )
        return found
    if callable(kernels):
        return kernels
    raise ValueError(
        f"HashTable: field 'kernels' expected None, True, False or a launcher, got {kernels!r}"
    )


class HashTable:
    """int64 key -> int64 value (a row id in the tier that owns the table), with an eviction
    score per key. Keys may be any int64 except EMPTY and TOMBSTONE (the two lowest).

    kernels: None (default) runs find, insert and the claim as kernels - CUDA when xp is cupy
    and they compile, numba (storage/host_kernels.py) on numpy unless TIERPS_HOST_KERNELS=0
    - else the array code; False always the array code; True the kernels or a RuntimeError;
    or a kernels.Launcher, used as given (the tests pass a host emulation of the CUDA
    kernels running over numpy arrays)."""

    def __init__(
        self,
        capacity: int = 1024,
        *,
        eviction: Eviction | str = Eviction.LRU,
        max_load: float = 0.5,
        xp: ModuleType = np,
        kernels: Any = None,
    ) -> None:
        if not 0.0 < max_load < 1.0:
            raise ValueError(f"HashTable: field 'max_load' expected in (0, 1), got {max_load}")
        self.xp = xp
        self._kernels = _pick_kernels(xp, kernels)
        self.eviction = Eviction(eviction)
        self.max_load = max_load
        self._size = 0  # live keys
        self._used = 0  # live keys + tombstones: what probing sees as occupied
        self._tick = 0  # LRU clock, one tick per touch call
        self.rebuilds = 0  # rehashes so far (growth or dropping tombstones): for tests, stats
        self._install(*self._allocate(_slots_for(capacity, max_load)))

    def _allocate(self, slots: int) -> tuple[Any, Any, Any]:
        """Empty (keys, values, scores) arrays of `slots` slots; the table is not changed.
        On the host they are the three columns of one [slots, 3] array: a lookup reads a
        slot's key and value and writes its score in one cache line, not three (about
        half of a hot lookup's random memory accesses). Same 24 bytes a slot; the array
        code and the kernels see three strided 1-D arrays. The GPU keeps three arrays:
        its kernels coalesce a warp's reads of one array, and so does a launcher given
        to the table (the tests' emulation of the GPU's kernels, over raw pointers)."""
        xp = self.xp
        if xp is np and (self._kernels is None or self.compiled_on_host):
            table = np.zeros((slots, 3), dtype=np.int64)
            table[:, 0] = EMPTY
            return table[:, 0], table[:, 1], table[:, 2]
        keys = xp.full(slots, EMPTY, dtype=xp.int64)
        values = xp.zeros(slots, dtype=xp.int64)  # the value of each slot's key
        scores = xp.zeros(slots, dtype=xp.int64)  # LRU: last touch tick; LFU: touches
        return keys, values, scores

    def _install(self, keys: Any, values: Any, scores: Any) -> None:
        self._keys, self.values, self._scores = keys, values, scores
        self._mask = keys.shape[0] - 1

    @property
    def size(self) -> int:
        """Number of live keys."""
        return self._size

    @property
    def slots(self) -> int:
        return self._mask + 1

    @property
    def tombstones(self) -> int:
        """Slots of erased keys not yet dropped by a rebuild."""
        return self._used - self._size

    def _fits(self, new_keys: int, leaving: int = 0) -> bool:
        """Whether new_keys more keys fit without a rehash, even if every one is new and takes
        an EMPTY slot: live keys within max_load, live keys and tombstones within the
        midpoint between max_load and 1 (see the module docstring); `leaving` live keys
        are erased before they come (their slots stay used, as tombstones)."""
        slots = self.slots
        return (
            self._size - leaving + new_keys <= self.max_load * slots
            and self._used + new_keys <= _tombstone_limit(self.max_load) * slots
        )

    @property
    def nbytes(self) -> int:
        return int(self._keys.nbytes + self.values.nbytes + self._scores.nbytes)

    @staticmethod
    def nbytes_for(capacity: int, max_load: float = 0.5) -> int:
        """Bytes a table sized for `capacity` keys takes (for budgets planned in advance)."""
        return 24 * _slots_for(capacity, max_load)

    def _home(self, keys: Any) -> Any:
        return (hash_keys(keys) & self.xp.uint64(self._mask)).astype(self.xp.int64)

    @property
    def uses_kernels(self) -> bool:
        """Whether find, insert and the claim run as kernels (else the array code)."""
        return self._kernels is not None

    @property
    def compiled_on_host(self) -> bool:
        """Whether find, insert and the claim run as the host's numba kernels."""
        return isinstance(self._kernels, host_kernels.NumbaLauncher)

    @property
    def launcher(self) -> _kernels.Launcher | None:
        """What runs the kernels of this table (None: the array code); a tier over the table
        runs its fused optimizer through the same."""
        return self._kernels

    def find(self, keys: Any) -> Any:
        """Slot of each key, -1 where absent. Slots stay valid until the next insert/erase."""
        if self._kernels is not None:
            return _kernels.find_slots(self._keys, self._mask, keys, launch=self._kernels)
        xp = self.xp
        # The first round runs over the whole batch without an index array: at load factor
        # 0.5 most keys end here, and the later rounds see only the rest.
        pos = self._home(keys)
        seen = self._keys[pos]
        hit = (seen == keys) & (keys > TOMBSTONE)
        slots = xp.where(hit, pos, -1)
        active = xp.nonzero(~hit & (seen != EMPTY) & (keys > TOMBSTONE))[0]
        probe_keys = keys[active]
        pos = (pos[active] + 1) & self._mask
        while active.size:
            seen = self._keys[pos]
            hit = seen == probe_keys
            slots[active[hit]] = pos[hit]
            going = ~hit & (seen != EMPTY)
            active, probe_keys = active[going], probe_keys[going]
            pos = (pos[going] + 1) & self._mask
        return slots

    def insert(self, keys: Any) -> tuple[Any, Any]:
        """Make every key present. Returns (slots, inserted): inserted[i] is True for exactly
        one occurrence of each key that was absent. The caller then sets
        `values[slots[inserted]]`. Growth may rehash: slots from earlier calls become stale."""
        xp = self.xp
        if keys.size and bool(xp.any(keys <= TOMBSTONE)):
            raise ValueError(
                f"HashTable: field 'keys' expected values > {TOMBSTONE} (the two lowest int64 "
                f"are reserved), got {int(keys.min())}"
            )
        if self._kernels is not None and self._fits(keys.shape[0]):
            # Room for every key even if all were new: find and claim in one kernel pass.
            slots, inserted, placed, empty = _kernels.upsert_slots(
                self._keys,
                self._mask,
                keys,
                scores=self._scores,
                score=self._new_score(),
                launch=self._kernels,
            )
            self._size += placed
            self._used += empty
            return slots, inserted
        slots = self.find(keys)
        missing = xp.nonzero(slots < 0)[0]
        inserted = xp.zeros(keys.shape[0], dtype=bool)
        if missing.size == 0:
            return slots, inserted
        if not self._fits(int(missing.size)):
            # Only now count distinct new keys (a sort): repeats must not inflate growth.
            if self._make_room(int(xp.unique(keys[missing]).size)):
                slots = self.find(keys)
        self._claim(keys, missing, slots, inserted)
        if self._kernels is None:  # the claim kernel set the new keys' scores
            self._reset_scores(slots[inserted])
        return slots, inserted

    def insert_absent(self, keys: Any, *, room_made: bool = False) -> Any:
        """Slots for keys known to be absent and unique (a find since the last change said
        so): insert without searching for them again. Returns their slots. room_made: the
        caller made room already (prepare_room, for after some keys leave): no rehash."""
        xp = self.xp
        if not room_made:
            self._make_room(keys.shape[0])
        slots = xp.full(keys.shape[0], -1, dtype=xp.int64)
        self._claim(keys, xp.arange(keys.shape[0]), slots, xp.zeros(keys.shape[0], bool))
        if self._kernels is None:  # the claim kernel set the new keys' scores
            self._reset_scores(slots)
        return slots

    def reserve(self, new_keys: int) -> bool:
        """Make room for new_keys more keys now (rehashing, growing if needed), so that the
        next insert of that many does not allocate; True if it rehashed. If the rehash fails
        (out of memory), it raises and the table is as it was."""
        return self._make_room(new_keys)

    def prepare_room(self, new_keys: int, leaving: Any) -> Rebuilt | None:
        """For an insert of new_keys keys after the keys in slots `leaving` (a cache's
        victims, kept until the tier below holds them) are erased: None if they will fit
        as the table is, else this table rebuilt without the leaving keys (and without
        tombstones) at the size that fits them all, for `install` to put in place once
        the victims are gone. Allocates now, changes nothing: an out-of-memory here leaves
        the table as it was."""
        if self._fits(new_keys, int(leaving.shape[0])):
            return None
        size = self._size - int(leaving.shape[0])
        return self._rebuilt(_slots_for(size + new_keys, self.max_load), leaving)

    def install(self, rebuilt: Rebuilt) -> None:
        """Put a table prepare_room built in place of this one (no allocation)."""
        self._install(rebuilt.keys, rebuilt.values, rebuilt.scores)
        self._size = self._used = rebuilt.size
        self.rebuilds += 1

    def saved(self) -> tuple[Any, ...]:
        """This table's state (its arrays by reference), for `restore` to put back after an
        `install` whose call failed."""
        return self._keys, self.values, self._scores, self._size, self._used, self.rebuilds

    def restore(self, state: tuple[Any, ...]) -> None:
        self._install(*state[:3])
        self._size, self._used, self.rebuilds = state[3], state[4], state[5]

    def _make_room(self, new_keys: int) -> bool:
        """Rehash so new_keys more fit (see _fits): at the size that holds the live keys and
        them under max_load, which is this size when only tombstones were in the way; True
        if it rehashed."""
        if self._fits(new_keys):
            return False
        self.install(self._rebuilt(_slots_for(self._size + new_keys, self.max_load)))
        return True

    def _new_score(self) -> int:
        """A new key's eviction score: now (LRU), or no touches yet (LFU)."""
        return self._tick if self.eviction is Eviction.LRU else 0

    def _reset_scores(self, slots: Any) -> None:
        self._scores[slots] = self._new_score()

    def _claim(self, keys: Any, todo: Any, slots: Any, inserted: Any) -> None:
        """Place keys[todo] (all absent) in free slots; fill slots[todo] and inserted. The
        kernel also sets the new keys' scores (the array code leaves that to the caller)."""
        xp = self.xp
        if self._kernels is not None:
            placed, empty = _kernels.claim_slots(
                self._keys,
                self._mask,
                keys,
                todo,
                slots,
                inserted,
                scores=self._scores,
                score=self._new_score(),
                launch=self._kernels,
            )
            self._size += placed
            self._used += empty
            return
        probe_keys = keys[todo]
        pos = self._home(probe_keys)
        while todo.size:
            seen = self._keys[pos]
            free = seen <= TOMBSTONE
            free_pos, free_idx = pos[free], todo[free]
            self.values[free_pos] = free_idx  # scratch: the slot's value is set by the caller
            won = self.values[free_pos] == free_idx
            won_pos, won_idx = free_pos[won], free_idx[won]
            self._used += int(xp.count_nonzero(self._keys[won_pos] == EMPTY))
            self._size += int(won_pos.size)
            self._keys[won_pos] = keys[won_idx]
            inserted[won_idx] = True
            placed = self._keys[pos] == probe_keys  # winners and their in-batch duplicates
            slots[todo[placed]] = pos[placed]
            going = ~placed
            todo, probe_keys = todo[going], probe_keys[going]
            pos = (pos[going] + 1) & self._mask

    def _rebuilt(self, slots: int, leaving: Any = None) -> Rebuilt:
        """This table's live keys (but those in slots `leaving`) with their values and
        scores, rebuilt into `slots` slots without tombstones. Exception-safe and leaves
        this table as it was: the new arrays are allocated and filled while the old ones
        are put aside, and put back whatever happens (out of memory on the GPU, a
        MemoryError on the host). On the host's compiled kernels, one pass over the slots
        (host_kernels.k_rehash) instead of the array code's gathers, claim and scatters."""
        xp = self.xp
        if self.compiled_on_host:
            return self._rebuilt_compiled(slots, leaving)
        old = (self._keys, self.values, self._scores, self._size, self._used)
        live = xp.nonzero(self._keys > TOMBSTONE)[0]
        if leaving is not None and leaving.shape[0]:
            live = live[~xp.isin(live, leaving)]
        keys, values, scores = self._keys[live], self.values[live], self._scores[live]
        fresh = self._allocate(slots)
        try:
            self._install(*fresh)
            self._size = self._used = 0
            new_slots = xp.full(keys.shape[0], -1, dtype=xp.int64)
            todo, inserted = xp.arange(keys.shape[0]), xp.zeros(keys.shape[0], bool)
            self._claim(keys, todo, new_slots, inserted)
            self.values[new_slots] = values
            self._scores[new_slots] = scores
            return Rebuilt(*fresh, size=int(keys.shape[0]))
        finally:
            self._install(*old[:3])
            self._size, self._used = old[3], old[4]

    def _rebuilt_compiled(self, slots: int, leaving: Any) -> Rebuilt:
        """_rebuilt by host_kernels.k_rehash: the new arrays are filled without touching
        this table's."""
        keys, values, scores = self._allocate(slots)
        skip = _NO_FLAGS
        if leaving is not None and leaving.shape[0]:
            skip = np.zeros(self.slots, dtype=bool)
            skip[leaving] = True
        size = self._size - (0 if leaving is None else int(leaving.shape[0]))
        placed = host_kernels.k_rehash(
            self._keys, self.values, self._scores, skip, keys, values, scores, slots - 1
        )
        if placed != size:
            raise RuntimeError(
                f"HashTable: rebuilding into {slots} slots expected to place {size} live "
                f"keys, placed {placed} (a bookkeeping error; the table is as it was)"
            )
        return Rebuilt(keys, values, scores, size=size)

    def find_rows(
        self, keys: Any, arena: Any, width: int | None = None, *, out: Any = None
    ) -> tuple[Any, Any]:
        """(slots, rows): slots as find, rows[i] = arena[values[slots[i]], :width] (all
        columns when width is None), zeros for missing keys. One kernel on the GPU."""
        if self._kernels is not None:
            return _kernels.find_rows(
                self._keys,
                self.values,
                self._mask,
                keys,
                arena,
                width=width,
                out=out,
                launch=self._kernels,
            )
        xp = self.xp
        width = arena.shape[1] if width is None else width
        slots = self.find(keys)
        if out is None:
            out = xp.zeros((keys.shape[0], width), dtype=arena.dtype)
        else:
            out[:, :width] = 0
        hit = xp.nonzero(slots >= 0)[0]
        out[hit, :width] = arena[self.values[slots[hit]], :width]
        return slots, out

    def lookup_rows(
        self, keys: np.ndarray, arena: np.ndarray, dirty: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The host tier's find in one compiled pass (numpy, host kernels only): (slots,
        rows [n, arena width] - a miss's row unset -, each key's dirty flag - a miss's
        unset -, hits), with the eviction touch of every hit, as find + find_rows + touch."""
        keys = _kernels._int64(np, keys)
        n = keys.shape[0]
        rows = np.empty((n, arena.shape[1]), dtype=np.float32)
        slots = np.empty(n, dtype=np.int64)
        found_dirty = np.empty(n, dtype=bool)
        mode = host_kernels.LOOKUP_SLOTS | host_kernels.LOOKUP_DIRTY
        hits, _ = self._lookup(keys, arena, rows, dirty, slots, found_dirty, _NO_SLOTS, mode)
        return slots, rows, found_dirty, hits

    def lookup_into(
        self, keys: np.ndarray, arena: np.ndarray, out: np.ndarray
    ) -> tuple[np.ndarray, int]:
        """A lookup's read of the rows held here (numpy, host kernels only), in one compiled
        pass: out[i] = the first out.shape[1] columns of the row of keys[i] for each hit
        (with its eviction touch, as `touch`), zeros where keys[i] < 0 (padding), left as
        it was for a miss. Returns (the indices of the misses: keys >= 0 not held here, hits)."""
        missed = np.empty(keys.shape[0], dtype=np.int64)
        hits, listed = self._lookup(
            keys, arena, out, _NO_FLAGS, _NO_SLOTS, _NO_FLAGS, missed, host_kernels.LOOKUP_MISSED
        )
        return missed[:listed], hits

    def resident_ids(self, keys: np.ndarray) -> tuple[np.ndarray, int]:
        """(the row id of each key, -1 where absent; hits), with the eviction touch of
        every hit, in one compiled pass (numpy, host kernels only): find, touch and
        values[slots] as one walk over the index instead of three."""
        keys = _kernels._int64(np, keys)
        ids = np.empty(keys.shape[0], dtype=np.int64)
        nothing = np.empty((keys.shape[0], 0), dtype=np.float32)
        hits, _ = self._lookup(
            keys,
            nothing,
            nothing,
            _NO_FLAGS,
            ids,
            _NO_FLAGS,
            _NO_SLOTS,
            host_kernels.LOOKUP_ROW_IDS,
        )
        return ids, hits

    def _lookup(
        self,
        keys: np.ndarray,
        arena: np.ndarray,
        out: np.ndarray,
        dirty: np.ndarray,
        slots: np.ndarray,
        found_dirty: np.ndarray,
        missed: np.ndarray,
        mode: int,
    ) -> tuple[int, int]:
        """host_kernels.k_lookup over this table, its LRU clock moved one tick (a call)."""
        table, values, scores, mask, tick, lfu = self.walk()
        hits, listed = host_kernels.k_lookup(
            table,
            values,
            scores,
            mask,
            keys,
            arena,
            out,
            dirty,
            slots,
            found_dirty,
            missed,
            mode,
            tick,
            lfu,
        )
        return int(hits), int(listed)

    def walk(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int, bool]:
        """(slot keys, values, scores, mask, tick, lfu): what a compiled pass that probes
        this index and touches its hits itself takes (numpy, host kernels only; k_lookup,
        host_kernels' key trainers), the LRU clock moved one tick (a call)."""
        lfu = self.eviction is not Eviction.LRU
        if not lfu:
            self._tick += 1
        return self._keys, self.values, self._scores, self._mask, self._tick, lfu

    def remove_slots(self, slots: Any) -> None:
        """Erase the keys in these (unique, live) slots."""
        self._keys[slots] = TOMBSTONE
        self._size -= int(slots.shape[0])

    def erase(self, keys: Any) -> int:
        """Erase the keys present; returns how many distinct keys were erased."""
        slots = self.find(keys)
        slots = self.xp.unique(slots[slots >= 0])
        self.remove_slots(slots)
        return int(slots.shape[0])

    def touch(self, slots: Any) -> None:
        """Record an access of each slot for the eviction score (repeats count for LFU)."""
        if self.compiled_on_host:
            lfu = self.eviction is not Eviction.LRU
            if not lfu:
                self._tick += 1
            host_kernels.k_touch(self._scores, _kernels._int64(np, slots), self._tick, lfu)
        elif self.eviction is Eviction.LRU:
            self._tick += 1
            self._scores[slots] = self._tick
        elif self.xp is np:
            np.add.at(self._scores, slots, 1)
        else:  # cupy's add.at has no int64 atomic add on every version: count repeats first
            touched, counts = self.xp.unique(slots, return_counts=True)
            self._scores[touched] += counts

    def eviction_candidates(self, count: int, protect: Any = None) -> Any:
        """Slots of the `count` live keys with the lowest score (least recent for LRU, least
        frequent for LFU), never one of the `protect` slots. Fewer if fewer are eligible."""
        xp = self.xp
        live = xp.nonzero(self._keys > TOMBSTONE)[0]
        scores = self._scores[live]
        if protect is not None and protect.size:
            eligible = ~xp.isin(live, protect)
            live, scores = live[eligible], scores[eligible]
        if count >= live.size:
            return live
        if count <= 0:
            return live[:0]
        return live[xp.argpartition(scores, count - 1)[:count]]

    def export(self) -> tuple[Any, Any]:
        """(keys, values) of every live key, in slot order."""
        live = self.xp.nonzero(self._keys > TOMBSTONE)[0]
        return self._keys[live], self.values[live]

    def keys_at(self, slots: Any) -> Any:
        return self._keys[slots]
