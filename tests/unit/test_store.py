"""EmbeddingStore: the tables of one shard over one RocksDB (storage/store.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import export_dict
from tierps.storage import (
    EmbeddingStore,
    FailedPreconditionError,
    TableConfig,
    TableNotFoundError,
    optim,
)

DIM = 4


def test_unknown_table_names_it(store: EmbeddingStore) -> None:
    store.create_table(TableConfig("users", DIM))
    with pytest.raises(TableNotFoundError, match=r"'nope' not found; tables: \['users'\]"):
        store.lookup("nope", np.array([1]))


def test_create_table_is_idempotent_but_refuses_another_config(store: EmbeddingStore) -> None:
    first = store.create_table(TableConfig("users", DIM))
    assert store.create_table(TableConfig("users", DIM)) is first
    with pytest.raises(FailedPreconditionError, match="'users'.*another config"):
        store.create_table(TableConfig("users", DIM + 1))


def test_drop_table_removes_rows(store: EmbeddingStore) -> None:
    config = TableConfig("users", DIM, optimizer=optim.SGD(lr=1.0))
    table = store.create_table(config)
    table.apply_gradients(np.array([1, 2]), np.ones((2, DIM), np.float32), 1)
    store.drop_table("users")
    assert store.tables() == []
    with pytest.raises(TableNotFoundError):
        store.table("users")
    fresh = store.create_table(config)
    assert export_dict(fresh) == {}
    np.testing.assert_array_equal(
        fresh.lookup(np.array([1, 2]), create=False), config.initial_rows(np.array([1, 2]))
    )


def test_a_table_keeps_its_cold_dtype_across_a_reopen(tmp_path) -> None:
    """The RocksDB tier's values take the config's cold dtype, which the store persists:
    a reopened store reads them with the same codec."""
    config = TableConfig("t", DIM, optimizer=optim.SGD(lr=1.0), cold_dtype="bfloat16")
    keys = np.arange(10, dtype=np.int64)
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        table.assign(keys, np.full((10, DIM), 1.0 + 2.0**-12, np.float32))  # not a bfloat16
        assert table.durable.codec.value_bytes == 2 * DIM
        exported = export_dict(table)
    np.testing.assert_array_equal(np.stack(list(exported.values())), 1.0)  # rounded on disk
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.table("t")
        assert table.config == config and table.durable.codec == config.codec
        np.testing.assert_array_equal(table.lookup(keys, create=False), 1.0)


@pytest.mark.parametrize("stored_bytes", [3, 4 * 4 + 4])
def test_a_stored_value_of_another_length_is_data_loss(tmp_path, stored_bytes: int) -> None:
    """A RocksDB value shorter or longer than a row (corrupt) is refused as data loss
    naming the table, never padded or cut into a row."""
    from tierps.storage import DataLossError
    from tierps.storage.rocksdb_tier import encode_keys

    config = TableConfig("items", 4, optimizer=optim.SGD(), host_cache_bytes=0)
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        table.assign(np.array([1, 2]), np.ones((2, 4), np.float32))
        table.durable._cf.put(encode_keys(np.array([2]))[0], b"\x00" * stored_bytes)
        with pytest.raises(DataLossError, match="'items'.*expected 2 rows of 16 bytes"):
            table.lookup(np.array([1, 2]))
        with pytest.raises(DataLossError, match="'items'.*expected 1 rows of 16 bytes"):
            table.lookup(np.array([5, 2]))
