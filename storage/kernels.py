"""CUDA kernels for the GPU tier: hash-table find, claim and upsert, row gather,
and one fused kernel per optimizer step.

The generic array code (storage/hash_table.py, core/optim.py) is the reference; these
kernels replace it on cupy arrays behind the same interface, and are tested against it.

The CUDA source below is written in a subset of CUDA that a host C++ compiler can also build
through a small shim (tests/unit/test_kernels.py does, to test every kernel without a GPU):

- threads of one launch share nothing but the slot keys they claim with atomicCAS, so there
  is no shared memory, no __syncthreads and no warp intrinsic;
- every kernel is `extern "C" __global__ void tierps_<name>(...)` with parameters of the
  types long long, int, float, and pointers to long long, float, bool and unsigned char
  (the shim's code generator and ctypes know these);
- every kernel takes the number of work items and returns in threads past it, since the
  last block of a launch is only partly used.

Python callers go through a `Launcher` (`launch(kernel_name, threads, args)`): on the GPU
the one `cupy_launcher()` returns, compiled lazily on first use with NVRTC; in the tests a
host emulation running the same source over numpy arrays. The functions below take a
`launch=` argument for that; left out, they use the cupy launcher.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tierps.core import optim
from tierps.core.xp import array_module, gpu_module

log = logging.getLogger(__name__)

# Set to "0" to keep the generic array code on the GPU as well (debugging, the benchmark's
# baseline runs through HashTable(kernels=False) instead).
ENV_SWITCH = "TIERPS_GPU_KERNELS"
BLOCK = 256  # threads per block: a multiple of the warp size; nothing here depends on it
# NVRTC options. --fmad=false: no fused multiply-add contraction, so the optimizer kernels
# round every operation as numpy does (the formulas here are memory bound: FMA buys nothing).
NVRTC_OPTIONS = ("--std=c++14", "--fmad=false")
MAX_LANES = 32  # threads that share one row in the row kernels (at most a warp)

SOURCE = r"""
/* tierps GPU kernels: see storage/kernels.py for the rules this source keeps. */

#define TIERPS_EMPTY (-9223372036854775807LL - 1LL) /* a slot never used since the rehash */
#define TIERPS_TOMBSTONE (TIERPS_EMPTY + 1LL)        /* an erased key: probing goes on */

/* Global index of this thread in a 1-D launch. */
__device__ __forceinline__ long long tierps_thread() {
    return (long long)blockIdx.x * (long long)blockDim.x + (long long)threadIdx.x;
}

/* Home slot of a key: splitmix64's finaliser of (uint64(key) + golden ratio), masked, the
   same arithmetic as core/hashing.py hash_keys (unsigned, so it wraps mod 2**64). */
__device__ __forceinline__ long long tierps_home(long long key, long long mask) {
    unsigned long long x = (unsigned long long)key + 0x9E3779B97F4A7C15ULL;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return (long long)(x & (unsigned long long)mask);
}

/* Slot holding key, or -1. Linear probing from the home slot; past tombstones, up to the
   first EMPTY slot. The bound of one visit per slot only matters for a table without EMPTY
   slots, which HashTable never builds (it keeps its load under max_load < 1); it turns what
   would be an endless loop on the device into a miss. The reserved values never match. */
__device__ __forceinline__ long long tierps_probe(const long long* table, long long mask,
                                                  long long key) {
    if (key <= TIERPS_TOMBSTONE) return -1;
    long long pos = tierps_home(key, mask);
    for (long long left = mask; left >= 0; --left) {
        const long long seen = table[pos];
        if (seen == key) return pos;
        if (seen == TIERPS_EMPTY) return -1;
        pos = (pos + 1) & mask;
    }
    return -1;
}

/* Place a key known to be absent in the first free slot (EMPTY or TOMBSTONE) along its probe
   sequence. *code: 2 it took an EMPTY slot, 1 it took a tombstone, 0 it found its key already
   placed by another thread (an in-batch duplicate) or found no free slot (-1 returned).

   Why this is safe with threads interleaving: during a launch a slot only ever changes from
   free to holding a key, once. A thread passes a slot only after seeing it hold another key,
   so two copies of one key, walking the same sequence, cannot pass the first free slot of
   it: both try it, one CAS wins, the other gets the winner's key back and shares the slot.
   A stale read (an old free value from a cache) only costs a failed CAS, whose return value
   is the slot's real content; it is examined without a second read. */
