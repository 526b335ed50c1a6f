"""Tombstones and rebuilds of HashTable (storage/hash_table.py), against a dict oracle.

A cache tier that is full evicts k keys and inserts k new ones per batch. At a power-of-two
budget its index holds exactly max_load of its slots, so when tombstones counted toward the
max_load limit every such batch rebuilt the whole index (measured: 20 rebuilds in 20
spilling batches). Now live keys and tombstones share a higher limit, the midpoint between
max_load and 1, and claims reuse tombstones; the bound on rebuilds is derived below.

A rebuild that fails (out of memory: a MemoryError injected into the array module at each of
its allocations in turn) leaves the table exactly as it was.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tierps.core.hashing import hash_keys
from tierps.storage.hash_table import EMPTY, TOMBSTONE, HashTable

BATCHES = 20


def rebuild_bound(table: HashTable, live: int, k: int, batches: int) -> int:
    """The most rebuilds `batches` spilling batches (k evicted, k new) can cause in a table
    holding `live` keys and no tombstones at the start.

    A batch raises live keys + tombstones (`used`) by at most k (each new key takes an EMPTY
    slot or reuses a tombstone; an eviction turns a live slot into a tombstone). The table
    rebuilds in a batch only when used + k exceeds U = (1 + max_load) / 2 * slots, and a
    rebuild leaves used = live keys <= `live`. So after a rebuild (or at the start) used
    <= live + j * k at the start of the j-th batch after it, a rebuild needs
    live + j * k + k > U, i.e. j >= (U - live) // k + 1 =: gap, and `batches` batches hold
    at most batches // gap rebuilds."""
    limit = (1.0 + table.max_load) / 2.0 * table.slots
    gap = int((limit - live) // k) + 1
    return batches // gap


def spill_batches(table: HashTable, live: int, k: int, seed: int = 0) -> dict[int, int]:
    """Fill the table with `live` keys, then run BATCHES batches as CacheTier.insert does
    when full: evict the k lowest-scored keys, reserve room, insert k new keys and set their
    values. Checked after every batch against a dict oracle. Returns the oracle."""
    rng = np.random.default_rng(seed)
    oracle: dict[int, int] = {}
    next_value = 0

    def add(keys: np.ndarray) -> None:
        nonlocal next_value
        values = np.arange(next_value, next_value + keys.size, dtype=np.int64)
        next_value += keys.size
        slots = table.insert_absent(keys)
        table.values[slots] = values
        table.touch(slots)
        oracle.update(zip(keys.tolist(), values.tolist(), strict=True))

    fresh = rng.choice(np.int64(1) << 40, size=live + BATCHES * k, replace=False)
    add(fresh[:live])
    assert table.size == live and table.tombstones == 0
    start_slots, start_rebuilds = table.slots, table.rebuilds
    tombstones_seen = 0
    for batch in range(BATCHES):
        victims = table.eviction_candidates(k)
        evicted = table.keys_at(victims)
        table.remove_slots(victims)
        for key in evicted.tolist():
            del oracle[key]
        tombstones_seen = max(tombstones_seen, table.tombstones)
        table.reserve(k)
        new = fresh[live + batch * k : live + (batch + 1) * k]
        add(new)
        assert_matches(table, oracle, absent=evicted)
    assert table.slots == start_slots  # never grew: the live keys did not
    assert tombstones_seen >= k  # the batches did leave tombstones behind
    table.spill_rebuilds = table.rebuilds - start_rebuilds  # type: ignore[attr-defined]
    return oracle


def assert_matches(table: HashTable, oracle: dict[int, int], absent: Any = ()) -> None:
    """The table holds exactly the oracle's items (and none of `absent`)."""
    keys = np.fromiter(oracle, dtype=np.int64, count=len(oracle))
    slots = table.find(keys)
    assert (slots >= 0).all(), f"{int((slots < 0).sum())} keys lost"
    np.testing.assert_array_equal(table.values[slots], np.fromiter(oracle.values(), np.int64))
    assert table.size == len(oracle)
    exported, _ = table.export()
    assert sorted(exported.tolist()) == sorted(oracle)
    if len(absent):
        assert (table.find(np.asarray(absent, dtype=np.int64)) < 0).all()


@pytest.mark.parametrize("max_load", [0.5, 0.75])
def test_a_full_cache_spilling_at_a_power_of_two_budget_rarely_rebuilds(max_load: float) -> None:
    """live = max_load * slots exactly (what host_rows_for_budget gives at a power-of-two
    budget), k = live / 16 per batch: at most BATCHES // gap rebuilds (2 at max_load 0.5),
    where every batch rebuilt before."""
    slots = 1 << 13
    live = int(max_load * slots)
    k = live // 16
    table = HashTable(live, max_load=max_load)
    assert table.slots == slots
    spill_batches(table, live, k)
    bound = rebuild_bound(table, live, k, BATCHES)
    assert bound == {0.5: 2, 0.75: 6}[max_load]  # < BATCHES: the old code rebuilt 20 times
    assert table.spill_rebuilds <= bound, (table.spill_rebuilds, bound)


def test_the_tombstone_limit_does_force_a_rebuild() -> None:
    """A rebuild still happens when tombstones would reach the limit, and drops them: the
    limit holds, so probing always ends at an EMPTY slot."""
    table = HashTable(64, max_load=0.5)  # 128 slots: 64 live keys, 96 live + tombstones
    oracle = {}
    key = 1
    for _ in range(40):
        keys = np.arange(key, key + 8, dtype=np.int64)
        key += 8
        slots, inserted = table.insert(keys)
        table.values[slots] = keys * 10
        oracle.update({int(k): int(k) * 10 for k in keys})
        if table.size > 48:
            gone = np.fromiter(list(oracle)[:8], dtype=np.int64)
            assert table.erase(gone) == 8
            for k in gone.tolist():
                del oracle[k]
        assert table.size + table.tombstones <= 0.75 * table.slots
        assert int(np.count_nonzero(table.keys_at(np.arange(table.slots)) == EMPTY)) > 0
        assert_matches(table, oracle)
    assert table.slots == 128 and table.rebuilds >= 1


def test_an_insert_past_a_tombstone_finds_its_key_instead_of_claiming_the_tombstone() -> None:
    """Keys a, b share a home slot (b one further); a erased leaves a tombstone at the home.
    Inserting b again must find b, not claim the tombstone (two copies of b)."""
    table = HashTable(8)
    candidates = np.arange(1, 10_000, dtype=np.int64)
    homes = (hash_keys(candidates) & np.uint64(table.slots - 1)).astype(np.int64)
    a, b = candidates[homes == homes[0]][:2]
    slots = np.concatenate([table.insert(np.array([key]))[0] for key in (a, b)])
    assert slots[1] == (slots[0] + 1) % table.slots
    table.erase(np.array([a], dtype=np.int64))
    assert table.keys_at(slots[:1])[0] == TOMBSTONE
    again, inserted = table.insert(np.array([b, b], dtype=np.int64))
    assert not inserted.any() and (again == slots[1]).all() and table.size == 1
    np.testing.assert_array_equal(table.find(np.array([a, b])), [-1, slots[1]])


class FailingArrays:
    """numpy, except that the n-th call of an allocating function raises MemoryError (as
    cupy's OutOfMemoryError, a MemoryError, would on a full GPU)."""

    ALLOCATING = ("full", "zeros", "empty", "arange", "nonzero", "unique", "count_nonzero")

    def __init__(self) -> None:
        self.fail_at = 0  # 0: never
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        found = getattr(np, name)
        if name not in self.ALLOCATING:
            return found

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == self.fail_at:
                raise MemoryError(f"injected: {name} is out of memory")
            return found(*args, **kwargs)

        return call


def _state(table: HashTable) -> tuple[Any, ...]:
    return (
        table.keys_at(np.arange(table.slots)).copy(),
        table.values.copy(),
        table._scores.copy(),
        table.size,
        table.tombstones,
        table.slots,
        table.rebuilds,
    )


@pytest.mark.parametrize("grow", [False, True], ids=["drop-tombstones", "grow"])
def test_a_rebuild_that_runs_out_of_memory_leaves_the_table_as_it_was(grow: bool) -> None:
    arrays = FailingArrays()
    table = HashTable(64, xp=arrays, kernels=False)  # type: ignore[arg-type]
    keys = np.arange(100, 164, dtype=np.int64)
    slots, _ = table.insert(keys)
    table.values[slots] = keys * 3
    table.touch(slots)
    assert table.erase(keys[:40]) == 40
    oracle = {int(k): int(k) * 3 for k in keys[40:]}
    # 128 slots, 24 live, 64 used: 24 + 80 > 64 grows; 24 + 36 <= 64 but 64 + 36 > 96 rebuilds
    new = 80 if grow else 36
    failures = 0
    while True:
        before = _state(table)
        arrays.calls, arrays.fail_at = 0, failures + 1
        try:
            rehashed = table.reserve(new)
        except MemoryError:
            failures += 1
            after = _state(table)
            for was, now in zip(before, after, strict=True):
                np.testing.assert_array_equal(now, was)
            assert_matches(table, oracle, absent=keys[:40])
            continue
        break
    assert failures >= 3  # the gathers, the new arrays and the claim's own each failed once
    arrays.fail_at = 0
    assert rehashed and table.rebuilds == 1 and table.tombstones == 0
    assert table.slots == (256 if grow else 128)
    assert_matches(table, oracle, absent=keys[:40])
    added = np.arange(1000, 1000 + new, dtype=np.int64)
    slots = table.insert_absent(added)  # reserve's promise: no rehash for these
    table.values[slots] = added * 3
    oracle.update({int(k): int(k) * 3 for k in added})
    assert table.rebuilds == 1
    assert_matches(table, oracle)
