"""The client's batch formats (tierps.client.formats.to_bags) and fused pooling
(tierps.client.pooling) as pure functions.

Oracles: a float64 numpy loop over bags written from the formulas in pooling's docstring
(sum: sum_i w_i e_i; mean: divided by sum_i w_i; sqrtn: divided by sqrt(sum_i w_i**2); keys
< 0 take no part; an empty bag pools to zeros), and for the backward the same loop scattering
each bag's gradient to its keys. Hypothesis drives the property tests.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierps.client import pooling
from tierps.client.formats import COO, Bags, to_bags
from tierps.client.pooling import (
    HASHED_DEDUP_KEYS,
    SPAN_DEDUP_BITS_PER_KEY,
    Combiner,
    Kernel,
    PoolingLayout,
    distinct_keys,
    pool,
    pooling_matrix,
    stacked_pooling_layout,
    stacked_pooling_matrix,
    unpool,
)
from tierps.core.compiled import unavailable_reason
from tierps.core.errors import InvalidArgumentError

WHERE = "table 'item'"
DIM = 4

# -- oracles ------------------------------------------------------------------------------------


def bag_spans(offsets: np.ndarray) -> list[tuple[int, int]]:
    return [(int(offsets[b]), int(offsets[b + 1])) for b in range(offsets.size - 1)]


def coefficients(
    keys: np.ndarray, weights: np.ndarray | None, combiner: str
) -> list[tuple[int, float]]:
    """(key, coefficient) of one bag's live keys, in float64, from the docstring formulas."""
    w = np.ones(keys.size) if weights is None else weights.astype(np.float64)
    live = keys >= 0
    pairs = [(int(k), float(x)) for k, x in zip(keys[live], w[live], strict=True)]
    if combiner == "sum":
        return pairs
    if combiner == "mean":
        total = sum(x for _, x in pairs)
    else:
        total = float(np.sqrt(sum(x * x for _, x in pairs)))
    return [(k, x / total if total != 0 else 0.0) for k, x in pairs]


def oracle_pool(bags: Bags, table: dict[int, np.ndarray], combiner: str) -> np.ndarray:
    out = np.zeros((bags.num_bags, DIM))
    for b, (start, end) in enumerate(bag_spans(bags.offsets)):
        weights = None if bags.weights is None else bags.weights[start:end]
        for key, c in coefficients(bags.keys[start:end], weights, combiner):
            out[b] += c * table[key].astype(np.float64)
    return out


def oracle_unpool(bags: Bags, grad_out: np.ndarray, combiner: str) -> dict[int, np.ndarray]:
    grads: dict[int, np.ndarray] = {}
    for b, (start, end) in enumerate(bag_spans(bags.offsets)):
        weights = None if bags.weights is None else bags.weights[start:end]
        for key, c in coefficients(bags.keys[start:end], weights, combiner):
            grads[key] = grads.get(key, np.zeros(DIM)) + c * grad_out[b].astype(np.float64)
    return grads


def distinct(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys >= 0 and each key's index among them (-1 for padding)."""
    unique = np.unique(keys[keys >= 0])
    inverse = np.where(keys >= 0, np.searchsorted(unique, keys), -1)
    return unique, inverse.astype(np.int64)


def rows_of(unique: np.ndarray, seed: int = 0) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    rows = np.random.default_rng(seed).standard_normal((unique.size, DIM)).astype(np.float32)
    return rows, dict(zip(unique.tolist(), rows, strict=True))


def refused(call: Any, *needles: str) -> str:
    with pytest.raises(InvalidArgumentError) as raised:
        call()
    message = str(raised.value)
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# -- to_bags: the three formats ----------------------------------------------------------------


def test_dense_keys_become_one_bag_per_row_of_the_last_axis() -> None:
    keys = np.array([[1, -1, 2], [3, 3, -1]], dtype=np.int32)
    bags = to_bags(WHERE, keys)
    assert bags.keys.dtype == np.int64
    np.testing.assert_array_equal(bags.keys, [1, -1, 2, 3, 3, -1])
    np.testing.assert_array_equal(bags.offsets, [0, 3, 6])
    assert bags.weights is None and bags.shape == (2,) and bags.num_bags == 2


def test_dense_keys_of_more_axes_keep_the_leading_shape() -> None:
    keys = np.arange(24).reshape(2, 3, 4)
    weights = np.linspace(0, 1, 24, dtype=np.float64).reshape(2, 3, 4)
    bags = to_bags(WHERE, keys, per_sample_weights=weights)
    assert bags.shape == (2, 3)
    np.testing.assert_array_equal(bags.offsets, np.arange(0, 25, 4))
    assert bags.weights is not None and bags.weights.dtype == np.float32
    np.testing.assert_array_equal(bags.weights, weights.reshape(-1).astype(np.float32))


def test_dense_keys_of_width_zero_are_empty_bags() -> None:
    bags = to_bags(WHERE, np.zeros((3, 0), np.int64))
    np.testing.assert_array_equal(bags.offsets, [0, 0, 0, 0])
    assert bags.shape == (3,)


def test_csr_offsets_of_length_b_run_the_last_bag_to_the_end() -> None:
    values = [5, 6, 7, 8, 9]
    bags = to_bags(WHERE, values, [0, 2, 2])
    np.testing.assert_array_equal(bags.keys, values)
    np.testing.assert_array_equal(bags.offsets, [0, 2, 2, 5])
    assert bags.shape == (3,)


def test_csr_offsets_of_length_b_plus_1_with_include_last_offset() -> None:
    bags = to_bags(WHERE, [5, 6, 7, 8, 9], [0, 2, 2, 5], include_last_offset=True)
    np.testing.assert_array_equal(bags.offsets, [0, 2, 2, 5])
    assert bags.shape == (3,)


def test_csr_accepts_torch_tensors_and_empty_batches() -> None:
    torch = pytest.importorskip("torch")
    bags = to_bags(
        WHERE,
        torch.tensor([4, 1, 4]),
        torch.tensor([0, 1]),
        torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64),
    )
    np.testing.assert_array_equal(bags.keys, [4, 1, 4])
    np.testing.assert_array_equal(bags.offsets, [0, 1, 3])
    np.testing.assert_array_equal(bags.weights, np.array([0.5, 2.0, 1.0], np.float32))
    empty = to_bags(WHERE, [], [0, 0])  # np.asarray([]) is float64: allowed when empty
    np.testing.assert_array_equal(empty.offsets, [0, 0, 0])
    assert empty.keys.dtype == np.int64 and empty.keys.size == 0