__device__ __forceinline__ long long tierps_claim_one(long long* table, long long mask,
                                                      long long key, int* code) {
    long long pos = tierps_home(key, mask);
    for (long long left = mask; left >= 0; --left) {
        long long seen = table[pos];
        while (seen <= TIERPS_TOMBSTONE) {
            const long long prev = (long long)atomicCAS(
                (unsigned long long*)(table + pos), (unsigned long long)seen,
                (unsigned long long)key);
            if (prev == seen) {
                *code = seen == TIERPS_EMPTY ? 2 : 1;
                return pos;
            }
            seen = prev;  /* someone took it first: look at what they put there */
        }
        if (seen == key) {
            *code = 0;
            return pos;
        }
        pos = (pos + 1) & mask;
    }
    *code = 0;
    return -1;
}

/* slots[i] = slot of keys[i] or -1 (HashTable.find). */
extern "C" __global__ void tierps_find(const long long* __restrict__ table, long long mask,
                                       const long long* __restrict__ keys, long long n,
                                       long long* __restrict__ slots) {
    const long long i = tierps_thread();
    if (i >= n) return;
    slots[i] = tierps_probe(table, mask, keys[i]);
}

/* HashTable._claim: for j = todo[i] (keys[j] absent from the table, repeats allowed), set
   slots[j] and, for the one occurrence that placed the key, inserted[j] = true (inserted is
   zeroed by the caller) and scores[slot] = score (a new key's eviction score; scores may be
   null). codes[i] as tierps_claim_one, so the caller can count the keys placed and the EMPTY
   slots used. */
extern "C" __global__ void tierps_claim(long long* table, long long mask,
                                        const long long* __restrict__ keys,
                                        const long long* __restrict__ todo, long long n,
                                        long long* __restrict__ slots,
                                        bool* __restrict__ inserted,
                                        unsigned char* __restrict__ codes,
                                        long long* __restrict__ scores, long long score) {
    const long long i = tierps_thread();
    if (i >= n) return;
    const long long j = todo[i];
    int code = 0;
    const long long slot = tierps_claim_one(table, mask, keys[j], &code);
    slots[j] = slot;
    if (code) {
        inserted[j] = true;
        if (scores) scores[slot] = score;
    }
    codes[i] = (unsigned char)code;
}

/* HashTable.insert in one pass when the table has room for every key: find each key, and
   claim a slot for those absent (keys > TOMBSTONE; the caller checks). A copy of a key that
   another thread is placing may miss it in the find and then meets it in the claim.
   Outputs as tierps_claim, with i for j. */
extern "C" __global__ void tierps_upsert(long long* table, long long mask,
                                         const long long* __restrict__ keys, long long n,
                                         long long* __restrict__ slots,
                                         bool* __restrict__ inserted,
                                         unsigned char* __restrict__ codes,
                                         long long* __restrict__ scores, long long score) {
    const long long i = tierps_thread();
    if (i >= n) return;
    const long long key = keys[i];
    long long slot = tierps_probe(table, mask, key);
    int code = 0;
    if (slot < 0) slot = tierps_claim_one(table, mask, key, &code);
    slots[i] = slot;
    if (code) {
        inserted[i] = true;
        if (scores) scores[slot] = score;
    }
    codes[i] = (unsigned char)code;
}

/* Copy columns [0, width) of row r of a row-major float matrix into the same columns of
   row d: `lane` of `lanes` threads sharing the row, each taking every lanes-th column (or
   float4 of columns when vec == 4: pointers, strides and width are then multiples of 4
   floats, checked by the caller), so a warp reads whole cache lines. */
