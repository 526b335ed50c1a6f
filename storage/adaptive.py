"""Adaptive embedding (DeepRec's AdaptiveEmbedding): with TableConfig.hash_bucket_size = B > 0
and promote_after = P > 0, a key sighted fewer than P times has no row of its own: it reads
and trains the shared row of bucket `bucket_of(key)` = splitmix64(key, salted) % B of a static
table of B rows (collisions allowed); its P-th sighting gives it its own row, initialised
from its bucket row's current weights.

Sightings are counted exactly as admission counts them (a CounterFilter with admit_after = P,
erased on promotion): a training lookup or a push in which the key has no row in any tier,
once per call per distinct key; create=False lookups neither count nor promote. The counts
are soft state (memory only): after a restart or a drop a key without a row starts counting
from 0 again; a snapshot carries them (exact, by key, also into another shard count).
EmbeddingTable asks them in one place, its Buckets fallback (storage/fallbacks.py), like
the admission filter.

A promoted row starts with FRESH optimizer state (the optimizer's initial fill), not the
bucket's: the bucket's state - Adagrad's sum of squares, Adam's moments, a momentum buffer -
was accumulated from the gradients of every key that shared the bucket, so copying it would
hand the new row another key's history (for Adagrad, a learning rate already shrunk by other
keys' traffic). The weights carry what the bucket learnt; the state starts as any new row's.

The bucket rows are B rows of row_width (weights and optimizer state side by side) held in
memory on each shard (each shard has its own B buckets for its own keys) and kept durable in a
RocksDB column family of their own ("buckets.<table>", key = bucket index), written at every
flush (and so at close, checkpoint and snapshot save) when changed, and at once with
write_policy="write_through". A bucket never written reads its initial row: the table's
initializer at seed `bucket_seed(config)` - a stream of its own, derived from the table seed
and a salt, so bucket b's initial row is not key b's. Snapshots (format 3) carry each
shard's bucket rows: a load into the same shard count gives shard i part i's; bucket rows
cannot be split by key, so a load into another shard count gives every shard the mean of the
parts' bucket rows (weights and optimizer state; storage/snapshot_format.py CARRIES).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tierps.core.config import TableConfig
from tierps.core.hashing import mix64, seed_stream
from tierps.storage.admission import CounterFilter
from tierps.storage.rocksdb_tier import RocksDBTier

BUCKET_SALT = 0x616461707476  # "adaptv": the bucket hash and the bucket rows' initial values
LOAD_CHUNK = 65536  # bucket rows read from RocksDB per multi-get when a table opens


def bucket_seed(config: TableConfig) -> int:
    """The seed the initializer uses for bucket rows: derived from (table seed, BUCKET_SALT),
    so bucket b and key b get unrelated initial weights."""
    return int(seed_stream(config.seed, BUCKET_SALT))


def bucket_of(keys: np.ndarray, buckets: int, seed: int = 0) -> np.ndarray:
    """The bucket (int64 in [0, buckets)) of int64 keys >= 0: splitmix64 of the key xor a
    per-(seed, BUCKET_SALT) stream offset, mod buckets. A pure function of (seed, key,
    buckets), never Python's hash()."""
    bits = keys.astype(np.int64, copy=False).view(np.uint64) ^ seed_stream(seed, BUCKET_SALT)
    return (mix64(bits) % np.uint64(buckets)).astype(np.int64)


class BucketRows:
    """The B shared rows of one table on one shard, the sighting counts of keys without a
    row, and their figures. Not thread-safe: EmbeddingTable calls it under its lock."""

    def __init__(self, config: TableConfig, durable: RocksDBTier | None = None) -> None:
        self.config = config
        self.size = config.hash_bucket_size
        self.durable = durable
        self.counts = CounterFilter(config.promote_after)
        index = np.arange(self.size, dtype=np.int64)  # a bucket's weights: a stream of its own
        weights = config.initializer.generate(index, config.dim, bucket_seed(config))
        self.rows = config.initial_rows(index, weights)
        self.dirty = np.zeros(self.size, dtype=bool)
        if durable is not None:
            for start in range(0, self.size, LOAD_CHUNK):
                index = np.arange(start, min(start + LOAD_CHUNK, self.size), dtype=np.int64)
                hit, found, _ = durable.find(index)
                self.rows[index[hit]] = found
        self.lookups = 0  # looked-up keys (with repeats) answered with their bucket's weights
        self.gradients = 0  # distinct keys of pushes whose gradient trained their bucket
        self.updates = 0  # bucket-row optimizer steps (one per bucket per push)

    def of(self, keys: np.ndarray) -> np.ndarray:
        """Bucket index of each key."""
        return bucket_of(keys, self.size, self.config.seed)

    def observe(self, keys: np.ndarray) -> np.ndarray:
        """One sighting of each distinct key; True where the key is promoted now."""
        return self.counts.observe(keys)

    def read(self, keys: np.ndarray) -> np.ndarray:
        """Bucket rows [n, row_width] of keys (copies)."""
        return self.rows[self.of(keys)]

    def apply(self, keys: np.ndarray, grads: np.ndarray, step: int) -> None:
        """Train the buckets of distinct keys: the gradients of the keys of one bucket are
        summed, and each bucket gets one optimizer step."""
        index, inverse = np.unique(self.of(keys), return_inverse=True)
        dim = self.config.dim
        summed = np.zeros((index.size, dim), dtype=np.float32)
        flat = (inverse.reshape(-1)[:, None] * dim + np.arange(dim)).reshape(-1)
        np.add.at(summed.reshape(-1), flat, grads.reshape(-1))
        rows = self.rows[index]
        self.config.optimizer.apply(rows, summed, step)
        self.rows[index] = rows
        self.dirty[index] = True
        self.gradients += int(keys.size)
        self.updates += int(index.size)

    def dirty_rows(self) -> tuple[RocksDBTier, np.ndarray, np.ndarray] | None:
        """(durable tier, bucket indices, rows) of the changed bucket rows, None if none:
        what a flush writes, and a write-through push writes with its own rows."""
        if self.durable is None or not self.dirty.any():
            return None
        index = np.flatnonzero(self.dirty).astype(np.int64)
        return self.durable, index, self.rows[index]

    def flush(self) -> None:
        """Write changed bucket rows to RocksDB."""
        changed = self.dirty_rows()
        if changed is not None:
            durable, index, rows = changed
            durable.write(index, rows)
            self.dirty[index] = False

    def stats(self) -> dict[str, Any]:
        counted = self.counts.stats()
        return {
            "bucket_rows": self.size,
            "bucket_bytes": int(self.rows.nbytes),
            "keys_counted": counted["keys_counted"],
            "sightings": counted["sightings"],
            "keys_promoted": counted["keys_admitted"],
            "lookups_from_buckets": self.lookups,
            "gradients_to_buckets": self.gradients,
            "bucket_updates": self.updates,
        }

    def close(self) -> None:
        if self.durable is not None:
            self.durable.close()
