"""Where a call's keys go: each table's distinct keys grouped by their owning shard (key % N;
every key of a table placed whole to its owner shard), cut into calls of a bounded size,
and a lookup reply's rows placed back at the keys' positions. No RPCs here
(tierps.client.transport makes the calls)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tierps.core.compiled import all_distinct
from tierps.core.config import TableConfig, single_shard
from tierps.core.ownership import group_by_shard

# A shard's part of a lookup of 2 * LOOKUP_PIECE_BYTES or more goes as up to LOOKUP_PIECES
# calls of LOOKUP_PIECE_BYTES or more, so that its storage work on one overlaps another's
# transfer; smaller or more pieces did not pay where measured (docs/perf/profile-lookup.md).
LOOKUP_PIECE_BYTES = 4 << 20
LOOKUP_PIECES = 4
# One table's part of a call to a shard: (table, dim, keys, their positions in the table's
# distinct keys).
Batch = tuple[str, int, np.ndarray, np.ndarray]


class Router:
    """Cuts the distinct keys of a call's tables into the calls to make, per shard, each of
    at most max_call_bytes of bulk. `table_config` gives a table's placement (a table whose
    rows all live on one shard)."""

    def __init__(
        self, table_config: Callable[[str], TableConfig], num_shards: int, max_call_bytes: int
    ) -> None:
        self.table_config = table_config
        self.num_shards = num_shards
        self.max_call_bytes = max_call_bytes

    def spread(self, table: str) -> int:
        """Over how many shards a table's keys spread: num_shards (key k on shard k % N),
        or 1 for a table on one shard. Distinct keys ordered by (key % spread, key)
        (pooling.distinct_keys' `shards`) reach each shard as one span of that order, so
        that its reply's rows are placed as one block."""
        on_one = single_shard(self.table_config(table), self.num_shards) is not None
        return 1 if on_one else self.num_shards

    def route(
        self,
        tables: dict[str, tuple[int, np.ndarray]],
        bytes_per_key: Callable[[int], int],
        *,
        pieces: bool = False,
    ) -> list[tuple[int, list[Batch]]]:
        """The calls to make: (shard, [(table, dim, keys, their positions, ascending)]),
        each call at most max_call_bytes (bytes_per_key(dim) per key); a shard with no keys
        gets none. Key k goes to shard k % N, or, of a table placed whole, to the table's
        owner_shard. `pieces` (lookups): a shard's part of LOOKUP_PIECE_BYTES or more goes
        as up to LOOKUP_PIECES calls at once, so that the shard looks one piece up while
        another's reply is on the wire (a lookup changes nothing a failed piece leaves
        half done). A push is not cut into pieces: its part for a shard is one call, applied
        whole or not at all, unless that part is over max_call_bytes (256 MiB by default),
        which only several calls can carry, and a failed one of them leaves the shard's part
        applied in part (its ShardError then does not count the shard as succeeded)."""
        calls: list[tuple[int, list[Batch]]] = []
        per_shard: list[list[Batch]] = [[] for _ in range(self.num_shards)]
        for name, (dim, keys) in tables.items():
            config = self.table_config(name)
            owner = single_shard(config, self.num_shards)
            if owner is not None:  # every key on one shard: no split
                if keys.size:
                    per_shard[owner].append((name, dim, keys, np.arange(keys.size)))
                continue
            grouped, order, bounds = group_by_shard(config, keys, self.num_shards)
            for shard in range(self.num_shards):
                span = slice(bounds[shard], bounds[shard + 1])
                if order[span].size:
                    per_shard[shard].append((name, dim, grouped[span], order[span]))
        for shard, batches in enumerate(per_shard):
            if not batches:
                continue
            limit = self.max_call_bytes
            total = sum(keys.size * bytes_per_key(dim) for _, dim, keys, _ in batches)
            if pieces:
                count = min(LOOKUP_PIECES, total // LOOKUP_PIECE_BYTES)
                widest = max(bytes_per_key(dim) for _, dim, _, _ in batches)
                if count > 1:  # rounded up to whole keys: count pieces, not one more
                    limit = min(limit, -(-total // count) + widest - 1)
            if total <= limit:  # the usual: one call of the batches as they are
                calls.append((shard, batches))
                continue
            call: list[Batch] = []
            room = limit
            for name, dim, keys, at in batches:
                start = 0
                while start < keys.size:
                    if room < bytes_per_key(dim) and call:  # full: the rest in another call
                        calls.append((shard, call))
                        call, room = [], limit
                    take = min(keys.size - start, max(1, room // bytes_per_key(dim)))
                    call.append((name, dim, keys[start : start + take], at[start : start + take]))
                    room -= take * bytes_per_key(dim)
                    start += take
            if call:
                calls.append((shard, call))
        return calls

    def lookup_calls(
        self, tables: dict[str, tuple[int, np.ndarray]]
    ) -> list[tuple[int, list[Batch]]]:
        """The calls of a lookup of tables' distinct keys (table -> (dim, keys)), in pieces."""
        return self.route(tables, lookup_key_bytes, pieces=True)

    def push_calls(
        self, pushes: dict[str, tuple[np.ndarray, np.ndarray]]
    ) -> list[tuple[int, list[Batch]]]:
        """The calls of a push of tables' distinct keys and gradients (table -> (keys, grads))."""
        return self.route(
            {t: (grads.shape[1], keys) for t, (keys, grads) in pushes.items()},
            key_and_row_bytes,
        )


def lookup_key_bytes(dim: int) -> int:
    """A key's bulk bytes in a lookup, the larger way: the key (int64) or its row back."""
    return max(8, 4 * dim)


def key_and_row_bytes(dim: int) -> int:
    """A key's bulk bytes in a push or an assign: the key (int64) and its row (float32)."""
    return 8 + 4 * dim


def reply_bytes(batches: list[Batch]) -> int:
    """The bytes of a lookup reply's rows for these batches."""
    return sum(4 * dim * keys.size for _, dim, keys, _ in batches)


def place_rows(batches: list[Batch], values: Any, out: dict[str, np.ndarray]) -> None:
    """A lookup reply's rows (bytes-like values of reply_bytes(batches) bytes), placed by
    batch: into out[table] at the batch's positions, or, for a table not in `out`, as a
    view of the reply (every row of the table, in the order of its keys)."""
    offset = 0
    for name, dim, keys, at in batches:  # placed here, while other shards answer
        rows = np.frombuffer(values, "<f4", keys.size * dim, offset)
        rows = rows.reshape(keys.size, dim)
        if name in out and at[-1] - at[0] == at.size - 1:  # ascending: a span
            out[name][at[0] : at[-1] + 1] = rows
        elif name in out:
            out[name][at] = rows
        else:  # every row of the table, in the order of its keys
            out[name] = rows
        offset += 4 * dim * keys.size


def distinct_live(keys: np.ndarray) -> bool:
    """Whether keys (int64, 1-D) are distinct and none is padding (< 0): then a call sends
    them as given, with no dedup and no reordering. The compiled check decides (a bitmap
    or a hash set, compiled.all_distinct; a sort without the host kernels)."""
    if keys.size == 0 or keys.min() < 0:
        return False
    distinct = all_distinct(keys)
    return distinct if distinct is not None else np.unique(keys).size == keys.size