__device__ __forceinline__ void tierps_copy_row(float* dst, const float* src, long long width,
                                                long long lane, long long lanes, int vec) {
    if (vec == 4) {
        for (long long c = lane * 4; c < width; c += lanes * 4)
            *(float4*)(dst + c) = *(const float4*)(src + c);
    } else {
        for (long long c = lane; c < width; c += lanes) dst[c] = src[c];
    }
}

__device__ __forceinline__ void tierps_zero_row(float* dst, long long width, long long lane,
                                                long long lanes) {
    for (long long c = lane; c < width; c += lanes) dst[c] = 0.0f;
}

/* Lookup: slot of keys[i] (into slots, when not null) and out[i, :width] =
   arena[values[slot], :width]; a missing key's row is zeroed when zero_misses, else left as
   it was. 2**lane_shift threads per key: each probes (the same addresses, so one memory
   transaction per warp and key) and copies its share of the row. */
extern "C" __global__ void tierps_find_rows(const long long* __restrict__ table,
                                            const long long* __restrict__ values,
                                            long long mask,
                                            const long long* __restrict__ keys, long long n,
                                            const float* __restrict__ arena,
                                            long long arena_stride, float* __restrict__ out,
                                            long long out_stride, long long width,
                                            int lane_shift, int vec, int zero_misses,
                                            long long* __restrict__ slots) {
    const long long t = tierps_thread();
    const long long i = t >> lane_shift;
    if (i >= n) return;
    const long long lanes = 1LL << lane_shift;
    const long long lane = t & (lanes - 1);
    const long long slot = tierps_probe(table, mask, keys[i]);
    if (slots && lane == 0) slots[i] = slot;
    float* dst = out + i * out_stride;
    if (slot >= 0) {
        tierps_copy_row(dst, arena + values[slot] * arena_stride, width, lane, lanes, vec);
    } else if (zero_misses) {
        tierps_zero_row(dst, width, lane, lanes);
    }
}

/* Fused optimizer steps, in place on rows arena[ids[i]] = [weights | state slots], each slot
   dim floats, with gradients grads[i, :dim]. ids are unique (the push summed repeats), so no
   two threads touch one float. 2**lane_shift threads per row, each taking every lanes-th
   column. Every formula keeps core/optim.py's order of float32 operations (and the
   module is built without FMA contraction), so the results match numpy's to the rounding.
   Hyper-parameters arrive as float32, as numpy rounds Python floats in float32 arithmetic;
   products of them (1 - beta, Adam's bias-corrected step size) are formed in double on
   the host, as optim.py forms them in Python. */

#define TIERPS_ROW_THREAD                                                \
    const long long t = tierps_thread();                                 \
    const long long i = t >> lane_shift;                                 \
    if (i >= n) return;                                                  \
    const long long lanes = 1LL << lane_shift;                           \
    float* w = arena + ids[i] * stride;                                  \
    const float* g = grads + i * dim;

/* SGD: w -= lr * g */
extern "C" __global__ void tierps_sgd(float* arena, long long stride,
                                      const long long* __restrict__ ids,
                                      const float* __restrict__ grads, long long n,
                                      long long dim, int lane_shift, float lr) {
    TIERPS_ROW_THREAD
    for (long long c = t & (lanes - 1); c < dim; c += lanes) w[c] = w[c] - lr * g[c];
}

/* Momentum: b = momentum * b + g; w -= lr * b.  Nesterov: w -= lr * (g + momentum * b). */
extern "C" __global__ void tierps_momentum(float* arena, long long stride,
                                           const long long* __restrict__ ids,
                                           const float* __restrict__ grads, long long n,
                                           long long dim, int lane_shift, float lr,
                                           float momentum, int nesterov) {
    TIERPS_ROW_THREAD
    float* buf = w + dim;
    for (long long c = t & (lanes - 1); c < dim; c += lanes) {
        const float gc = g[c];
        float b = buf[c] * momentum;
        b = b + gc;
        buf[c] = b;
        const float update = nesterov ? gc + momentum * b : b;
        w[c] = w[c] - lr * update;
    }
}

