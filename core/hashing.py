"""Key hashing: the splitmix64 finaliser, vectorised over int64 keys.

One mixing function serves both the hash table (slot of a key) and the initialisers
(counter-based random bits of a (seed, key, column) triple), so both are pure functions of
their inputs and give the same answer on numpy and cupy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tierps.core.xp import array_module

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix64(x: Any) -> Any:
    """splitmix64's finaliser: a bijection of uint64 that spreads every input bit over the
    output (Steele et al. 2014). Arithmetic wraps modulo 2**64."""
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


def hash_keys(keys: Any) -> Any:
    """uint64 hash of int64 keys, used to pick a home slot."""
    xp = array_module(keys)
    return mix64(keys.astype(xp.int64, copy=False).view(xp.uint64) + GOLDEN)


def seed_stream(seed: int, salt: int) -> np.uint64:
    """A per-(seed, salt) uint64 that offsets every counter of one random stream."""
    state = np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    salted = np.array([salt & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) * GOLDEN
    return mix64(mix64(state) + salted)[0]


def counter_bits(keys: Any, columns: int, seed: int, salt: int = 0) -> Any:
    """uint64 random bits [n, columns], a pure function of (seed, salt, key, column).

    Counter-based (like Philox or Threefry, but with splitmix64 as the block function): no
    generator state, so a key gets the same bits in any order, batch, tier or shard count.
    """
    xp = array_module(keys)
    base = mix64(keys.astype(xp.int64, copy=False).view(xp.uint64) ^ seed_stream(seed, salt))
    cols = (xp.arange(1, columns + 1, dtype=xp.uint64) * GOLDEN)[None, :]
    return mix64(base[:, None] + cols)
