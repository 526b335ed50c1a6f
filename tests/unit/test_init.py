"""Initialisers: initial rows are a pure function of (seed, key), have the distribution they
claim, and bad parameters are refused with a message that says what to fix."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.optimizers import each
from tierps.storage import EmbeddingStore, TableConfig, init, optim
from tierps.storage.tiers import host_rows_for_budget

try:
    from scipy import stats as scipy_stats
except ImportError:  # scipy is optional: a numpy Kolmogorov-Smirnov test stands in
    scipy_stats = None

DIM = 16
INITIALIZERS = [
    init.Uniform(),
    init.Uniform(-3.0, 0.5),
    init.Normal(),
    init.Normal(0.25, 0.01),
    init.TruncatedNormal(),
    init.TruncatedNormal(-1.0, 3.0),
    init.Constant(0.75),
    init.Zeros(),
]
RANDOM_INITIALIZERS = [i for i in INITIALIZERS if not isinstance(i, init.Constant | init.Zeros)]


def ids(values: list) -> list[str]:
    return [repr(v) for v in values]


def bits(values: np.ndarray) -> np.ndarray:
    """float32 values as their bit patterns: equal means bit-for-bit equal (even -0.0, NaN)."""
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


def some_keys(n: int, seed: int = 0) -> np.ndarray:
    """Distinct keys spread over all of int64 >= 0, with the edges and small keys in."""
    rng = np.random.default_rng(seed)
    edges = np.array([0, 1, 2, 3, 2**31, 2**32 - 1, 2**62, 2**63 - 1], dtype=np.int64)
    wide = rng.integers(0, 2**63 - 1, size=n, dtype=np.int64)
    return np.unique(np.concatenate([edges, np.arange(50, dtype=np.int64), wide]))


def tiny_budget(config: TableConfig, rows: int) -> int:
    budget = rows * config.row_bytes
    while host_rows_for_budget(budget, config.row_bytes) < rows:
        budget += 16
    return budget


# -- purity --------------------------------------------------------------------------


@pytest.mark.parametrize("initializer", INITIALIZERS, ids=ids(INITIALIZERS))
def test_generate_ignores_batch_order_and_duplicates(initializer: init.Initializer) -> None:
    keys = some_keys(500)
    whole = initializer.generate(keys, DIM, 42)
    assert whole.dtype == np.float32 and whole.shape == (keys.size, DIM)

    rng = np.random.default_rng(1)
    order = rng.permutation(keys.size)
    shuffled = initializer.generate(keys[order], DIM, 42)
    np.testing.assert_array_equal(bits(shuffled), bits(whole[order]))

    with_repeats = rng.integers(0, keys.size, size=3 * keys.size)
    repeated = initializer.generate(keys[with_repeats], DIM, 42)
    np.testing.assert_array_equal(bits(repeated), bits(whole[with_repeats]))

    for key_index in (0, keys.size // 2, keys.size - 1):  # alone in a batch of one
        single = initializer.generate(keys[key_index : key_index + 1], DIM, 42)
        np.testing.assert_array_equal(bits(single[0]), bits(whole[key_index]))


@pytest.mark.parametrize("initializer", INITIALIZERS, ids=ids(INITIALIZERS))
def test_store_initial_rows_independent_of_batch_tier_and_store(
    tmp_path: Path, initializer: init.Initializer
) -> None:
    """One batch in one store == shuffled small batches with repeats and padding through a
    host tier of 3 rows (so most rows come back from RocksDB) in another store == lookups
    that store nothing == a table with another optimizer == generate()."""
    keys = some_keys(300)
    seed = 2**64 - 1
    roomy = TableConfig("a", DIM, initializer=initializer, optimizer=optim.SGD(), seed=seed)
    sgd_tiny = TableConfig(
        "b",
        DIM,
        initializer=initializer,
        optimizer=optim.SGD(),
        seed=seed,
        host_cache_bytes=tiny_budget(roomy, 3),
    )
    adam = TableConfig("c", DIM, initializer=initializer, optimizer=optim.Adam(), seed=seed)
    want = initializer.generate(keys, DIM, seed)

    rng = np.random.default_rng(7)
    with (
        EmbeddingStore(tmp_path / "one") as one,
        EmbeddingStore(tmp_path / "two") as two,
    ):
        got_one = one.create_table(roomy).lookup(keys)
        tiny = two.create_table(sgd_tiny)
        got_tiny = np.empty_like(got_one)
        order = rng.permutation(keys.size)
        for start in range(0, keys.size, 17):
            part = order[start : start + 17]
            part = np.concatenate([part, part[:5]])  # repeats
            batch = np.concatenate([keys[part], [-1, -7]])  # padding
            looked = tiny.lookup(batch)
            np.testing.assert_array_equal(looked[-2:], 0.0)
            got_tiny[part] = looked[:-2]
        assert tiny.stats()["spilled"] > 0
        # read back after the rows went through RocksDB
        again = tiny.lookup(keys[rng.permutation(keys.size)[:50]])
        eval_only = two.create_table(adam).lookup(keys[::-1], create=False)[::-1]

    for got in (got_one, got_tiny, eval_only):
        np.testing.assert_array_equal(bits(got), bits(want))
    assert again.shape == (50, DIM)
    np.testing.assert_array_equal(bits(roomy.initial_rows(keys)[:, :DIM]), bits(want))


def test_reopened_store_initialises_new_keys_the_same(tmp_path: Path) -> None:
    config = TableConfig("t", DIM, initializer=init.TruncatedNormal(0.5, 2.0), seed=2**63 + 12345)
    keys = some_keys(200)
    with EmbeddingStore(tmp_path / "db") as store:
        first = store.create_table(config).lookup(keys[:100])
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.table("t")
        assert table.config == config
        late = table.lookup(keys[100:][::-1])[::-1]
        stored = table.lookup(keys[:100])
    want = config.initializer.generate(keys, DIM, config.seed)
    np.testing.assert_array_equal(bits(np.concatenate([first, late])), bits(want))
    np.testing.assert_array_equal(bits(stored), bits(first))


@pytest.mark.parametrize("initializer", RANDOM_INITIALIZERS, ids=ids(RANDOM_INITIALIZERS))
def test_different_seeds_and_keys_give_different_rows(initializer: init.Initializer) -> None:
    keys = some_keys(2000)
    rows = initializer.generate(keys, DIM, 0)
    assert np.unique(rows, axis=0).shape[0] == keys.size  # no two keys share a row
    for other_seed in (1, 2, 2**32, 2**63, 2**64 - 1):
        other = initializer.generate(keys, DIM, other_seed)
        same_row = np.all(other == rows, axis=1)
        assert not same_row.any(), f"seed {other_seed}: {same_row.sum()} rows equal seed 0's"
        # not merely different: unrelated (the same key never repeats a value in a column)
        assert np.mean(other == rows) < 0.01
    # and a row is not a shifted copy of another row's columns
    assert np.mean(rows[:, 1:] == rows[:, :-1]) < 0.01


def test_initial_weights_do_not_depend_on_optimizer_or_table_name() -> None:
    keys = some_keys(100)
    base = TableConfig("x", DIM, initializer=init.Normal(), seed=5)
    for optimizer in each():
        other = TableConfig("y", DIM, initializer=init.Normal(), optimizer=optimizer, seed=5)
        np.testing.assert_array_equal(
            bits(other.initial_rows(keys)[:, :DIM]), bits(base.initial_rows(keys)[:, :DIM])
        )


# -- distributions -------------------------------------------------------------------

N_KEYS, N_COLS = 20_000, 10  # 200k values; consecutive keys, the hardest case for a hash


def sample(initializer: init.Initializer, seed: int = 3) -> np.ndarray:
    keys = np.arange(N_KEYS, dtype=np.int64)
    return initializer.generate(keys, N_COLS, seed)


def normal_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.frompyfunc(math.erf, 1, 1)(x / math.sqrt(2.0)).astype(np.float64))


def uniform_cdf(low: float, high: float) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: np.clip((x - low) / (high - low), 0.0, 1.0)


def truncnorm_cdf(mean: float, std: float) -> Callable[[np.ndarray], np.ndarray]:
    lo, mass = normal_cdf(np.array([-2.0]))[0], 1.0 - 2.0 * normal_cdf(np.array([-2.0]))[0]
    return lambda x: np.clip((normal_cdf((x - mean) / std) - lo) / mass, 0.0, 1.0)


def ks_pvalue(values: np.ndarray, cdf: Callable[[np.ndarray], np.ndarray]) -> float:
    """Two-sided one-sample Kolmogorov-Smirnov p-value (scipy's when installed, else the
    asymptotic Kolmogorov distribution with Stephens' small-n correction)."""
    x = np.sort(values.astype(np.float64).ravel())
    if scipy_stats is not None:
        return float(scipy_stats.kstest(x, cdf).pvalue)
    n = x.size
    f = cdf(x)
    d = max(np.max(np.arange(1, n + 1) / n - f), np.max(f - np.arange(n) / n))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    k = np.arange(1, 101)
    return float(np.clip(2.0 * np.sum((-1.0) ** (k - 1) * np.exp(-2.0 * k**2 * lam**2)), 0, 1))


def test_ks_helper_rejects_a_wrong_distribution() -> None:
    """The KS helper has power: the uniform sample is not N(0, 1), and a shifted uniform
    is not the uniform."""
    values = sample(init.Uniform(0.0, 1.0))
    assert ks_pvalue(values, uniform_cdf(0.0, 1.0)) > 1e-3
    assert ks_pvalue(values, normal_cdf) < 1e-12
    assert ks_pvalue(values, uniform_cdf(0.01, 1.01)) < 1e-12


@pytest.mark.parametrize(("low", "high"), [(-0.05, 0.05), (0.0, 1.0), (-3.0, 0.5), (2.0, 2.25)])
def test_uniform_distribution(low: float, high: float) -> None:
    values = sample(init.Uniform(low, high))
    assert values.min() >= np.float32(low)
    assert values.max() < np.float32(high)
    assert ks_pvalue(values, uniform_cdf(low, high)) > 1e-3
    width = high - low
    n = values.size
    assert abs(values.mean() - (low + high) / 2) < 5 * width / math.sqrt(12 * n)
    assert abs(values.std() - width / math.sqrt(12)) < 0.01 * width
    # columns and neighbouring keys are uncorrelated
    assert abs(np.corrcoef(values[:, 0], values[:, 1])[0, 1]) < 0.03
    assert abs(np.corrcoef(values[:-1, 0], values[1:, 0])[0, 1]) < 0.03


@pytest.mark.parametrize(("low", "high"), [(100.0, 100.5), (1000.0, 1001.0)])
def test_uniform_never_returns_high_for_offset_ranges(low: float, high: float) -> None:
    """[low, high) must hold whatever the offset. low + (high-low)*u is computed in float64
    and cast to float32; where float32's spacing at `high` exceeds (high-low) * 2**-24, the
    top values round up to high itself (about 1 in 20000 for [1000, 1001))."""
    values = sample(init.Uniform(low, high))
    assert values.min() >= np.float32(low)
    at_high = int(np.count_nonzero(values >= np.float32(high)))
    assert at_high == 0, f"{at_high} of {values.size} values equal high={high}"


@pytest.mark.parametrize(("mean", "std"), [(0.0, 1.0), (0.25, 0.01), (-5.0, 3.0)])
def test_normal_distribution(mean: float, std: float) -> None:
    values = sample(init.Normal(mean, std)).astype(np.float64)
    n = values.size
    z = (values - mean) / std
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.std() - 1.0) < 5 / math.sqrt(2 * n)
    assert abs(np.mean(z**3)) < 5 * math.sqrt(15 / n)  # skewness (6/n variance for a normal)
    assert abs(np.mean(z**4) - 3.0) < 5 * math.sqrt(96 / n)  # kurtosis
    assert ks_pvalue(z, normal_cdf) > 1e-3
    assert np.abs(z).max() > 4.0  # the tails are there (P(|z| > 4) = 6e-5, n = 2e5)
    assert abs(np.corrcoef(z[:, 0], z[:, 1])[0, 1]) < 0.03
    assert abs(np.corrcoef(z[:-1, 0], z[1:, 0])[0, 1]) < 0.03