def test_coo_with_unsorted_rows_groups_keys_by_row_in_their_given_order() -> None:
    rows = np.array([2, 0, 2, 1, 0])
    values = np.array([20, 1, 21, 10, 2])
    weights = np.array([0.2, 0.0, 0.21, 0.1, 0.02])
    bags = to_bags(WHERE, COO(rows, values, (4, 3)), None, weights)
    np.testing.assert_array_equal(bags.keys, [1, 2, 10, 20, 21])
    np.testing.assert_array_equal(bags.offsets, [0, 2, 3, 5, 5])  # row 3 is an empty bag
    np.testing.assert_array_equal(bags.weights, np.array([0.0, 0.02, 0.1, 0.2, 0.21], np.float32))
    assert bags.shape == (4,)


def test_coo_of_no_entries_is_empty_bags() -> None:
    bags = to_bags(WHERE, COO(np.zeros(0, np.int64), np.zeros(0, np.int64), (2, 0)))
    np.testing.assert_array_equal(bags.offsets, [0, 0, 0])


# -- to_bags: refusals name the table, the field, what was expected and what came -----------


@pytest.mark.parametrize(
    ("args", "kwargs", "needles"),
    [
        (
            ([1, 2, 3, 4, 5, 6], [0, 4, 2]),
            {},
            ["offsets must not decrease, but offsets[2]=2 < offsets[1]=4"],
        ),
        (
            ([1, 2, 3, 4, 5, 6], [0, 2, 6, 3]),
            {},
            ["offsets must not decrease, but offsets[3]=3 < offsets[2]=6"],
        ),
        (
            ([1, 2, 3, 4, 5], [0, 7]),
            {},
            ["'offsets'", "values <= len(values)=5", "got offsets[1]=7"],
        ),
        (([1, 2, 3], [1, 2]), {}, ["'offsets'", "offsets[0] = 0", "got 1"]),
        (([1, 2, 3], [-1, 2]), {}, ["'offsets'", "offsets[0] = 0", "got -1"]),
        (
            ([1, 2, 3], [0, 2]),
            {"include_last_offset": True},
            ["'offsets'", "include_last_offset", "len(values)=3", "got 2"],
        ),
        (
            ([1, 2, 3], []),
            {"include_last_offset": True},
            ["'offsets'", "include_last_offset", "got none"],
        ),
        (([1, 2, 3], [[0, 1]]), {}, ["'offsets'", "1-D", "(1, 2)"]),
        (([1, 2, 3], [0.0, 1.0]), {}, ["'offsets'", "integer", "float64"]),
        (([1.0, 2.0], [0]), {}, ["'keys'", "integer array", "float64"]),
        ((["a", "b"], [0]), {}, ["'keys'", "integer array", "<U1"]),
        (([[1, 2]], [0]), {}, ["'keys'", "1-D values", "(1, 2)"]),
        ((np.int64(3),), {}, ["'keys'", "dense keys [..., nnz]", "scalar"]),
        ((np.array([2**63], dtype=np.uint64),), {}, ["'keys'", "2**63-1", str(2**63)]),
        (
            ([1, 2, 3, 4, 5], [0, 2], [1.0, 1.0, 1.0, 1.0]),
            {},
            ["'per_sample_weights'", "shape (5,)", "that of the values", "got (4,)"],
        ),
        (
            ([[1, 2], [3, -1]], None, [1.0, 2.0, 3.0, 4.0]),
            {},
            ["'per_sample_weights'", "shape (2, 2)", "that of the keys", "got (4,)"],
        ),
        (
            ([1, 2, 3], [0], [1.0, np.nan, 1.0]),
            {},
            ["'per_sample_weights'", "finite", "nan at index 1"],
        ),
        (
            ([1, 2, 3], [0], [1.0, 1.0, -np.inf]),
            {},
            ["'per_sample_weights'", "finite", "-inf at index 2"],
        ),
        (
            ([1, 2], [0], ["x", "y"]),
            {},
            ["'per_sample_weights'", "float array", "<U1"],
        ),
    ],
)
def test_to_bags_refuses_bad_batches_naming_table_field_expected_and_got(
    args: tuple[Any, ...], kwargs: dict[str, Any], needles: list[str]
) -> None:
    message = refused(lambda: to_bags(WHERE, *args, **kwargs), *needles)
    assert message.startswith(WHERE + ":"), message


