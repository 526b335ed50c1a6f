"""Pooling on a torch device (tierps.client.device_pooling) as pure functions, on CPU tensors
(every run) and on CUDA tensors and cupy arrays (where a GPU is usable; skipped otherwise).

References: a float64 numpy oracle of pooling's formulas (each bag's coefficient of each
distinct key, summed into a dense matrix A, so output = A @ E and gradient = A.T @ G), the
host path's kernels (to_bags, distinct_keys, stacked_pooling_matrix, pool and unpool with
the scipy kernel), and torch.nn.EmbeddingBag. Refusals must read exactly as the host
checks (to_bags, float_array) word them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierps.client.formats import COO, array_device, batch_arrays, float_array, to_bags
from tierps.client.pooling import (
    Combiner,
    distinct_keys,
    pool,
    stacked_pooling_matrix,
    unpool,
)
from tierps.core.errors import InvalidArgumentError

torch = pytest.importorskip("torch")
device_pooling = pytest.importorskip("tierps.client.device_pooling")
FeatureSpec = device_pooling.FeatureSpec

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available())")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
DIM = 4
ATOL = 1e-5


def cupy_or_skip() -> Any:
    """cupy, where it is installed and sees a GPU."""
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("cupy sees no CUDA device")
    except Exception as error:  # noqa: BLE001 - any CUDA runtime failure means not usable
        pytest.skip(f"cupy is not usable: {error}")
    return cupy


# -- batches, as the host takes them and as a device call takes them ---------------------------


def fixed_batch(fmt: str, weighted: bool) -> tuple[Any, ...]:
    """(keys, offsets, weights) in numpy: repeats within and across bags, padding, an empty
    bag, a bag of padding only; fmt 'dense', 'csr', 'csr-last' or 'coo' (shuffled entries)."""
    if fmt == "dense":
        keys = np.array([[7, 7, 3, -1], [3, -1, -1, -1], [11, 7, 2, 2], [-1, -1, -1, -1]])
        weights = np.linspace(0.25, 3.0, keys.size).reshape(keys.shape) if weighted else None
        return keys, None, weights
    keys = np.array([7, 7, 3, -1, 3, -1, -1, 11, 7, 2, 2, 2])
    offsets = np.array([0, 3, 5, 5, 7, 9])  # bag 2 empty, bag 3 only padding
    weights = np.linspace(0.25, 3.0, keys.size) if weighted else None
    if fmt == "csr":
        return keys, offsets, weights
    if fmt == "csr-last":
        return keys, np.append(offsets, keys.size), weights
    rows = np.repeat(np.arange(offsets.size), np.diff(np.append(offsets, keys.size)))
    order = np.random.default_rng(0).permutation(keys.size)
    coo = COO(rows[order], keys[order], (offsets.size, 4))
    return coo, None, None if weights is None else weights[order]


def on(device: str, value: Any) -> Any:
    """A host batch's arrays as torch tensors on `device` (COO fields too)."""
    if value is None:
        return None
    if isinstance(value, COO):
        return COO(on(device, value.rows), on(device, value.values), value.shape)
    return torch.as_tensor(np.asarray(value)).to(device)


def as_value(keys: Any, offsets: Any, weights: Any) -> Any:
    """The feature-batch form of (keys, offsets, weights)."""
    if offsets is None and weights is None:
        return keys
    return (keys, offsets, weights)


def host_bags(value: Any, include_last_offset: bool) -> Any:
    if isinstance(value, tuple) and not isinstance(value, COO):
        return to_bags("host", *value, include_last_offset=include_last_offset)
    return to_bags("host", value)


# -- the references ------------------------------------------------------------------------------


def oracle_matrix(bags: Any, unique: np.ndarray, combiner: Combiner) -> np.ndarray:
    """float64 A [B, u] from pooling's formulas: sum: w_i; mean: w_i / sum w; sqrtn: w_i /
    sqrt(sum w^2); keys < 0 take no part; a zero divisor gives a zero row."""
    position = {int(k): j for j, k in enumerate(unique)}
    matrix = np.zeros((bags.num_bags, unique.size))
    for b in range(bags.num_bags):
        lo, hi = int(bags.offsets[b]), int(bags.offsets[b + 1])
        keys = bags.keys[lo:hi]
        w = np.ones(hi - lo) if bags.weights is None else bags.weights[lo:hi].astype(np.float64)
        live = keys >= 0
        total = {"sum": 1.0, "mean": w[live].sum(), "sqrtn": np.sqrt((w[live] ** 2).sum())}
        divisor = total[combiner.value]
        for key, weight in zip(keys[live], w[live], strict=True):
            matrix[b, position[int(key)]] += weight / divisor if divisor != 0 else 0.0
    return matrix


