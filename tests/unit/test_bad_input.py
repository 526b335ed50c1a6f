"""Bad input gets a clear error naming the table and field, and changes nothing stored."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import export_dict
from tierps.storage import (
    EmbeddingStore,
    FailedPreconditionError,
    InvalidArgumentError,
    TableConfig,
    TableNotFoundError,
    optim,
)

DIM = 4


@pytest.fixture
def table(store: EmbeddingStore):
    table = store.create_table(
        TableConfig("items", DIM, optimizer=optim.Adam(), host_cache_bytes=4096)
    )
    keys = np.arange(100, dtype=np.int64)
    table.apply_gradients(keys, np.ones((100, DIM), np.float32), step=1)
    return table


def good_grads(n: int = 3) -> np.ndarray:
    return np.ones((n, DIM), np.float32)


BAD_CALLS = {
    "float keys": (
        lambda t: t.lookup(np.array([1.0, 2.0])),
        ["'items'", "'keys'", "integer", "float64"],
    ),
    "2-D keys": (
        lambda t: t.apply_gradients(np.array([[1, 2]]), good_grads(2), 2),
        ["'items'", "'keys'", "1-D", "(1, 2)"],
    ),
    "list keys": (lambda t: t.lookup([1, 2]), ["'items'", "'keys'", "list"]),
    "grads rows mismatch": (
        lambda t: t.apply_gradients(np.array([1, 2, 3]), good_grads(2), 2),
        ["'items'", "'grads'", "(3, 4)", "(2, 4)"],
    ),
    "grads dim mismatch": (
        lambda t: t.apply_gradients(np.array([1, 2, 3]), np.ones((3, 5), np.float32), 2),
        ["'items'", "'grads'", "dim 4", "(3, 5)"],
    ),
    "grads float64": (
        lambda t: t.apply_gradients(np.array([1, 2, 3]), np.ones((3, DIM)), 2),
        ["'items'", "'grads'", "float32", "float64"],
    ),
    "NaN gradient": (
        lambda t: t.apply_gradients(
            np.array([1, 2, 3]), np.where(np.eye(3, DIM) > 0, np.nan, 1).astype(np.float32), 2
        ),
        ["'items'", "'grads'", "finite", "nan", "[0, 0]"],
    ),
    "Inf gradient": (
        lambda t: t.apply_gradients(
            np.array([1, 2, 3]), np.array([[1, 1, 1, 1]] * 2 + [[1, 1, np.inf, 1]], np.float32), 2
        ),
        ["'items'", "'grads'", "finite", "inf", "[2, 2]"],
    ),
    "step 0": (
        lambda t: t.apply_gradients(np.array([1]), good_grads(1), 0),
        ["'items'", "'step'", ">= 1", "0"],
    ),
    "assign values shape": (
        lambda t: t.assign(np.array([1, 2]), np.ones((2, 3), np.float32)),
        ["'items'", "'values'", "(2, 4)", "(2, 3)"],
    ),
    "assign NaN": (
        lambda t: t.assign(np.array([1]), np.full((1, DIM), np.nan, np.float32)),
        ["'items'", "'values'", "finite"],
    ),
    "uint64 key above int64": (
        lambda t: t.lookup(np.array([2**64 - 1], dtype=np.uint64)),
        ["'items'", "'keys'", "2**63-1"],
    ),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_is_refused_and_changes_nothing(table, name: str) -> None:
    call, fragments = BAD_CALLS[name]
    before = export_dict(table)
    stats_before = table.stats()["tiers"]["host"]["rows"]
    with pytest.raises(InvalidArgumentError) as raised:
        call(table)
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))
    after = export_dict(table)
    assert sorted(after) == sorted(before)
    for key, row in before.items():
        np.testing.assert_array_equal(after[key], row)
    assert table.stats()["tiers"]["host"]["rows"] == stats_before


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


def test_empty_batches_work(table) -> None:
    before = export_dict(table)
    empty = np.empty(0, dtype=np.int64)
    assert table.lookup(empty).shape == (0, DIM)
    table.apply_gradients(empty, np.empty((0, DIM), np.float32), 2)
    table.assign(empty, np.empty((0, DIM), np.float32))
    assert sorted(export_dict(table)) == sorted(before)


def test_negative_keys_are_padding(store: EmbeddingStore) -> None:
    config = TableConfig("t", DIM, optimizer=optim.SGD(lr=1.0))
    table = store.create_table(config)
    keys = np.array([-1, 5, -7, 5, -(2**63)], dtype=np.int64)
    out = table.lookup(keys)
    np.testing.assert_array_equal(out[[0, 2, 4]], 0.0)
    expected = config.initial_rows(np.array([5]))[0]
    np.testing.assert_array_equal(out[[1, 3]], [expected, expected])
    table.apply_gradients(keys, np.ones((5, DIM), np.float32), 1)
    table.assign(np.array([-3]), np.ones((1, DIM), np.float32))
    stored = export_dict(table)
    assert sorted(stored) == [5]
    np.testing.assert_allclose(stored[5], expected - 2.0)  # two occurrences, lr 1


def test_lookup_without_create_stores_nothing(store: EmbeddingStore) -> None:
    config = TableConfig("t", DIM, host_cache_bytes=4096)
    table = store.create_table(config)
    keys = np.arange(50, dtype=np.int64)
    got = table.lookup(keys, create=False)
    np.testing.assert_array_equal(got, config.initial_rows(keys)[:, :DIM])
    assert export_dict(table) == {}
    assert table.stats()["created"] == 0


def test_smaller_integer_dtypes_are_accepted(store: EmbeddingStore) -> None:
    table = store.create_table(TableConfig("t", DIM))
    np.testing.assert_array_equal(
        table.lookup(np.array([1, 2], dtype=np.int32)),
        table.lookup(np.array([1, 2], dtype=np.int64)),
    )
