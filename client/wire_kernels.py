"""Compiled passes of the client's data calls: grouping a call's keys by shard in one pass
(whether they are distinct: storage.host_kernels.all_distinct, shared with the shards).

The numpy reference (`group_by_shard_reference`) runs where the host kernels are off (numba
missing, TIERPS_HOST_KERNELS=0), and tests/unit/test_wire_kernels.py compares the kernel
against it. The kernel is `njit(nogil=True, cache=True)`, compiled and cached as the host
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