def host_reference(
    features: list[tuple[str, Any, str, Combiner]], dims: dict[str, int], include_last: bool
) -> dict[str, Any]:
    """The host path's kernels on the same batch: per table, the distinct keys and the
    stacked CSR matrix; per feature, the bags and its rows of the matrix."""
    bags = {name: host_bags(value, include_last) for name, value, _, _ in features}
    tables: dict[str, Any] = {}
    for table in dict.fromkeys(t for _, _, t, _ in features):
        names = [n for n, _, t, _ in features if t == table]
        keys = np.concatenate([bags[n].keys for n in names])
        unique, inverse = distinct_keys(keys, kernel="scipy")
        bounds = np.cumsum([0] + [bags[n].keys.size for n in names])
        parts = [
            (bags[n], inverse[bounds[i] : bounds[i + 1]], c)
            for i, (n, c) in enumerate((n, c) for n, _, t, c in features if t == table)
        ]
        rows = np.cumsum([0] + [bags[n].num_bags for n in names])
        tables[table] = {
            "unique": unique,
            "matrix": stacked_pooling_matrix(parts, unique.size),
            "rows": {n: slice(rows[i], rows[i + 1]) for i, n in enumerate(names)},
            "dim": dims[table],
        }
    return {"bags": bags, "tables": tables}


