"""Acknowledged means kept, at the storage layer, with real faults: a RocksDB on a small
tmpfs that fills up. Each table trains with SGD(lr=1) from zeros and every gradient is -1, so
a row's weight is exactly the number of pushes applied to it (integers, exact in float32):
the oracle is the count of acknowledged pushes per key, and a row above it means a refused
push was applied, a row below it means an acknowledged one was lost."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import export_dict
from tests.fault_fs import fill, small_tmpfs
from tierps.storage import (
    DataLossError,
    EmbeddingStore,
    StorageFullError,
    TableConfig,
    init,
    optim,
)
from tierps.storage.table import EmbeddingTable
from tierps.storage.tiers import CacheTier, Spill

DIM = 64  # 256 bytes of weights a row: a few thousand rows fill a few MiB
UNIVERSE = 20_000


def counting_table(name: str, **overrides: object) -> TableConfig:
    return TableConfig(
        name,
        DIM,
        initializer=init.Zeros(),
        optimizer=optim.SGD(lr=1.0),
        host_cache_bytes=overrides.pop("host_cache_bytes", 256 << 10),  # type: ignore[arg-type]
        **overrides,  # type: ignore[arg-type]
    )


def lost_and_extra(store: EmbeddingStore, name: str, acked: np.ndarray) -> tuple[int, int]:
    """(acknowledged updates missing, updates present that were never acknowledged)."""
    rows = export_dict(store.table(name))
    weight = np.zeros(UNIVERSE, dtype=np.int64)
    for key, row in rows.items():
        assert np.all(row[:DIM] == row[0]), f"key {key}: columns differ: {row[:DIM]}"
        weight[key] = int(row[0])
    return int(np.maximum(acked - weight, 0).sum()), int(np.maximum(weight - acked, 0).sum())


@pytest.fixture
def full_disk(tmp_path: Path):
    with small_tmpfs(tmp_path / "fs", megabytes=30) as fs:
        yield fs


@pytest.mark.parametrize("gpu", [False, True], ids=["host", "gpu-over-host"])
def test_full_disk_write_back_loses_nothing_and_recovers(full_disk: Path, gpu: bool) -> None:
    """Host tier over RocksDB, and a GPU tier (its code on numpy arrays) over both."""
    rng = np.random.default_rng(7)
    acked = np.zeros(UNIVERSE, dtype=np.int64)
    refused = 0
    store = EmbeddingStore(full_disk / "db", gpu_arrays="numpy")
    store.create_table(counting_table("t", gpu_cache_bytes=(128 << 10) if gpu else 0))
    table = store.table("t")
    filler = fill(full_disk, leave_bytes=3 << 20)
    for _ in range(400):  # spilling batches until the disk is full, then some more
        keys = rng.choice(UNIVERSE, size=512, replace=False).astype(np.int64)
        try:
            table.apply_gradients(keys, -np.ones((keys.size, DIM), np.float32), step=1)
        except StorageFullError as error:
            assert "No space left" in str(error) and "table 't' on shard 0" in str(error)
            refused += 1
            if refused >= 20:
                break
            continue
        acked[keys] += 1
    assert refused >= 20, "the disk never filled: the test proves nothing"
    assert not store.writable
    # a read-only lookup of rows below the host tier promotes them: evicting dirty rows
    # needs a write, which fails: the lookup still answers, and nothing may be lost by it
    cold = np.flatnonzero(acked)[:2000].astype(np.int64)
    out = table.lookup(cold, create=False)
    assert np.array_equal(out[:, 0], acked[cold].astype(np.float32))
    with pytest.raises(StorageFullError):
        store.flush()
    assert store.recover() is False  # still no space: it does not even try to reopen
    filler.unlink()  # space is back
    assert store.recover() is True
    assert store.writable and store.recoveries == 1
    lost, extra = lost_and_extra(store, "t", acked)
    assert (lost, extra) == (0, 0)
    # and after a restart (clean close, reopen)
    store.close()
    with EmbeddingStore(full_disk / "db", gpu_arrays="numpy") as reopened:
        assert lost_and_extra(reopened, "t", acked) == (0, 0)
    print(
        f"full disk, write_back: {int(acked.sum())} acknowledged key-updates, "
        f"{refused} pushes refused, lost 0"
    )


def sighting_state(table: EmbeddingTable) -> dict[str, object]:
    """What a push may change besides rows: the table's figures (counts of sightings,
    promotions, creations, dropped gradients, bucket updates; not the tiers' hits and
    misses, which a refused call's reads count too), the bucket rows, the clock."""
    stats = table.stats()
    del stats["tiers"]
    buckets = table.buckets
    return {
        **stats,
        "bucket_rows": buckets.rows.tobytes() if buckets is not None else None,
        "clock": (table.current_step, table.first_step, table.leap_step),
    }