/* Adagrad: s += g * g; w -= lr * g / (sqrt(s) + eps) */
extern "C" __global__ void tierps_adagrad(float* arena, long long stride,
                                          const long long* __restrict__ ids,
                                          const float* __restrict__ grads, long long n,
                                          long long dim, int lane_shift, float lr,
                                          float eps) {
    TIERPS_ROW_THREAD
    float* acc = w + dim;
    for (long long c = t & (lanes - 1); c < dim; c += lanes) {
        const float gc = g[c];
        const float s = acc[c] + gc * gc;
        acc[c] = s;
        w[c] = w[c] - (lr * gc) / (sqrtf(s) + eps);
    }
}

/* Adam (torch.optim.SparseAdam): m += (1-b1)(g-m); v += (1-b2)(g*g-v);
   w -= step_size * m / (sqrt(v) + eps), step_size = lr * sqrt(1-b2**t) / (1-b1**t). */
extern "C" __global__ void tierps_adam(float* arena, long long stride,
                                       const long long* __restrict__ ids,
                                       const float* __restrict__ grads, long long n,
                                       long long dim, int lane_shift, float one_minus_beta1,
                                       float one_minus_beta2, float step_size, float eps) {
    TIERPS_ROW_THREAD
    float* m = w + dim;
    float* v = w + 2 * dim;
    for (long long c = t & (lanes - 1); c < dim; c += lanes) {
        const float gc = g[c];
        const float mc = m[c] + one_minus_beta1 * (gc - m[c]);
        const float vc = v[c] + one_minus_beta2 * (gc * gc - v[c]);
        m[c] = mc;
        v[c] = vc;
        w[c] = w[c] - step_size * (mc / (sqrtf(vc) + eps));
    }
}

/* RMSprop (torch.optim.RMSprop, no momentum, not centered): v = alpha * v + (1 - alpha) g*g;
   w -= lr * g / (sqrt(v) + eps). */
extern "C" __global__ void tierps_rmsprop(float* arena, long long stride,
                                          const long long* __restrict__ ids,
                                          const float* __restrict__ grads, long long n,
                                          long long dim, int lane_shift, float lr, float alpha,
                                          float one_minus_alpha, float eps) {
    TIERPS_ROW_THREAD
    float* avg = w + dim;
    for (long long c = t & (lanes - 1); c < dim; c += lanes) {
        const float gc = g[c];
        float v = avg[c] * alpha;
        v = v + one_minus_alpha * (gc * gc);
        avg[c] = v;
        w[c] = w[c] - lr * (gc / (sqrtf(v) + eps));
    }
}

/* FTRL-Proximal as optim.FTRL: n' = n + g*g; z += g - (n'^p - n^p) / lr * w;
   w = (sign(z) * l1 - z) / (n'^p / lr + 2 * l2) where |z| > l1, else 0; n = n'.
   p = -lr_power; numpy computes x ** 0.5 as sqrt(x), so p == 0.5 does too (use_sqrt). */
__device__ __forceinline__ float tierps_pow(float x, float p, int use_sqrt) {
    return use_sqrt ? sqrtf(x) : powf(x, p);
}

extern "C" __global__ void tierps_ftrl(float* arena, long long stride,
                                       const long long* __restrict__ ids,
                                       const float* __restrict__ grads, long long n,
                                       long long dim, int lane_shift, float lr, float power,
                                       int use_sqrt, float l1, float two_l2) {
    TIERPS_ROW_THREAD
    float* acc = w + dim;
    float* z = w + 2 * dim;
    for (long long c = t & (lanes - 1); c < dim; c += lanes) {
        const float gc = g[c];
        const float n_old = acc[c];
        const float n_new = n_old + gc * gc;
        const float p_new = tierps_pow(n_new, power, use_sqrt);
        const float p_old = tierps_pow(n_old, power, use_sqrt);
        const float zc = z[c] + (gc - ((p_new - p_old) / lr) * w[c]);
        z[c] = zc;
        const float quadratic = p_new / lr + two_l2;
        const float sign = (float)((zc > 0.0f) - (zc < 0.0f));
        w[c] = fabsf(zc) > l1 ? (sign * l1 - zc) / quadratic : 0.0f;
        acc[c] = n_new;
    }
}
"""


class Launcher(Protocol):
    """Runs kernel `name` over `threads` threads (1-D). `args` are arrays (passed as device
    pointers), numpy scalars of the parameter's exact type, or None for a null pointer."""

    def __call__(self, name: str, threads: int, args: Sequence[Any]) -> None: ...


