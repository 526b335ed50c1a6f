"""Admission filters (DeepRec's counter filter and counting Bloom filter).

The filters are checked against a Python dict of counts (the exact counter equals it; the
Bloom filter never counts below it, and admits keys never sighted enough at about its
false_positive_rate); tables are checked against a reference model in plain numpy: SGD on
admitted keys only, default_value for every key without a row."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import export_dict
from tierps.storage import (
    EmbeddingStore,
    EmbeddingTable,
    ResourceExhaustedError,
    TableConfig,
    init,
    optim,
)
from tierps.storage.admission import (
    BloomFilter,
    CounterFilter,
    bloom_bytes,
    bloom_size,
    counter_dtype,
    make_filter,
)
from tierps.storage.store import check_admission_size

DIM = 3
LR = 0.25
DEFAULT = -0.5


def batches(rng: np.random.Generator, universe: int, count: int, size: int) -> list[np.ndarray]:
    """Random int64 key batches with repeats (keys 0..universe-1, skewed to small ones)."""
    return [(rng.zipf(1.3, size) % universe).astype(np.int64) for _ in range(count)]


# -- the filters against a dict -----------------------------------------------------------------


def test_bloom_size_follows_the_standard_formulas() -> None:
    # n = 1000, p = 0.01: m = ceil(1000 * ln(100) / ln(2)^2) = ceil(9585.06), k = round(6.64)
    assert bloom_size(1000, 0.01) == (9586, 7)
    assert bloom_size(1, 0.5) == (2, 1)  # ceil(1 / ln 2) = ceil(1.44), round(2 ln 2) = 1
    for n, p in [(10**6, 0.001), (123, 0.2), (5000, 1e-6)]:
        m, k = bloom_size(n, p)
        assert m == math.ceil(-n * math.log(p) / math.log(2) ** 2)
        assert k == max(1, round(m / n * math.log(2)))
    with pytest.raises(ValueError, match="max_elements >= 1"):
        bloom_size(0, 0.01)


def test_counters_are_the_smallest_type_that_holds_admit_after() -> None:
    assert [counter_dtype(a) for a in (1, 255, 256, 65535, 65536, 2**32)] == [
        np.uint8,
        np.uint8,
        np.uint16,
        np.uint16,
        np.uint32,
        np.uint64,
    ]
    config = TableConfig("t", DIM, admit_after=300, admission="bloom", max_elements=1000)
    assert bloom_bytes(config) == 9586 * 2
    assert bloom_bytes(TableConfig("t", DIM, admit_after=3)) == 0


@pytest.mark.parametrize("admit_after", [1, 2, 5])
def test_the_exact_counter_equals_a_dict_of_counts(admit_after: int) -> None:
    rng = np.random.default_rng(admit_after)
    counter = CounterFilter(admit_after)
    counts: Counter[int] = Counter()  # the oracle: sightings of keys not yet admitted
    admitted_total = sightings = 0
    for keys in batches(rng, 5000, 60, 700):
        expected = {}
        for key in set(keys.tolist()):  # once per call per distinct key
            counts[key] += 1
            expected[key] = counts[key] >= admit_after
            if expected[key]:
                del counts[key]  # admitted: its count is erased (a new count would start at 0)
        admitted = counter.observe(keys)
        np.testing.assert_array_equal(admitted, [expected[k] for k in keys.tolist()])
        admitted_total += sum(expected.values())
        sightings += len(expected)
    universe = np.arange(5000, dtype=np.int64)
    np.testing.assert_array_equal(counter.estimate(universe), [counts[k] for k in range(5000)])
    stats = counter.stats()
    assert stats["keys_counted"] == stats["counters_used"] == len(+counts)
    assert stats["keys_admitted"] == admitted_total and stats["sightings"] == sightings
    # the hash table (keys, values, scores: 8 bytes a slot) and the id arrays (count, latest
    # sighting: 8 bytes an id each; the free ids: 8 bytes each)
    ids, free = counter._count.size, counter._free.size
    assert stats["bytes"] == 24 * stats["counters"] + 16 * ids + 8 * free


def test_the_bloom_filter_never_counts_below_a_dict_of_counts() -> None:
    rng = np.random.default_rng(7)
    universe, admit_after = 4000, 4
    bloom = BloomFilter(admit_after, max_elements=universe, false_positive_rate=0.01, seed=5)
    counts: Counter[int] = Counter()  # every sighting (a Bloom filter never forgets)
    for keys in batches(rng, universe, 80, 500):
        distinct = set(keys.tolist())
        counts.update(distinct)
        admitted = bloom.observe(keys)
        due = np.array([counts[k] >= admit_after for k in keys.tolist()])
        assert admitted[due].all()  # a key sighted admit_after times is admitted
    every = np.arange(universe, dtype=np.int64)
    estimate, truth = bloom.estimate(every), np.array([counts[k] for k in range(universe)])
    assert (estimate >= truth).all()
    assert np.mean(estimate == truth) > 0.9  # sized for these keys: over-counts are rare
    stats = bloom.stats()
    assert stats["sightings"] == counts.total()
    assert (stats["counters"], stats["hash_functions"]) == bloom_size(universe, 0.01)
    assert stats["bytes"] == stats["counters"]  # uint8 counters
    # keys_counted estimates the distinct keys sighted from the counters in use
    assert abs(stats["keys_counted"] - len(counts)) < 0.1 * len(counts)


def test_the_bloom_filter_admits_keys_not_sighted_enough_at_about_its_rate() -> None:
    n, rate, admit_after = 20000, 0.01, 3
    bloom = BloomFilter(admit_after, max_elements=n, false_positive_rate=rate, seed=1)
    full = np.arange(n, dtype=np.int64) * 7 + 1
    for _ in range(admit_after - 1):  # fill it to its design load: n keys, each admitted
        bloom.observe(full)
    assert bloom.observe(full).all()
    # Keys never sighted that the filter already counts admit_after times: a first sighting
    # would admit them. At design load that is the false positive rate (1.0% here).
    fresh = np.arange(50000, dtype=np.int64) * 7 + 3
    counted = np.mean(bloom.estimate(fresh) >= admit_after)
    assert 0.5 * rate < counted < 1.5 * rate, counted
    # Sighted once each (a few thousand: each sighting also fills counters, so a long run of
    # new keys would push the filter past its design load and the rate up).
    few = fresh[:5000]
    early = sum(int(bloom.observe(part).sum()) for part in np.array_split(few, 10)) / few.size
    assert 0.3 * rate < early < 2.0 * rate, early


def test_bloom_counters_saturate_instead_of_wrapping() -> None:
    bloom = BloomFilter(200, max_elements=100, false_positive_rate=0.1)
    assert bloom.stats()["bytes"] == bloom.size  # uint8 counters: 200 fits
    key = np.array([42], dtype=np.int64)
    seen = [bool(bloom.observe(key)[0]) for _ in range(300)]
    assert seen.index(True) == 199 and all(seen[199:])
    assert bloom.estimate(key)[0] == 255  # saturated, not 300 % 256 = 44
    # a batch that adds several uses to one counter at once saturates too
    many = np.arange(100000, dtype=np.int64)
    bloom.observe(many)
    assert int(bloom.estimate(many).max()) <= 255


def test_bloom_positions_are_a_pure_function_of_seed_and_key() -> None:
    keys = np.array([5, 99, 2**40, 7], dtype=np.int64)
    one, two = BloomFilter(3, 1000, 0.01, seed=9), BloomFilter(3, 1000, 0.01, seed=9)
    np.testing.assert_array_equal(one.positions(keys), two.positions(keys[::-1])[::-1])
    assert one.positions(keys).shape == (4, one.hash_functions)
    assert not np.array_equal(one.positions(keys), BloomFilter(3, 1000, 0.01, 10).positions(keys))


def test_make_filter_follows_the_config() -> None:
    assert make_filter(TableConfig("t", DIM)) is None
    assert isinstance(make_filter(TableConfig("t", DIM, admit_after=2)), CounterFilter)
    bloom = make_filter(
        TableConfig(
            "t", DIM, admit_after=2, admission="bloom", max_elements=500, false_positive_rate=0.05
        )
    )
    assert isinstance(bloom, BloomFilter)
    assert (bloom.size, bloom.hash_functions) == bloom_size(500, 0.05)


# -- tables against a reference model -----------------------------------------------------------


class Reference:
    """The admission semantics in plain numpy and dicts: SGD on admitted keys only."""

    def __init__(self, config: TableConfig) -> None:
        self.config = config
        self.rows: dict[int, np.ndarray] = {}
        self.counts: Counter[int] = Counter()
        self.lookups_default = self.gradients_dropped = self.admitted = 0

    def _sight(self, keys: set[int]) -> None:
        """One call's sighting of distinct keys >= 0 without a row."""
        for key in keys:
            if key in self.rows or key < 0:
                continue
            self.counts[key] += 1
            if self.counts[key] >= self.config.admit_after:
                del self.counts[key]
                self.admitted += 1
                initial = self.config.initial_rows(np.array([key], dtype=np.int64))
                self.rows[key] = initial[0, : self.config.dim].copy()

    def lookup(self, keys: np.ndarray, create: bool) -> np.ndarray:
        if create:
            self._sight(set(keys.tolist()))
        out = np.zeros((keys.size, self.config.dim), dtype=np.float32)
        for i, key in enumerate(keys.tolist()):
            if key >= 0:
                if key in self.rows:
                    out[i] = self.rows[key]
                else:
                    out[i] = self.config.default_value
                    self.lookups_default += 1
        return out

    def push(self, keys: np.ndarray, grads: np.ndarray) -> int:
        summed: dict[int, np.ndarray] = {}
        for key, grad in zip(keys.tolist(), grads, strict=True):
            if key >= 0:
                summed[key] = summed.get(key, 0) + grad.astype(np.float64)
        self._sight(set(summed))
        updated = 0
        for key, grad in summed.items():
            if key in self.rows:
                self.rows[key] = (self.rows[key] - LR * grad).astype(np.float32)
                updated += 1
            else:
                self.gradients_dropped += 1
        return updated


