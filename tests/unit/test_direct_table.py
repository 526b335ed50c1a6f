"""Direct tables (use_hashtable=False, capacity=N): row i of an arena holds key i, no hash
table. Keys outside [0, N) are refused before anything changes; flush, export, restart and
snapshots work as for a hashed table; initial rows are those of a hashed table."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import export_dict
from tests.optimizers import each, kind_id
from tierps.core.codec import step_bits
from tierps.storage import (
    EmbeddingStore,
    EmbeddingTable,
    InvalidArgumentError,
    ResourceExhaustedError,
    TableConfig,
    init,
    optim,
)
from tierps.storage.snapshot_reader import Snapshot
from tierps.storage.snapshot_writer import commit, write_part
from tierps.storage.store import check_direct_size

DIM = 4
CAPACITY = 10


def direct_config(name: str = "items", **fields: Any) -> TableConfig:
    fields.setdefault("optimizer", optim.Adam(lr=0.1))
    fields.setdefault("capacity", CAPACITY)
    return TableConfig(
        name, DIM, initializer=init.Normal(0.0, 0.1), seed=3, use_hashtable=False, **fields
    )


def ones(n: int) -> np.ndarray:
    return np.ones((n, DIM), np.float32)


@pytest.fixture
def table(store: EmbeddingStore) -> EmbeddingTable:
    table = store.create_table(direct_config())
    table.apply_gradients(np.array([0, 3, 9], np.int64), ones(3), step=1)
    return table


def state(table: EmbeddingTable) -> tuple[dict[int, np.ndarray], dict[str, Any]]:
    """Stored rows (export flushes, so dirty flags are left out of the comparison) and the
    stats that a refused call must not move."""
    rows = export_dict(table)
    stats = table.stats()
    direct = stats["tiers"]["direct"]
    return rows, {
        "initialized": stats["initialized"],
        "created": stats["created"],
        "direct": (direct["rows"], direct["hits"], direct["misses"]),
    }


def assert_same_state(before: Any, after: Any) -> None:
    (rows_before, stats_before), (rows_after, stats_after) = before, after
    assert stats_after == stats_before
    assert sorted(rows_after) == sorted(rows_before)
    for key, row in rows_before.items():
        np.testing.assert_array_equal(rows_after[key], row)


# One call per public entry point, each with key 10 (== capacity) at index 2.
OUT_OF_RANGE: dict[str, tuple[str, Callable[[EmbeddingTable, np.ndarray], Any]]] = {
    "lookup": ("lookup", lambda t, k: t.lookup(k)),
    "eval lookup": ("lookup", lambda t, k: t.lookup(k, create=False)),
    "apply_gradients": ("apply_gradients", lambda t, k: t.apply_gradients(k, ones(k.size), 2)),
    "assign": ("assign", lambda t, k: t.assign(k, ones(k.size))),
    "remove": ("remove", lambda t, k: t.remove(k)),
    "peek": ("peek", lambda t, k: t.peek(k)),
    "restore": (
        "restore",
        lambda t, k: t.restore(k, np.zeros((k.size, t.config.row_width), np.float32)),
    ),
}


@pytest.mark.parametrize("case", list(OUT_OF_RANGE))
def test_a_key_out_of_range_is_refused_naming_table_key_index_and_range(
    table: EmbeddingTable, case: str
) -> None:
    call_name, call = OUT_OF_RANGE[case]
    keys = np.array([1, 4, CAPACITY, 5], np.int64)
    before = state(table)
    with pytest.raises(InvalidArgumentError) as raised:
        call(table, keys)
    message = str(raised.value)
    for needle in (
        "table 'items' on shard 0",
        f"{call_name}:",
        f"[0, {CAPACITY})",
        f"got key {CAPACITY} at index 2",
        "use_hashtable=False",
    ):
        assert needle in message, (needle, message)
    assert_same_state(before, state(table))


@pytest.mark.parametrize("bad", [CAPACITY + 1, 2**40, 2**63 - 1])
def test_the_first_key_out_of_range_is_named_and_padding_is_not_refused(
    table: EmbeddingTable, bad: int
) -> None:
    keys = np.array([-1, -7, CAPACITY - 1, bad, CAPACITY], np.int64)
    with pytest.raises(InvalidArgumentError, match=rf"got key {bad} at index 3$"):
        table.lookup(keys)
    with pytest.raises(InvalidArgumentError, match=rf"got key {bad} at index 3$"):
        table.check_key_range(keys)
    uint_keys = np.array([2, bad], np.uint64)  # other integer dtypes are checked alike
    with pytest.raises(InvalidArgumentError, match=rf"got key {bad} at index 1$"):
        table.assign(uint_keys, ones(2))


def test_keys_in_range_and_padding_behave_as_in_a_hashed_table(store: EmbeddingStore) -> None:
    direct = store.create_table(direct_config("direct", write_policy="write_through"))
    hashed = store.create_table(
        TableConfig(
            "hashed", DIM, initializer=init.Normal(0.0, 0.1), seed=3, optimizer=optim.Adam(lr=0.1)
        )
    )
    rng = np.random.default_rng(0)
    for step in range(1, 30):
        keys = rng.integers(-2, CAPACITY, 12).astype(np.int64)  # padding and repeats
        np.testing.assert_array_equal(direct.lookup(keys), hashed.lookup(keys))
        grads = rng.standard_normal((12, DIM)).astype(np.float32)
        assert direct.apply_gradients(keys, grads, step) == hashed.apply_gradients(
            keys, grads, step
        )
        if step % 7 == 0:
            values = rng.standard_normal((12, DIM)).astype(np.float32)
            direct.assign(keys, values)
            hashed.assign(keys, values)
    every = np.arange(-1, CAPACITY, dtype=np.int64)
    np.testing.assert_array_equal(
        direct.lookup(every, create=False), hashed.lookup(every, create=False)
    )
    assert export_dict(direct).keys() == export_dict(hashed).keys()
    for key, row in export_dict(hashed).items():
        np.testing.assert_array_equal(export_dict(direct)[key], row)
    # initial rows are the initializer's, a pure function of (seed, key)
    fresh = np.array([k for k in range(CAPACITY) if k not in export_dict(direct)], np.int64)
    np.testing.assert_array_equal(
        direct.lookup(fresh, create=False), direct.config.initial_rows(fresh)[:, :DIM]
    )


def test_tiers_and_stats_of_a_direct_table(store: EmbeddingStore) -> None:
    config = direct_config(host_cache_bytes=0)  # the budget does not apply to a direct table
    table = store.create_table(config)
    stats = table.stats()["tiers"]
    assert list(stats) == ["direct", "rocksdb"]
    assert stats["direct"]["capacity_rows"] == CAPACITY
    assert stats["direct"]["bytes"] >= CAPACITY * config.row_bytes
    assert stats["direct"]["rows"] == 0
    table.lookup(np.array([1, 2, 2, -1], np.int64))  # 3 misses: rows 1 and 2 are created
    table.lookup(np.array([2, 5], np.int64), create=False)  # a hit and a miss, 5 not stored
    direct = table.stats()["tiers"]["direct"]
    assert (direct["rows"], direct["hits"], direct["misses"]) == (2, 1, 4)
    assert direct["dirty_rows"] == 2
    table.flush()
    assert table.stats()["tiers"]["direct"]["dirty_rows"] == 0
    assert table.tiers[-1].contains(np.array([1, 2, 5], np.int64)).tolist() == [True, True, False]


def test_write_through_leaves_no_dirty_row(store: EmbeddingStore) -> None:
    table = store.create_table(direct_config(write_policy="write_through"))
    table.apply_gradients(np.array([2, 7], np.int64), ones(2), step=1)
    assert table.stats()["tiers"]["direct"]["dirty_rows"] == 0
    assert table.tiers[-1].contains(np.array([2, 7], np.int64)).all()


def test_restart_reads_rows_back_from_rocksdb(tmp_path: Path) -> None:
    config = direct_config()
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        table.apply_gradients(np.array([0, 4, 9], np.int64), ones(3), step=1)
        table.assign(np.array([5], np.int64), np.full((1, DIM), 2.0, np.float32))
        expected = export_dict(table)
        probe = np.arange(-1, CAPACITY, dtype=np.int64)
        weights = table.lookup(probe, create=False)
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.table("items")
        assert table.config == config
        assert table.stats()["tiers"]["direct"]["rows"] == 0  # the arena starts empty
        np.testing.assert_array_equal(table.lookup(probe, create=False), weights)
        stats = table.stats()["tiers"]
        assert stats["rocksdb"]["hits"] == 4  # the stored rows came from RocksDB ...
        assert stats["direct"]["rows"] == 4  # ... and were promoted into the arena
        got = export_dict(table)
        assert sorted(got) == sorted(expected) == [0, 4, 5, 9]
        for key, row in expected.items():
            np.testing.assert_array_equal(got[key], row)
        # training goes on from the stored optimizer state
        table.apply_gradients(np.array([4], np.int64), ones(1), step=2)
        after = export_dict(table)
        assert not np.array_equal(after[4], expected[4])


def test_export_and_restore_round_trip(tmp_path: Path) -> None:
    config = direct_config(optimizer=optim.Adagrad(lr=0.1))
    with EmbeddingStore(tmp_path / "a") as source:
        table = source.create_table(config)
        table.apply_gradients(np.arange(0, CAPACITY, 2, dtype=np.int64), ones(5), step=1)
        chunks = list(table.export(chunk_rows=2))
        assert [k.tolist() for k, _ in chunks] == [[0, 2], [4, 6], [8]]  # key order
        expected = export_dict(table)
    with EmbeddingStore(tmp_path / "b") as target:
        copy = target.create_table(config)
        for keys, rows in chunks:
            copy.restore(keys, rows)
        assert copy.stats()["tiers"]["direct"]["rows"] == 5
        got = export_dict(copy)
    assert sorted(got) == sorted(expected)
    for key, row in expected.items():
        np.testing.assert_array_equal(got[key], row)


def test_snapshot_save_and_load_into_two_shards(tmp_path: Path) -> None:
    """A snapshot's save (export) and load (rows_for_shard + restore) as a shard
    does them, resharding one part into two: shard i keeps keys k % 2 == i."""
    config = direct_config()
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        table.apply_gradients(np.arange(CAPACITY, dtype=np.int64), ones(CAPACITY), step=1)
        expected = export_dict(table)
        exports = [(config, table.export(4))]
        list(write_part(tmp_path / "snaps", "s", "save1", 0, 1, exports, CAPACITY))
    commit(tmp_path / "snaps", "s", "save1")
    opened = Snapshot(tmp_path / "snaps", "s")
    opened.verify()
    assert opened.configs["items"] == config
    for shard_id in (0, 1):
        with EmbeddingStore(tmp_path / f"shard{shard_id}", shard_id=shard_id) as store:
            table = store.create_table(opened.configs["items"])
            for keys, rows, _ in opened.rows_for_shard("items", shard_id, 2, chunk_rows=3):
                table.restore(keys, rows)
            got = export_dict(table)
        assert sorted(got) == list(range(shard_id, CAPACITY, 2))
        for key, row in got.items():
            np.testing.assert_array_equal(row, expected[key])


def test_a_direct_table_too_large_for_memory_is_refused_and_not_kept(tmp_path: Path) -> None:
    config = direct_config("huge", capacity=2**40)  # 2**40 rows of 12 floats: 52 TiB
    with EmbeddingStore(tmp_path / "db") as store:
        with pytest.raises(ResourceExhaustedError) as raised:
            store.create_table(config)
        message = str(raised.value)
        for needle in (
            "table 'huge' on shard 0",
            f"{2**40} rows x 50 bytes",
            "at most",
            "lower capacity",
            "use_hashtable=True",
        ):
            assert needle in message, (needle, message)
        assert store.tables() == []
    with EmbeddingStore(tmp_path / "db") as reopened:
        assert reopened.tables() == []


def test_the_size_bound_is_half_the_given_memory() -> None:
    config = direct_config()  # 10 rows of 12 floats + 2 flag bytes: 500 bytes
    check_direct_size(config, "t", memory_bytes=1000)
    with pytest.raises(ResourceExhaustedError, match=re.escape("expected at most 499 bytes")):
        check_direct_size(config, "t", memory_bytes=999)
    check_direct_size(TableConfig("h", DIM), "t", memory_bytes=1)  # hashed: not bounded here


def _present_tier(config: TableConfig, rows: np.ndarray) -> Any:
    """A direct tier that trains in place, holding rows for keys 0, 2, 4, ... (odd keys
    absent: the cascade's)."""
    from tierps.storage.tiers import DirectTier

    tier = DirectTier(config, compiled=True)
    keys = np.arange(0, config.capacity, 2, dtype=np.int64)
    tier.insert(keys, rows[keys], np.arange(keys.size) % 3 == 0, lambda *_: None)
    return tier


@pytest.mark.parametrize("optimizer", [*each(), optim.FTRL(lr=0.05, l2=0.1)], ids=kind_id)
def test_a_direct_tier_trains_its_present_rows_in_place_as_the_array_code_does(
    optimizer: optim.Optimizer,
) -> None:
    """train_resident: the present keys' rows trained where they lie, within the derived
    float64 bound of the update that the array code (gather, apply, scatter) also meets,
    stamped and marked dirty, hits counted; absent keys left to the cascade, other rows
    untouched; the undo puts back every bit."""
    from tests.unit.test_kernels import _float64_step, assert_within

    rng = np.random.default_rng(5)
    config = direct_config(optimizer=optimizer, capacity=200, steps_to_live=10)
    rows = np.zeros((200, config.stored_width), np.float32)
    rows[:, : config.row_width] = config.initial_rows(np.arange(200, dtype=np.int64))
    rows[:, :DIM] = rng.standard_normal((200, DIM), dtype=np.float32)
    tier = _present_tier(config, rows)
    before = tier.arena.copy(), tier.dirty.copy()
    push = rng.permutation(200)[:80].astype(np.int64)  # about half of them present
    grads = rng.standard_normal((80, DIM), dtype=np.float32)
    hits = tier.hits
    hit, undo, refused = tier.train_resident(push, grads, 3, 5)
    present = np.flatnonzero(push % 2 == 0)
    np.testing.assert_array_equal(hit, present)
    assert refused is None and undo is not None and tier.hits == hits + present.size
    trained = push[present]
    width = config.row_width
    expected = _float64_step(optimizer, rows[trained, :width], grads[present], 3)
    assert_within(f"direct {optimizer.kind}", tier.arena[trained, :width], expected)
    gathered = rows[trained].copy()  # the array code the cascade runs otherwise
    optimizer.apply(gathered, grads[present], 3)
    assert_within(f"numpy {optimizer.kind}", gathered[:, :width], expected)
    stamps = np.broadcast_to(step_bits(5), (trained.size, config.stored_width - width))
    np.testing.assert_array_equal(tier.arena[trained, width:], stamps)
    assert tier.dirty[trained].all()
    others = np.setdiff1d(np.arange(200), trained)
    np.testing.assert_array_equal(tier.arena[others], before[0][others])
    np.testing.assert_array_equal(tier.dirty[others], before[1][others])
    undo()
    np.testing.assert_array_equal(tier.arena.view(np.uint32), before[0].view(np.uint32))
    np.testing.assert_array_equal(tier.dirty, before[1])


def test_a_direct_tier_refusing_a_non_finite_update_changes_nothing() -> None:
    """An update made non-finite in a late row: every row and dirty flag as it was (the
    rows trained before it put back), the trained rows handed back for the refusal."""
    config = direct_config(capacity=100, steps_to_live=10)
    rows = np.zeros((100, config.stored_width), np.float32)
    rows[:, : config.row_width] = config.initial_rows(np.arange(100, dtype=np.int64))
    tier = _present_tier(config, rows)
    before = tier.arena.copy(), tier.dirty.copy()
    push = np.arange(0, 100, 2, dtype=np.int64)
    grads = np.full((push.size, DIM), 1e-3, np.float32)
    grads[40, 1] = 1e20  # Adam's v = (1 - beta2) * g * g overflows float32
    hit, undo, refused = tier.train_resident(push, grads, 1, 1)
    assert undo is None and refused is not None and hit.size == push.size
    assert not np.isfinite(refused[40]).all() and np.isfinite(refused[:40]).all()
    np.testing.assert_array_equal(tier.arena.view(np.uint32), before[0].view(np.uint32))
    np.testing.assert_array_equal(tier.dirty, before[1])


def test_a_refused_push_on_a_warm_direct_table_changes_no_row(store: EmbeddingStore) -> None:
    """Through the table: rows trained in place (the second push of the same keys), then a
    push that one key's gradient makes non-finite: refused naming the table, and no row,
    dirty flag or count of rows moved (hits count rows found, refused or not, as on a
    hashed table)."""
    table = store.create_table(direct_config())
    keys = np.array([1, 4, 7], np.int64)
    table.apply_gradients(keys, ones(3), step=1)  # made: the cascade's array code
    table.apply_gradients(keys, ones(3) * 0.5, step=2)  # present: trained in place
    assert table.tiers[0].trains_in_place
    table.flush()  # clean: a lost restore of the dirty flags shows
    tier = table.tiers[0]
    arena, dirty, stats = tier.arena.copy(), tier.dirty.copy(), table.stats()
    assert not dirty.any()
    grads = ones(3)
    grads[2, 3] = 1e20
    with pytest.raises(InvalidArgumentError, match="items"):
        table.apply_gradients(keys, grads, step=3)
    np.testing.assert_array_equal(tier.arena.view(np.uint32), arena.view(np.uint32))
    np.testing.assert_array_equal(tier.dirty, dirty)
    after = table.stats()
    for field in ("initialized", "created"):
        assert after[field] == stats[field]
    assert after["tiers"]["direct"]["rows"] == stats["tiers"]["direct"]["rows"]


@pytest.mark.parametrize("dim", [4, 16])  # 16: rows of whole cache lines, streamed when large
def test_a_compiled_direct_find_writes_what_the_array_code_writes(dim: int) -> None:
    """find_into compiled (k_take_rows) against the array code's find and copy: the same
    rows (the first `width` columns), zeros for padding, the misses listed and left as they
    were, the same hits and misses counted; into a given out and a new one."""
    from tierps.storage.tiers import DirectTier

    rng = np.random.default_rng(11)
    config = TableConfig("d", dim, optimizer=optim.Adam(), use_hashtable=False, capacity=5000)
    tiers = [DirectTier(config, compiled=compiled) for compiled in (True, False)]
    held = rng.choice(5000, 3000, replace=False).astype(np.int64)
    rows = rng.standard_normal((held.size, config.stored_width), dtype=np.float32)
    for tier in tiers:
        tier.insert(held, rows, np.zeros(held.size, dtype=bool), lambda *_: None)
    for n in (7, 70000):  # 70000 rows of 64 bytes (dim 16): past STREAM_BYTES, streamed
        keys = rng.integers(-3, 5000, n).astype(np.int64)
        outs = [np.full((n, dim), np.nan, np.float32) for _ in tiers]
        found = [t.find_into(keys, out, dim) for t, out in zip(tiers, outs, strict=True)]
        np.testing.assert_array_equal(found[0][1], found[1][1])
        np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
        assert np.isnan(outs[0][found[0][1]]).all() and (outs[0][keys < 0] == 0).all()
        new = [t.find_into(keys, None, dim) for t in tiers]
        live = np.setdiff1d(np.arange(n), new[1][1])
        np.testing.assert_array_equal(new[0][0][live], new[1][0][live])
        assert (tiers[0].hits, tiers[0].misses) == (tiers[1].hits, tiers[1].misses)
