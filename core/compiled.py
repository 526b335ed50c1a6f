"""How tierps compiles its host kernels, and the compiled checks both the client and the
shards run: whether a call's keys are distinct, and where the first inf or NaN of a float32
array is.

Every host kernel (these, core/ownership.py's routing, storage/host_kernels.py's host tier)
is made by `jit_kernel`: `njit(nogil=True, cache=True)`, so that it releases the GIL and its
machine code is cached on disk (where: docs/architecture.md, "Compiled host kernels").
`unavailable_reason()` is the one switch: numba missing, or TIERPS_HOST_KERNELS=0, turns every
one of them off, and the callers then run their numpy references.

numba's disk cache is keyed on each kernel's own file: a change to a kernel here (such as
`home_slot`) does not invalidate the cached kernels of other files that call it; remove
their __pycache__ after changing one.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable

import numpy as np

from tierps.core import hashing

ENV_SWITCH = "TIERPS_HOST_KERNELS"  # "0": every host kernel is off, the numpy code runs

try:  # numba is a dependency; a build without it still runs the array code
    import numba
except ImportError:  # pragma: no cover - exercised only without numba
    numba = None

# A float32's exponent bits: all set for inf and NaN. Adding EXPONENT_LOW_BIT to a value's
# exponent bits carries into bit 31 (CARRY) only then, so one OR over a block finds one.
EXPONENT = np.uint32(0x7F800000)
EXPONENT_LOW_BIT = np.uint32(0x00800000)
CARRY = np.uint32(0x80000000)

_cache_warned = False


def jit_kernel(fn: Callable) -> Callable:
    """njit(nogil=True, cache=True), or without the disk cache where numba finds no
    writable place for it (warned once). error_model="numpy": a float division by zero
    gives inf or NaN as in numpy (the finiteness check refuses it) instead of a per-element
    zero test that keeps LLVM from vectorising the loops."""
    global _cache_warned
    options = {"nogil": True, "error_model": "numpy"}
    try:
        return numba.njit(cache=True, **options)(fn)
    except RuntimeError as error:  # "cannot cache function ...: no locator available"
        if not _cache_warned:
            _cache_warned = True
            warnings.warn(
                f"tierps host kernels: no writable numba cache ({error}); compiling at each "
                f"start instead (set NUMBA_CACHE_DIR to a writable directory to keep them)",
                RuntimeWarning,
                stacklevel=2,
            )
        return numba.njit(**options)(fn)


@functools.cache
def unavailable_reason() -> str | None:
    """Why the host kernels are off ("numba is not installed", "TIERPS_HOST_KERNELS=0"), or
    None where they run. Decided once per process, at the first call."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if numba is None:
        return "numba is not installed"
    return None


SPAN_BITS_PER_KEY = 64  # a bitmap up to this many bits a key (8 bytes, as the hash set's keys)


if numba is not None:
    # core/hashing.py's splitmix64 finaliser, the same source compiled: a scalar uint64 in.
    mix64_scalar = jit_kernel(hashing.mix64)

    @jit_kernel
    def home_slot(key, mask):
        """The home slot of an int64 key in a table of mask + 1 slots (hashing.hash_keys)."""
        return np.int64(mix64_scalar(np.uint64(key) + hashing.GOLDEN) & np.uint64(mask))

    @jit_kernel
    def k_first_non_finite(bits):
        """The index of the first inf or NaN among float32 values given as their uint32
        bits (all exponent bits set), -1 if none: blocks of 256 are tested with an integer
        OR (LLVM vectorises a loop of constant length; a float test would need fastmath)
        and only a block holding one is searched. Reads each value once, with no [n]
        temporary."""
        n = bits.shape[0]
        whole = n - n % 256
        for start in range(0, whole, 256):
            found = np.uint32(0)
            for k in range(start, start + 256):
                found |= (bits[k] & EXPONENT) + EXPONENT_LOW_BIT
            if found & CARRY:
                for k in range(start, start + 256):
                    if bits[k] & EXPONENT == EXPONENT:
                        return k
        for k in range(whole, n):
            if bits[k] & EXPONENT == EXPONENT:
                return k
        return -1

    @jit_kernel
    def k_all_distinct(keys):
        """Whether no int64 key repeats: an open-addressing set at load <= 0.5."""
        n = keys.shape[0]
        size = 16
        while size < 2 * n:
            size *= 2
        mask = size - 1
        table = np.zeros(size, dtype=np.int64)
        used = np.zeros(size, dtype=np.bool_)  # every int64 is a valid key here
        for i in range(n):
            key = keys[i]
            pos = home_slot(key, mask)
            while used[pos]:
                if table[pos] == key:
                    return False
                pos = (pos + 1) & mask
            used[pos] = True
            table[pos] = key
        return True

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

    @jit_kernel
    def k_distinct(keys, refuse_negative):
        """Whether no int64 key repeats (and, with refuse_negative, none is < 0) in one
        call: the keys' span in one pass, then a bitmap over it where it is at most
        SPAN_BITS_PER_KEY bits a key, else the hash set. The span's width is taken in
        uint64, exact for any two int64 keys."""
        n = keys.shape[0]
        if n == 0:
            return True
        low = high = keys[0]
        for i in range(1, n):
            key = keys[i]
            if key < low:
                low = key
            elif key > high:
                high = key
        if refuse_negative and low < 0:
            return False
        width = np.uint64(high) - np.uint64(low)  # the span less one
        if width < np.uint64(SPAN_BITS_PER_KEY * n):
            return k_distinct_in_span(keys, low, np.int64(width // np.uint64(64)) + 1)
        return k_all_distinct(keys)


def first_non_finite_index(values: np.ndarray) -> int | None:
    """The flat index of the first inf or NaN of a C-contiguous float32 array (-1 if
    none) at compiled speed, with no [n] temporary; None without the host kernels or for
    another array (the caller then runs numpy's isfinite)."""
    if unavailable_reason() is not None:
        return None
    if values.dtype != np.float32 or not values.flags.c_contiguous:
        return None
    return int(k_first_non_finite(values.reshape(-1).view(np.uint32)))


def all_distinct(keys: np.ndarray) -> bool | None:
    """Whether no key repeats (int64 keys), compiled instead of a sort: a bitmap over the
    keys' span where it is at most SPAN_BITS_PER_KEY bits a key (dense ids; 7-9x faster
    than the hash set at 16k-256k keys, measured), else a hash set. None without the host
    kernels (the caller then sorts)."""
    if unavailable_reason() is not None:
        return None
    return bool(k_distinct(np.ascontiguousarray(keys, dtype=np.int64), False))


def distinct_nonnegative(keys: np.ndarray) -> bool | None:
    """Whether every key is >= 0 and none repeats (int64 keys): a push's keys as a client
    sends them, told in one compiled call (all_distinct's test). None without the host
    kernels."""
    if unavailable_reason() is not None:
        return None
    return bool(k_distinct(np.ascontiguousarray(keys, dtype=np.int64), True))


def warm_up() -> None:
    """Compile (or load from numba's cache) these kernels for the arrays they meet, so
    that the first call is not slow (a shard runs it when it starts)."""
    if unavailable_reason() is not None:
        return
    keys = np.arange(1, 9, dtype=np.int64)
    k_distinct(keys, False)
    k_distinct(np.array([1, 1 << 40], dtype=np.int64), True)
    k_first_non_finite(np.zeros(8, np.float32).view(np.uint32))
