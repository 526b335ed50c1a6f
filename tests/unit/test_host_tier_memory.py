"""A host tier's memory follows the rows it holds, not its budget (storage/tiers.py).

host_cache_bytes is a cap: a table with an 8 GiB budget that holds 100,000 rows allocates
what those rows need (their arena rows, dirty flags and index, with the arena's growth
step and one index rebuild on top), measured by tracemalloc, which sees every numpy
allocation, and its own byte accounting says so. At a budget smaller than the keys, the
arena stops growing at the budget's rows and the rest goes to RocksDB.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from tierps.core import optim
from tierps.core.config import TableConfig
from tierps.storage import EmbeddingStore
from tierps.storage.hash_table import HashTable
from tierps.storage.tiers import ARENA_GROWTH, host_rows_for_budget
from tierps.storage.warm_up import warm_up

KEYS = 100_000
DIM = 16
BIG_BUDGET = 8 << 30


def _first_touch(table, keys: np.ndarray, batch: int) -> None:
    for start in range(0, keys.size, batch):
        table.lookup(keys[start : start + batch])


def _keys(n: int) -> np.ndarray:
    return np.random.default_rng(3).choice(2**40, n, replace=False).astype(np.int64)


@pytest.mark.parametrize("batch", [16_384, KEYS])
def test_first_touch_allocates_what_the_rows_need_whatever_the_budget(
    tmp_path: Path, batch: int
) -> None:
    """The peak of what a first touch of KEYS keys allocates under an 8 GiB budget is
    bounded by the rows: the arena and flags at most ARENA_GROWTH times the rows (its
    capacity) plus the rows copied at a growth, the index and the one it rebuilds into,
    and a call's temporaries (a few copies of its rows: the initializer's, the lookup's
    output; its keys' slots, row ids and masks) - under 1% of the budget, so that
    anything sized by the budget fails here. The kernels are compiled first: numba's
    compiler keeps Python objects that tracemalloc would count."""
    config = TableConfig("t", DIM, optimizer=optim.SGD(), host_cache_bytes=BIG_BUDGET)
    row = config.stored_bytes + 1  # a row and its dirty flag
    need = KEYS * row + HashTable.nbytes_for(KEYS)
    temporaries = batch * (4 * config.stored_bytes + 64)
    bound = (ARENA_GROWTH + 1) * KEYS * row + 2 * HashTable.nbytes_for(KEYS) + temporaries
    assert bound < BIG_BUDGET / 100
    keys = _keys(KEYS)
    warm_up()
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        tracemalloc.start()
        try:
            _first_touch(table, keys, batch)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        host = table.stats()["tiers"]["host"]
        assert host["rows"] == KEYS
        assert host["capacity_rows"] == host_rows_for_budget(BIG_BUDGET, config.stored_bytes)
        # what it reports taking: the rows written and the index, not the capacity
        assert host["bytes"] == KEYS * row + table.tiers[0].index.nbytes <= 2 * need
    assert peak <= bound, f"first touch allocated {peak} bytes at peak, bound {bound}"


def test_the_arena_grows_only_to_the_budget_and_the_rest_goes_to_rocksdb(
    tmp_path: Path,
) -> None:
    """A budget for fewer rows than the keys: the arena's growth steps stop at the
    budget's rows, the host tier holds that many, the others are in RocksDB, and every
    key reads back its initial row."""
    probe = TableConfig("t", DIM, optimizer=optim.SGD())
    budget = 3 * 1024 * (probe.stored_bytes + 100)  # about 3,000 rows: between two steps
    config = TableConfig("t", DIM, optimizer=optim.SGD(), host_cache_bytes=budget)
    max_rows = host_rows_for_budget(budget, config.stored_bytes)
    keys = _keys(10_000)
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        first = np.concatenate([table.lookup(part) for part in np.array_split(keys, 10)])
        host = table.tiers[0]
        assert host.arena.shape[0] == max_rows, "the arena should stop at the budget's rows"
        assert host.rows <= max_rows and table.stats()["spilled"] >= keys.size - max_rows
        np.testing.assert_array_equal(table.lookup(keys, create=False), first)
        np.testing.assert_array_equal(
            first, table.config.initial_rows(keys)[:, :DIM]
        )