def previous_offsets(nnz: int, offsets: np.ndarray, include_last_offset: bool) -> np.ndarray:
    """formats' offsets check as it was before a good batch took one comparison pass, frozen
    here as the reference (offsets[0] and the shape are checked alike, before these)."""
    beyond = offsets > nnz
    if beyond.any():
        i = int(np.argmax(beyond))
        raise InvalidArgumentError(
            f"{WHERE}: field 'offsets' expected values <= len(values)={nnz}, got "
            f"offsets[{i}]={int(offsets[i])}"
        )
    if include_last_offset:
        if offsets.size == 0 or offsets[-1] != nnz:
            last = int(offsets[-1]) if offsets.size else "none"
            raise InvalidArgumentError(
                f"{WHERE}: field 'offsets' with include_last_offset expected the last offset "
                f"to equal len(values)={nnz}, got {last}"
            )
    else:
        if offsets.size == 0 and nnz:
            raise InvalidArgumentError(
                f"{WHERE}: field 'offsets' expected at least one bag for {nnz} values, got "
                f"no offsets"
            )
        offsets = np.append(offsets, nnz)
    falls = np.diff(offsets) < 0
    if falls.any():
        i = int(np.argmax(falls))
        raise InvalidArgumentError(
            f"{WHERE}: offsets must not decrease, but offsets[{i + 1}]={int(offsets[i + 1])} "
            f"< offsets[{i}]={int(offsets[i])}"
        )
    return offsets


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 8),
    st.lists(st.integers(0, 10), max_size=6).map(lambda rest: [0, *rest] if rest else []),
    st.booleans(),
)
def test_offsets_are_checked_as_before(
    nnz: int, offsets: list[int], include_last_offset: bool
) -> None:
    """Any offsets starting at 0 (or none): the same bounds, or the same refusal."""
    keys = np.arange(nnz, dtype=np.int64)
    given = np.array(offsets, np.int64)
    try:
        want: np.ndarray | str = previous_offsets(nnz, given, include_last_offset)
    except InvalidArgumentError as error:
        want = str(error)
    try:
        got: np.ndarray | str = to_bags(
            WHERE, keys, given, include_last_offset=include_last_offset
        ).offsets
    except InvalidArgumentError as error:
        got = str(error)
    if isinstance(want, str):
        assert got == want
    else:
        assert isinstance(got, np.ndarray) and got.dtype == np.int64
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("batch", "offsets", "weights", "needles"),
    [
        (COO([0, 3], [1, 2], (3, 2)), None, None, ["COO field 'rows'", "[0, 3)", "rows[1]=3"]),
        (COO([-1, 0], [1, 2], (3, 2)), None, None, ["COO field 'rows'", "[0, 3)", "rows[0]=-1"]),
        (COO([0, 1], [1, 2, 3], (3, 2)), None, None, ["'rows' and 'values'", "(2,) and (3,)"]),
        (COO([0.5], [1], (3, 2)), None, None, ["'rows'", "integer", "float64"]),
        (COO([0], [1], (3, 2, 1)), None, None, ["COO field 'shape'", "(3, 2, 1)"]),
        (COO([0], [1], (-1, 2)), None, None, ["COO field 'shape'", "(-1, 2)"]),
        (COO([0], [1], (3, 2)), [0], None, ["COO batch expected offsets=None"]),
        (COO([0, 1], [1, 2], (3, 2)), None, [1.0], ["'per_sample_weights'", "(2,)", "(1,)"]),
    ],
)
def test_to_bags_refuses_bad_coo_batches(
    batch: COO, offsets: Any, weights: Any, needles: list[str]
) -> None:
    message = refused(lambda: to_bags(WHERE, batch, offsets, weights), *needles)
    assert message.startswith(WHERE + ":"), message


