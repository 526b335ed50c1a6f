"""Compiled passes of the client's data calls: grouping a call's keys by shard in one pass,
and deciding whether its keys are distinct.

The numpy references (the `*_reference` functions) run where the host kernels are off (numba
missing, TIERPS_HOST_KERNELS=0), and tests/unit/test_wire_kernels.py compares the kernel
against them. The kernels are `njit(nogil=True, cache=True)`, compiled and cached as the host
tier's kernels are (tierps.storage.host_kernels).

Measured and left to numpy (65,536 keys, 2 shards, 2-core machine): placing a shard's reply
rows into the result (`out[at] = rows`: a compiled loop was no faster, 0.6 ms at dim 16)
and the gradients' finiteness check (`np.isfinite(...).all()`: a compiled OR over the
values' exponent bits gave 0.24 against 0.16-0.23 ms at dim 16, 1.1 against 1.3-1.6 ms at
dim 64; a float sum, finite only where every value is, was slower than both).
"""

from __future__ import annotations

import numpy as np

from tierps.storage import host_kernels
from tierps.storage.host_kernels import host_launcher

if host_kernels.numba is not None:
    jit_kernel = host_kernels.jit_kernel  # one owner of how the host kernels compile and cache

    @jit_kernel
    def k_group_by_shard(shard_of, keys, grouped, positions, bounds):
        """A stable counting sort of keys by their shard: grouped[bounds[s]:bounds[s+1]]
        are shard s's keys in their order, positions their places in `keys`."""
        num_shards = bounds.shape[0] - 1
        bounds[:] = 0
        for i in range(shard_of.shape[0]):
            bounds[shard_of[i] + 1] += 1
        for s in range(num_shards):
            bounds[s + 1] += bounds[s]
        fill = bounds[:num_shards].copy()
        for i in range(shard_of.shape[0]):
            s = shard_of[i]
            grouped[fill[s]] = keys[i]
            positions[fill[s]] = i
            fill[s] += 1

    @jit_kernel
    def k_distinct_in_span(keys, low, words):
        """Whether no key repeats, all keys in [low, low + 64 * words): one bit per key of
        the span (a bitmap no larger than the hash set's keys where the span is at most 64
        keys per key, and no hashing or probing)."""
        seen = np.zeros(words, np.uint64)
        for i in range(keys.shape[0]):
            at = np.uint64(keys[i] - low)
            word = at >> np.uint64(6)
            bit = np.uint64(1) << (at & np.uint64(63))
            if seen[word] & bit:
                return False
            seen[word] |= bit
        return True


def group_by_shard(
    shard_of: np.ndarray, keys: np.ndarray, num_shards: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys grouped by shard, their positions in `keys`, bounds [num_shards + 1]): shard
    s's keys, in their order, are grouped[bounds[s]:bounds[s + 1]], and their positions
    ascend. shard_of: one shard in [0, num_shards) per key (storage.config.key_shards);
    keys: int64 1-D."""
    if host_launcher() is None:
        return group_by_shard_reference(shard_of, keys, num_shards)
    grouped = np.empty(keys.size, np.int64)
    positions = np.empty(keys.size, np.int64)
    bounds = np.empty(num_shards + 1, np.int64)
    k_group_by_shard(np.ascontiguousarray(shard_of, np.int64), keys, grouped, positions, bounds)
    return grouped, positions, bounds


def group_by_shard_reference(
    shard_of: np.ndarray, keys: np.ndarray, num_shards: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """group_by_shard in numpy: a stable argsort of the shards."""
    positions = np.argsort(shard_of, kind="stable")
    bounds = np.searchsorted(shard_of[positions], np.arange(num_shards + 1))
    return keys[positions], positions, bounds.astype(np.int64)


SPAN_BITS_PER_KEY = 64  # a bitmap up to this many bits a key (8 bytes, as the hash set's keys)


def all_distinct(keys: np.ndarray, low: int, high: int) -> bool:
    """Whether no key of `keys` (int64 1-D, every one in [low, high]) repeats: a bitmap over
    the span where it is at most SPAN_BITS_PER_KEY bits a key (7-9x faster than the hash
    set at 16k-256k keys, measured), else the host kernels' hash set."""
    if host_launcher() is None:
        return all_distinct_reference(keys)
    keys = np.ascontiguousarray(keys, np.int64)
    span = high - low + 1
    if span <= SPAN_BITS_PER_KEY * keys.size:
        return bool(k_distinct_in_span(keys, np.int64(low), (span + 63) // 64))
    return bool(host_kernels.all_distinct(keys))


def all_distinct_reference(keys: np.ndarray) -> bool:
    """all_distinct in numpy: a sort."""
    return bool(np.unique(keys).size == keys.size)
