"""Fused pooling: bags of keys -> one row per bag, and its backward, as one sparse product.

A batch of B bags over the u distinct keys of a table is a sparse matrix A [B, u] whose
entry (b, j) is the coefficient of distinct key j in bag b. With the distinct keys' rows
E [u, dim]:

    forward:   output = A @ E          [B, dim]
    backward:  grad_E = A.T @ grad_out [u, dim]   (gradients of repeated keys summed)

Both run in scipy.sparse's compiled CSR kernels: no Python loop over bags, and the
backward yields per-distinct-key gradients directly, ready to push. Coefficients, for a bag
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
the backward are compiled: the dedup of a call's keys up to HASHED_DEDUP_KEYS numbers the
distinct keys as they first come in a hash set that stays in cache, then sorts only them
(8,192 Zipf keys of 2,400 distinct: 0.06 ms against np.unique's 0.15-0.20 ms); more keys
are argsorted by numpy and numbered in one compiled pass over that order (a hash set that
outgrows the cache waits on memory: at 43,000 keys of 24,000 distinct it took 1.7 ms, the
sort 0.95, np.unique 1.2); the backward is a compiled pass over the CSR arrays, in scipy's
order (the same float32 sums, bit for bit). Every kernel gives the same results to float
rounding, and the tests run each against its reference and against a numpy oracle.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Sequence
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


def pooling_matrix(
    bags: Bags, inverse: np.ndarray, num_unique: int, combiner: Combiner
) -> sp.csr_array:
    """A [B, num_unique] as a scipy CSR array. inverse[k] is the distinct-key index of
    bags.keys[k], or -1 for padding."""
    return stacked_pooling_matrix([(bags, inverse, combiner)], num_unique)


def stacked_pooling_matrix(
    parts: Sequence[tuple[Bags, np.ndarray, Combiner]], num_unique: int
) -> sp.csr_array:
    """The pooling matrices of several features over one table's distinct keys, stacked row
    block after row block ([sum of B_f, num_unique], fbgemm's table-batched layout): one
    forward and one backward kernel call serve every feature of the table."""
    inverse = _joined([inverse for _, inverse, _ in parts])
    # Every bag's bounds in the joined entries: each feature's offsets shifted to where its
    # entries start (its last offset is the next feature's first), then the end; written
    # into one array (a trainer's prefetch builds this every step, for a few features).
    bag_starts = [0, *itertools.accumulate(bags.num_bags for bags, _, _ in parts)]
    spans = list(zip(parts, bag_starts[:-1], bag_starts[1:], strict=True))
    bounds = np.empty(bag_starts[-1] + 1, np.int64)
    base = 0
    for (bags, part_inverse, _), first, end in spans:
        np.add(bags.offsets[:-1], base, out=bounds[first:end])
        base += part_inverse.size
    bounds[-1] = base
    live = inverse >= 0
    if live.all():  # no padding (the usual batch): bags count their entries
        indptr, column = bounds, inverse
    else:  # each bag's live entries: the running count of live entries before its bound
        running = np.zeros(live.size + 1, np.int64)
        np.cumsum(live, out=running[1:])
        indptr, column = running[bounds], inverse[live]
    # Coefficients: 1 for an unweighted sum; the other features write theirs into their
    # span of the live entries.
    data = np.ones(column.size, np.float32)
    for (bags, _, combiner), first, end in spans:
        if combiner is not Combiner.SUM or bags.weights is not None:
            entries = live[bounds[first] : bounds[end]]  # the feature's, padding too
            counts = np.diff(indptr[first : end + 1])
            data[indptr[first] : indptr[end]] = _coefficients(bags, entries, counts, combiner)
    index = np.int32 if max(num_unique, column.size) < np.iinfo(np.int32).max else np.int64
    return sp.csr_array(
        (data, column.astype(index, copy=False), indptr.astype(index)),
        shape=(indptr.size - 1, num_unique),
    )


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """np.concatenate, without the copy for one array."""
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _coefficients(
    bags: Bags, live: np.ndarray, counts: np.ndarray, combiner: Combiner
) -> np.ndarray:
    """The float32 coefficient of each live key of the bags (the formulas above)."""
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


def distinct_keys(keys: np.ndarray, *, kernel: Kernel = "auto") -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys >= 0 (sorted), and each key's index among them (-1: padding).
    "auto": the compiled pass where the host kernels run (the module docstring), else
    numpy's sort; "scipy": numpy's sort, the reference; "torch": torch.unique, 2-10x slower
    than numpy's sort here (65,536 keys: 27 ms against 2.8 ms on a loaded 2-core machine)."""
    if kernel == "auto" and unavailable_reason() is None:
        return _distinct_keys_compiled(np.ascontiguousarray(keys, np.int64).reshape(-1))
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
    return unique, inverse


def pool(matrix: Any, rows: np.ndarray, *, kernel: Kernel = "auto") -> np.ndarray:
    """Forward: one pooled row per bag, [B, dim] float32."""
    torch = _use_torch(kernel)
    if torch is None or matrix.shape[0] == 0:
        return np.asarray(matrix @ rows, dtype=np.float32)
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


def _distinct_keys_compiled(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """distinct_keys compiled: up to HASHED_DEDUP_KEYS keys, number the distinct keys as
    they first come, sort only them and renumber; more, argsort them all and number them
    in that order (the module docstring)."""
    unique = np.empty(keys.size, np.int64)
    inverse = np.empty(keys.size, np.int64)
    if keys.size > HASHED_DEDUP_KEYS:
        count = k_number_sorted(keys, np.argsort(keys), unique, inverse)
        return unique[:count], inverse
    count = k_first_seen(keys, unique, inverse)
    order = np.argsort(unique[:count])
    k_renumber(inverse, order)
    return unique[order], inverse


def unpool(matrix: Any, grad_output: np.ndarray, *, kernel: Kernel = "auto") -> np.ndarray:
    """Backward: the gradient of each distinct key's row, [u, dim] float32. "auto": the
    compiled pass where the host kernels run (no transposed matrix built), else scipy's
    A.T @ G, the reference ("scipy")."""
    if kernel == "scipy" or unavailable_reason() is not None:
        return np.asarray(matrix.T @ grad_output, dtype=np.float32)
    grad_output = np.ascontiguousarray(grad_output, np.float32)
    out = np.empty((matrix.shape[1], grad_output.shape[1]), np.float32)
    k_unpool(matrix.indptr, matrix.indices, matrix.data, grad_output, out)
    return out