class CupyLauncher:
    """The kernels compiled by NVRTC (cupy.RawModule) for the current device."""

    def __init__(self) -> None:
        import cupy

        module = cupy.RawModule(code=SOURCE, options=NVRTC_OPTIONS)
        # get_function compiles the module: do it now, so a failure shows here, once.
        self._functions = {name: module.get_function(name) for name in KERNEL_NAMES}
        self._null = np.uint64(0)  # a pointer-sized zero: cupy passes numpy scalars by value

    def __call__(self, name: str, threads: int, args: Sequence[Any]) -> None:
        if threads <= 0:
            return
        blocks = (threads + BLOCK - 1) // BLOCK
        packed = tuple(self._null if arg is None else arg for arg in args)
        self._functions[name]((blocks,), (BLOCK,), packed)


_cupy_launcher: CupyLauncher | None = None
_cupy_failure: str | None = None


def cupy_launcher() -> CupyLauncher | None:
    """The compiled kernels, or None when they cannot be used here (no cupy, no usable GPU,
    TIERPS_GPU_KERNELS=0, or a compile error: `unavailable_reason()` says which). Compiled
    on the first call, then cached."""
    global _cupy_launcher, _cupy_failure
    if _cupy_launcher is not None or _cupy_failure is not None:
        return _cupy_launcher
    if os.environ.get(ENV_SWITCH, "1") == "0":
        _cupy_failure = f"{ENV_SWITCH}=0"
        return None
    cupy, why = gpu_module()
    if cupy is None:
        _cupy_failure = why
        return None
    try:
        _cupy_launcher = CupyLauncher()
    except Exception as exc:  # a compile or driver error: fall back to the generic code
        _cupy_failure = f"the kernels did not compile or load: {exc}"
        log.warning("tierps GPU kernels unavailable, using the generic cupy code: %s", exc)
    return _cupy_launcher


def unavailable_reason() -> str | None:
    """Why cupy_launcher() returned None (None if it has not or it worked)."""
    return _cupy_failure


def _resolve(launch: Launcher | None) -> Launcher:
    if launch is not None:
        return launch
    found = cupy_launcher()
    if found is None:
        raise RuntimeError(f"tierps GPU kernels are unavailable: {unavailable_reason()}")
    return found


# --------------------------------------------------------------------------- array helpers


def _address(array: Any) -> int:
    """Data pointer of a numpy or cupy array."""
    if isinstance(array, np.ndarray):
        return int(array.ctypes.data)
    return int(array.data.ptr)


def _int64(xp: Any, keys: Any) -> Any:
    return xp.ascontiguousarray(keys, dtype=xp.int64)


def _check_out(name: str, array: Any, dtype: Any, n: int) -> None:
    """Output arrays are written through raw pointers: they must be exactly right."""
    if array.dtype != dtype or array.ndim != 1 or array.shape[0] < n:
        raise ValueError(
            f"kernels: field '{name}' expected a 1-D {np.dtype(dtype).name} array of at least "
            f"{n} items, got {array.dtype} {array.shape}"
        )
    if not array.flags.c_contiguous:
        raise ValueError(f"kernels: field '{name}' expected a contiguous array")


def _row_stride(name: str, matrix: Any) -> int:
    """Row stride in floats of a float32 matrix whose rows are contiguous (a column slice of
    a contiguous matrix qualifies: the kernels take the stride)."""
    if matrix.dtype != np.float32 or matrix.ndim != 2:
        raise ValueError(
            f"kernels: field '{name}' expected a 2-D float32 array, "
            f"got {matrix.dtype} {matrix.shape}"
        )
    # numpy and cupy may give a dimension of length 1 any stride: it is never stepped over.
    if matrix.shape[1] > 1 and matrix.strides[1] != 4:
        raise ValueError(f"kernels: field '{name}' expected contiguous rows")
    if matrix.shape[0] <= 1:
        return matrix.shape[1]
    if matrix.strides[0] % 4:
        raise ValueError(f"kernels: field '{name}' row stride is not a multiple of 4 bytes")
    return matrix.strides[0] // 4


