"""Admission filters (DeepRec's counter filter and counting Bloom filter): with
TableConfig.admit_after = A > 0, a key gets a trainable row only once it was sighted A times.

A sighting is one call - a training lookup (create=True) or a push (apply_gradients) - in
which the key comes up with no row in any tier; a key that repeats within one call is sighted
once. Evaluation lookups (create=False) neither count nor admit, and a key that has a row
(admitted, assigned, restored from a snapshot, or there before) never reaches the filter
again. EmbeddingTable asks its filter in one place, its Admission fallback
(storage/fallbacks.py): the final misses of a training lookup or a push go to `observe`,
which counts them and says which are admitted; those get their initial row, the others
read default_value and are not stored.

Two filters behind one batched interface (`observe(keys) -> admitted mask`, `estimate`,
`stats`); neither loops over keys in Python:
- CounterFilter: an exact count per key in the vectorised HashTable; an admitted key's count
  is erased. It holds at most max_elements keys (DEFAULT_COUNTER_KEYS = 2**18 when
  max_elements is 0): when a call leaves more, the counts of the least recently sighted keys
  are dropped (a quarter of max_elements at a time) and those keys start over from 0 - a
  key is admitted when it is sighted admit_after times before max_elements other keys push
  its count out. Memory: O(max_elements + the distinct keys of one call).
- BloomFilter: a counting Bloom filter of m small saturating counters and k hash functions,
  sized from max_elements (n) and false_positive_rate (p) by the standard formulas
  m = ceil(-n ln p / (ln 2)^2), k = round(m / n ln 2); a key's estimated count is the minimum
  of its k counters, never below its true count (up to saturation), sometimes above it (a
  false positive admits a key early). Memory is fixed: m counters of the smallest unsigned
  type that holds admit_after. Its counts are never erased.

Filter state is soft: it lives in memory only and is lost when the shard restarts or the table
is dropped (a key not yet admitted then starts counting from 0 again). What admission decided
persists: an admitted key has a row, and rows are durable and saved in snapshots. Snapshots
(format 3) carry the counts too (export_counts / counters): the exact counter's by key, into
any shard count; a Bloom filter's counters as they are into the same shard count, and as the
element-wise max of every part's into another (it cannot be split by key: no key's estimate
falls below its count, more keys collide). The figures (sightings, keys_admitted) start over.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from tierps.core.config import Admission, TableConfig
from tierps.core.hashing import counter_bits
from tierps.storage.hash_table import HashTable

BLOOM_SALT = 0x61646D6974  # "admit": the Bloom filter's hashes are a stream of their own


class AdmissionFilter(Protocol):
    """Counts sightings of keys without a row and admits those sighted admit_after times."""

    admit_after: int

    def observe(self, keys: np.ndarray) -> np.ndarray:
        """Count one sighting of each distinct int64 key >= 0 (duplicates in `keys` count
        once); returns a bool mask over `keys`: True where the key is admitted now."""
        ...

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """Each key's count as the filter holds it now (int64), changing nothing."""
        ...

    def stats(self) -> dict[str, int]:
        """keys_counted, counters, counters_used, hash_functions, bytes, sightings,
        keys_admitted (see TableDescription.lifecycle in the proto), keys_dropped (counts
        the exact counter forgot because it was full; 0 for the Bloom filter)."""
        ...

    def begin(self) -> None:
        """Start recording what observe changes, so that a call refused after its sighting
        (EmbeddingTable.apply_gradients' numeric guard) can undo it."""
        ...

    def commit(self) -> None:
        """Keep what observe changed since begin; stop recording."""
        ...

    def rollback(self) -> None:
        """Undo what observe changed since begin (counts and figures); stop recording."""
        ...


DEFAULT_COUNTER_KEYS = 1 << 18
"""Keys an exact counter holds at most when TableConfig.max_elements is 0: about 35 MiB
(a hash table of 2**20 slots and the id arrays, with calls of up to 8192 new keys)."""


def make_filter(config: TableConfig) -> AdmissionFilter | None:
    """The filter a table's config asks for; None when admit_after is 0 (no admission)."""
    if not config.admit_after:
        return None
    if config.admission is Admission.BLOOM:
        return BloomFilter(
            config.admit_after, config.max_elements, config.false_positive_rate, config.seed
        )
    return CounterFilter(config.admit_after, config.max_elements or DEFAULT_COUNTER_KEYS)