def table_rows(unique: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """Rows of the distinct keys: a pure function of the key, whichever path asks."""
    out = np.empty((unique.size, dim), np.float32)
    for i, key in enumerate(unique.tolist()):
        out[i] = np.random.default_rng([seed, key]).standard_normal(dim)
    return out


def run_device(
    features: list[tuple[str, Any, str, Combiner]],
    dims: dict[str, int],
    device: str,
    include_last: bool = False,
    seed: int = 0,
) -> tuple[list[Any], dict[str, Any]]:
    """Plan the features on `device`, hand the groups their rows, pool: (groups, outputs)."""
    specs = [FeatureSpec(n, f"feature {n!r}", v, t, c) for n, v, t, c in features]
    groups = device_pooling.plan(device, specs, dims.__getitem__, include_last)
    outputs: dict[str, Any] = {}
    for group in groups:
        rows = np.zeros((group.num_unique + 1, group.dim), np.float32)
        for table, (lo, hi) in group.spans.items():
            rows[lo:hi] = table_rows(group.unique[table], group.dim, seed)
        outputs.update(group.forward(torch.from_numpy(rows).to(device)))
    return groups, outputs


def check_against_host(
    features: list[tuple[str, Any, str, Combiner]],
    host_features: list[tuple[str, Any, str, Combiner]],
    dims: dict[str, int],
    device: str,
    include_last: bool = False,
    grad_of: list[str] | None = None,
) -> None:
    """The device path against the host kernels and the oracle: distinct keys, outputs, and
    the pushed (keys, gradients) per table, for gradients of `grad_of` (default: all)."""
    reference = host_reference(host_features, dims, include_last)
    groups, outputs = run_device(features, dims, device, include_last)
    rng = np.random.default_rng(1)
    grads: dict[str, np.ndarray] = {}
    for name, _, table, _ in host_features:
        want_shape = (*reference["bags"][name].shape, dims[table])
        assert tuple(outputs[name].shape) == want_shape, name
        assert outputs[name].device.type == torch.device(device).type
        grads[name] = rng.standard_normal(want_shape).astype(np.float32)
    given = grad_of if grad_of is not None else list(grads)
    pushed: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for group in groups:
        pushed.update(
            group.host_gradients({n: torch.from_numpy(grads[n]).to(device) for n in given})
        )

    for table, ref in reference["tables"].items():
        unique, matrix, dim = ref["unique"], ref["matrix"], ref["dim"]
        group = next(g for g in groups if table in g.spans)
        np.testing.assert_array_equal(group.unique[table], unique, err_msg=table)
        rows = table_rows(unique, dim, 0)
        dense = oracle_matrix_stacked(reference, table, host_features)
        pooled = pool(matrix, rows, kernel="scipy")
        np.testing.assert_allclose(dense, matrix.toarray(), atol=1e-6, err_msg=table)
        stacked = np.zeros((matrix.shape[0], dim), np.float32)
        for name, span in ref["rows"].items():
            got = outputs[name].cpu().numpy().reshape(-1, dim)
            np.testing.assert_allclose(got, dense[span] @ rows, atol=ATOL, err_msg=name)
            np.testing.assert_allclose(got, pooled[span], atol=ATOL, err_msg=name)
            if name in given:
                stacked[span] = grads[name].reshape(-1, dim)
        summed = unpool(matrix, stacked)
        np.testing.assert_allclose(summed, dense.T @ stacked, atol=ATOL)
        touched = np.zeros(unique.size, bool)
        for name, _, t, _ in host_features:
            if t == table and name in given:
                touched[np.isin(unique, reference["bags"][name].keys)] = True
        keys, got = pushed.get(table, (np.zeros(0, np.int64), np.zeros((0, dim), np.float32)))
        np.testing.assert_array_equal(keys, unique[touched], err_msg=table)
        np.testing.assert_allclose(got, summed[touched], atol=ATOL, err_msg=table)


def oracle_matrix_stacked(
    reference: dict[str, Any], table: str, features: list[tuple[str, Any, str, Combiner]]
) -> np.ndarray:
    unique = reference["tables"][table]["unique"]
    blocks = [
        oracle_matrix(reference["bags"][n], unique, c) for n, _, t, c in features if t == table
    ]
    return np.vstack(blocks)


# -- forward and backward against the references ---------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["dense", "csr", "csr-last", "coo"])
@pytest.mark.parametrize("combiner", list(Combiner))
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_a_fixed_batch_pools_as_the_host_and_the_oracle(
    device: str, fmt: str, combiner: Combiner, weighted: bool
) -> None:
    keys, offsets, weights = fixed_batch(fmt, weighted)
    host = as_value(keys, offsets, weights)
    value = as_value(on(device, keys), on(device, offsets), on(device, weights))
    check_against_host(
        [("f", value, "t", combiner)],
        [("f", host, "t", combiner)],
        {"t": DIM},
        device,
        include_last=fmt == "csr-last",
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("given", [None, ["a", "c"], ["b"]], ids=["all", "a-c", "b"])
def test_several_features_tables_and_dims_pool_in_groups_as_the_host(
    device: str, given: list[str] | None
) -> None:
    """Four features over three tables of two dims (two groups): 'a' and 'c' share a table,
    and the same keys appear in other tables (a key is distinct per table). Gradients of
    some features only move only their keys."""
    rng = np.random.default_rng(3)
    csr_keys = rng.integers(-1, 12, 40)
    csr_offsets = np.sort(rng.integers(0, 40, 9))
    csr_offsets[0] = 0
    dense_keys = rng.integers(-2, 12, (3, 5, 4))
    coo_rows, coo_keys = rng.integers(0, 7, 25), rng.integers(-1, 30, 25)
    weights = rng.uniform(-1.0, 2.0, 40)
    host = {
        "a": ((csr_keys, csr_offsets, weights), "t1", Combiner.MEAN),
        "b": (dense_keys, "t2", Combiner.SQRTN),
        "c": (COO(coo_rows, coo_keys, (7, 9)), "t1", Combiner.SUM),
        "d": ((csr_keys[:13], np.array([0, 4, 9])), "t3", Combiner.MEAN),
    }
    dims = {"t1": 4, "t2": 8, "t3": 4}

    def device_value(value: Any) -> Any:
        if isinstance(value, tuple) and not isinstance(value, COO):
            return tuple(on(device, v) for v in value)
        return on(device, value)

    check_against_host(
        [(n, device_value(v), t, c) for n, (v, t, c) in host.items()],
        [(n, v, t, c) for n, (v, t, c) in host.items()],
        dims,
        device,
        grad_of=given,
    )
    groups, _ = run_device(
        [(n, device_value(v), t, c) for n, (v, t, c) in host.items()], dims, device
    )
    assert [g.tables for g in groups] == [["t1", "t3"], ["t2"]]  # t1 and t3 share dim 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("mode", "weighted"), [("sum", False), ("mean", False), ("sum", True)])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense-grad", "sparse-grad"])
def test_forward_and_backward_match_torch_nn_embedding_bag(
    device: str, mode: str, weighted: bool, sparse: bool
) -> None:
    """torch.nn.EmbeddingBag over a vocabulary whose row V is padding (padding_idx): the
    same outputs, and its weight gradient at each distinct key is the pushed gradient."""
    vocab, bags, rng = 50, 64, np.random.default_rng(5)
    lengths = rng.integers(0, 9, bags)
    index = rng.zipf(1.3, int(lengths.sum())) % vocab
    padding = rng.random(index.size) < 0.1
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    weights = rng.uniform(0.5, 1.5, index.size).astype(np.float32) if weighted else None
    table = rng.standard_normal((vocab + 1, DIM)).astype(np.float32)
    table[vocab] = 0.0
    module = torch.nn.EmbeddingBag(vocab + 1, DIM, mode=mode, sparse=sparse, padding_idx=vocab)
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(table))
    module = module.to(device)
    rows_index = torch.from_numpy(np.where(padding, vocab, index)).to(device)
    grad = torch.from_numpy(rng.standard_normal((bags, DIM)).astype(np.float32)).to(device)
    want = module(rows_index, on(device, offsets), on(device, weights))
    want.backward(grad)
    weight_grad = module.weight.grad.to_dense() if sparse else module.weight.grad

    keys = np.where(padding, -1, index)  # key k is row k
    value = as_value(on(device, keys), on(device, offsets), on(device, weights))
    specs = [FeatureSpec("f", "feature 'f'", value, "t", Combiner(mode))]
    (group,) = device_pooling.plan(device, specs, lambda _: DIM)
    unique = group.unique["t"]
    rows = np.vstack([table[unique], np.zeros((1, DIM), np.float32)])
    got = group.forward(torch.from_numpy(rows).to(device))["f"]
    assert got.device == want.device
    np.testing.assert_allclose(got.cpu().numpy(), want.detach().cpu().numpy(), atol=ATOL)
    (_, pushed), *_ = group.host_gradients({"f": grad}).values()
    np.testing.assert_allclose(pushed, weight_grad.cpu().numpy()[unique], atol=ATOL)
    assert unique.size == np.unique(index[~padding]).size


@pytest.mark.parametrize("device", DEVICES)
def test_edge_batches_no_entries_no_bags_only_padding_and_width_zero(device: str) -> None:
    empty = (on(device, np.zeros(0, np.int64)), on(device, np.zeros(3, np.int64)))
    cases = {
        "no-entries": (empty, (np.zeros(0, np.int64), np.zeros(3, np.int64))),
        "no-bags": (
            (on(device, np.zeros(0, np.int64)), on(device, np.zeros(0, np.int64))),
            (np.zeros(0, np.int64), np.zeros(0, np.int64)),
        ),
        "padding-only": (on(device, -np.ones((3, 2), np.int64)), -np.ones((3, 2), np.int64)),
        "width-zero": (on(device, np.zeros((4, 0), np.int64)), np.zeros((4, 0), np.int64)),
    }
    for combiner in Combiner:
        for name, (value, host) in cases.items():
            check_against_host(
                [(name, value, "t", combiner)], [(name, host, "t", combiner)], {"t": DIM}, device
            )
    groups, outputs = run_device(
        [("p", cases["padding-only"][0], "t", Combiner.MEAN)], {"t": 3}, device
    )
    assert groups[0].num_unique == 0 and groups[0].unique["t"].size == 0
    assert outputs["p"].shape == (3, 3) and not outputs["p"].any()


def test_an_exact_zero_weight_sum_pools_to_zeros_as_on_the_host() -> None:
    """mean of weights 1 and -1 divides by an exact 0: zeros, not inf or nan."""
    keys = torch.tensor([[4, 6], [4, -1], [5, 5]])
    weights = torch.tensor([[1.0, -1.0], [0.0, 1.0], [0.5, -0.5]])
    for combiner in (Combiner.MEAN, Combiner.SQRTN):
        _, outputs = run_device([("f", (keys, None, weights), "t", combiner)], {"t": DIM}, "cpu")
        assert torch.isfinite(outputs["f"]).all()
        assert not outputs["f"][1].any()
        if combiner is Combiner.MEAN:
            assert not outputs["f"][0].any() and not outputs["f"][2].any()


# Weights are multiples of 1/4: sums are exact, so a mean over weights summing to 0 is exactly
# the empty case on both paths.
WEIGHT = st.integers(-4, 8).map(lambda n: n / 4)


@st.composite
def feature_batches(draw: st.DrawFn) -> tuple[Any, Any, bool]:
    """(device value on CPU tensors, host value, include_last_offset) of one feature."""
    sizes = draw(st.lists(st.integers(0, 5), max_size=6))
    nnz = sum(sizes)
    keys = np.array(draw(st.lists(st.integers(-3, 9), min_size=nnz, max_size=nnz)), np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    weights = (
        np.array(draw(st.lists(WEIGHT, min_size=nnz, max_size=nnz)), np.float32)
        if draw(st.booleans())
        else None
    )
    layout = draw(st.sampled_from(["csr", "csr-last", "coo", "dense"]))
    if layout == "dense":
        width = draw(st.integers(0, 4))
        keys = np.array(
            draw(st.lists(st.integers(-3, 9), min_size=3 * width, max_size=3 * width)), np.int64
        ).reshape(3, width)
        weights = None if weights is None else np.full(keys.shape, 0.75, np.float32)
        host: Any = as_value(keys, None, weights)
    elif layout == "coo":
        rows = np.repeat(np.arange(len(sizes)), sizes)
        order = np.random.default_rng(draw(st.integers(0, 99))).permutation(nnz)
        shuffled = None if weights is None else weights[order]
        host = as_value(COO(rows[order], keys[order], (len(sizes), 5)), None, shuffled)
    else:
        host = (keys, offsets if layout == "csr-last" else offsets[:-1], weights)
    if isinstance(host, tuple) and not isinstance(host, COO):
        device_value: Any = tuple(on("cpu", v) for v in host)
    else:
        device_value = on("cpu", host)
    return device_value, host, layout == "csr-last"


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            feature_batches(), st.sampled_from(["t1", "t2"]), st.sampled_from(list(Combiner))
        ),
        min_size=1,
        max_size=3,
    )
)
def test_random_calls_pool_as_the_host_kernels(cases: list[Any]) -> None:
    last = cases[0][0][2]  # include_last_offset is per call: give every feature the same
    features, host_features = [], []
    for i, ((value, host, is_last), table, combiner) in enumerate(cases):
        if is_last != last:
            continue
        features.append((f"f{i}", value, table, combiner))
        host_features.append((f"f{i}", host, table, combiner))
    check_against_host(features, host_features, {"t1": DIM, "t2": DIM}, "cpu", last)