def admission_config(admission: str, **fields: Any) -> TableConfig:
    fields.setdefault("admit_after", 3)
    if admission == "bloom":  # sized so that no key here is a false positive
        fields.setdefault("max_elements", 10000)
        fields.setdefault("false_positive_rate", 1e-9)
    return TableConfig(
        "items",
        DIM,
        initializer=init.Normal(0.0, 0.1),
        optimizer=optim.SGD(lr=LR),
        seed=11,
        admission=admission,
        default_value=DEFAULT,
        **fields,
    )


def grads_for(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal((n, DIM)).astype(np.float32)


@pytest.mark.parametrize("admission", ["counter", "bloom"])
@pytest.mark.parametrize("host_cache_bytes", [256 << 20, 4096])  # 4096: rows spill to RocksDB
def test_a_table_matches_the_reference_model(
    store: EmbeddingStore, admission: str, host_cache_bytes: int
) -> None:
    config = admission_config(admission, host_cache_bytes=host_cache_bytes)
    table = store.create_table(config)
    reference = Reference(config)
    rng = np.random.default_rng(3)
    for step, keys in enumerate(batches(rng, 300, 40, 64), start=1):
        keys[rng.random(keys.size) < 0.1] = -1  # padding
        np.testing.assert_allclose(
            table.lookup(keys), reference.lookup(keys, create=True), rtol=1e-5, atol=1e-5
        )
        grads = grads_for(rng, keys.size)
        assert table.apply_gradients(keys, grads, step) == reference.push(keys, grads)
        if step % 5 == 0:  # evaluation lookups neither count nor admit
            probe = rng.integers(0, 400, 50)
            np.testing.assert_allclose(
                table.lookup(probe, create=False),
                reference.lookup(probe, create=False),
                rtol=1e-5,
                atol=1e-5,
            )
    stored = export_dict(table)
    assert sorted(stored) == sorted(reference.rows)
    for key, row in reference.rows.items():
        np.testing.assert_allclose(stored[key][:DIM], row, rtol=1e-5, atol=1e-6)
    figures = table.stats()["admission"]
    assert figures["keys_admitted"] == reference.admitted == table.stats()["created"]
    assert figures["lookups_default"] == reference.lookups_default > 0
    assert figures["gradients_dropped"] == reference.gradients_dropped > 0
    if admission == "counter":
        assert figures["keys_counted"] == len(+reference.counts)


def test_a_key_sighted_fewer_times_reads_default_stores_nothing_and_drops_its_gradients(
    store: EmbeddingStore,
) -> None:
    config = admission_config("counter", admit_after=4)
    table = store.create_table(config)
    key = np.array([7, 7, -1, 7], dtype=np.int64)  # one sighting a call, however often it comes
    expected_default = np.full((4, DIM), DEFAULT, np.float32)
    expected_default[2] = 0.0  # padding still reads zeros
    np.testing.assert_array_equal(table.lookup(key), expected_default)  # sighting 1
    assert table.apply_gradients(key, np.ones((4, DIM), np.float32), step=1) == 0  # 2
    np.testing.assert_array_equal(table.lookup(key), expected_default)  # 3
    for _ in range(3):
        np.testing.assert_array_equal(table.lookup(key, create=False), expected_default)
    stats = table.stats()
    assert export_dict(table) == {} and stats["created"] == stats["initialized"] == 0
    assert all(tier["rows"] == 0 for tier in stats["tiers"].values())
    figures = stats["admission"]
    assert (figures["sightings"], figures["keys_counted"], figures["keys_admitted"]) == (3, 1, 0)
    assert figures["lookups_default"] == 5 * 3  # 2 training and 3 evaluation lookups
    assert figures["gradients_dropped"] == 1  # one distinct key's summed gradient
    # sighting 4, a push: the key gets its initial row and this gradient trains it
    initial = config.initial_rows(np.array([7]))[0, :DIM]
    grad = np.array([[1.0, -2.0, 0.5]], np.float32)
    assert table.apply_gradients(np.array([7]), grad, step=2) == 1
    np.testing.assert_allclose(table.lookup(np.array([7])), [initial - LR * grad[0]], rtol=1e-6)
    figures = table.stats()["admission"]
    assert (figures["keys_counted"], figures["keys_admitted"], figures["sightings"]) == (0, 1, 4)
    assert table.stats()["created"] == 1


def test_a_training_lookup_that_admits_a_key_stores_and_returns_its_initial_row(
    store: EmbeddingStore,
) -> None:
    config = admission_config("bloom", admit_after=2)
    table = store.create_table(config)
    keys = np.arange(10, dtype=np.int64)
    np.testing.assert_array_equal(table.lookup(keys), np.full((10, DIM), DEFAULT))
    initial = config.initial_rows(keys)[:, :DIM]
    np.testing.assert_array_equal(table.lookup(keys), initial)
    np.testing.assert_array_equal(table.lookup(keys, create=False), initial)
    assert sorted(export_dict(table)) == keys.tolist()


def test_rows_that_exist_train_whatever_the_filter(store: EmbeddingStore, tmp_path: Path) -> None:
    config = admission_config("counter", admit_after=100)
    table = store.create_table(config)
    assigned = np.array([1, 2], dtype=np.int64)
    table.assign(assigned, np.ones((2, DIM), np.float32))
    restored = np.array([5], dtype=np.int64)
    table.restore(restored, config.initial_rows(restored))
    keys = np.array([1, 2, 5, 9], dtype=np.int64)
    assert table.apply_gradients(keys, np.ones((4, DIM), np.float32), step=1) == 3
    out = table.lookup(keys)
    np.testing.assert_allclose(out[:2], 1.0 - LR)
    np.testing.assert_allclose(out[2], config.initial_rows(restored)[0, :DIM] - LR, rtol=1e-6)
    np.testing.assert_array_equal(out[3], DEFAULT)  # 9: sighted twice of 100


def test_counts_are_soft_state_and_admitted_rows_persist(tmp_path: Path) -> None:
    config = admission_config("counter", admit_after=3)
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        for _ in range(3):
            table.lookup(np.array([1, 2]))  # 1 and 2 admitted on the third
        table.lookup(np.array([3]))
        table.lookup(np.array([3]))  # 3: two sightings, not admitted
        trained = table.lookup(np.array([1, 2]))
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.table("items")
        assert table.stats()["admission"]["keys_counted"] == 0  # counts were lost
        np.testing.assert_array_equal(table.lookup(np.array([1, 2])), trained)
        np.testing.assert_array_equal(table.lookup(np.array([3])), [[DEFAULT] * DIM])  # 1 of 3
        table.lookup(np.array([3]))
        np.testing.assert_array_equal(
            table.lookup(np.array([3])), config.initial_rows(np.array([3]))[:, :DIM]
        )


def test_tables_without_admission_are_unchanged(store: EmbeddingStore) -> None:
    table: EmbeddingTable = store.create_table(TableConfig("plain", DIM))
    table.apply_gradients(np.array([4]), np.ones((1, DIM), np.float32), step=1)
    assert table.stats()["admission"] is None and table.stats()["created"] == 1


def test_a_bloom_filter_too_large_for_memory_is_refused(store: EmbeddingStore) -> None:
    config = admission_config("bloom", max_elements=10**6, false_positive_rate=0.01)
    need = bloom_bytes(config)
    check_admission_size(config, "here", memory_bytes=4 * need)
    with pytest.raises(ResourceExhaustedError, match=r"here: field 'max_elements' expected"):
        check_admission_size(config, "here", memory_bytes=need)
    with pytest.raises(ResourceExhaustedError, match=r"table 'huge' on shard 0: .*max_elements"):
        store.create_table(
            TableConfig("huge", DIM, admit_after=2, admission="bloom", max_elements=2**60)
        )
    assert [c.name for c in store.tables()] == []