def _lanes(columns: int) -> int:
    """log2 of the threads per row: a power of two covering the columns, at most a warp."""
    lanes = 1
    while lanes < min(columns, MAX_LANES):
        lanes *= 2
    return lanes.bit_length() - 1


def _vec(width: int, *strided: tuple[Any, int]) -> int:
    """4 when every row start is 16-byte aligned and width a multiple of 4 (float4 copies),
    else 1."""
    if width % 4:
        return 1
    for array, stride in strided:
        if _address(array) % 16 or stride % 4:
            return 1
    return 4


# --------------------------------------------------------------------------- hash table


def find_slots(table_keys: Any, mask: int, keys: Any, *, launch: Launcher | None = None) -> Any:
    """Slot of each key in the slot-key array `table_keys` (mask = slots - 1), -1 where
    absent: HashTable.find."""
    xp = array_module(table_keys)
    keys = _int64(xp, keys)
    slots = xp.empty(keys.shape[0], dtype=xp.int64)
    if keys.shape[0]:
        _resolve(launch)(
            "tierps_find",
            keys.shape[0],
            (table_keys, np.int64(mask), keys, np.int64(keys.shape[0]), slots),
        )
    return slots


def _counts(xp: Any, codes: Any) -> tuple[int, int]:
    """(keys placed, EMPTY slots used) from claim codes, in one device-to-host copy."""
    if xp is np:
        return int(np.count_nonzero(codes)), int(np.count_nonzero(codes == 2))
    placed, empty = xp.stack([xp.count_nonzero(codes), xp.count_nonzero(codes == 2)]).tolist()
    return int(placed), int(empty)


def claim_slots(
    table_keys: Any,
    mask: int,
    keys: Any,
    todo: Any,
    slots: Any,
    inserted: Any,
    *,
    scores: Any = None,
    score: int = 0,
    launch: Launcher | None = None,
) -> tuple[int, int]:
    """HashTable._claim: place keys[todo] (all absent from the table; repeats allowed) in
    free slots, setting slots[todo] and inserted[todo] (True for the one occurrence of each
    key that placed it; the rest of `inserted` is left alone), and scores[slot] = score for
    each slot taken when `scores` is given. Returns (keys placed, of them into EMPTY slots)
    for the table's size and used counts. The table must have a free slot for every distinct
    key (HashTable grows first); without one a key gets slot -1."""
    xp = array_module(table_keys)
    keys, todo = _int64(xp, keys), _int64(xp, todo)
    _check_out("slots", slots, np.int64, keys.shape[0])
    _check_out("inserted", inserted, np.bool_, keys.shape[0])
    n = todo.shape[0]
    if n == 0:
        return 0, 0
    codes = xp.empty(n, dtype=xp.uint8)
    _resolve(launch)(
        "tierps_claim",
        n,
        (
            table_keys,
            np.int64(mask),
            keys,
            todo,
            np.int64(n),
            slots,
            inserted,
            codes,
            scores,
            np.int64(score),
        ),
    )
    return _counts(xp, codes)


def upsert_slots(
    table_keys: Any,
    mask: int,
    keys: Any,
    *,
    scores: Any = None,
    score: int = 0,
    launch: Launcher | None = None,
) -> tuple[Any, Any, int, int]:
    """HashTable.insert's find and claim in one pass, for a table with a free slot for every
    key in the batch (the caller checks, counting repeats). Keys must be > TOMBSTONE.
    scores[slot] = score for each slot taken, when `scores` is given. Returns (slots,
    inserted, keys placed, of them into EMPTY slots)."""
    xp = array_module(table_keys)
    keys = _int64(xp, keys)
    n = keys.shape[0]
    slots = xp.empty(n, dtype=xp.int64)
    inserted = xp.zeros(n, dtype=bool)
    if n == 0:
        return slots, inserted, 0, 0
    codes = xp.empty(n, dtype=xp.uint8)
    _resolve(launch)(
        "tierps_upsert",
        n,
        (
            table_keys,
            np.int64(mask),
            keys,
            np.int64(n),
            slots,
            inserted,
            codes,
            scores,
            np.int64(score),
        ),
    )
    placed, empty = _counts(xp, codes)
    return slots, inserted, placed, empty