def test_the_result_is_deterministic_run_to_run() -> None:
    rng = np.random.default_rng(11)
    keys = torch.from_numpy(rng.zipf(1.2, 5000) % 300)
    offsets = torch.arange(0, 5000, 7)
    value = (keys, offsets, torch.from_numpy(rng.random(5000).astype(np.float32)))
    results = []
    for _ in range(2):
        groups, outputs = run_device([("f", value, "t", Combiner.SQRTN)], {"t": 16}, "cpu")
        grad = torch.from_numpy(np.random.default_rng(2).random((offsets.numel(), 16), np.float32))
        results.append((outputs["f"], groups[0].backward({"f": grad})))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


# -- refusals read as the host's -------------------------------------------------------------------

BAD_BATCHES = [
    (([1, 2, 3, 4, 5, 6], [0, 4, 2]), {}),
    (([1, 2, 3, 4, 5, 6], [0, 2, 6, 3]), {}),
    (([1, 2, 3, 4, 5], [0, 7]), {}),
    (([1, 2, 3], [1, 2]), {}),
    (([1, 2, 3], [-1, 2]), {}),
    (([1, 2, 3], [0, 2]), {"include_last_offset": True}),
    (([1, 2, 3], [3]), {"include_last_offset": True}),
    ((np.zeros(3, np.int64), np.zeros(0, np.int64)), {"include_last_offset": True}),
    ((np.arange(3), np.zeros(0, np.int64)), {}),
    (([1, 2, 3], [[0, 1]]), {}),
    (([1, 2, 3], [0.0, 1.0]), {}),
    (([1.0, 2.0], [0]), {}),
    (([[1, 2]], [0]), {}),
    ((np.int64(3),), {}),
    (([1, 2, 3, 4, 5], [0, 2], [1.0, 1.0, 1.0, 1.0]), {}),
    (([[1, 2], [3, -1]], None, [1.0, 2.0, 3.0, 4.0]), {}),
    (([1, 2, 3], [0], [1.0, np.nan, 1.0]), {}),
    (([1, 2, 3], [0], [1.0, 1.0, -np.inf]), {}),
    (([[1, 2], [3, 4]], None, [[1.0, 1e39], [1.0, 1.0]]), {}),
    ((COO([0, 3], [1, 2], (3, 2)),), {}),
    ((COO([-1, 0], [1, 2], (3, 2)),), {}),
    ((COO([0, 1], [1, 2, 3], (3, 2)),), {}),
    ((COO([0.5], [1], (3, 2)),), {}),
    ((COO([0], [1], (3, 2, 1)),), {}),
    ((COO([0], [1], (-1, 2)),), {}),
    ((COO([0], [1], (3, 2)), [0]), {}),
    ((COO([0, 1], [1, 2], (3, 2)), None, [1.0]), {}),
    ((np.array([[True, False]]),), {}),
]


