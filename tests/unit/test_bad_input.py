"""Bad input gets a clear error naming the table and field, and changes nothing stored."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import export_dict
from tierps.storage import (
    EmbeddingStore,
    InvalidArgumentError,
    TableConfig,
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