@pytest.mark.parametrize(
    "lifecycle",
    [
        {"admit_after": 2},
        {"promote_after": 2, "hash_bucket_size": 64},
        {"promote_after": 2, "hash_bucket_size": 64, "write_policy": "write_through"},
    ],
    ids=["admission", "adaptive", "adaptive-write-through"],
)
def test_a_push_refused_by_a_full_disk_counts_nothing(
    full_disk: Path, lifecycle: dict[str, int]
) -> None:
    """A push whose rows cannot be stored (its evictions need RocksDB, whose disk is full)
    leaves no trace: no sighting or promotion counted, no bucket row trained, nothing
    created, the clock where it was; and once space is back nothing acknowledged is lost."""
    store = EmbeddingStore(full_disk / "db")
    store.create_table(counting_table("t", steps_to_live=1_000, **lifecycle))
    table = store.table("t")
    rng = np.random.default_rng(5)
    filler = fill(full_disk, leave_bytes=3 << 20)
    refused = 0
    for step in range(1, 400):
        keys = rng.choice(UNIVERSE, size=512, replace=False).astype(np.int64)
        before = sighting_state(table)
        try:
            table.apply_gradients(keys, -np.ones((keys.size, DIM), np.float32), step=step)
        except StorageFullError:
            refused += 1
            assert sighting_state(table) == before, f"refused push {refused} changed state"
            if lifecycle.get("write_policy") == "write_through":  # buckets and rows: one batch
                buckets = table.buckets
                assert buckets is not None
                _, on_disk, _ = buckets.durable.find(np.arange(buckets.size, dtype=np.int64))
                np.testing.assert_array_equal(on_disk, buckets.rows)
            if refused >= 5:
                break
    assert refused >= 5, "the disk never filled: the test proves nothing"
    filler.unlink()
    assert store.recover()
    store.close()


def test_a_write_through_row_a_cache_cannot_take_is_read_from_rocksdb(tmp_path: Path) -> None:
    """Write-through: once RocksDB holds a push's rows the push succeeded. If the host tier
    then fails to take them (out of memory, injected), it drops its older copies, so no
    lookup reads a stale row, and the rows are there after a restart."""
    store = EmbeddingStore(tmp_path / "db")
    store.create_table(counting_table("wt", write_policy="write_through"))
    table = store.table("wt")
    host = table.tiers[0]
    keys = np.arange(300, dtype=np.int64)
    grads = -np.ones((keys.size, DIM), np.float32)
    table.apply_gradients(keys, grads, step=1)
    assert host.find(keys)[0].size == keys.size  # cached, clean

    def out_of_memory(*args: object) -> None:
        raise MemoryError("injected: the host tier cannot take the rows")

    host.insert = out_of_memory
    try:
        assert table.apply_gradients(keys, grads, step=2) == keys.size
    finally:
        del host.insert
    assert host.find(keys)[0].size == 0  # no stale copy left
    np.testing.assert_array_equal(table.lookup(keys, create=False), np.full((300, DIM), 2.0))
    store.close()
    with EmbeddingStore(tmp_path / "db") as reopened:
        np.testing.assert_array_equal(
            reopened.table("wt").lookup(keys, create=False), np.full((300, DIM), 2.0)
        )


def test_write_through_push_is_atomic_on_a_full_disk(full_disk: Path) -> None:
    """A write-through push of 20,000 rows (5 MiB: more than one 4 MiB batch used to be) on
    a nearly full disk is refused whole: after recovery and restart no row carries it."""
    store = EmbeddingStore(full_disk / "db")
    store.create_table(counting_table("wt", write_policy="write_through"))
    table = store.table("wt")
    keys = np.arange(UNIVERSE, dtype=np.int64)
    grads = -np.ones((keys.size, DIM), np.float32)
    table.apply_gradients(keys[:100], grads[:100], step=1)  # acknowledged: durable at once
    acked = np.zeros(UNIVERSE, dtype=np.int64)
    acked[:100] = 1
    filler = fill(full_disk, leave_bytes=2 << 20)
    with pytest.raises(StorageFullError):
        table.apply_gradients(keys, grads, step=2)
    filler.unlink()
    assert store.recover()
    assert lost_and_extra(store, "wt", acked) == (0, 0)
    store.close()
    with EmbeddingStore(full_disk / "db") as reopened:
        assert lost_and_extra(reopened, "wt", acked) == (0, 0)


def assert_rows_accounted(tier: CacheTier) -> None:
    """Every row id below the high mark is either a live key's (once) or free (once)."""
    _, live_ids = tier.index.export()
    ids = np.concatenate([np.asarray(live_ids), np.asarray(tier._free)])
    assert np.array_equal(np.sort(ids), np.arange(tier._high)), "row ids leaked or shared"


# Where a GPU insert allocates: the index rebuild, the new rows' ids, the new keys' slots.
ALLOCATIONS = [("index", "_allocate"), ("tier", "_take_rows"), ("index", "insert_absent")]