def tensors(value: Any) -> Any:
    """An argument of to_bags as CPU tensors where torch takes it."""
    if value is None:
        return None
    if isinstance(value, COO):
        return COO(tensors(value.rows), tensors(value.values), value.shape)
    return torch.as_tensor(np.asarray(value))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize(("args", "kwargs"), BAD_BATCHES)
def test_bad_batches_are_refused_in_the_host_checks_words(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    where = "feature 'f'"
    value = tuple(tensors(a) for a in args)
    with pytest.raises(InvalidArgumentError) as host:  # the host path given the same tensors
        to_bags(where, *value, **kwargs)
    value = value[0] if len(value) == 1 else value
    specs = [FeatureSpec("f", where, value, "t", Combiner.MEAN)]
    with pytest.raises(InvalidArgumentError) as device:
        device_pooling.plan("cpu", specs, lambda _: DIM, kwargs.get("include_last_offset", False))
    assert str(device.value) == str(host.value)


@pytest.mark.parametrize(
    "value",
    [
        (torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 4, 2])),
        (torch.tensor([1, 2, 3]), torch.tensor([0, 4])),
        (torch.tensor([1, 2, 3]), torch.tensor([1, 2])),
        (torch.tensor([1, 2]), torch.tensor([0]), torch.tensor([1.0, float("nan")])),
        COO(torch.tensor([0, 3]), torch.tensor([1, 2]), (3, 2)),
    ],
)
def test_bad_values_are_caught_by_the_device_checks_not_the_host_fallback(value: Any) -> None:
    """These batches are well-formed in shape and dtype: feature_parts takes them as they
    are (its host fallback would refuse them at once), and the group's checks on the device
    catch their values."""
    device_pooling.feature_parts("feature 'f'", value, False, torch.device("cpu"))
    spec = FeatureSpec("f", "feature 'f'", value, "t", Combiner.SUM)
    with pytest.raises(InvalidArgumentError, match="feature 'f'"):
        device_pooling.plan("cpu", [spec], lambda _: DIM)


