"""Fused pooling: bags of keys -> one row per bag, and its backward, as one sparse product.

A batch of B bags over the u distinct keys of a table is a sparse matrix A [B, u] whose
entry (b, j) is the coefficient of distinct key j in bag b. With the distinct keys' rows
E [u, dim]:

    forward:   output = A @ E          [B, dim]
    backward:  grad_E = A.T @ grad_out [u, dim]   (gradients of repeated keys summed)

Both run over A's CSR arrays in compiled kernels: no Python loop over bags, and the
backward yields per-distinct-key gradients directly, ready to push. A lookup keeps the
arrays it builds (PoolingLayout) and gives them to the kernels as they are; a scipy CSR
array of them is built only for scipy's kernels, the reference. Coefficients, for a bag
b with keys i (keys < 0 are padding and take no part) and weights w_i (1 without
per_sample_weights):

    sum:    c_i = w_i                         output_b = sum_i w_i e_i
    mean:   c_i = w_i / sum_j w_j             (unweighted: 1 / n_b)
    sqrtn:  c_i = w_i / sqrt(sum_j w_j**2)    (unweighted: 1 / sqrt(n_b))

An empty bag (no keys, only padding, or weights summing to 0 under mean) pools to zeros.

Kernels: numpy's sort (the dedup) and scipy.sparse (forward and backward) are the
reference and always there. Where torch is installed (a trainer's usual case), the forward
runs torch's embedding_bag over the same CSR arrays, 2.6x faster here
(tests/bench/bench_pooling.py). Where the host kernels run (core.compiled), the dedup and
the backward are compiled. The dedup of keys that span at most SPAN_DEDUP_BITS_PER_KEY
values a key (ids of a table of bounded size) marks them in a bitmap of their span and
numbers each by the count of marked bits below it, with no hashing and no sort (8,192
Zipf keys of 2,400 distinct over 200,000 ids: 0.02-0.05 ms, against the hash set's 0.06-0.11
and np.unique's 0.15-0.22; 65,536 such keys: 0.2 ms against 2.2). A lookup asks for its
distinct keys by shard (distinct_keys' `shards`: each shard's keys one span, ascending), so
that a shard's reply rows land as one block, not scattered row by row; for a power of two
of shards the bitmap keeps each shard's keys in a block of their own, which gives that
order as it ranks (about 10% more than one block), and another number of shards is
renumbered after, in a pass over the distinct keys. Wider keys (hashed ids),
up to HASHED_DEDUP_KEYS of them, are numbered as they first come in a hash set that stays
in cache, then only the distinct ones are sorted; more are argsorted by numpy and numbered
in one compiled pass over that order (a hash set that outgrows the cache waits on memory:
at 43,000 keys of 24,000 distinct it took 1.7 ms, the sort 0.95, np.unique 1.2). The
backward is a compiled pass over the CSR arrays, in scipy's order (the same float32 sums,
bit for bit). Every kernel gives the same results to float
rounding, and the tests run each against its reference and against a numpy oracle.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import scipy.sparse as sp

from tierps.client.formats import Bags
from tierps.core.compiled import home_slot, jit_kernel, numba, unavailable_reason
from tierps.core.errors import InvalidArgumentError


class Combiner(enum.StrEnum):
    """How a bag's rows become one row."""

    SUM = "sum"  # weighted sum of the bag's rows
    MEAN = "mean"  # the sum divided by the bag's total weight (its key count, unweighted)
    SQRTN = "sqrtn"  # the sum divided by the square root of the bag's sum of squared weights

    @classmethod
    def of(cls, value: str | Combiner, where: str) -> Combiner:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(c.value) for c in cls)
            raise InvalidArgumentError(
                f"{where}: field 'combiner' expected one of {choices}, got {value!r}"
            ) from None