@pytest.mark.parametrize("where", ALLOCATIONS, ids=lambda w: f"{w[0]}.{w[1]}")
def test_out_of_memory_in_the_gpu_tier_changes_nothing(
    tmp_path: Path, where: tuple[str, str]
) -> None:
    """An allocation failing inside a GPU tier's insert (injected where it allocates, as
    there is no GPU here) fails the push before anything was handed down: no acknowledged
    update is lost, the failed pushes left nothing behind, and every row id is accounted
    for (a leaked id once made later calls index past the arena)."""
    store = EmbeddingStore(tmp_path / "db", gpu_arrays="numpy")
    store.create_table(counting_table("t", gpu_cache_bytes=64 << 10, host_cache_bytes=128 << 10))
    table = store.table("t")
    gpu = table.tiers[0]
    assert gpu.name == "gpu"
    owner = gpu.index if where[0] == "index" else gpu
    real = getattr(owner, where[1])
    rng = np.random.default_rng(11)
    acked = np.zeros(UNIVERSE, dtype=np.int64)
    failures = 0
    for round_ in range(90):
        if round_ % 2:  # every other push: the GPU runs out of memory there, if it gets there

            def out_of_memory(*args: object, **kwargs: object) -> object:
                raise MemoryError(f"injected: out of GPU memory in {where[1]}")

            setattr(owner, where[1], out_of_memory)
        keys = rng.choice(UNIVERSE, size=300, replace=False).astype(np.int64)
        try:
            table.apply_gradients(keys, -np.ones((keys.size, DIM), np.float32), step=1)
            acked[keys] += 1
        except MemoryError:
            failures += 1
        finally:
            setattr(owner, where[1], real)
        assert_rows_accounted(gpu)
    assert failures >= 5, f"the injected allocation ran in only {failures} failing rounds"
    assert lost_and_extra(store, "t", acked) == (0, 0)
    store.close()


def test_a_clean_row_handed_down_keeps_the_dirty_copy_below(tmp_path: Path) -> None:
    """A flush writes the GPU tier's dirty rows to the host tier (GPU copy now clean: equal
    to the host's, still dirty there) and lets the table lock go between levels. If the GPU
    tier evicts those rows meanwhile, the host keeps them dirty, so the rest of the flush
    writes them to RocksDB, and they survive a reopen."""
    store = EmbeddingStore(tmp_path / "db", gpu_arrays="numpy")
    store.create_table(counting_table("t", gpu_cache_bytes=32 << 10, host_cache_bytes=2 << 20))
    table = store.table("t")
    gpu, host = table.tiers[0], table.tiers[1]
    keys = np.arange(50, dtype=np.int64)
    table.apply_gradients(keys, -np.ones((keys.size, DIM), np.float32), step=1)
    held, rows, handle = gpu.dirty_rows(gpu.dirty_keys())  # the flush's first level, by hand
    table._place(Spill(held, rows, np.ones(held.size, dtype=bool)), 1)
    gpu.mark_clean(handle)
    others = np.arange(1_000, 1_000 + gpu.max_rows, dtype=np.int64)
    table.lookup(others)  # evicts every clean row of `keys` from the GPU tier to the host
    assert gpu.find(keys)[0].size == 0
    assert host.dirty_rows(keys)[0].size == keys.size
    table.flush()
    store.close()
    with EmbeddingStore(tmp_path / "db") as reopened:
        np.testing.assert_array_equal(
            reopened.table("t").lookup(keys, create=False), np.ones((keys.size, DIM))
        )


def test_a_corrupt_table_file_is_data_loss(tmp_path: Path) -> None:
    """Bytes flipped inside a RocksDB table file (a real corrupted file): reading the rows
    there is DATA_LOSS (DataLossError), not a retryable UNAVAILABLE."""
    keys = np.arange(100_000, dtype=np.int64)  # 26 MB of rows: more than a memtable holds
    with EmbeddingStore(tmp_path / "db") as store:
        store.create_table(counting_table("t", host_cache_bytes=0))
        table = store.table("t")
        for start in range(0, keys.size, 10_000):
            part = keys[start : start + 10_000]
            table.assign(part, np.full((part.size, DIM), 3.0, np.float32))
    tables = sorted((tmp_path / "db").glob("*.sst"), key=lambda f: f.stat().st_size)
    assert tables, "no table file was written"
    data = bytearray(tables[-1].read_bytes())
    for at in range(4096, len(data) // 2, 4096):  # many blocks, away from the footer
        data[at] ^= 0xFF
    tables[-1].write_bytes(bytes(data))
    with EmbeddingStore(tmp_path / "db") as store:
        with pytest.raises(DataLossError, match="Corruption"):
            for start in range(0, keys.size, 10_000):
                store.table("t").lookup(keys[start : start + 10_000], create=False)