def test_a_bad_feature_is_named_among_good_ones() -> None:
    good = (torch.tensor([1, 2, 3]), torch.tensor([0, 1]))
    bad = (torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1]))
    specs = [
        FeatureSpec("a", "feature 'a'", good, "t", Combiner.SUM),
        FeatureSpec("b", "feature 'b'", bad, "t", Combiner.SUM),
    ]
    with pytest.raises(InvalidArgumentError, match=r"^feature 'b': offsets must not decrease"):
        device_pooling.plan("cpu", specs, lambda _: DIM)


def test_arrays_on_another_device_are_refused_naming_field_expected_and_got() -> None:
    meta = torch.zeros(2, dtype=torch.int64, device="meta")
    cases = [
        (
            (torch.tensor([1, 2]), meta),
            "field 'offsets' expected an array on cpu",
            "got one on meta",
        ),
        ((meta, torch.tensor([0])), "field 'keys' expected an array on cpu", "got one on meta"),
        (
            (torch.tensor([1, 2]), torch.tensor([0]), meta.float()),
            "field 'per_sample_weights' expected an array on cpu",
            "got one on meta",
        ),
        (COO(meta, torch.tensor([1, 2]), (3, 2)), "field 'rows'", "got one on meta"),
    ]
    for value, *needles in cases:
        spec = FeatureSpec("f", "feature 'f'", value, "t", Combiner.SUM)
        with pytest.raises(InvalidArgumentError) as raised:
            device_pooling.plan("cpu", [spec], lambda _: DIM)
        assert str(raised.value).startswith("feature 'f': "), raised.value
        for needle in needles:
            assert needle in str(raised.value), (needle, str(raised.value))