def test_combiner_names_and_a_bad_one() -> None:
    assert [Combiner.of(name, "feature 'f'") for name in ("sum", "mean", "sqrtn")] == [
        Combiner.SUM,
        Combiner.MEAN,
        Combiner.SQRTN,
    ]
    assert Combiner.of(Combiner.MEAN, "feature 'f'") is Combiner.MEAN
    refused(
        lambda: Combiner.of("max", "feature 'f'"),
        "feature 'f': field 'combiner'",
        "'sum', 'mean', 'sqrtn'",
        "got 'max'",
    )


# -- pooling vs the oracle ------------------------------------------------------------------------


# the reference; the compiled dedup and backward where the host kernels run; torch's forward
# and dedup
KERNELS = ["scipy", "auto", "torch"]


def check_pooling(bags: Bags, combiner: Combiner, kernel: Kernel = "auto") -> None:
    """Forward and backward against the numpy loops, and backward = the forward's transpose."""
    unique, inverse = distinct(bags.keys)
    got_unique, got_inverse = distinct_keys(bags.keys, kernel=kernel)
    np.testing.assert_array_equal(got_unique, unique)
    np.testing.assert_array_equal(got_inverse, inverse)
    rows, table = rows_of(unique)
    matrix = pooling_matrix(bags, inverse, unique.size, combiner)
    assert matrix.shape == (bags.num_bags, unique.size)

    got = pool(matrix, rows, kernel=kernel)
    assert got.dtype == np.float32 and got.shape == (bags.num_bags, DIM)
    np.testing.assert_allclose(got, oracle_pool(bags, table, combiner.value), atol=1e-5)

    grad_out = np.random.default_rng(1).standard_normal((bags.num_bags, DIM)).astype(np.float32)
    grads = unpool(matrix, grad_out)
    assert grads.dtype == np.float32 and grads.shape == (unique.size, DIM)
    expected = oracle_unpool(bags, grad_out, combiner.value)
    want = np.zeros((unique.size, DIM))
    for i, key in enumerate(unique.tolist()):
        want[i] = expected.get(key, 0.0)
    np.testing.assert_allclose(grads, want, atol=1e-5)
    dense = matrix.toarray().astype(np.float64)
    np.testing.assert_allclose(grads, dense.T @ grad_out, atol=1e-5)
    np.testing.assert_allclose(got, dense @ rows, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("combiner", list(Combiner))
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_pooling_of_a_fixed_batch_with_repeats_padding_and_empty_bags(
    combiner: Combiner, weighted: bool, kernel: Kernel
) -> None:
    keys = np.array([7, 7, 3, -1, 3, -1, -1, 11, 7, 2, 2, 2])
    offsets = [0, 3, 5, 5, 7, 9]  # bag 2 is empty, bag 3 only padding
    weights = np.linspace(0.25, 3.0, keys.size) if weighted else None
    check_pooling(to_bags(WHERE, keys, offsets, weights), combiner, kernel)


@pytest.mark.parametrize("dim", [1, 16, 64])
def test_the_two_kernels_agree_on_a_large_zipf_batch(dim: int) -> None:
    generator = np.random.default_rng(dim)
    sizes = generator.integers(0, 21, 2048)
    keys = generator.zipf(1.2, int(sizes.sum())) % 5000 - (generator.random(sizes.sum()) < 0.05)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    bags = to_bags(WHERE, keys, offsets, generator.random(keys.size).astype(np.float32))
    unique, inverse = distinct(bags.keys)
    rows = generator.standard_normal((unique.size, dim)).astype(np.float32)
    matrix = pooling_matrix(bags, inverse, unique.size, Combiner.MEAN)
    results = {}
    for kernel in KERNELS:
        got_unique, got_inverse = distinct_keys(bags.keys, kernel=kernel)
        results[kernel] = (got_unique, got_inverse, pool(matrix, rows, kernel=kernel))
    np.testing.assert_allclose(results["auto"][2], results["torch"][2], rtol=1e-5, atol=1e-6)
    for kernel in KERNELS:
        np.testing.assert_array_equal(results[kernel][0], unique, err_msg=kernel)
        np.testing.assert_array_equal(results[kernel][1], inverse, err_msg=kernel)
    np.testing.assert_allclose(results["torch"][2], results["scipy"][2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results["scipy"][2], matrix.toarray() @ rows, rtol=1e-5, atol=1e-5)


def test_pooling_unweighted_mean_and_sqrtn_count_only_live_keys() -> None:
    bags = to_bags(WHERE, np.array([[5, 5, -1, 9]]))
    unique, inverse = distinct(bags.keys)
    rows, table = rows_of(unique)
    mean = pool(pooling_matrix(bags, inverse, unique.size, Combiner.MEAN), rows)
    sqrtn = pool(pooling_matrix(bags, inverse, unique.size, Combiner.SQRTN), rows)
    total = 2 * table[5].astype(np.float64) + table[9]
    np.testing.assert_allclose(mean[0], total / 3, atol=1e-6)
    np.testing.assert_allclose(sqrtn[0], total / np.sqrt(3), atol=1e-6)


def test_empty_and_all_padding_bags_and_zero_weight_sums_pool_to_zeros() -> None:
    keys = np.array([[-1, -1], [4, 6], [4, -1]])
    weights = np.array([[1.0, 1.0], [1.0, -1.0], [0.0, 1.0]])
    bags = to_bags(WHERE, keys, per_sample_weights=weights)
    unique, inverse = distinct(bags.keys)
    rows, _ = rows_of(unique)
    for combiner in Combiner:
        matrix = pooling_matrix(bags, inverse, unique.size, combiner)
        got = pool(matrix, rows)
        np.testing.assert_array_equal(got[0], 0.0)  # only padding
        if combiner is Combiner.MEAN:  # weights 1 and -1 sum to 0: zeros, not inf or nan
            np.testing.assert_array_equal(got[1], 0.0)
        if combiner is not Combiner.SUM:  # a bag whose one live key has weight 0
            np.testing.assert_array_equal(got[2], 0.0)
        assert np.isfinite(unpool(matrix, np.ones((3, DIM), np.float32))).all()


# -- properties ---------------------------------------------------------------------------

# Weights are multiples of 1/4: sums are exact, so a mean over weights summing to 0 is exactly
# the "empty bag" case and no near-zero sum blows the comparison up.
WEIGHT = st.integers(-4, 8).map(lambda n: n / 4)


@st.composite
def batches(draw: st.DrawFn) -> tuple[Bags, Combiner]:
    sizes = draw(st.lists(st.integers(0, 5), min_size=0, max_size=6))
    nnz = sum(sizes)
    keys = np.array(draw(st.lists(st.integers(-3, 9), min_size=nnz, max_size=nnz)), np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    weighted = draw(st.booleans())
    weights = (
        np.array(draw(st.lists(WEIGHT, min_size=nnz, max_size=nnz)), np.float64)
        if weighted
        else None
    )
    layout = draw(st.sampled_from(["csr", "csr-last", "coo"]))
    if layout == "csr":
        bags = to_bags(WHERE, keys, offsets[:-1], weights)
    elif layout == "csr-last":
        bags = to_bags(WHERE, keys, offsets, weights, include_last_offset=True)
    else:  # the same bags as a COO whose entries come shuffled
        rows = np.repeat(np.arange(len(sizes)), sizes)
        order = np.random.default_rng(draw(st.integers(0, 100))).permutation(nnz)
        shuffled = None if weights is None else weights[order]
        bags = to_bags(WHERE, COO(rows[order], keys[order], (len(sizes), 5)), None, shuffled)
    return bags, draw(st.sampled_from(list(Combiner)))


@settings(max_examples=150, deadline=None)
@given(batches())
def test_pooling_forward_and_backward_match_the_oracle(case: tuple[Bags, Combiner]) -> None:
    bags, combiner = case
    check_pooling(bags, combiner)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_padding_keys_contribute_nothing(case: tuple[Bags, Combiner]) -> None:
    """Dropping every key < 0 (and its weight) from the bags changes neither direction."""
    bags, combiner = case
    live = bags.keys >= 0
    kept = np.concatenate([[0], np.cumsum(live)])[bags.offsets]
    stripped = Bags(
        bags.keys[live],
        kept.astype(np.int64),
        None if bags.weights is None else bags.weights[live],
        bags.shape,
    )
    unique, inverse = distinct(bags.keys)
    _, inverse_stripped = distinct(stripped.keys)
    rows, _ = rows_of(unique)
    full = pooling_matrix(bags, inverse, unique.size, combiner)
    bare = pooling_matrix(stripped, inverse_stripped, unique.size, combiner)
    np.testing.assert_array_equal(pool(full, rows), pool(bare, rows))
    grad = np.ones((bags.num_bags, DIM), np.float32)
    np.testing.assert_array_equal(unpool(full, grad), unpool(bare, grad))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=8), st.sampled_from(list(Combiner)))
def test_empty_bags_pool_to_zeros_and_take_no_gradient(
    sizes: list[int], combiner: Combiner
) -> None:
    nnz = sum(sizes)
    keys = np.arange(nnz, dtype=np.int64) % 3
    bags = to_bags(WHERE, keys, np.concatenate([[0], np.cumsum(sizes)[:-1]]))
    unique, inverse = distinct(bags.keys)
    rows, _ = rows_of(unique)
    matrix = pooling_matrix(bags, inverse, unique.size, combiner)
    empty = np.array(sizes) == 0
    np.testing.assert_array_equal(pool(matrix, rows)[empty], 0.0)
    grad = np.zeros((len(sizes), DIM), np.float32)
    grad[empty] = 1.0  # gradients of empty bags only: no key moves
    np.testing.assert_array_equal(unpool(matrix, grad), 0.0)


def test_a_stacked_matrix_is_the_features_matrices_one_above_the_other() -> None:
    """Features of one table pooled in one kernel call: the stacked matrix is exactly the
    vertical stack of each feature's own matrix, whatever their combiners and weights."""
    generator = np.random.default_rng(7)
    parts = []
    keys = []
    for combiner, weighted in (
        (Combiner.SUM, False),
        (Combiner.MEAN, True),
        (Combiner.SQRTN, False),
    ):
        sizes = generator.integers(0, 5, 6)
        values = generator.integers(-1, 30, int(sizes.sum()))
        weights = generator.random(values.size).astype(np.float32) if weighted else None
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        parts.append((to_bags(WHERE, values, offsets, weights), combiner))
        keys.append(values)
    unique, inverse = distinct(np.concatenate(keys))
    bounds = np.cumsum([0] + [k.size for k in keys])
    inverses = [inverse[bounds[i] : bounds[i + 1]] for i in range(len(keys))]
    stacked = stacked_pooling_matrix(
        [(bags, inv, combiner) for (bags, combiner), inv in zip(parts, inverses, strict=True)],
        unique.size,
    )
    alone = [
        pooling_matrix(bags, inv, unique.size, combiner).toarray()
        for (bags, combiner), inv in zip(parts, inverses, strict=True)
    ]
    np.testing.assert_array_equal(stacked.toarray(), np.vstack(alone))


# -- the stacked matrix, bit for bit the code before it was reworked -----------------------------


def previous_stacked_pooling_matrix(
    parts: list[tuple[Bags, np.ndarray, Combiner]], num_unique: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data, indices, indptr) as stacked_pooling_matrix built them before a trainer's
    prefetch made it cheaper: frozen here as the reference that the
    demo's training stays bit for bit the same."""
    inverse = np.concatenate([inverse for _, inverse, _ in parts])
    base, shifted = 0, []
    for bags, part_inverse, _ in parts:
        shifted.append(bags.offsets[:-1] + base)
        base += part_inverse.size
    shifted.append(np.array([base], np.int64))
    bounds = np.concatenate(shifted)
    live = inverse >= 0
    running = np.zeros(live.size + 1, np.int64)
    np.cumsum(live, out=running[1:])
    counts, column = np.diff(running[bounds]), inverse[live]
    data_parts, bag, entry = [], 0, 0
    for bags, part_inverse, combiner in parts:
        part_counts = counts[bag : bag + bags.num_bags]
        part_live = live[entry : entry + part_inverse.size]
        weights = None if bags.weights is None else bags.weights[part_live]
        if combiner is Combiner.SUM:
            coefficients = (
                np.ones(int(part_counts.sum()), np.float32) if weights is None else weights
            )
        else:
            bag_of = np.repeat(np.arange(bags.num_bags), part_counts)
            if weights is None:
                per_bag = part_counts.astype(np.float64)
            else:
                squares = weights.astype(np.float64) ** (2 if combiner is Combiner.SQRTN else 1)
                per_bag = np.bincount(bag_of, weights=squares, minlength=bags.num_bags)
            if combiner is Combiner.SQRTN:
                per_bag = np.sqrt(per_bag)
            with np.errstate(divide="ignore", invalid="ignore"):
                scale = np.where(per_bag != 0, 1.0 / per_bag, 0.0)
            per_entry = scale[bag_of] if weights is None else weights * scale[bag_of]
            coefficients = per_entry.astype(np.float32)
        data_parts.append(coefficients)
        bag += bags.num_bags
        entry += part_inverse.size
    indptr = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return np.concatenate(data_parts), column, indptr


def random_stacked(
    generator: np.random.Generator,
    features: list[tuple[list[int], Combiner, bool, int]],
    high: int,
) -> tuple[list[tuple[Any, np.ndarray, Combiner]], np.ndarray]:
    """Features of one table as stacked_pooling_matrix takes them, and their distinct keys:
    per feature (bag sizes, combiner, weighted, the lowest key: -1 pads), keys drawn in
    [lowest, high) and weights in [0, 3) where weighted."""
    parts, keys = [], []
    for sizes, combiner, weighted, lowest in features:
        values = generator.integers(lowest, high, sum(sizes))
        weights = generator.random(values.size).astype(np.float32) * 3 if weighted else None
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        parts.append((to_bags(WHERE, values, offsets, weights, include_last_offset=True), combiner))
        keys.append(values)
    unique, inverse = distinct(np.concatenate(keys))
    bounds = np.cumsum([0] + [k.size for k in keys])
    stacked = [(bags, inverse[bounds[i] : bounds[i + 1]], c) for i, (bags, c) in enumerate(parts)]
    return stacked, unique


@settings(max_examples=120, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 5), max_size=6),  # keys per bag
            st.sampled_from(list(Combiner)),
            st.booleans(),  # weighted
            st.booleans(),  # with padding
        ),
        min_size=1,
        max_size=5,
    ),
    st.integers(0, 2**32 - 1),
)
def test_a_stacked_matrix_is_bit_for_bit_the_previous_code(
    features: list[tuple[list[int], Combiner, bool, bool]], seed: int
) -> None:
    generator = np.random.default_rng(seed)
    lowest = [(sizes, c, weighted, -1 if padded else 0) for sizes, c, weighted, padded in features]
    stacked, unique = random_stacked(generator, lowest, 40)
    data, indices, indptr = previous_stacked_pooling_matrix(stacked, unique.size)
    layout = stacked_pooling_layout(stacked, unique.size)
    for got in (stacked_pooling_matrix(stacked, unique.size), layout):
        assert got.shape == (indptr.size - 1, unique.size)
        assert got.data.dtype == np.float32
        np.testing.assert_array_equal(got.data, data)
        np.testing.assert_array_equal(got.indices, indices)
        np.testing.assert_array_equal(got.indptr, indptr)
    assert layout.indices.dtype == np.int64 and layout.indptr.dtype == np.int64