@pytest.mark.parametrize(("mean", "std"), [(0.0, 1.0), (-1.0, 3.0), (0.0, 0.02)])
def test_truncated_normal_distribution(mean: float, std: float) -> None:
    raw = sample(init.TruncatedNormal(mean, std))
    assert raw.min() >= np.float32(mean - 2 * std)
    assert raw.max() <= np.float32(mean + 2 * std)
    values = raw.astype(np.float64)
    # not clipped: only a float32 rounding's worth of values sit at the bounds
    at_bounds = np.isclose(values, mean - 2 * std, rtol=0, atol=1e-6 * std) | np.isclose(
        values, mean + 2 * std, rtol=0, atol=1e-6 * std
    )
    assert at_bounds.sum() < 5
    assert ks_pvalue(values, truncnorm_cdf(mean, std)) > 1e-3
    z = (values - mean) / std
    truncated_var = 1.0 - 4.0 * math.exp(-2.0) / math.sqrt(2 * math.pi) / (
        1.0 - 2.0 * normal_cdf(np.array([-2.0]))[0]
    )  # variance of N(0, 1) cut at +-2: 0.7737
    assert abs(z.mean()) < 5 * math.sqrt(truncated_var / z.size)
    assert abs(z.var() - truncated_var) < 0.01


def test_constant_and_zeros_exact() -> None:
    keys = some_keys(1000)
    for value in (0.75, -2.5, 0.0, 1e30):
        got = init.Constant(value).generate(keys, DIM, 9)
        assert got.dtype == np.float32 and got.shape == (keys.size, DIM)
        np.testing.assert_array_equal(got, np.float32(value))
    zeros = init.Zeros().generate(keys, DIM, 9)
    assert zeros.dtype == np.float32 and zeros.shape == (keys.size, DIM)
    np.testing.assert_array_equal(bits(zeros), 0)  # +0.0, not -0.0
    assert init.Constant().value == 0.0


