"""The compiled key-ownership passes (core/ownership.py) against its numpy reference
(a stable argsort) on the same keys, and both against the plain definition: each shard's
keys in their order, with their positions."""

from __future__ import annotations

import numpy as np
import pytest

from tierps.core import compiled, ownership
from tierps.core.config import TableConfig, key_shards


@pytest.mark.parametrize(
    ("size", "num_shards"),
    [(0, 2), (1, 2), (1000, 1), (5000, 2), (5000, 3), (777, 8), (4000, 4), (3001, 7)],
)
def test_group_by_shard_matches_the_reference_and_the_definition(
    size: int, num_shards: int
) -> None:
    keys = np.random.default_rng(size + num_shards).choice(10**9, size, replace=False)
    config = TableConfig("t", 4)
    shard_of = key_shards(config, keys, num_shards)
    got = ownership.group_by_shard(config, keys, num_shards)
    want = ownership.group_by_shard_reference(shard_of, keys, num_shards)
    for got_part, want_part in zip(got, want, strict=True):
        assert got_part.dtype == np.int64
        assert np.array_equal(got_part, want_part)
    grouped, positions, bounds = got
    assert bounds[0] == 0 and bounds[-1] == size
    for shard in range(num_shards):
        mine = np.flatnonzero(keys % num_shards == shard)  # the definition, in key order
        assert np.array_equal(positions[bounds[shard] : bounds[shard + 1]], mine)
        assert np.array_equal(grouped[bounds[shard] : bounds[shard + 1]], keys[mine])


def test_group_by_shard_runs_compiled_where_the_host_kernels_do() -> None:
    if compiled.unavailable_reason() is not None:
        pytest.skip(f"host kernels unavailable: {compiled.unavailable_reason()}")
    assert hasattr(ownership, "k_group_by_shard")
    keys = np.array([5, 2, 7, 4], np.int64)
    grouped = np.empty(4, np.int64)
    positions = np.empty(4, np.int64)
    bounds = np.empty(3, np.int64)
    assert not ownership.k_group_by_shard(keys, 2, grouped, positions, bounds)
    assert grouped.tolist() == [2, 4, 5, 7]
    assert positions.tolist() == [1, 3, 0, 2]
    assert bounds.tolist() == [0, 2, 4]
    assert ownership.k_group_by_shard(grouped, 2, keys, positions, bounds)  # grouped already
    assert keys.tolist() == [5, 2, 7, 4] and bounds.tolist() == [0, 2, 4]  # only bounds


@pytest.mark.parametrize("num_shards", [1, 2, 3, 8])
@pytest.mark.parametrize("within", ["ascending", "any order"])
def test_keys_grouped_already_are_returned_as_they_are(num_shards: int, within: str) -> None:
    """Keys whose shards never fall (a lookup's distinct keys ordered by shard) come back
    as the same array at positions 0..n-1, with the reference's bounds; one key moved out
    of its group is grouped by the counting sort again."""
    config = TableConfig("t", 4)
    rng = np.random.default_rng(num_shards)
    keys = rng.choice(10**9, 3000, replace=False)
    order = np.lexsort(
        (keys if within == "ascending" else rng.random(keys.size), keys % num_shards)
    )
    keys = keys[order]
    want = ownership.group_by_shard_reference(
        key_shards(config, keys, num_shards), keys, num_shards
    )
    grouped, positions, bounds = ownership.group_by_shard(config, keys, num_shards)
    assert np.array_equal(grouped, want[0]) and np.array_equal(positions, want[1])
    assert np.array_equal(bounds, want[2])
    if compiled.unavailable_reason() is None and num_shards > 1:  # one shard: no kernel
        assert grouped is keys  # no copy
    if num_shards > 1:
        moved = np.concatenate([keys[-1:], keys[:-1]])  # the last shard's key first
        want = ownership.group_by_shard_reference(
            key_shards(config, moved, num_shards), moved, num_shards
        )
        for got_part, want_part in zip(
            ownership.group_by_shard(config, moved, num_shards), want, strict=True
        ):
            assert np.array_equal(got_part, want_part)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7])