# -- the compiled dedup and backward against their references ----------------------------------

compiled = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@compiled
@pytest.mark.parametrize(
    "keys",
    [
        np.zeros(0, np.int64),
        np.full(5, -1, np.int64),
        np.array([2**62, -(2**62), 0, 2**62, 7, 0, -1], np.int64),
        # padding far below the keys (a key less the lowest would wrap around): the bitmap
        np.array([5, -(2**63), 9, 5, -(2**63) + 1, 70, -1], np.int64),
        np.array([2**63 - 1, -(2**63), 2**63 - 2, -1], np.int64),  # at the int64 edges
        np.arange(1000, 0, -1, dtype=np.int64),  # all distinct, descending
        np.random.default_rng(0).zipf(1.2, 8192) % 200_000 - 1,  # repeats, some padding
        # more than HASHED_DEDUP_KEYS: argsorted, then numbered
        np.random.default_rng(2).zipf(1.05, 43_000) % 100_000 - 1,
        np.random.default_rng(1).integers(0, 2**63 - 1, 65_536),  # wide, all but distinct
    ],
    ids=[
        "empty",
        "all-padding",
        "extremes",
        "lowest-padding",
        "int64-edges",
        "descending",
        "zipf",
        "zipf-large",
        "wide",
    ],
)
def test_the_compiled_dedup_is_numpys(keys: np.ndarray) -> None:
    check_compiled_dedup(keys)


