"""A pooled lookup's host path (tierps.client.pooled_lookup.prepare, fetch and
key_gradients) over stand-in row calls: its distinct keys ordered by shard, as the client's
router spreads each table, change no output and no key's gradient, bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tierps.client.formats import COO
from tierps.client.pooled_lookup import Feature, PooledLookup, RowCalls, prepare

DIM = 5


def rows_of(keys: np.ndarray) -> np.ndarray:
    """Each key's row: a pure function of the key, whatever the order asked in."""
    return (
        np.stack(
            [np.random.default_rng([7, int(key)]).standard_normal(DIM) for key in keys.tolist()]
        )
        .astype(np.float32)
        .reshape(-1, DIM)
    )


def row_calls(spread: int) -> RowCalls:
    def lookup_unique(
        tables: dict[str, tuple[int, np.ndarray]], create: bool, out: Any = None
    ) -> dict[str, np.ndarray]:
        return {table: rows_of(keys) for table, (_, keys) in tables.items()}

    return RowCalls(lambda table: DIM, lookup_unique, None, None, lambda table: spread)  # type: ignore[arg-type]


def batch(seed: int) -> tuple[dict[str, Any], list[Feature]]:
    """Three features over two tables: CSR with weights and padding, dense -1-padded
    keys and a COO, two of them sharing a table."""
    generator = np.random.default_rng(seed)
    values = generator.integers(-1, 400, 60)
    offsets = np.sort(generator.integers(0, 60, 9))
    offsets[0] = 0
    weights = generator.random(60).astype(np.float32)
    dense = generator.integers(-1, 90, (7, 3))
    rows = generator.integers(0, 6, 20)
    features = {
        "clicks": (values, offsets, weights),
        "views": dense,
        "tags": COO(rows, generator.integers(0, 10**12, 20), (6, 4)),
    }
    specs = [
        Feature("clicks", "items", "mean"),
        Feature("views", "items", "sum"),
        Feature("tags", "tags", "sqrtn"),
    ]
    return features, specs


def looked_up(spread: int, seed: int) -> tuple[PooledLookup, Any]:
    features, specs = batch(seed)
    prepared = prepare(row_calls(spread), features, specs, False, None)
    return prepared.fetch(True), prepared


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("spread", [2, 3, 4])
def test_distinct_keys_by_shard_pool_and_push_as_in_key_order(spread: int, seed: int) -> None:
    ordered, prepared = looked_up(spread, seed)
    plain, _ = looked_up(1, seed)
    for table in prepared.tables.values():  # each shard's keys one ascending span
        keys = table.unique
        assert (np.lexsort((keys, keys % spread)) == np.arange(keys.size)).all()
    for name, output in plain.outputs.items():
        np.testing.assert_array_equal(ordered.outputs[name], output, err_msg=name)
    generator = np.random.default_rng(seed)
    grads = {
        name: generator.standard_normal(output.shape).astype(np.float32)
        for name, output in plain.outputs.items()
    }
    got, want = ordered.key_gradients(grads), plain.key_gradients(grads)
    assert got.keys() == want.keys()
    for table, (keys, summed) in want.items():
        got_keys, got_summed = got[table]
        by_key = dict(zip(got_keys.tolist(), got_summed, strict=True))
        assert sorted(by_key) == keys.tolist()
        for key, row in zip(keys.tolist(), summed, strict=True):
            np.testing.assert_array_equal(by_key[key], row)