def test_first_foreign_key_is_the_first_key_of_another_shard(num_shards: int) -> None:
    config = TableConfig("t", 4)
    rng = np.random.default_rng(num_shards)
    for shard_id in range(num_shards):
        mine = rng.choice(10**9, 3000, replace=False) * num_shards + shard_id
        mine[::7] = -1 - mine[::7]  # padding passes, whatever its remainder
        assert ownership.first_foreign_key(config, mine, num_shards, shard_id) == -1
        if num_shards == 1:
            continue
        for index in (0, 1234, mine.size - 1):
            keys = mine.copy()
            keys[index] = 12345 * num_shards + (shard_id + 1) % num_shards  # another's
            keys[-1 if index == 0 else 0] = -5  # padding before it does not count
            want = np.flatnonzero((keys >= 0) & (key_shards(config, keys, num_shards) != shard_id))
            got = ownership.first_foreign_key(config, keys, num_shards, shard_id)
            assert got == want[0] == index


EXTREME_KEYS = [2**63 - 1, 2**63 - 2, 2**62, 2**62 + 1, 2**31, 2**31 - 1, 1, 0]


@pytest.mark.parametrize("num_shards", [2, 3, 4, 5, 7, 8, 1_000_003])
def test_the_kernels_route_int64_extremes_as_key_shards(num_shards: int) -> None:
    """Keys near the int64 limits (and padding, keys < 0, down to its minimum) route as
    key_shards' k % num_shards, for powers of two (a mask) and not."""
    config = TableConfig("t", 4)
    keys = np.array(EXTREME_KEYS, np.int64)
    shard_of = key_shards(config, keys, num_shards)
    got = ownership.group_by_shard(config, keys, num_shards)
    want = ownership.group_by_shard_reference(shard_of, keys, num_shards)
    for got_part, want_part in zip(got, want, strict=True):
        assert np.array_equal(got_part, want_part)
    padded = np.concatenate([np.array([-(2**63), -(2**63) + 1, -7, -1], np.int64), keys])
    for shard_id in range(min(num_shards, 8)):
        wrong = (padded >= 0) & (key_shards(config, padded, num_shards) != shard_id)
        want_index = int(np.argmax(wrong)) if wrong.any() else -1
        got_index = ownership.first_foreign_key(config, padded, num_shards, shard_id)
        assert got_index == want_index


def test_a_table_placed_whole_routes_every_key_to_its_shard() -> None:
    """placement="table": the compiled routing and key check give way to key_shards, which
    places every key on the table's shard (not k % num_shards)."""
    config = TableConfig("t", 4, placement="table", table_shard=1)
    keys = np.arange(6, dtype=np.int64)
    grouped, positions, bounds = ownership.group_by_shard(config, keys, 3)
    assert bounds.tolist() == [0, 0, 6, 6]
    assert grouped.tolist() == keys.tolist() and positions.tolist() == list(range(6))
    assert ownership.first_foreign_key(config, keys, 3, 1) == -1
    assert ownership.first_foreign_key(config, keys, 3, 0) == 0


def test_warm_up_compiles_both_kernels_for_own_and_request_keys() -> None:
    """ownership.warm_up (a shard runs it at start) leaves each kernel compiled for a
    writable key array and for a read-only view of a request's bytes, the two a call meets,
    so that neither compiles in a data call."""
    if compiled.unavailable_reason() is not None:
        pytest.skip(f"host kernels unavailable: {compiled.unavailable_reason()}")
    ownership.warm_up()
    for kernel in (ownership.k_first_foreign_key, ownership.k_group_by_shard):
        writable = {signature[0].mutable for signature in kernel.signatures}
        assert writable == {False, True}, kernel.signatures