class CounterFilter:
    """Exact counts: key -> (sightings, the observe call of its latest sighting), erased
    when the key is admitted, and bounded: after a call leaves more than max_keys keys
    counted, the least recently sighted are dropped (ties: the lower count first, then the
    smaller key) until keep_keys = max_keys - max_keys // 4 remain. A dropped key's count is
    forgotten: its next sighting counts 1 again, as a key never seen. Dropping a quarter at
    a time keeps the sort that picks them to about one per max_keys / 4 new keys.

    Memory: a HashTable (key -> id) plus two int64 arrays by id (count, latest call); all
    three grow with the keys counted at once, which is at most max_keys plus the distinct
    keys of one call (the trim runs at the end of the call that went over)."""

    def __init__(
        self, admit_after: int, max_keys: int = DEFAULT_COUNTER_KEYS, capacity: int = 16
    ) -> None:
        if admit_after < 1:
            raise ValueError(f"CounterFilter: admit_after expected >= 1, got {admit_after}")
        if max_keys < 1:
            raise ValueError(f"CounterFilter: max_keys expected >= 1, got {max_keys}")
        self.admit_after = admit_after
        self.max_keys = max_keys
        self.keep_keys = max_keys - max_keys // 4  # what a trim leaves
        self._index = HashTable(capacity)  # key -> id into _count and _seen
        self._count = np.zeros(0, dtype=np.int64)  # sightings so far, by id
        self._seen = np.zeros(0, dtype=np.int64)  # the call of the latest sighting, by id
        self._free = np.zeros(0, dtype=np.int64)  # ids not in use
        self.calls = 0  # observe calls so far: the recency clock
        self.sightings = 0
        self.keys_admitted = 0
        self.keys_dropped = 0  # counts forgotten because the counter was full
        self._journal: list[tuple[str, tuple[np.ndarray, ...]]] | None = None

    def _take(self, n: int) -> np.ndarray:
        """n ids for new keys, growing the id arrays (doubling) when too few are free."""
        if self._free.size < n:
            old = self._count.size
            size = max(2 * old, old + n - self._free.size, 16)
            self._count = np.concatenate([self._count, np.zeros(size - old, np.int64)])
            self._seen = np.concatenate([self._seen, np.zeros(size - old, np.int64)])
            self._free = np.concatenate([self._free, np.arange(size - 1, old - 1, -1)])
        ids = self._free[self._free.size - n :]
        self._free = self._free[: self._free.size - n]
        return ids

    def _release(self, slots: np.ndarray) -> None:
        """Erase the keys of these (unique, live) slots and free their ids."""
        if slots.size:
            self._free = np.concatenate([self._free, self._index.values[slots]])
            self._index.remove_slots(slots)

    def _held(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(count, latest call) of unique keys, (0, 0) where not counted."""
        slots = self._index.find(keys)
        found = slots >= 0
        ids = self._index.values[slots[found]]
        count, seen = np.zeros((2, keys.size), dtype=np.int64)
        count[found], seen[found] = self._count[ids], self._seen[ids]
        return count, seen

    def _put(self, keys: np.ndarray, count: np.ndarray, seen: np.ndarray) -> None:
        """Set (count, latest call) of unique keys, inserting the absent ones."""
        slots, inserted = self._index.insert(keys)
        self._index.values[slots[inserted]] = self._take(int(np.count_nonzero(inserted)))
        ids = self._index.values[slots]
        self._count[ids], self._seen[ids] = count, seen

    def observe(self, keys: np.ndarray) -> np.ndarray:
        unique, inverse = np.unique(keys, return_inverse=True)
        if self._journal is not None:
            self._journal.append(("sighted", (unique, *self._held(unique))))
        self.calls += 1
        slots, inserted = self._index.insert(unique)
        self._index.values[slots[inserted]] = self._take(int(np.count_nonzero(inserted)))
        ids = self._index.values[slots]
        self._count[ids[inserted]] = 0  # a new key starts from no sightings
        self._count[ids] += 1  # unique keys: one id each
        self._seen[ids] = self.calls
        admitted = self._count[ids] >= self.admit_after
        self._release(slots[admitted])
        self.sightings += int(unique.size)
        self.keys_admitted += int(np.count_nonzero(admitted))
        if self._index.size > self.max_keys:
            self._trim()
        return admitted[inverse.reshape(-1)]

    def _trim(self) -> None:
        """Drop the least recently sighted counts until keep_keys remain."""
        keys, ids = self._index.export()
        count, seen = self._count[ids], self._seen[ids]
        drop = np.lexsort((keys, count, seen))[: keys.size - self.keep_keys]
        if self._journal is not None:
            self._journal.append(("dropped", (keys[drop], count[drop], seen[drop])))
        self._release(self._index.find(keys[drop]))
        self.keys_dropped += int(drop.size)

    def begin(self) -> None:
        """Record what observe changes from now on, for `rollback` (until `commit`)."""
        self._journal = []

    def commit(self) -> None:
        """Keep the changes since `begin`; stop recording."""
        self._journal = None

    def rollback(self) -> None:
        """Undo every observe since `begin`: each key's count and latest sighting, the call
        clock and the figures return to what they were; stop recording."""
        journal, self._journal = self._journal or [], None
        for kind, (keys, count, seen) in reversed(journal):
            if kind == "dropped":  # put the trimmed counts back
                self._put(keys, count, seen)
                self.keys_dropped -= int(keys.size)
                continue
            # a sighting: keys counted before get their (count, seen) back (admitted ones
            # are inserted again); keys first counted by it are erased
            self.calls -= 1
            self.sightings -= int(keys.size)
            self.keys_admitted -= int(np.count_nonzero(self._held(keys)[0] == 0))  # erased
            before = count > 0
            self._put(keys[before], count[before], seen[before])
            gone = self._index.find(keys[~before])
            self._release(gone[gone >= 0])

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        return self._held(keys)[0]

    def export_counts(self) -> np.ndarray:
        """Every count held, as int64 [n, 3] rows (key, sightings, call of the latest
        sighting) in ascending key order: what a snapshot carries (import_counts takes it)."""
        keys, ids = self._index.export()
        order = np.argsort(keys, kind="stable")
        keys, ids = keys[order], ids[order]
        return np.stack([keys, self._count[ids], self._seen[ids]], axis=1).astype(np.int64)

    def import_counts(self, counts: np.ndarray, calls: int) -> None:
        """Replace every count with `counts` (rows of export_counts, distinct keys, each
        count in [1, admit_after)) and the recency clock with `calls`; the figures
        (sightings, keys_admitted, keys_dropped) start over. More than max_keys counts (a
        snapshot of more shards loaded into fewer) are trimmed as observe trims them."""
        self._index = HashTable(1 << max(4, (2 * int(counts.shape[0])).bit_length()))
        self._count = np.zeros(0, dtype=np.int64)
        self._seen = np.zeros(0, dtype=np.int64)
        self._free = np.zeros(0, dtype=np.int64)
        self.calls = int(calls)
        self.sightings = self.keys_admitted = self.keys_dropped = 0
        if counts.shape[0]:
            self._put(counts[:, 0].copy(), counts[:, 1].copy(), counts[:, 2].copy())
        if self._index.size > self.max_keys:
            self._trim()

    def stats(self) -> dict[str, int]:
        return {
            "keys_counted": self._index.size,
            "counters": self._index.slots,
            "counters_used": self._index.size,
            "hash_functions": 0,
            "bytes": self.nbytes,
            "sightings": self.sightings,
            "keys_admitted": self.keys_admitted,
            "keys_dropped": self.keys_dropped,
        }

    @property
    def nbytes(self) -> int:
        """Memory the counter holds: its hash table and its id arrays."""
        arrays = (self._count, self._seen, self._free)
        return self._index.nbytes + sum(int(a.nbytes) for a in arrays)


def bloom_size(max_elements: int, false_positive_rate: float) -> tuple[int, int]:
    """(m counters, k hash functions) of a Bloom filter holding max_elements keys at
    false_positive_rate: m = ceil(-n ln p / (ln 2)^2), k = max(1, round(m / n ln 2))."""
    if max_elements < 1 or not 0.0 < false_positive_rate < 1.0:
        raise ValueError(
            f"bloom_size: expected max_elements >= 1 and false_positive_rate in (0, 1), got "
            f"{max_elements} and {false_positive_rate}"
        )
    m = math.ceil(-max_elements * math.log(false_positive_rate) / math.log(2) ** 2)
    return m, max(1, round(m / max_elements * math.log(2)))


def counter_dtype(admit_after: int) -> np.dtype:
    """The smallest unsigned integer type whose maximum reaches admit_after (uint8 up to
    255): counters saturate at that maximum instead of wrapping."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if admit_after <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


def bloom_bytes(config: TableConfig) -> int:
    """Bytes of the counters a table's Bloom filter allocates (0 without one)."""
    if not config.admit_after or config.admission is not Admission.BLOOM:
        return 0
    m, _ = bloom_size(config.max_elements, config.false_positive_rate)
    return m * counter_dtype(config.admit_after).itemsize


class BloomFilter:
    """A counting Bloom filter: k counters per key out of m, each key's k positions
    splitmix64 counter-based hashes of (seed, key, i) for i < k (hashing.counter_bits)."""

    def __init__(
        self, admit_after: int, max_elements: int, false_positive_rate: float, seed: int = 0
    ) -> None:
        if admit_after < 1:
            raise ValueError(f"BloomFilter: admit_after expected >= 1, got {admit_after}")
        self.admit_after = admit_after
        self.size, self.hash_functions = bloom_size(max_elements, false_positive_rate)
        self.seed = seed
        self._counters = np.zeros(self.size, dtype=counter_dtype(admit_after))
        self._ceiling = np.uint64(np.iinfo(self._counters.dtype).max)
        self.counters_used = 0  # counters above 0
        self.sightings = 0
        self.keys_admitted = 0
        self._journal: list[tuple[np.ndarray, np.ndarray, int, int, int]] | None = None

    def positions(self, keys: np.ndarray) -> np.ndarray:
        """[n, k] int64 counter indices of keys."""
        bits = counter_bits(keys, self.hash_functions, self.seed, BLOOM_SALT)
        return (bits % np.uint64(self.size)).astype(np.int64)

    def observe(self, keys: np.ndarray) -> np.ndarray:
        unique, inverse = np.unique(keys, return_inverse=True)
        positions = self.positions(unique)
        # A counter shared by several keys of the batch (or twice by one key) goes up once
        # per use, saturating at the type's maximum.
        where, uses = np.unique(positions, return_counts=True)
        before = self._counters[where]
        self.counters_used += int(np.count_nonzero(before == 0))
        after = np.minimum(before.astype(np.uint64) + uses.astype(np.uint64), self._ceiling)
        self._counters[where] = after.astype(self._counters.dtype)
        admitted = self._counters[positions].min(axis=1) >= self.admit_after
        if self._journal is not None:
            self._journal.append(
                (
                    where,
                    before,
                    int(np.count_nonzero(before == 0)),
                    int(unique.size),
                    int(np.count_nonzero(admitted)),
                )
            )
        self.sightings += int(unique.size)
        self.keys_admitted += int(np.count_nonzero(admitted))
        return admitted[inverse.reshape(-1)]

    def begin(self) -> None:
        """Record what observe changes from now on, for `rollback` (until `commit`)."""
        self._journal = []

    def commit(self) -> None:
        """Keep the changes since `begin`; stop recording."""
        self._journal = None

    def rollback(self) -> None:
        """Undo every observe since `begin` (counters and figures); stop recording."""
        journal, self._journal = self._journal or [], None
        for where, before, newly_used, sighted, admitted in reversed(journal):
            self._counters[where] = before
            self.counters_used -= newly_used
            self.sightings -= sighted
            self.keys_admitted -= admitted

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        return self._counters[self.positions(keys)].min(axis=1).astype(np.int64)

    @property
    def counters(self) -> np.ndarray:
        """The m counters (read-only view): what a snapshot carries (import_counters)."""
        view = self._counters.view()
        view.flags.writeable = False
        return view

    def import_counters(self, counters: np.ndarray) -> None:
        """Replace the m counters with `counters` (this filter's size and dtype, as
        `counters` gave them); the figures (sightings, keys_admitted) start over."""
        if counters.shape != self._counters.shape or counters.dtype != self._counters.dtype:
            raise ValueError(
                f"BloomFilter: counters expected {self._counters.shape} of "
                f"{self._counters.dtype}, got {counters.shape} of {counters.dtype}"
            )
        self._counters = counters.copy()
        self.counters_used = int(np.count_nonzero(self._counters))
        self.sightings = self.keys_admitted = 0

    def estimated_keys(self) -> int:
        """Distinct keys sighted, estimated from the share of counters in use:
        -(m / k) ln(1 - used / m) (Swamidass and Baldi 2007); m when every one is used."""
        if self.counters_used >= self.size:
            return self.size
        share = self.counters_used / self.size
        return round(-self.size / self.hash_functions * math.log1p(-share))

    def stats(self) -> dict[str, int]:
        return {
            "keys_counted": self.estimated_keys(),
            "counters": self.size,
            "counters_used": self.counters_used,
            "hash_functions": self.hash_functions,
            "bytes": int(self._counters.nbytes),
            "sightings": self.sightings,
            "keys_admitted": self.keys_admitted,
            "keys_dropped": 0,  # counts are never dropped: keys share saturating counters
        }