@dataclass(frozen=True)
class PoolingLayout:
    """A pooling matrix A [rows, columns] as its CSR arrays, built by this module and so
    valid by construction (scipy's csr_array checks them again at each construction):
    bag r's entries are indices[indptr[r]:indptr[r + 1]] (distinct-key columns, int64)
    with coefficients data[...] (float32). matrix() is the scipy matrix, for the
    reference kernels."""

    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray
    shape: tuple[int, int]

    def matrix(self) -> sp.csr_array:
        """The scipy CSR array (int32 indices where they fit)."""
        index = np.int32 if max(self.shape[1], self.indices.size) < _INT32_MAX else np.int64
        return sp.csr_array(
            (
                self.data,
                self.indices.astype(index, copy=False),
                self.indptr.astype(index, copy=False),
            ),
            shape=self.shape,
        )


_INT32_MAX = np.iinfo(np.int32).max
_INT64_MAX = np.int64(np.iinfo(np.int64).max)
# A pooling matrix as the kernels take it: the layout, or a scipy CSR array.
PoolingMatrix = PoolingLayout | sp.csr_array


def pooling_matrix(
    bags: Bags, inverse: np.ndarray, num_unique: int, combiner: Combiner
) -> sp.csr_array:
    """A [B, num_unique] as a scipy CSR array. inverse[k] is the distinct-key index of
    bags.keys[k], or -1 for padding."""
    return stacked_pooling_matrix([(bags, inverse, combiner)], num_unique)


def stacked_pooling_matrix(
    parts: Sequence[tuple[Bags, np.ndarray, Combiner]], num_unique: int
) -> sp.csr_array:
    """stacked_pooling_layout's matrix as a scipy CSR array."""
    return stacked_pooling_layout(parts, num_unique).matrix()


def stacked_pooling_layout(
    parts: Sequence[tuple[Bags, np.ndarray, Combiner]], num_unique: int
) -> PoolingLayout:
    """The pooling matrices of several features over one table's distinct keys, stacked row
    block after row block ([sum of B_f, num_unique], fbgemm's table-batched layout): one
    forward and one backward kernel call serve every feature of the table."""
    inverse = _joined([inverse for _, inverse, _ in parts])
    # Every bag's bounds in the joined entries: each feature's offsets shifted to where its
    # entries start (its last offset is the next feature's first), then the end; written
    # into one array (a trainer's prefetch builds this every step, for a few features).
    if len(parts) == 1:  # one feature: its offsets are the bounds
        bags = parts[0][0]
        bag_starts = [0, bags.num_bags]
        bounds = bags.offsets
    else:
        bag_starts = [0, *itertools.accumulate(bags.num_bags for bags, _, _ in parts)]
        bounds = np.empty(bag_starts[-1] + 1, np.int64)
        base = 0
        for (bags, part_inverse, _), first, end in zip(
            parts, bag_starts[:-1], bag_starts[1:], strict=True
        ):
            np.add(bags.offsets[:-1], base, out=bounds[first:end])
            base += part_inverse.size
        bounds[-1] = base
    live: np.ndarray | None = None  # None: every entry is live
    if inverse.size == 0 or inverse.min() >= 0:  # no padding (the usual batch): bags count
        indptr, column = bounds, inverse  # their entries
    else:  # each bag's live entries: the running count of live entries before its bound
        live = inverse >= 0
        running = np.zeros(live.size + 1, np.int64)
        np.cumsum(live, out=running[1:])
        indptr, column = running[bounds], inverse[live]
    # Coefficients: 1 for an unweighted sum; the other features write theirs into their
    # span of the live entries.
    data = np.ones(column.size, np.float32)
    for (bags, _, combiner), first, end in zip(parts, bag_starts[:-1], bag_starts[1:], strict=True):
        if combiner is not Combiner.SUM or bags.weights is not None:
            # the feature's entries, padding too
            entries = slice(None) if live is None else live[bounds[first] : bounds[end]]
            counts = np.diff(indptr[first : end + 1])
            data[indptr[first] : indptr[end]] = _coefficients(bags, entries, counts, combiner)
    return PoolingLayout(indptr, column, data, (indptr.size - 1, num_unique))


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """np.concatenate, without the copy for one array."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _coefficients(
    bags: Bags, live: np.ndarray | slice, counts: np.ndarray, combiner: Combiner
) -> np.ndarray:
    """The float32 coefficient of each live key of the bags (the formulas above); `live`
    picks the bags' live entries (a mask, or every entry)."""
    weights = None if bags.weights is None else bags.weights[live]
    if combiner is Combiner.SUM:
        return np.ones(int(counts.sum()), np.float32) if weights is None else weights
    if weights is None:
        per_bag = counts.astype(np.float64)
    else:
        squares = weights.astype(np.float64) ** (2 if combiner is Combiner.SQRTN else 1)
        bag_of = np.repeat(np.arange(bags.num_bags), counts)
        per_bag = np.bincount(bag_of, weights=squares, minlength=bags.num_bags)
    if combiner is Combiner.SQRTN:
        per_bag = np.sqrt(per_bag)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(per_bag != 0, 1.0 / per_bag, 0.0)
    per_entry = np.repeat(scale, counts)  # each live key's bag's scale
    return (per_entry if weights is None else weights * per_entry).astype(np.float32)


