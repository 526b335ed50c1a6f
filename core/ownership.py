"""Key ownership: which shard holds a key, as core.config.key_shards says, computed where a
data call's keys are grouped or checked. The client groups a call's keys by shard (and asks
whether they are distinct: core.compiled.all_distinct, shared with the shards); a shard
finds the first key sent to it that is another shard's. Both compute a key's shard as
key_shards does for a table whose keys spread (k % num_shards), inside the pass: no array
of shards, no temporaries.

The numpy reference (`group_by_shard_reference`) runs where the host kernels are off (numba
missing, TIERPS_HOST_KERNELS=0), and tests/unit/test_ownership.py compares the kernel
against it. The kernels are made by core.compiled.jit_kernel, compiled and cached as every
host kernel is.

Measured and left to numpy (65,536 keys, 2 shards, 2-core machine): placing a shard's reply
rows into the result (`out[at] = rows`: a compiled loop was no faster, 0.6 ms at dim 16)
and the gradients' finiteness check (`np.isfinite(...).all()`: a compiled OR over the
values' exponent bits gave 0.24 against 0.16-0.23 ms at dim 16, 1.1 against 1.3-1.6 ms at
dim 64; a float sum, finite only where every value is, was slower than both).
"""

from __future__ import annotations

import numpy as np

from tierps.core.compiled import jit_kernel, numba, unavailable_reason
from tierps.core.config import TableConfig, key_shards, single_shard

if numba is not None:

    @jit_kernel
    def _key_shard(key, num_shards, mask, power_of_two):
        """k % num_shards (core.config.key_shards' row placement); for a power of two by
        the mask, as an integer division costs ~20 cycles."""
        return key & mask if power_of_two else key % num_shards

    @jit_kernel
    def k_group_by_shard(keys, num_shards, grouped, positions, bounds):
        """A stable counting sort of keys >= 0 by their shard k % num_shards (the row
        placement of core.config.key_shards): grouped[bounds[s]:bounds[s+1]] are shard
        s's keys in their order, positions their places in `keys`. Each key's shard is
        computed once and kept for the second pass. Returns whether the keys came grouped
        already (their shards never fall, as a lookup's distinct keys ordered by shard
        do): then only bounds is written, grouped and positions are left as they were,
        and the keys are grouped[...] themselves, at positions 0..n-1."""
        n = keys.shape[0]
        shard_of = np.empty(n, np.int32)
        bounds[:] = 0
        mask = num_shards - 1
        power_of_two = num_shards & mask == 0
        rising = True
        last = 0
        for i in range(n):
            s = _key_shard(keys[i], num_shards, mask, power_of_two)
            shard_of[i] = s
            bounds[s + 1] += 1
            rising &= s >= last
            last = s
        for s in range(num_shards):
            bounds[s + 1] += bounds[s]
        if rising:
            return True
        fill = bounds[:num_shards].copy()
        for i in range(n):
            s = shard_of[i]
            j = fill[s]
            grouped[j] = keys[i]
            positions[j] = i
            fill[s] = j + 1
        return False

    @jit_kernel
    def k_first_foreign_key(keys, num_shards, shard_id):
        """The index of the first key >= 0 whose shard k % num_shards is not shard_id, or
        -1: a shard's check of the keys it is sent, in one pass with no temporaries."""
        mask = num_shards - 1
        power_of_two = num_shards & mask == 0
        for i in range(keys.shape[0]):
            k = keys[i]
            if k >= 0 and _key_shard(k, num_shards, mask, power_of_two) != shard_id:
                return i
        return -1


def group_by_shard(
    config: TableConfig, keys: np.ndarray, num_shards: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys grouped by shard, their positions in `keys`, bounds [num_shards + 1]): shard
    s's keys, in their order, are grouped[bounds[s]:bounds[s + 1]], and their positions
    ascend. keys: int64 1-D, >= 0. Where the table's keys spread over the shards
    (core.config.single_shard is None) the kernel computes key_shards' k % num_shards
    in its pass; else (and without the kernels) key_shards places them."""
    if unavailable_reason() is not None or single_shard(config, num_shards) is not None:
        return group_by_shard_reference(key_shards(config, keys, num_shards), keys, num_shards)
    keys = np.ascontiguousarray(keys, np.int64)
    grouped = np.empty(keys.size, np.int64)
    positions = np.empty(keys.size, np.int64)
    bounds = np.empty(num_shards + 1, np.int64)
    if k_group_by_shard(keys, num_shards, grouped, positions, bounds):  # no copy to make
        return keys, np.arange(keys.size), bounds
    return grouped, positions, bounds


def first_foreign_key(config: TableConfig, keys: np.ndarray, num_shards: int, shard_id: int) -> int:
    """The index of the first key >= 0 of `keys` (int64 1-D) that is not shard shard_id's
    (core.config.key_shards), or -1 where every one is. The kernel computes key_shards'
    k % num_shards where the table's keys spread (single_shard is None)."""
    if unavailable_reason() is not None or single_shard(config, num_shards) is not None:
        wrong = (keys >= 0) & (key_shards(config, keys, num_shards) != shard_id)
        return int(np.argmax(wrong)) if wrong.any() else -1
    return int(k_first_foreign_key(np.ascontiguousarray(keys, np.int64), num_shards, shard_id))


def group_by_shard_reference(
    shard_of: np.ndarray, keys: np.ndarray, num_shards: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """group_by_shard in numpy: a stable argsort of the shards."""
    positions = np.argsort(shard_of, kind="stable")
    bounds = np.searchsorted(shard_of[positions], np.arange(num_shards + 1))
    return keys[positions], positions, bounds.astype(np.int64)


def warm_up() -> None:
    """Compile (or load from numba's cache) the routing kernels for the arrays they meet:
    keys of an array of their own, and keys read in place from a request's bytes (a
    read-only view, which numba compiles apart). A shard runs it when it starts
    (storage.warm_up), so that its first data call does not."""
    if unavailable_reason() is not None:
        return
    request = np.arange(9, dtype=np.int64).tobytes()
    for keys in (np.arange(8, dtype=np.int64), np.frombuffer(request, np.int64, 8, 1)):
        k_first_foreign_key(keys, 2, 0)
        k_group_by_shard(keys, 2, *(np.empty(n, np.int64) for n in (8, 8, 3)))