def spanning(size: int, span: int, seed: int, padding: float = 0.1) -> np.ndarray:
    """`size` keys from Zipf(1.1) ranks scattered over [base, base + span), the first and
    the last of the span among them, a `padding` share of the others -1."""
    generator = np.random.default_rng(seed)
    base = int(generator.integers(0, 2**40))
    keys = base + (generator.zipf(1.1, size) * 7919) % span
    keys[generator.random(size) < padding] = -1
    keys[:2] = base, base + span - 1
    return generator.permutation(keys).astype(np.int64)


@compiled
@pytest.mark.parametrize(
    ("size", "span", "bitmap"),
    [
        (8192, 200_000, True),
        (8192, SPAN_DEDUP_BITS_PER_KEY * 8192, True),  # the bitmap's widest span
        (8192, SPAN_DEDUP_BITS_PER_KEY * 8192 + 1, False),  # the hash set
        (8192, 2**50, False),
        (HASHED_DEDUP_KEYS + 1, 2**50, False),  # argsorted, then numbered
        (HASHED_DEDUP_KEYS + 1, 100_000, True),
        (64, 64, True),  # one word
        (3, 130, True),  # bits at the words' edges
    ],
)
def test_each_compiled_dedup_path_is_numpys(size: int, span: int, bitmap: bool) -> None:
    for padding in (0.1, 0.0):
        keys = spanning(size, span, size + span, padding)
        unique, inverse = np.empty(size, np.int64), np.empty(size, np.int64)
        ranked = pooling.k_rank_in_span(keys, SPAN_DEDUP_BITS_PER_KEY, 1, unique, inverse)
        assert (ranked >= 0) == bitmap
        check_compiled_dedup(keys)