def test_defaults_match_their_references() -> None:
    """Uniform: Keras' RandomUniform(-0.05, 0.05); Normal / TruncatedNormal: torch.nn.init's
    normal_ and trunc_normal_ (mean 0, std 1)."""
    assert (init.Uniform().low, init.Uniform().high) == (-0.05, 0.05)
    assert (init.Normal().mean, init.Normal().std) == (0.0, 1.0)
    assert (init.TruncatedNormal().mean, init.TruncatedNormal().std) == (0.0, 1.0)
    assert isinstance(TableConfig("t", 4).initializer, init.Uniform)


# -- optimizer state -------------------------------------------------------------------

STATE_CASES = [
    (optim.SGD(), ()),
    (optim.Momentum(), (0.0,)),
    (optim.Nesterov(momentum=0.5), (0.0,)),
    (optim.Adagrad(), (0.0,)),
    (optim.Adagrad(initial_accumulator_value=0.25), (0.25,)),
    (optim.Adam(), (0.0, 0.0)),
    (optim.FTRL(), (0.1, 0.0)),
    (optim.FTRL(initial_accumulator_value=0.7), (0.7, 0.0)),
]


@pytest.mark.parametrize(("optimizer", "slots"), STATE_CASES, ids=[repr(c[0]) for c in STATE_CASES])
def test_initial_rows_carry_fresh_optimizer_state(
    tmp_path: Path, optimizer: optim.Optimizer, slots: tuple[float, ...]
) -> None:
    config = TableConfig("t", DIM, initializer=init.Normal(), optimizer=optimizer, seed=11)
    keys = some_keys(64)
    rows = config.initial_rows(keys)
    assert rows.dtype == np.float32
    assert rows.shape == (keys.size, DIM * (1 + len(slots))) == (keys.size, config.row_width)
    np.testing.assert_array_equal(rows[:, :DIM], config.initializer.generate(keys, DIM, 11))
    for slot, value in enumerate(slots, start=1):
        np.testing.assert_array_equal(rows[:, slot * DIM : (slot + 1) * DIM], np.float32(value))

    given = np.full((keys.size, DIM), 3.5, np.float32)
    with_weights = config.initial_rows(keys, weights=given)
    np.testing.assert_array_equal(with_weights[:, :DIM], given)
    np.testing.assert_array_equal(with_weights[:, DIM:], rows[:, DIM:])

    # and the store keeps exactly these rows for keys it creates or assigns
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        table.lookup(keys[:32])
        table.assign(keys[32:], given[32:])
        exported = {}
        for chunk_keys, chunk_rows in table.export():
            exported.update(zip(chunk_keys.tolist(), chunk_rows, strict=True))
    assert sorted(exported) == sorted(keys.tolist())
    stored = np.stack([exported[k] for k in keys.tolist()])
    np.testing.assert_array_equal(stored[:32], rows[:32])
    np.testing.assert_array_equal(stored[32:], with_weights[32:])


