"""Admission filters (DeepRec's counter filter and counting Bloom filter): with
TableConfig.admit_after = A > 0, a key gets a trainable row only once it was sighted A times.

A sighting is one call - a training lookup (create=True) or a push (apply_gradients) - in
which the key comes up with no row in any tier; a key that repeats within one call is sighted
once. Evaluation lookups (create=False) neither count nor admit, and a key that has a row
(admitted, assigned, restored from a snapshot, or there before) never reaches the filter
again. EmbeddingTable asks its filter in one place, the last step of its cascade: the final
misses of a training lookup or a push go to `observe`, which counts them and says which are
admitted; those get their initial row, the others read default_value and are not stored.

Two filters behind one batched interface (`observe(keys) -> admitted mask`, `estimate`,
`stats`); neither loops over keys in Python:
- CounterFilter: an exact count per key in the vectorised HashTable; an admitted key's count
  is erased, so memory grows with the distinct keys sighted and not yet admitted.
- BloomFilter: a counting Bloom filter of m small saturating counters and k hash functions,
  sized from max_elements (n) and false_positive_rate (p) by the standard formulas
  m = ceil(-n ln p / (ln 2)^2), k = round(m / n ln 2); a key's estimated count is the minimum
  of its k counters, never below its true count (up to saturation), sometimes above it (a
  false positive admits a key early). Memory is fixed: m counters of the smallest unsigned
  type that holds admit_after. Its counts are never erased.

Filter state is soft: it lives in memory only and is lost when the shard restarts, the table
is dropped or a snapshot is loaded into it (a key not yet admitted then starts counting from
0 again). What admission decided persists: an admitted key has a row, and rows are durable and
saved in snapshots.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from tierps.storage.config import Admission, TableConfig
from tierps.storage.hash_table import HashTable
from tierps.storage.hashing import counter_bits

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
        keys_admitted (see TableDescription.lifecycle in the proto)."""
        ...


def make_filter(config: TableConfig) -> AdmissionFilter | None:
    """The filter a table's config asks for; None when admit_after is 0 (no admission)."""
    if not config.admit_after:
        return None
    if config.admission is Admission.BLOOM:
        return BloomFilter(
            config.admit_after, config.max_elements, config.false_positive_rate, config.seed
        )
    return CounterFilter(config.admit_after)


class CounterFilter:
    """Exact counts: key -> sightings in a HashTable, erased when the key is admitted."""

    def __init__(self, admit_after: int, capacity: int = 16) -> None:
        if admit_after < 1:
            raise ValueError(f"CounterFilter: admit_after expected >= 1, got {admit_after}")
        self.admit_after = admit_after
        self._counts = HashTable(capacity)  # values: sightings so far
        self.sightings = 0
        self.keys_admitted = 0

    def observe(self, keys: np.ndarray) -> np.ndarray:
        unique, inverse = np.unique(keys, return_inverse=True)
        slots, inserted = self._counts.insert(unique)
        counts = self._counts.values
        counts[slots[inserted]] = 0  # a new key's value is scratch until set
        counts[slots] += 1  # unique keys: one slot each
        admitted = counts[slots] >= self.admit_after
        self._counts.remove_slots(slots[admitted])
        self.sightings += int(unique.size)
        self.keys_admitted += int(np.count_nonzero(admitted))
        return admitted[inverse.reshape(-1)]

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        slots = self._counts.find(keys)
        out = np.zeros(keys.shape[0], dtype=np.int64)
        found = slots >= 0
        out[found] = self._counts.values[slots[found]]
        return out

    def stats(self) -> dict[str, int]:
        return {
            "keys_counted": self._counts.size,
            "counters": self._counts.slots,
            "counters_used": self._counts.size,
            "hash_functions": 0,
            "bytes": self._counts.nbytes,
            "sightings": self.sightings,
            "keys_admitted": self.keys_admitted,
        }


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
        self.sightings += int(unique.size)
        self.keys_admitted += int(np.count_nonzero(admitted))
        return admitted[inverse.reshape(-1)]

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        return self._counters[self.positions(keys)].min(axis=1).astype(np.int64)

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
        }