@compiled
@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(-3, 200), max_size=40),
    st.sampled_from([0, 1, 2**31, 2**62]),
)
def test_the_compiled_dedup_of_any_small_keys_is_numpys(values: list[int], base: int) -> None:
    """Keys near each other (the bitmap, its words' edges among them) or shifted far apart
    from the others (the hash set), padding anywhere."""
    keys = np.array(values, np.int64)
    if keys.size:
        keys[::3] = np.where(keys[::3] >= 0, keys[::3] + base, keys[::3])
    check_compiled_dedup(keys)


def check_compiled_dedup(keys: np.ndarray) -> None:
    """The compiled dedup against numpy's and the oracle's, in key order and by shard."""
    for shards in (1, 2, 3, 4):
        unique, inverse = distinct_keys(keys, kernel="auto", shards=shards)
        want_unique, want_inverse = distinct_keys(keys, kernel="scipy", shards=shards)
        assert unique.dtype == np.int64 and inverse.dtype == np.int64
        np.testing.assert_array_equal(unique, want_unique)
        np.testing.assert_array_equal(inverse, want_inverse)
        np.testing.assert_array_equal(unique, by_shard(distinct(keys)[0], shards))  # the oracle's
        live = keys >= 0
        np.testing.assert_array_equal(inverse < 0, ~live)
        np.testing.assert_array_equal(unique[inverse[live]], keys[live])


