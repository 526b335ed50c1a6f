"""Adaptive embedding (DeepRec's AdaptiveEmbedding).

Tables with hash_bucket_size and promote_after are checked against a reference model in
plain numpy and dicts: own rows in a dict, the bucket rows in an array indexed by the bucket
function imported from tierps, SGD (and Adagrad, written out) applied by the reference, the
sightings counted per call and distinct key. Restarts keep own and bucket rows."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import export_dict
from tierps.storage import EmbeddingStore, ResourceExhaustedError, TableConfig, init, optim
from tierps.storage.adaptive import BucketRows, bucket_of, bucket_seed
from tierps.storage.store import check_bucket_size

DIM = 3
LR = 0.25
BUCKETS = 7
PROMOTE = 3
ADAGRAD = optim.Adagrad(lr=0.5, eps=1e-8, initial_accumulator_value=0.1)


def batches(rng: np.random.Generator, universe: int, count: int, size: int) -> list[np.ndarray]:
    """Random int64 key batches with repeats (keys 0..universe-1, skewed to small ones)."""
    return [(rng.zipf(1.3, size) % universe).astype(np.int64) for _ in range(count)]


def adaptive_config(**fields: Any) -> TableConfig:
    fields.setdefault("hash_bucket_size", BUCKETS)
    fields.setdefault("promote_after", PROMOTE)
    fields.setdefault("optimizer", optim.SGD(lr=LR))
    return TableConfig("items", DIM, initializer=init.Normal(0.0, 0.1), seed=11, **fields)


class Reference:
    """Adaptive embedding in plain numpy and dicts: own rows, B bucket rows, counts.

    Rows are [weights, optimizer state] in float64; SGD is w -= lr g, Adagrad (torch's
    formula) is s += g^2, w -= lr g / (sqrt(s) + eps). A promoted row takes its bucket's
    current weights and fresh state."""

    def __init__(self, config: TableConfig) -> None:
        self.config = config
        self.adagrad = isinstance(config.optimizer, optim.Adagrad)
        index = np.arange(config.hash_bucket_size, dtype=np.int64)
        weights = config.initializer.generate(index, DIM, bucket_seed(config))
        self.buckets = np.concatenate([weights, self._fresh_state(len(index))], axis=1)
        self.buckets = self.buckets.astype(np.float64)
        self.own: dict[int, np.ndarray] = {}
        self.counts: Counter[int] = Counter()
        self.promoted = self.sightings = self.bucket_lookups = self.bucket_updates = 0
        self.bucket_gradients = 0

    def _fresh_state(self, n: int) -> np.ndarray:
        if not self.adagrad:
            return np.zeros((n, 0))
        return np.full((n, DIM), self.config.optimizer.initial_accumulator_value)

    def bucket(self, key: int) -> int:
        return int(bucket_of(np.array([key]), self.config.hash_bucket_size, self.config.seed)[0])

    def _sight(self, keys: set[int]) -> None:
        for key in sorted(keys):
            if key < 0 or key in self.own:
                continue
            self.counts[key] += 1
            self.sightings += 1
            if self.counts[key] >= self.config.promote_after:
                del self.counts[key]
                self.promoted += 1
                weights = self.buckets[self.bucket(key), :DIM]
                self.own[key] = np.concatenate([weights, self._fresh_state(1)[0]])

    def _step(self, row: np.ndarray, grad: np.ndarray) -> None:
        if self.adagrad:
            row[DIM:] += grad * grad
            row[:DIM] -= (
                self.config.optimizer.lr * grad / (np.sqrt(row[DIM:]) + self.config.optimizer.eps)
            )
        else:
            row[:DIM] -= self.config.optimizer.lr * grad

    def lookup(self, keys: np.ndarray, create: bool) -> np.ndarray:
        if create:
            self._sight(set(keys.tolist()))
        out = np.zeros((keys.size, DIM))
        for i, key in enumerate(keys.tolist()):
            if key >= 0 and key in self.own:
                out[i] = self.own[key][:DIM]
            elif key >= 0:
                out[i] = self.buckets[self.bucket(key), :DIM]
                self.bucket_lookups += 1
        return out

    def push(self, keys: np.ndarray, grads: np.ndarray) -> int:
        summed: dict[int, np.ndarray] = {}
        for key, grad in zip(keys.tolist(), grads.astype(np.float64), strict=True):
            if key >= 0:
                summed[key] = summed.get(key, 0) + grad
        self._sight(set(summed))
        per_bucket: dict[int, np.ndarray] = {}
        for key, grad in summed.items():
            if key in self.own:
                self._step(self.own[key], grad)
            else:
                bucket = self.bucket(key)
                per_bucket[bucket] = per_bucket.get(bucket, 0) + grad
                self.bucket_gradients += 1
        for bucket, grad in per_bucket.items():  # one step per bucket per push
            self._step(self.buckets[bucket], grad)
            self.bucket_updates += 1
        return len(summed)


def test_buckets_are_a_pure_function_of_seed_and_key_spread_over_every_bucket() -> None:
    keys = np.arange(100000, dtype=np.int64) * 13 + 5
    buckets = bucket_of(keys, 64, seed=3)
    assert buckets.dtype == np.int64 and buckets.min() == 0 and buckets.max() == 63
    np.testing.assert_array_equal(buckets[::-1], bucket_of(keys[::-1], 64, seed=3))
    counts = np.bincount(buckets, minlength=64)
    assert counts.min() > 0.9 * keys.size / 64 and counts.max() < 1.1 * keys.size / 64
    assert not np.array_equal(buckets, bucket_of(keys, 64, seed=4))
    assert not np.array_equal(buckets, keys % 64)  # a hash, not the key itself


def test_bucket_rows_start_from_their_own_stream_not_the_keys() -> None:
    config = adaptive_config(hash_bucket_size=50)
    rows = BucketRows(config).rows
    index = np.arange(50, dtype=np.int64)
    np.testing.assert_array_equal(
        rows[:, :DIM], config.initializer.generate(index, DIM, bucket_seed(config))
    )
    keys_initial = config.initial_rows(index)[:, :DIM]
    assert not np.isclose(rows[:, :DIM], keys_initial).any()  # bucket b is not key b
    assert bucket_seed(config) != config.seed


@pytest.mark.parametrize(
    "fields",
    [
        {"host_cache_bytes": 256 << 20},
        {"host_cache_bytes": 4096},  # rows spill to RocksDB
        {"host_cache_bytes": 0},  # RocksDB only
        {"write_policy": "write_through"},
        {"use_hashtable": False, "capacity": 400},  # direct arena
        {"optimizer": ADAGRAD},
    ],
    ids=["host", "spilling", "rocksdb", "write_through", "direct", "adagrad"],
)
def test_a_table_matches_the_reference_model(store: EmbeddingStore, fields: dict) -> None:
    config = adaptive_config(**fields)
    table = store.create_table(config)
    reference = Reference(config)
    rng = np.random.default_rng(5)
    promoted_mid_run = False
    for step, keys in enumerate(batches(rng, 300, 40, 64), start=1):
        keys[rng.random(keys.size) < 0.1] = -1  # padding
        before = reference.promoted
        np.testing.assert_allclose(
            table.lookup(keys), reference.lookup(keys, create=True), rtol=1e-5, atol=1e-6
        )
        promoted_mid_run |= step > 1 and reference.promoted > before
        grads = rng.standard_normal((keys.size, DIM)).astype(np.float32)
        assert table.apply_gradients(keys, grads, step) == reference.push(keys, grads)
        if step % 5 == 0:  # evaluation lookups neither count nor promote
            probe = rng.integers(0, 400, 50)
            np.testing.assert_allclose(
                table.lookup(probe, create=False),
                reference.lookup(probe, create=False),
                rtol=1e-5,
                atol=1e-6,
            )
    assert promoted_mid_run
    stored = export_dict(table)
    assert sorted(stored) == sorted(reference.own)
    width = config.row_width
    for key, row in reference.own.items():  # weights and optimizer state
        np.testing.assert_allclose(stored[key][:width], row, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(table.buckets.rows, reference.buckets, rtol=1e-5, atol=1e-6)
    stats = table.stats()
    figures = stats["adaptive"]
    assert figures["keys_promoted"] == reference.promoted == stats["created"] == len(stored)
    assert figures["keys_counted"] == len(+reference.counts) > 0
    assert figures["sightings"] == reference.sightings
    assert figures["lookups_from_buckets"] == reference.bucket_lookups > 0
    assert figures["gradients_to_buckets"] == reference.bucket_gradients > 0
    assert figures["bucket_updates"] == reference.bucket_updates > 0
    assert figures["bucket_rows"] == BUCKETS
    assert figures["bucket_bytes"] == BUCKETS * config.row_bytes


def test_a_promoted_row_starts_from_its_buckets_current_weights_with_fresh_state(
    store: EmbeddingStore,
) -> None:
    config = adaptive_config(optimizer=ADAGRAD, promote_after=2, hash_bucket_size=1)
    table = store.create_table(config)
    a, b = np.array([10], dtype=np.int64), np.array([20], dtype=np.int64)  # one bucket
    initial = table.buckets.rows[0].copy()
    # b and 30 in one push (sighting 1 each): one Adagrad step of their bucket with the
    # summed gradient
    grads = np.array([[1.0, 2.0, -1.0], [0.5, 0.0, 1.0]], np.float32)
    assert table.apply_gradients(np.array([20, 30]), grads, step=1) == 2
    trained = table.buckets.rows[0].copy()
    np.testing.assert_allclose(trained[DIM:], initial[DIM:] + grads.sum(axis=0) ** 2, rtol=1e-6)
    assert table.stats()["adaptive"]["bucket_updates"] == 1
    np.testing.assert_array_equal(table.lookup(a)[0], trained[:DIM])  # a: sighting 1
    np.testing.assert_array_equal(table.lookup(a)[0], trained[:DIM])  # 2: promoted
    # a's own row: the bucket's current weights, and Adagrad's initial accumulator
    own = export_dict(table)[10]
    np.testing.assert_array_equal(own[:DIM], trained[:DIM])
    fresh = np.float32(ADAGRAD.initial_accumulator_value)
    np.testing.assert_array_equal(own[DIM:], np.full(DIM, fresh))
    # b still reads the bucket; a reads its own row, trained on its own from now on
    table.apply_gradients(a, np.ones((1, DIM), np.float32), step=2)
    np.testing.assert_array_equal(table.lookup(b, create=False)[0], trained[:DIM])
    assert not np.allclose(table.lookup(a, create=False)[0], trained[:DIM])
    np.testing.assert_array_equal(table.buckets.rows[0], trained)


def test_create_false_lookups_neither_count_nor_promote(store: EmbeddingStore) -> None:
    table = store.create_table(adaptive_config(promote_after=1))
    keys = np.array([3, 3, -1, 8], dtype=np.int64)
    out = table.lookup(keys, create=False)
    np.testing.assert_array_equal(out[2], 0.0)  # padding reads zeros
    np.testing.assert_array_equal(out[0], table.buckets.read(keys[:1])[0, :DIM])
    assert table.stats()["adaptive"]["sightings"] == 0 and export_dict(table) == {}
    table.lookup(keys)  # promote_after=1: the first training lookup promotes
    assert sorted(export_dict(table)) == [3, 8]


def test_restart_keeps_own_rows_and_bucket_rows(tmp_path: Path) -> None:
    config = adaptive_config(host_cache_bytes=4096)
    rng = np.random.default_rng(8)
    trace = batches(rng, 200, 20, 50)
    probe = np.arange(300, dtype=np.int64)
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        for step, keys in enumerate(trace, start=1):
            table.lookup(keys)
            table.apply_gradients(keys, rng.standard_normal((keys.size, DIM)).astype("f4"), step)
        own, buckets = export_dict(table), table.buckets.rows.copy()
        before = table.lookup(probe, create=False)
        assert 0 < len(own) < 200
        assert not np.array_equal(buckets, BucketRows(config).rows)  # trained
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.table("items")
        assert export_dict(table).keys() == own.keys()
        np.testing.assert_array_equal(table.buckets.rows, buckets)
        np.testing.assert_array_equal(table.lookup(probe, create=False), before)
        assert table.stats()["adaptive"]["keys_counted"] == 0  # counts are soft state
        store.drop_table("items")
        table = store.create_table(config)  # a new table: initial buckets again
        np.testing.assert_array_equal(table.buckets.rows, BucketRows(config).rows)


def test_zipf_trace_stores_own_rows_for_a_small_fraction_of_keys(store: EmbeddingStore) -> None:
    config = adaptive_config(hash_bucket_size=1000, promote_after=3)
    table = store.create_table(config)
    rng = np.random.default_rng(0)
    distinct: set[int] = set()
    sightings = 0
    for step in range(1, 101):  # 100 pushes of 1000 keys: ~100k sightings
        keys = (rng.zipf(1.2, 1000) % 10**9).astype(np.int64)
        distinct.update(keys.tolist())
        sightings += np.unique(keys).size
        table.apply_gradients(keys, np.full((keys.size, DIM), 0.01, np.float32), step)
    figures = table.stats()["adaptive"]
    stored = len(export_dict(table))
    assert stored == figures["keys_promoted"] == table.stats()["created"]
    assert stored < 0.25 * len(distinct), (stored, len(distinct))
    assert figures["keys_counted"] + figures["keys_promoted"] == len(distinct)
    assert figures["sightings"] <= sightings


def test_create_table_refuses_buckets_too_large_for_memory() -> None:
    config = adaptive_config(hash_bucket_size=10**6)
    check_bucket_size(config, "table 'items'", memory_bytes=10**9)
    with pytest.raises(ResourceExhaustedError, match="field 'hash_bucket_size'.*12000000 bytes"):
        check_bucket_size(config, "table 'items'", memory_bytes=10**7)