# -- validation ------------------------------------------------------------------------

NAN = float("nan")
BAD = [
    # (constructor kwargs, the field named, what the message must contain)
    (init.Uniform, {"low": 1.0, "high": 1.0}, "low", ["low < high", "low=1.0", "high=1.0"]),
    (init.Uniform, {"low": 2.0, "high": -1.0}, "low", ["low < high", "low=2.0", "high=-1.0"]),
    (init.Uniform, {"low": NAN}, "'low'", ["finite", "nan"]),
    (init.Uniform, {"high": NAN}, "'high'", ["finite", "nan"]),
    (init.Uniform, {"high": float("inf")}, "'high'", ["finite", "inf"]),
    (init.Normal, {"std": 0.0}, "'std'", ["> 0", "0.0"]),
    (init.Normal, {"std": -1.0}, "'std'", ["> 0", "-1.0"]),
    (init.Normal, {"std": NAN}, "'std'", ["nan"]),
    (init.Normal, {"mean": NAN}, "'mean'", ["finite", "nan"]),
    (init.TruncatedNormal, {"std": 0.0}, "'std'", ["> 0", "0.0"]),
    (init.TruncatedNormal, {"std": -0.5}, "'std'", ["> 0", "-0.5"]),
    (init.TruncatedNormal, {"mean": NAN}, "'mean'", ["finite", "nan"]),
    (init.TruncatedNormal, {"std": NAN}, "'std'", ["nan"]),
    (init.Constant, {"value": NAN}, "'value'", ["finite", "nan"]),
    (init.Constant, {"value": float("-inf")}, "'value'", ["finite", "-inf"]),
    (init.Normal, {"std": "1"}, "'std'", ["'1'"]),
    (init.Constant, {"value": True}, "'value'", ["True"]),
]


@pytest.mark.parametrize(
    ("cls", "kwargs", "field", "fragments"),
    BAD,
    ids=[f"{c.__name__}-{k}" for c, k, _, _ in BAD],
)
def test_bad_parameters_refused_with_field_expectation_and_value(
    cls: type, kwargs: dict, field: str, fragments: list[str]
) -> None:
    with pytest.raises(ValueError) as raised:
        cls(**kwargs)
    message = str(raised.value)
    assert f"init.{cls.__name__}" in message
    assert field in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("cls", [init.Normal, init.TruncatedNormal])
def test_nan_std_message_names_the_expected_range(cls: type) -> None:
    """std=NaN is out of range like std=-1: the message should say std must be > 0 (today
    check_finite answers first with only "expected a finite number")."""
    with pytest.raises(ValueError, match="'std'") as raised:
        cls(std=NAN)
    assert "> 0" in str(raised.value)


def test_table_config_refuses_a_non_initializer() -> None:
    with pytest.raises(ValueError, match="'initializer'"):
        TableConfig("t", DIM, initializer=optim.SGD())