def by_shard(ascending: np.ndarray, shards: int) -> np.ndarray:
    """Ascending distinct keys in the order (key % shards, key), by a sort of pairs."""
    return np.array(sorted(ascending.tolist(), key=lambda key: (key % shards, key)), np.int64)


@compiled
@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 6), min_size=0, max_size=30),  # bag sizes
            st.sampled_from(list(Combiner)),
            st.booleans(),  # weighted
        ),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from([1, 4, 16]),
    st.integers(0, 2**32 - 1),
)
def test_the_compiled_backward_is_scipys_bit_for_bit(
    features: list[tuple[list[int], Combiner, bool]], dim: int, seed: int
) -> None:
    """Stacked features of any combiner, weights and padding: the compiled A.T @ G sums in
    scipy's order, so its float32 results are scipy's exactly."""
    generator = np.random.default_rng(seed)
    lowest = [(sizes, combiner, weighted, -1) for sizes, combiner, weighted in features]
    stacked, unique = random_stacked(generator, lowest, 50)
    matrix = stacked_pooling_matrix(stacked, unique.size)
    grad = generator.standard_normal((matrix.shape[0], dim)).astype(np.float32)
    got = unpool(matrix, grad, kernel="auto")
    assert got.dtype == np.float32 and got.shape == (unique.size, dim)
    want = unpool(matrix, grad, kernel="scipy")
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, matrix.toarray().astype(np.float64).T @ grad, atol=1e-5)
    layout = stacked_pooling_layout(stacked, unique.size)  # int64 arrays, no scipy matrix
    for kernel in ("auto", "scipy"):
        np.testing.assert_array_equal(unpool(layout, grad, kernel=kernel), want)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, 6), min_size=0, max_size=30),  # bag sizes
            st.sampled_from(list(Combiner)),
            st.booleans(),  # weighted
            st.booleans(),  # with padding
        ),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from([1, 4, 17]),
    st.integers(0, 2**32 - 1),
)
def test_a_layout_pools_as_its_scipy_matrix_bit_for_bit(
    features: list[tuple[list[int], Combiner, bool, bool]], dim: int, seed: int
) -> None:
    """The CSR arrays a trainer's lookup keeps (PoolingLayout) and the scipy matrix built
    from them give the same forward and backward, bit for bit, with every kernel."""
    generator = np.random.default_rng(seed)
    lowest = [(sizes, c, weighted, -1 if padded else 0) for sizes, c, weighted, padded in features]
    stacked, unique = random_stacked(generator, lowest, 50)
    layout = stacked_pooling_layout(stacked, unique.size)
    assert isinstance(layout, PoolingLayout)
    matrix = layout.matrix()
    np.testing.assert_array_equal(
        matrix.toarray(), stacked_pooling_matrix(stacked, unique.size).toarray()
    )
    rows = generator.standard_normal((unique.size, dim)).astype(np.float32)
    grad = generator.standard_normal((layout.shape[0], dim)).astype(np.float32)
    for kernel in KERNELS:
        np.testing.assert_array_equal(
            pool(layout, rows, kernel=kernel), pool(matrix, rows, kernel=kernel), err_msg=kernel
        )
        if kernel != "torch":
            np.testing.assert_array_equal(
                unpool(layout, grad, kernel=kernel), unpool(matrix, grad, kernel=kernel)
            )
