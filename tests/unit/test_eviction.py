"""Eviction (DeepRec's global-step and L2-weight eviction, Monolith's expiry).

Tables are checked against an oracle in plain Python: a dict of each key's last-update step
(the step of the last push that updated it; the table's current step when a lookup or an
assign created it) and the weights given to assign, with the L2 norm as math.sqrt of a sum of
squares. A key is expected gone when current_step - max(last step, first step pushed) >=
steps_to_live, or when its weights' norm is below min_l2_norm; every tier set-up (host
cache, rows spilled to RocksDB, RocksDB only, direct arena, write-through) must agree."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import export_dict
from tierps.storage import EmbeddingStore, EmbeddingTable, TableConfig, init, optim

DIM = 3
LR = 0.5

SETUPS: dict[str, dict[str, Any]] = {
    "host": {},  # every row fits the host cache
    "spilled": {"host_cache_bytes": 2048},  # a few rows in the cache, the rest in RocksDB
    "rocksdb_only": {"host_cache_bytes": 0},
    "direct": {"use_hashtable": False, "capacity": 400},
    "write_through": {"host_cache_bytes": 2048, "write_policy": "write_through"},
    # a few rows on the GPU tier (its code on numpy arrays), more on the host, the rest in
    # RocksDB: rows pushed while on the GPU are stamped there
    "gpu": {"gpu_cache_bytes": 1024, "host_cache_bytes": 2048},
}


def config_of(setup: str, **fields: Any) -> TableConfig:
    return TableConfig(
        "t",
        DIM,
        initializer=init.Normal(0.0, 0.5),
        optimizer=optim.Adagrad(lr=LR),
        seed=7,
        **SETUPS[setup],
        **fields,
    )


def open_table(path: Path, config: TableConfig) -> tuple[EmbeddingStore, EmbeddingTable]:
    store = EmbeddingStore(path, gpu_arrays="numpy")
    return store, store.create_table(config)


class Oracle:
    """Last-update steps of keys in plain Python, as the feature defines them."""

    def __init__(self) -> None:
        self.last: dict[int, int] = {}
        self.current = 0
        self.first = 0

    def push(self, keys: np.ndarray, step: int) -> None:
        self.current = max(self.current, step)
        self.first = step if not self.first else min(self.first, step)
        for key in keys.tolist():
            self.last[key] = step

    def create(self, keys: np.ndarray) -> None:
        for key in keys.tolist():
            self.last.setdefault(key, self.current)

    def stale(self, steps_to_live: int) -> set[int]:
        return {
            key
            for key, step in self.last.items()
            if self.current - max(step, self.first) >= steps_to_live
        }


def push(
    table: EmbeddingTable, oracle: Oracle, keys: np.ndarray, step: int, grad: float = 0.01
) -> None:
    grads = np.full((keys.size, DIM), grad, np.float32)
    table.apply_gradients(keys, grads, step)
    oracle.push(np.unique(keys), step)


def run_pushes(table: EmbeddingTable, oracle: Oracle, seed: int) -> None:
    """Lookups before the first push, then 30 steps of random pushes (with repeats, and
    keys also created by lookups between them)."""
    rng = np.random.default_rng(seed)
    early = np.arange(300, 310)
    table.lookup(early)
    oracle.create(early)
    for step in range(1, 31):
        keys = rng.integers(0, 250, size=40)
        push(table, oracle, keys, step)
        if step % 7 == 0:
            looked = rng.integers(250, 300, size=5)
            table.lookup(looked)
            oracle.create(np.unique(looked))


def assert_evicted(table: EmbeddingTable, gone: set[int], kept: set[int]) -> None:
    """gone keys are in no tier (they read their initial rows and are not exported), kept
    keys are all there."""
    stored = set(export_dict(table))
    assert stored == kept
    assert not gone & stored
    for tier in table.tiers:  # no tier finds a removed key, whatever it held before
        hit, _, _ = tier.find(np.array(sorted(gone), dtype=np.int64))
        assert hit.size == 0, tier.name
    gone_keys = np.array(sorted(gone), dtype=np.int64)
    expected = table.config.initial_rows(gone_keys)[:, :DIM]
    np.testing.assert_array_equal(table.lookup(gone_keys, create=False), expected)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_steps_to_live_removes_rows_not_updated_for_that_many_steps(
    tmp_path: Path, setup: str
) -> None:
    config = config_of(setup, steps_to_live=8)
    store, table = open_table(tmp_path / "db", config)
    with store:
        oracle = Oracle()
        run_pushes(table, oracle, seed=1)
        gone = oracle.stale(8)
        kept = set(oracle.last) - gone
        assert gone and kept  # the workload exercises both
        if setup in ("spilled", "write_through"):  # some doomed rows live in RocksDB only
            in_host = set(table.tiers[0].index.export()[0].tolist())
            assert gone - in_host
        assert table.evict() == len(gone)
        assert_evicted(table, gone, kept)
        assert table.evict() == 0  # nothing is stale any more
        eviction = table.stats()["eviction"]
        assert eviction == {
            "removed_total": len(gone),
            "last_removed": 0,
            "runs": 2,
            "current_step": 30,
            "first_step": 1,
        }


@pytest.mark.parametrize("setup", ["host", "spilled", "direct"])
def test_min_l2_norm_removes_rows_whose_weights_are_small(tmp_path: Path, setup: str) -> None:
    config = config_of(setup, min_l2_norm=0.3)
    rng = np.random.default_rng(2)
    keys = np.arange(200, dtype=np.int64)
    values = (rng.standard_normal((200, DIM)) * rng.uniform(0.0, 0.4, (200, 1))).astype(np.float32)
    norms = {
        int(k): math.sqrt(sum(float(x) ** 2 for x in row))
        for k, row in zip(keys, values, strict=True)
    }
    gone = {k for k, norm in norms.items() if norm < 0.3}
    kept = set(norms) - gone
    assert gone and kept and min(abs(n - 0.3) for n in norms.values()) > 1e-6
    store, table = open_table(tmp_path / "db", config)
    with store:
        table.assign(keys, values)
        assert table.evict() == len(gone)
        assert_evicted(table, gone, kept)
        for key in sorted(kept)[:10]:  # survivors keep their weights
            np.testing.assert_array_equal(table.lookup(np.array([key]))[0], values[key])


@pytest.mark.parametrize("setup", ["spilled", "direct"])
def test_both_criteria_remove_the_union(tmp_path: Path, setup: str) -> None:
    config = config_of(setup, steps_to_live=5, min_l2_norm=0.2)
    store, table = open_table(tmp_path / "db", config)
    with store:
        oracle = Oracle()
        keys = np.arange(100, dtype=np.int64)
        small = keys[keys % 3 == 0]
        values = np.full((100, DIM), 0.5, np.float32)
        values[small] = 0.05  # norm 0.0866 < 0.2
        push(table, oracle, keys, 1)  # creates the rows at step 1
        table.assign(keys, values)  # assign: last-update step = current step (1)
        oracle.create(keys)
        # zero gradients: the pushes move the steps, not the weights (SGD and Adagrad alike)
        push(table, oracle, keys[keys % 2 == 0], 4, grad=0.0)
        push(table, oracle, keys[:10], 6, grad=0.0)
        stale = oracle.stale(5)  # odd keys >= 10, updated at step 1
        tiny = {int(k) for k in keys if math.sqrt(sum(float(x) ** 2 for x in values[k])) < 0.2}
        assert tiny == set(small.tolist())
        assert tiny - stale and stale - tiny and tiny & stale
        gone = stale | tiny
        assert table.evict() == len(gone)
        assert_evicted(table, gone, set(range(100)) - gone)


def test_last_update_steps_survive_a_restart(tmp_path: Path) -> None:
    config = config_of("spilled", steps_to_live=10)
    oracle = Oracle()
    store, table = open_table(tmp_path / "db", config)
    with store:
        run_pushes(table, oracle, seed=3)
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.table("t")
        assert (table.current_step, table.first_step) == (30, 1)
        push(table, oracle, np.arange(0, 250, 5), 34)
        gone = oracle.stale(10)
        assert table.evict() == len(gone)
        assert_evicted(table, gone, set(oracle.last) - gone)
    with EmbeddingStore(tmp_path / "db") as store:  # the removal is durable
        assert set(export_dict(store.table("t"))) == set(oracle.last) - gone


def test_steps_whose_bits_are_float_nans_are_kept_bit_for_bit(tmp_path: Path) -> None:
    """The step lives in two float32 slots: steps whose low half reads as a NaN (signalling
    or quiet) must come back exact through the cache, RocksDB and a restart. (A step is
    below 2**53, so its high half is below 0x00200000 and never a NaN; pushes move the
    clock by less than steps_to_live.)"""
    signalling = 0x7FBFFFFF  # a signalling NaN as float32; + 2 is a quiet one (0x7FC00001)
    config = config_of("spilled", steps_to_live=3)
    oracle = Oracle()
    store, table = open_table(tmp_path / "db", config)
    with store:
        push(table, oracle, np.arange(100), signalling)
        push(table, oracle, np.arange(50), signalling + 2)
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.table("t")
        stored = np.concatenate([table.codec.steps(rows) for _, rows in table.durable.export(64)])
        assert sorted(set(stored.tolist())) == [signalling, signalling + 2]
        push(table, oracle, np.arange(10), signalling + 4)
        push(table, oracle, np.arange(10, 20), signalling + 3)  # older: stamped + 4
        push(table, oracle, np.arange(20), signalling + 5)
        gone = oracle.stale(3)  # keys 20..99: 50..99 at the first step, 20..49 at + 2
        assert gone == set(range(20, 100))
        assert table.evict() == len(gone)
        assert set(export_dict(table)) == set(range(20))


def test_snapshot_rows_hold_row_width_floats_and_restored_rows_take_the_first_push(
    tmp_path: Path,
) -> None:
    config = config_of("host", steps_to_live=4)
    store, table = open_table(tmp_path / "db", config)
    with store:
        rows = config.initial_rows(np.arange(20))
        table.restore(np.arange(20), rows)  # before any push: they count from the first one
        for _, chunk in table.export():
            assert chunk.shape[1] == config.row_width
        np.testing.assert_array_equal(export_dict(table)[5], rows[5])
        table.apply_gradients(np.array([0]), np.ones((1, DIM), np.float32), 100)
        assert table.evict() == 0  # 100 - max(0, first step 100) = 0
        # a push moves the clock by less than steps_to_live (3 here): two pushes walk it
        table.apply_gradients(np.array([1]), np.ones((1, DIM), np.float32), 102)
        table.apply_gradients(np.array([1]), np.ones((1, DIM), np.float32), 104)
        assert table.evict() == 19  # 104 - 100 >= 4: all but key 1


def test_a_table_without_eviction_removes_nothing(tmp_path: Path) -> None:
    config = config_of("spilled")
    store, table = open_table(tmp_path / "db", config)
    with store:
        table.apply_gradients(np.arange(50), np.zeros((50, DIM), np.float32), 1)
        table.apply_gradients(np.arange(5), np.zeros((5, DIM), np.float32), 1000)
        assert config.stored_width == config.row_width
        assert table.evict() == 0
        assert len(export_dict(table)) == 50
        assert table.stats()["eviction"] is None