@pytest.mark.parametrize(
    "grad",
    [
        np.zeros((2, DIM + 1), np.float32),
        np.zeros((2, DIM), np.int64),
        np.array([[0.0] * DIM, [0.0, np.nan, 0.0, 0.0]], np.float32),
        np.array([[0.0] * DIM, [0.0, 0.0, np.inf, 0.0]], np.float64),
    ],
)
def test_bad_gradients_are_refused_in_the_host_checks_words(grad: np.ndarray) -> None:
    where, shape = "feature 'f'", (2, DIM)
    with pytest.raises(InvalidArgumentError) as host:
        float_array(where, "grad_output", grad, shape, "that of the pooled output")
    with pytest.raises(InvalidArgumentError) as device:
        tensor, bad = device_pooling.checked_gradient(
            where, torch.from_numpy(grad), torch.device("cpu"), shape
        )
        if bad is not None and bool(bad):
            device_pooling.refuse_gradient(where, torch.from_numpy(grad), shape)
    assert str(device.value) == str(host.value)


def test_a_good_gradient_passes_as_float32_and_host_arrays_count_as_cpu() -> None:
    tensor, bad = device_pooling.checked_gradient(
        "feature 'f'", torch.ones(2, 3, dtype=torch.float64), torch.device("cpu"), (2, 3)
    )
    assert tensor.dtype == torch.float32 and bad is not None and not bool(bad)
    tensor, bad = device_pooling.checked_gradient(
        "feature 'f'", np.ones((2, 3)), torch.device("cpu"), (2, 3)
    )
    assert tensor.dtype == torch.float32 and bad is None
    with pytest.raises(InvalidArgumentError, match="expected an array on cpu .* got one on meta"):
        device_pooling.checked_gradient(
            "feature 'f'", torch.ones(2, 3, device="meta"), torch.device("cpu"), (2, 3)
        )


# -- where arrays live -----------------------------------------------------------------------------


class FakeDLPack:
    """Stands for a DLPack array (as cupy's) on some device; never converted here."""

    def __init__(self, kind: int, index: int) -> None:
        self.device = (kind, index)

    def __dlpack__(self, stream: Any = None) -> Any:
        raise AssertionError("not converted in these tests")

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


def test_array_device_reads_torch_numpy_and_dlpack_devices() -> None:
    assert array_device(np.zeros(2)) == "cpu"
    assert array_device([1, 2]) == "cpu"
    assert array_device(torch.zeros(2)) == "cpu"
    assert array_device(torch.zeros(2, device="meta")) == "meta"
    assert array_device(FakeDLPack(2, 1)) == "cuda:1"
    assert array_device(FakeDLPack(10, 0)) == "cuda:0"  # ROCm: torch calls it cuda
    assert array_device(FakeDLPack(4, 0)) == "DLPack device type 4"
    coo = COO([0], [5], (1, 1))
    assert batch_arrays((coo, None, [1.0])) == [
        ("values", [5]),
        ("rows", [0]),
        ("per_sample_weights", [1.0]),
    ]
    assert batch_arrays(([3], [0])) == [("keys", [3]), ("offsets", [0])]
    assert batch_arrays([[3]]) == [("keys", [[3]])]


