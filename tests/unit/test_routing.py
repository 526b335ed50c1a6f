"""The client's routing (tierps.client.routing.Router.route): the calls it cuts a call's
keys into, against the cutting loop written before the one-call shortcut, frozen here."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierps.client import routing
from tierps.client.routing import Batch, Router, key_and_row_bytes, lookup_key_bytes
from tierps.core.config import TableConfig, single_shard
from tierps.core.ownership import group_by_shard


def previous_route(
    router: Router,
    tables: dict[str, tuple[int, np.ndarray]],
    bytes_per_key: Callable[[int], int],
    pieces: bool,
) -> list[tuple[int, list[Batch]]]:
    """Router.route as it was before a shard's part that fits one call went as it is."""
    calls: list[tuple[int, list[Batch]]] = []
    per_shard: list[list[Batch]] = [[] for _ in range(router.num_shards)]
    for name, (dim, keys) in tables.items():
        config = router.table_config(name)
        owner = single_shard(config, router.num_shards)
        if owner is not None:
            if keys.size:
                per_shard[owner].append((name, dim, keys, np.arange(keys.size)))
            continue
        grouped, order, bounds = group_by_shard(config, keys, router.num_shards)
        for shard in range(router.num_shards):
            span = slice(bounds[shard], bounds[shard + 1])
            if order[span].size:
                per_shard[shard].append((name, dim, grouped[span], order[span]))
    for shard, batches in enumerate(per_shard):
        limit = router.max_call_bytes
        if pieces:
            total = sum(keys.size * bytes_per_key(dim) for _, dim, keys, _ in batches)
            count = min(routing.LOOKUP_PIECES, total // routing.LOOKUP_PIECE_BYTES)
            widest = max(bytes_per_key(dim) for _, dim, _, _ in batches) if batches else 0
            if count > 1:
                limit = min(limit, -(-total // count) + widest - 1)
        call: list[Batch] = []
        room = limit
        for name, dim, keys, at in batches:
            start = 0
            while start < keys.size:
                if room < bytes_per_key(dim) and call:
                    calls.append((shard, call))
                    call, room = [], limit
                take = min(keys.size - start, max(1, room // bytes_per_key(dim)))
                call.append((name, dim, keys[start : start + take], at[start : start + take]))
                room -= take * bytes_per_key(dim)
                start += take
        if call:
            calls.append((shard, call))
    return calls


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([1, 4, 16]),  # dim
            st.integers(0, 60),  # distinct keys
            st.booleans(),  # placed whole on one shard
        ),
        min_size=1,
        max_size=5,
    ),
    st.integers(1, 4),  # shards
    st.sampled_from([1, 40, 300, 2_000, 1 << 20]),  # max_call_bytes
    st.booleans(),  # a lookup (in pieces), else a push
    st.sampled_from([64, 1 << 22]),  # LOOKUP_PIECE_BYTES
    st.integers(0, 2**32 - 1),
)
def test_route_cuts_the_calls_the_previous_loop_cut(
    tables: list[tuple[int, int, bool]],
    num_shards: int,
    max_call_bytes: int,
    lookup: bool,
    piece_bytes: int,
    seed: int,
) -> None:
    generator = np.random.default_rng(seed)
    configs, keys = {}, {}
    for index, (dim, count, whole) in enumerate(tables):
        name = f"t{index}"
        placement = {"placement": "table", "table_shard": 0} if whole else {}
        configs[name] = TableConfig(name, dim, **placement)
        drawn = generator.choice(10 * count + 1, count, replace=False)
        keys[name] = (dim, np.sort(drawn).astype(np.int64))
    router = Router(configs.__getitem__, num_shards, max_call_bytes)
    bytes_per_key = lookup_key_bytes if lookup else key_and_row_bytes
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(routing, "LOOKUP_PIECE_BYTES", piece_bytes)
        got = router.route(keys, bytes_per_key, pieces=lookup)
        want = previous_route(router, keys, bytes_per_key, lookup)
    assert [(shard, len(batches)) for shard, batches in got] == [
        (shard, len(batches)) for shard, batches in want
    ]
    for (_, got_batches), (_, want_batches) in zip(got, want, strict=True):
        for got_batch, want_batch in zip(got_batches, want_batches, strict=True):
            assert got_batch[:2] == want_batch[:2]
            np.testing.assert_array_equal(got_batch[2], want_batch[2])
            np.testing.assert_array_equal(got_batch[3], want_batch[3])