# --------------------------------------------------------------------------- rows


def find_rows(
    table_keys: Any,
    values: Any,
    mask: int,
    keys: Any,
    arena: Any,
    *,
    width: int | None = None,
    out: Any = None,
    zero_misses: bool = True,
    launch: Launcher | None = None,
) -> tuple[Any, Any]:
    """Lookup in one kernel: (slots, rows) with slots as find_slots and
    rows[i] = arena[values[slots[i]], :width] (width: all columns when None).

    Rows of missing keys are zeros, or with zero_misses=False whatever `out` held (the
    cascade can then fill them from the tier below without a second pass). `out` must be a
    float32 [n, >= width] matrix with contiguous rows; allocated when None."""
    xp = array_module(table_keys)
    keys = _int64(xp, keys)
    n = keys.shape[0]
    arena_stride = _row_stride("arena", arena)
    width = arena.shape[1] if width is None else int(width)
    if not 0 <= width <= arena.shape[1]:
        raise ValueError(f"kernels: field 'width' expected 0..{arena.shape[1]}, got {width}")
    if out is None:
        out = xp.empty((n, width), dtype=xp.float32)
    if out.shape[0] != n or out.shape[1] < width:
        raise ValueError(
            f"kernels: field 'out' expected shape ({n}, >= {width}), got {tuple(out.shape)}"
        )
    out_stride = _row_stride("out", out)
    slots = xp.empty(n, dtype=xp.int64)
    if n == 0:
        return slots, out
    vec = _vec(width, (arena, arena_stride), (out, out_stride))
    shift = _lanes(-(-width // vec))
    _resolve(launch)(
        "tierps_find_rows",
        n << shift,
        (
            table_keys,
            values,
            np.int64(mask),
            keys,
            np.int64(n),
            arena,
            np.int64(arena_stride),
            out,
            np.int64(out_stride),
            np.int64(width),
            np.int32(shift),
            np.int32(vec),
            np.int32(1 if zero_misses else 0),
            slots,
        ),
    )
    return slots, out


# --------------------------------------------------------------------------- optimizers

_F32 = np.float32


@dataclass(frozen=True)
class FusedUpdate:
    """An optimizer's fused step: the CUDA kernel in SOURCE that runs it, and its
    hyper-parameters for a step in that kernel's order and types (float32 for a float:
    numpy rounds a Python float so in float32 arithmetic). storage/host_kernels.py's numba
    twin of the kernel takes the same values."""

    kernel: str
    arguments: Callable[[Any, int], tuple[Any, ...]]  # (optimizer config, step) -> values


def _adam_arguments(opt: Any, step: int) -> tuple[Any, ...]:
    # As optim.Adam.apply: these are Python (double) expressions rounded once to float32.
    step_size = opt.lr * (1.0 - opt.beta2**step) ** 0.5 / (1.0 - opt.beta1**step)
    return _F32(1.0 - opt.beta1), _F32(1.0 - opt.beta2), _F32(step_size), _F32(opt.eps)


def _ftrl_arguments(opt: Any, step: int) -> tuple[Any, ...]:
    power = -opt.lr_power
    use_sqrt = np.int32(1 if power == 0.5 else 0)
    return _F32(opt.lr), _F32(power), use_sqrt, _F32(opt.l1), _F32(2.0 * opt.l2)


FUSED: dict[str, FusedUpdate] = {
    "sgd": FusedUpdate("tierps_sgd", lambda opt, step: (_F32(opt.lr),)),
    "momentum": FusedUpdate(
        "tierps_momentum", lambda opt, step: (_F32(opt.lr), _F32(opt.momentum), np.int32(0))
    ),
    "nesterov": FusedUpdate(
        "tierps_momentum", lambda opt, step: (_F32(opt.lr), _F32(opt.momentum), np.int32(1))
    ),
    "adagrad": FusedUpdate("tierps_adagrad", lambda opt, step: (_F32(opt.lr), _F32(opt.eps))),
    "adam": FusedUpdate("tierps_adam", _adam_arguments),
    "rmsprop": FusedUpdate(
        "tierps_rmsprop",
        lambda opt, step: (_F32(opt.lr), _F32(opt.alpha), _F32(1.0 - opt.alpha), _F32(opt.eps)),
    ),
    "ftrl": FusedUpdate("tierps_ftrl", _ftrl_arguments),
}
"""The fused update of every optimizer of optim.OPTIMIZERS, by kind."""

KERNEL_NAMES = (
    "tierps_find",
    "tierps_claim",
    "tierps_upsert",
    "tierps_find_rows",
    *dict.fromkeys(fused.kernel for fused in FUSED.values()),
)


def fused_update(opt: Any) -> FusedUpdate | None:
    """The fused update of an optimizer config, or None for a subclass of a registered
    config (it may change apply(): only the generic path is right for it). A registered
    optimizer without one is an error, not a silent fall back to the array code."""
    if optim.OPTIMIZERS.get(opt.kind) is not type(opt):
        return None
    fused = FUSED.get(opt.kind)
    if fused is None:
        raise LookupError(
            f"kernels: optimizer {opt.kind!r} expected a fused update in kernels.FUSED (a "
            f"CUDA kernel and its arguments) as every optimizer of optim.OPTIMIZERS has, "
            f"got none"
        )
    return fused


def optimizer_args(opt: Any, step: int) -> tuple[str, tuple[Any, ...]] | None:
    """(kernel, hyper-parameters) of an optimizer's fused step, or None (fused_update)."""
    fused = fused_update(opt)
    return None if fused is None else (fused.kernel, fused.arguments(opt, step))


def has_fused(optimizer: Any) -> bool:
    """Whether fused_apply has a kernel for this optimizer."""
    return optimizer_args(optimizer, 1) is not None


def fused_apply(
    optimizer: Any,
    arena: Any,
    ids: Any,
    grads: Any,
    step: int,
    *,
    launch: Launcher | None = None,
) -> bool:
    """One optimizer step in one kernel launch, in place on rows arena[ids] laid out
    [weights | state slots] (optimizer.size_factor slots of dim = grads.shape[1] floats,
    anything after them, such as stored step slots, untouched), with gradients grads [n, dim]
    for n unique ids (summed per key by the caller). The same arithmetic as
    optimizer.apply(rows, grads, step) on the gathered rows.

    Returns False, changing nothing, when there is no kernel for this optimizer, the arrays
    are numpy and no launcher is given, or the arena is not a float32 matrix with contiguous
    rows: the caller then gathers, calls optimizer.apply and scatters."""
    params = optimizer_args(optimizer, step)
    if params is None:
        return False
    xp = array_module(arena)
    if launch is None and xp is np:
        return False
    try:
        stride = _row_stride("arena", arena)
    except ValueError:
        return False
    launch = launch or cupy_launcher()
    if launch is None:  # TIERPS_GPU_KERNELS=0 or no compiled kernels: the array code
        return False
    ids = _int64(xp, ids)
    grads = xp.ascontiguousarray(grads, dtype=xp.float32)
    n, dim = grads.shape
    if ids.shape[0] != n or dim * optimizer.size_factor > arena.shape[1]:
        raise ValueError(
            f"kernels: fused {optimizer.kind} expected ids of {n} items and arena rows of at "
            f"least {dim * optimizer.size_factor} floats, got {ids.shape[0]} ids and "
            f"{arena.shape[1]} floats"
        )
    if n == 0 or dim == 0:
        return True
    shift = _lanes(dim)
    name, hyper = params
    shape = (np.int64(stride), ids, grads, np.int64(n), np.int64(dim), np.int32(shift))
    launch(name, n << shift, (arena, *shape, *hyper))
    return True