Kernel = Literal["auto", "scipy", "torch"]
# The most keys the compiled dedup numbers in a hash set (2 int64 arrays of 2-4 slots a key:
# 256-512 KiB, in cache); more are argsorted instead (the module docstring).
HASHED_DEDUP_KEYS = 16_384
# The widest span of keys, in bits a key, that the compiled dedup ranks in a bitmap of the
# span (the bitmap and its words' ranks: at most 64 bytes a key). The bitmap was 2-4x
# faster than the hash set or the sort at every size measured up to this span (1,024 to
# 200,000 keys, Zipf and uniform): 8,192 Zipf keys over 2,000,000 ids 0.06 ms against 0.13.
SPAN_DEDUP_BITS_PER_KEY = 256


@functools.cache
def _torch() -> Any | None:
    """The torch module when it is installed, else None (imported on first use only)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def _use_torch(kernel: Kernel) -> Any | None:
    if kernel == "scipy":
        return None
    torch = _torch()
    if torch is None and kernel == "torch":
        raise RuntimeError("pooling kernel 'torch' expected torch installed, but it is not")
    return torch


if numba is not None:
    from llvmlite import ir
    from numba.core import types
    from numba.core.extending import intrinsic

    from tierps.core.ownership import k_group_by_shard

    @jit_kernel
    def k_first_seen(keys, unique, inverse):
        """Number the distinct keys >= 0 in the order they first come: unique[:count] are
        they, inverse[i] the number of keys[i] (-1: padding); returns count. An
        open-addressing set at load <= 0.5 (core.compiled.home_slot's hash)."""
        n = keys.shape[0]
        size = 16
        while size < 2 * n:
            size *= 2
        mask = size - 1
        slot_keys = np.empty(size, np.int64)
        slot_numbers = np.full(size, -1, np.int64)  # -1: an empty slot
        count = 0
        for i in range(n):
            key = keys[i]
            if key < 0:
                inverse[i] = -1
                continue
            pos = home_slot(key, mask)
            while True:
                number = slot_numbers[pos]
                if number < 0:
                    slot_numbers[pos] = count
                    slot_keys[pos] = key
                    unique[count] = key
                    inverse[i] = count
                    count += 1
                    break
                if slot_keys[pos] == key:
                    inverse[i] = number
                    break
                pos = (pos + 1) & mask
        return count

    @intrinsic
    def popcount64(typing_context, bits):
        """The number of set bits of a uint64, as an int64: LLVM's ctpop (one popcnt
        instruction on x86-64 with POPCNT)."""

        def codegen(context, builder, signature, args):
            return builder.ctpop(args[0])

        return types.int64(types.uint64), codegen

    @intrinsic
    def trailing_zeros64(typing_context, bits):
        """The number of zero bits below the lowest set bit of a nonzero uint64, as an
        int64: LLVM's cttz (one tzcnt or bsf instruction)."""

        def codegen(context, builder, signature, args):
            return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

        return types.int64(types.uint64), codegen

    @jit_kernel
    def k_rank_in_span(keys, bits_per_key, shards, unique, inverse):
        """Number the distinct keys >= 0 in the order (key % shards, key) where they span
        fewer than bits_per_key * len(keys) values: unique[:count] are they, in that order
        (ascending for one shard), inverse[i] the number of keys[i] (-1: padding); returns
        count, or -1 (nothing written) where the span is wider. A bitmap of the span marks
        the keys; a key's number is the count of marked bits below its own (the running
        count of the words before it, and a popcount within its word): no hashing and no
        sort, and the bitmap stays in cache. For a power of two of shards the bitmap holds
        each shard's keys in a block of their own, shard after shard (a key's bit: its
        shard's block, then key >> log2(shards) within it), so that its order is already the
        shards'; for another number of shards the ranks are renumbered shard by shard."""
        n = keys.shape[0]
        low, high = _INT64_MAX, np.int64(-1)  # branch-free: LLVM vectorises the loop
        for i in range(n):
            key = keys[i]
            high = max(high, key)
            low = min(low, key if key >= 0 else _INT64_MAX)
        if high < 0:  # padding only
            inverse[:] = -1
            return 0
        if high - low >= bits_per_key * n:
            return -1
        mask = shards - 1
        blocks = shards  # a block of the bitmap for each shard
        if shards & mask != 0:  # not a power of two: one block, renumbered after
            mask, blocks = 0, 1
        shift = trailing_zeros64(np.uint64(mask + 1))  # log2 of a block's stride in keys
        base = low >> shift
        block_words = (((high >> shift) - base) >> 6) + 1
        block_bits = 64 * block_words
        words = blocks * block_words
        seen = np.zeros(words, np.uint64)
        # A key's bit: (key & mask) * block_bits + (key >> shift) - base, which is key - low
        # for one block (the loops apart: the shard's arithmetic costs ~10% of the pass).
        if blocks == 1:
            for i in range(n):
                key = keys[i]
                if key >= 0:  # (a padding key less low could wrap around to >= 0)
                    at = key - low
                    seen[at >> 6] |= np.uint64(1) << np.uint64(at & 63)
        else:
            for i in range(n):
                key = keys[i]
                if key >= 0:
                    at = (key & mask) * block_bits + (key >> shift) - base
                    seen[at >> 6] |= np.uint64(1) << np.uint64(at & 63)
        below_word = np.empty(words, np.int64)  # the marked bits of the words before
        count = 0
        for shard in range(blocks):
            count = _marked_keys(
                seen,
                below_word,
                shard * block_words,
                block_words,
                base,
                shift,
                shard,
                unique,
                count,
            )
        if blocks == 1:
            for i in range(n):
                key = keys[i]
                if key < 0:
                    inverse[i] = -1
                    continue
                at = key - low
                word = at >> 6
                below = seen[word] & ((np.uint64(1) << np.uint64(at & 63)) - np.uint64(1))
                inverse[i] = below_word[word] + popcount64(below)
        else:
            for i in range(n):
                key = keys[i]
                if key < 0:
                    inverse[i] = -1
                    continue
                at = (key & mask) * block_bits + (key >> shift) - base
                word = at >> 6
                below = seen[word] & ((np.uint64(1) << np.uint64(at & 63)) - np.uint64(1))
                inverse[i] = below_word[word] + popcount64(below)
        if blocks != shards and count:  # renumbered by shard, core.ownership's stable sort
            grouped = np.empty(count, np.int64)
            positions = np.empty(count, np.int64)
            bounds = np.empty(shards + 1, np.int64)
            if not k_group_by_shard(unique[:count], shards, grouped, positions, bounds):
                number = np.empty(count, np.int64)  # a rank's new number
                for j in range(count):
                    number[positions[j]] = j
                    unique[j] = grouped[j]
                for i in range(n):
                    if inverse[i] >= 0:
                        inverse[i] = number[inverse[i]]
        return count

    @jit_kernel
    def _marked_keys(seen, below_word, start, words, base, shift, shard, unique, count):
        """The keys of a block of the bitmap (words from `start`; bit b of its word w is
        the key ((base + 64 * w + b) << shift) | shard), written to unique from `count` in
        bit order, and each word's count of the marked bits before it; returns the count
        after the block."""
        for in_block in range(words):
            word = start + in_block
            below_word[word] = count
            bits = seen[word]
            first = base + 64 * in_block
            while bits != 0:
                unique[count] = ((first + trailing_zeros64(bits)) << shift) | shard
                count += 1
                bits &= bits - np.uint64(1)  # the lowest set bit cleared
        return count

    @jit_kernel
    def k_number_sorted(keys, order, unique, inverse):
        """Number the distinct keys >= 0 in key order, given `order`, an argsort of keys:
        unique[:count] are they, ascending, inverse[i] the number of keys[i] (-1:
        padding); returns count."""
        count = 0
        for r in range(order.shape[0]):
            i = order[r]
            key = keys[i]
            if key < 0:
                inverse[i] = -1
                continue
            if count == 0 or key != unique[count - 1]:
                unique[count] = key
                count += 1
            inverse[i] = count - 1
        return count

    @jit_kernel
    def k_renumber(inverse, order):
        """inverse's numbers (>= 0) renumbered to their ranks: number order[r] becomes r."""
        rank = np.empty(order.shape[0], np.int64)
        for r in range(order.shape[0]):
            rank[order[r]] = r
        for i in range(inverse.shape[0]):
            number = inverse[i]
            if number >= 0:
                inverse[i] = rank[number]

    @jit_kernel
    def k_unpool(indptr, indices, data, grad_output, out):
        """out = A.T @ grad_output for the CSR matrix A (indptr, indices, data): each bag's
        gradient row, times each of its entries' coefficient, added to its key's row, bags
        and entries in order (scipy's csc_matvecs order: the same float32 sums)."""
        out[:] = 0
        dim = grad_output.shape[1]
        for bag in range(indptr.shape[0] - 1):
            for entry in range(indptr[bag], indptr[bag + 1]):
                coefficient = data[entry]
                row = indices[entry]
                for d in range(dim):
                    out[row, d] += coefficient * grad_output[bag, d]


def distinct_keys(
    keys: np.ndarray, *, kernel: Kernel = "auto", shards: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys >= 0 (sorted), and each key's index among them (-1: padding).
    shards > 1: the distinct keys ordered by (key % shards, key) instead, so that the keys
    of each shard of a table whose keys spread over `shards` (core.config.key_shards) are
    one span of them, ascending: a lookup's reply rows of a shard land as one block. "auto":
    the compiled pass where the host kernels run (the module docstring), else numpy's sort;
    "scipy": numpy's sort, the reference; "torch": torch.unique, 2-10x slower than numpy's
    sort here (65,536 keys: 27 ms against 2.8 ms on a loaded 2-core machine)."""
    if kernel == "auto" and unavailable_reason() is None:
        flat = np.ascontiguousarray(keys, np.int64).reshape(-1)
        return _distinct_keys_compiled(flat, shards)
    torch = _use_torch(kernel) if kernel == "torch" else None
    if torch is None:
        unique, inverse = np.unique(keys, return_inverse=True)
    else:
        found, index = torch.unique(torch.from_numpy(keys), sorted=True, return_inverse=True)
        unique, inverse = found.numpy(), index.numpy()
    inverse = inverse.reshape(-1)
    padding = int(np.searchsorted(unique, 0))
    if padding:
        unique = unique[padding:]
        inverse = inverse - padding
        inverse[inverse < 0] = -1
    return _by_shard(unique, inverse, shards)


def _by_shard(
    unique: np.ndarray, inverse: np.ndarray, shards: int
) -> tuple[np.ndarray, np.ndarray]:
    """Ascending distinct keys reordered by (key % shards, key), and the indices of the
    keys among them renumbered to match (numpy: a stable argsort by shard)."""
    if shards == 1 or unique.size == 0:
        return unique, inverse
    order = np.argsort(unique % shards, kind="stable")
    number = np.empty(order.size, np.int64)
    number[order] = np.arange(order.size)
    live = inverse >= 0
    return unique[order], np.where(live, number[np.where(live, inverse, 0)], -1)


def pool(matrix: PoolingMatrix, rows: np.ndarray, *, kernel: Kernel = "auto") -> np.ndarray:
    """Forward: one pooled row per bag, [B, dim] float32."""
    torch = _use_torch(kernel)
    if torch is None or matrix.shape[0] == 0:
        return np.asarray(_scipy_matrix(matrix) @ rows, dtype=np.float32)
    as_tensor = torch.from_numpy
    pooled = torch.nn.functional.embedding_bag(
        as_tensor(matrix.indices.astype(np.int64, copy=False)),
        as_tensor(np.ascontiguousarray(rows, dtype=np.float32)),
        as_tensor(matrix.indptr.astype(np.int64, copy=False)),
        mode="sum",
        per_sample_weights=as_tensor(matrix.data),
        include_last_offset=True,
    )
    return pooled.numpy()


def _distinct_keys_compiled(keys: np.ndarray, shards: int) -> tuple[np.ndarray, np.ndarray]:
    """distinct_keys compiled: keys of a narrow span ranked in a bitmap of it (and ordered
    by shard there); else, up to HASHED_DEDUP_KEYS keys, number the distinct keys as they
    first come, sort only them and renumber; more, argsort them all and number them in that
    order (the module docstring); these two ordered by shard after, by numpy."""
    unique = np.empty(keys.size, np.int64)
    inverse = np.empty(keys.size, np.int64)
    count = k_rank_in_span(keys, SPAN_DEDUP_BITS_PER_KEY, shards, unique, inverse)
    if count >= 0:
        return unique[:count], inverse
    if keys.size > HASHED_DEDUP_KEYS:
        count = k_number_sorted(keys, np.argsort(keys), unique, inverse)
        return _by_shard(unique[:count], inverse, shards)
    count = k_first_seen(keys, unique, inverse)
    order = np.argsort(unique[:count])
    k_renumber(inverse, order)
    return _by_shard(unique[order], inverse, shards)


def unpool(
    matrix: PoolingMatrix, grad_output: np.ndarray, *, kernel: Kernel = "auto"
) -> np.ndarray:
    """Backward: the gradient of each distinct key's row, [u, dim] float32. "auto": the
    compiled pass where the host kernels run (no transposed matrix built), else scipy's
    A.T @ G, the reference ("scipy")."""
    if kernel == "scipy" or unavailable_reason() is not None:
        return np.asarray(_scipy_matrix(matrix).T @ grad_output, dtype=np.float32)
    grad_output = np.ascontiguousarray(grad_output, np.float32)
    out = np.empty((matrix.shape[1], grad_output.shape[1]), np.float32)
    k_unpool(matrix.indptr, matrix.indices, matrix.data, grad_output, out)
    return out


def _scipy_matrix(matrix: PoolingMatrix) -> sp.csr_array:
    """The scipy CSR array of a pooling matrix, for the reference kernels."""
    return matrix.matrix() if isinstance(matrix, PoolingLayout) else matrix