def test_a_dlpack_array_on_another_device_is_refused() -> None:
    spec = FeatureSpec("f", "feature 'f'", (FakeDLPack(2, 0), torch.tensor([0])), "t", "sum")
    with pytest.raises(InvalidArgumentError, match="'keys' expected an array on cpu .* cuda:0"):
        device_pooling.plan("cpu", [spec], lambda _: DIM)


# -- on a GPU: the same results as on the host, from CUDA tensors and cupy arrays ------------------


def zipf_call(device: str) -> list[tuple[str, Any, str, Combiner]]:
    rng = np.random.default_rng(13)
    features = []
    for i, combiner in enumerate([Combiner.SUM, Combiner.MEAN, Combiner.SQRTN]):
        lengths = rng.integers(0, 21, 512)
        keys = rng.zipf(1.1, int(lengths.sum())) % 5000 - (rng.random(lengths.sum()) < 0.05)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        weights = rng.random(keys.size).astype(np.float32)
        value = (on(device, keys), on(device, offsets), on(device, weights))
        features.append((f"f{i}", value, f"t{i % 2}", combiner))
    return features


@requires_cuda
def test_cuda_pools_as_the_cpu_path() -> None:
    """CUDA against CPU tensors, the same code: both sum each bag (forward) and each key's
    entries (backward) in entry order, so only float32 rounding (FMA contraction) differs;
    a hot key's gradient sums thousands of terms, hence the relative 1e-5 beside 1e-6."""
    dims = {"t0": 32, "t1": 32}
    results = {}
    for device in ("cpu", "cuda"):
        groups, outputs = run_device(zipf_call(device), dims, device)
        rng = np.random.default_rng(4)
        grads = {
            n: torch.from_numpy(rng.random(tuple(o.shape), np.float32)).to(device)
            for n, o in outputs.items()
        }
        pushed = groups[0].host_gradients(grads)
        results[device] = ({n: o.cpu().numpy() for n, o in outputs.items()}, pushed)
    for name, want in results["cpu"][0].items():
        np.testing.assert_allclose(results["cuda"][0][name], want, rtol=1e-5, atol=1e-6)
    for table, (keys, want) in results["cpu"][1].items():
        got_keys, got = results["cuda"][1][table]
        np.testing.assert_array_equal(got_keys, keys)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@requires_cuda
def test_cupy_arrays_pool_on_their_gpu_into_torch_tensors_there() -> None:
    cupy = cupy_or_skip()
    keys, offsets, weights = fixed_batch("csr", weighted=True)
    value = (cupy.asarray(keys), cupy.asarray(offsets), cupy.asarray(weights, dtype=cupy.float32))
    host = (keys, offsets, weights)
    check_against_host(
        [("f", value, "t", Combiner.MEAN)], [("f", host, "t", Combiner.MEAN)], {"t": DIM}, "cuda:0"
    )
    _, outputs = run_device([("f", value, "t", Combiner.MEAN)], {"t": DIM}, "cuda:0")
    assert isinstance(outputs["f"], torch.Tensor) and outputs["f"].device == torch.device("cuda:0")
    back = cupy.from_dlpack(outputs["f"])  # a cupy caller takes the output without a copy
    assert back.data.ptr == outputs["f"].data_ptr()


@requires_cuda
def test_cuda_batches_refuse_host_arrays_and_cuda_gradients_stay_there() -> None:
    spec = FeatureSpec(
        "f", "feature 'f'", (torch.tensor([1, 2], device="cuda"), np.array([0])), "t", "sum"
    )
    with pytest.raises(InvalidArgumentError, match="'offsets' expected an array on cuda:0"):
        device_pooling.plan("cuda", [spec], lambda _: DIM)
    with pytest.raises(InvalidArgumentError, match="expected an array on cuda:0 .* got one on cpu"):
        device_pooling.checked_gradient(
            "feature 'f'", np.ones((2, DIM), np.float32), torch.device("cuda:0"), (2, DIM)
        )
