"""Optimizer parity: the real store (host tier over RocksDB, in tmp_path) against references
no one here wrote, for every registered optimizer (optim.OPTIMIZERS).

- Each optimizer with a torch reference (its `torch_reference`) equals that torch.optim
  optimizer step for step, at its defaults and at tests/optimizers.py's example, fed the
  gradient of an nn.Embedding(sparse=True) (torch sums duplicate indices itself): the
  sparse gradient itself where torch's optimizer takes it and is lazy (SGD, Adagrad,
  SparseAdam), else one torch parameter per row, stepped only when the batch touches it.
- FTRL (no torch counterpart) equals a float64 numpy transcription of TensorFlow's ApplyFtrl.

Every trace runs >= 50 steps with repeated keys, absent keys and -1 padding, once with every
row in the host tier and once with a budget of a few rows, so rows spill to RocksDB between
steps. Max abs difference <= 1e-5 throughout; rows a step leaves out do not change at all.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.optimizers import EXAMPLES, TorchTwin
from tierps.storage import EmbeddingStore, EmbeddingTable, TableConfig, init, optim
from tierps.storage.tiers import host_rows_for_budget

torch = pytest.importorskip("torch")

DIM = 8
NUM_KEYS = 24
STEPS = 50
BATCH = 40
ATOL = 1e-5
# Sparse, non-contiguous table keys; torch addresses the same rows by position.
ALL_KEYS = (np.arange(NUM_KEYS, dtype=np.int64) * 7919 + 13) ** 2 % (1 << 40)
ROOMY = 64 << 20
TINY_ROWS = 4
STATE_RTOL = 1e-6  # float32 has 24 bits (6e-8): a few roundings of a sum of ~50 squares
Z_RTOL = 1e-6  # ~16 float32 roundings of each term accumulated into FTRL's linear

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning"),
    pytest.mark.usefixtures("one_torch_thread"),
]


def budget_for_rows(optimizer: optim.Optimizer, rows: int) -> int:
    """The smallest host_cache_bytes that holds `rows` rows of DIM with this optimizer."""
    row_bytes = 4 * DIM * optimizer.size_factor
    budget = rows * row_bytes
    while host_rows_for_budget(budget, row_bytes) < rows:
        budget += 16
    return budget


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EmbeddingStore]:
    with EmbeddingStore(tmp_path / "db") as opened:
        yield opened


def make_table(
    store: EmbeddingStore, optimizer: optim.Optimizer, host_rows: int | None, w0: np.ndarray
) -> EmbeddingTable:
    budget = ROOMY if host_rows is None else budget_for_rows(optimizer, host_rows)
    config = TableConfig(
        "t",
        DIM,
        initializer=init.Normal(0.0, 0.1),
        optimizer=optimizer,
        seed=3,
        host_cache_bytes=budget,
    )
    table = store.create_table(config)
    table.assign(ALL_KEYS, w0)
    return table


def initial_weights(rng: np.random.Generator) -> np.ndarray:
    return rng.normal(0.0, 0.5, size=(NUM_KEYS, DIM)).astype(np.float32)


def sparse_batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch over a random strict subset of the rows, with repeats and -1 padding.

    Returns (table keys with padding, row positions of the valid entries, per-entry grads)."""
    present = rng.choice(NUM_KEYS, size=int(rng.integers(4, NUM_KEYS - 3)), replace=False)
    positions = rng.choice(present, size=BATCH, replace=True)
    positions[:3] = positions[-1]  # at least one key repeats
    keys = ALL_KEYS[positions]
    pad = rng.random(BATCH) < 0.1
    pad[int(rng.integers(BATCH))] = True
    keys[pad] = -1
    grads = rng.normal(0.0, 1.0, size=(BATCH, DIM)).astype(np.float32)
    return keys, positions[~pad], grads


def stored_rows(table: EmbeddingTable) -> np.ndarray:
    """Full rows [NUM_KEYS, row_width] of ALL_KEYS from export(), in ALL_KEYS order."""
    found: dict[int, np.ndarray] = {}
    for keys, rows in table.export(chunk_rows=7):
        found.update(zip(keys.tolist(), rows, strict=True))
    assert sorted(found) == sorted(ALL_KEYS.tolist())
    return np.stack([found[k] for k in ALL_KEYS.tolist()])


def assert_close(got: np.ndarray, want: np.ndarray, what: str, rtol: float = 0.0) -> None:
    """max |got - want| <= ATOL (+ rtol * |want| for optimizer state, whose sums of squares
    grow to where float32 rounding alone exceeds 1e-5)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    excess = np.abs(got - want) - (ATOL + rtol * np.abs(want))
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[worst] <= 0, (
        f"{what}: at {worst} got {got[worst]!r}, want {want[worst]!r}, "
        f"max abs diff {np.max(np.abs(got - want)):.3g} > {ATOL} (rtol {rtol})"
    )


def assert_spilled(table: EmbeddingTable, host_rows: int | None) -> None:
    """With a tiny budget the host tier really was too small for the table."""
    if host_rows is not None:
        stats = table.stats()
        assert stats["tiers"]["host"]["capacity_rows"] < NUM_KEYS
        assert stats["spilled"] > 0


# -- torch parity: every optimizer with a torch reference ----------------------------------

TORCH_CASES = [
    (f"{kind}{suffix}", config)
    for kind, cls in optim.OPTIMIZERS.items()
    if cls.torch_reference is not None
    for suffix, config in (("_default", cls()), ("", EXAMPLES[kind]))
]


@pytest.mark.parametrize("host_rows", [None, TINY_ROWS], ids=["roomy", "tiny_host"])
@pytest.mark.parametrize(
    "optimizer", [case[1] for case in TORCH_CASES], ids=[case[0] for case in TORCH_CASES]
)
def test_optimizer_matches_torch(
    store: EmbeddingStore, optimizer: optim.Optimizer, host_rows: int | None
) -> None:
    rng = np.random.default_rng(11)
    w0 = initial_weights(rng)
    table = make_table(store, optimizer, host_rows, w0)

    embedding = torch.nn.Embedding(NUM_KEYS, DIM, sparse=True)
    with torch.no_grad():
        embedding.weight.copy_(torch.from_numpy(w0))
    reference = TorchTwin(optimizer, embedding.weight)
    assert_close(table.lookup(ALL_KEYS), w0, "after assign")

    for step in range(1, STEPS + 1):
        keys, positions, grads = sparse_batch(rng)
        before = table.lookup(ALL_KEYS)
        table.apply_gradients(keys, grads, step)

        reference.zero_grad()
        out = embedding(torch.from_numpy(positions))
        (out * torch.from_numpy(grads[keys >= 0])).sum().backward()
        assert embedding.weight.grad.is_sparse
        reference.step(positions)

        after = table.lookup(ALL_KEYS)
        assert_close(after, embedding.weight.detach().numpy(), f"weights after step {step}")
        absent = np.setdiff1d(np.arange(NUM_KEYS), positions)
        assert absent.size >= 3
        np.testing.assert_array_equal(after[absent], before[absent])  # lazy: bit for bit

    assert_spilled(table, host_rows)
    rows = stored_rows(table)
    assert_close(rows[:, :DIM], embedding.weight.detach().numpy(), "exported weights")
    state = reference.state()
    assert len(state) == optimizer.size_factor - 1  # torch keeps the same state slots
    for slot, (name, theirs) in enumerate(
        zip(optimizer.torch_reference.state, state, strict=True), start=1
    ):
        got = rows[:, slot * DIM : (slot + 1) * DIM]
        assert_close(got, theirs, f"state slot {slot} ({name})", STATE_RTOL)


def test_adam_bias_correction_uses_the_step_passed_in(store: EmbeddingStore) -> None:
    """A row first updated at step 7 gets step 7's bias correction, as in SparseAdam, where
    the step counts optimizer steps, not updates of the row."""
    opt = optim.Adam(lr=0.1, beta1=0.8, beta2=0.9)
    w0 = np.zeros((NUM_KEYS, DIM), np.float32)
    table = make_table(store, opt, None, w0)
    g = np.full((1, DIM), 0.5, np.float32)
    table.apply_gradients(ALL_KEYS[:1], g, 7)
    m, v = 0.2 * 0.5, 0.1 * 0.25
    want = -0.1 * math.sqrt(1 - 0.9**7) / (1 - 0.8**7) * m / (math.sqrt(v) + 1e-8)
    assert_close(table.lookup(ALL_KEYS[:1]), np.full((1, DIM), want), "step 7")
    # the same gradient at step 1 moves the row by a different amount
    table.apply_gradients(ALL_KEYS[1:2], g, 1)
    first = -0.1 * math.sqrt(1 - 0.9) / (1 - 0.8) * m / (math.sqrt(v) + 1e-8)
    assert_close(table.lookup(ALL_KEYS[1:2]), np.full((1, DIM), first), "step 1")
    assert abs(first - want) > 1e-3


# -- FTRL ---------------------------------------------------------------------------


class FtrlOracle:
    """float64 transcription of TensorFlow's ApplyFtrl (training_ops.cc, FtrlOptimizer):

        accum_new = accum + g^2
        linear += g - (accum_new^(-lr_power) - accum^(-lr_power)) / lr * w
        quadratic = accum_new^(-lr_power) / lr + 2 * l2
        w = (sign(linear) * l1 - linear) / quadratic  if |linear| > l1  else 0
        accum = accum_new
    applied lazily (sparse apply) to the rows in the batch, gradients of repeats summed.

    `z_scale` sums, per value, the magnitudes that float32 rounding in the store acts on
    when it accumulates linear: |g| + (accum_new^p + accum^p) / lr * |w|. With lr = 1e-3
    and w0 ~ 0.5, linear passes through ~1e4 and float32 keeps only ~1e-3 of it, so linear is
    checked against ATOL + Z_RTOL * z_scale (a summation error bound) instead of ATOL alone."""

    def __init__(self, w0: np.ndarray, config: optim.FTRL) -> None:
        self.c = config
        self.w = w0.astype(np.float64)
        self.accum = np.full_like(self.w, config.initial_accumulator_value)
        self.linear = np.zeros_like(self.w)
        self.z_scale = np.zeros_like(self.w)

    def step(self, positions: np.ndarray, grads: np.ndarray) -> None:
        rows = np.unique(positions)
        g = np.zeros((rows.size, self.w.shape[1]))
        np.add.at(g, np.searchsorted(rows, positions), grads.astype(np.float64))
        c, power = self.c, -self.c.lr_power
        w, accum, linear = self.w[rows], self.accum[rows], self.linear[rows]
        accum_new = accum + g * g
        linear = linear + g - (accum_new**power - accum**power) / c.lr * w
        quadratic = accum_new**power / c.lr + 2.0 * c.l2
        self.z_scale[rows] += np.abs(g) + (accum_new**power + accum**power) / c.lr * np.abs(w)
        shrunk = np.where(np.abs(linear) > c.l1, (np.sign(linear) * c.l1 - linear) / quadratic, 0)
        self.w[rows], self.accum[rows], self.linear[rows] = shrunk, accum_new, linear


# The references of the optimizers torch has no counterpart of, by kind.
OTHER_REFERENCES = {"ftrl": FtrlOracle}

FTRL_CASES = [
    ("l1_l2", optim.FTRL(lr=0.1, l1=0.05, l2=0.02)),
    ("lr_power_-0.6", optim.FTRL(lr=0.1, lr_power=-0.6, l1=0.05, l2=0.02)),
    ("accum_0.5_big_l1", optim.FTRL(lr=0.3, l1=1.5, l2=0.1, initial_accumulator_value=0.5)),
    ("default", optim.FTRL()),
]


@pytest.mark.parametrize("host_rows", [None, TINY_ROWS], ids=["roomy", "tiny_host"])
@pytest.mark.parametrize(
    "optimizer", [case[1] for case in FTRL_CASES], ids=[case[0] for case in FTRL_CASES]
)
def test_ftrl_matches_tensorflow_transcription(
    store: EmbeddingStore, optimizer: optim.FTRL, host_rows: int | None
) -> None:
    rng = np.random.default_rng(17)
    w0 = initial_weights(rng)
    table = make_table(store, optimizer, host_rows, w0)
    oracle = FtrlOracle(w0, optimizer)
    zeros_seen = 0
    for step in range(1, STEPS + 1):
        keys, positions, grads = sparse_batch(rng)
        table.apply_gradients(keys, grads, step)
        oracle.step(positions, grads[keys >= 0])
        assert_close(table.lookup(ALL_KEYS), oracle.w, f"weights after step {step}")
        zeros_seen += int(np.count_nonzero(oracle.w == 0.0))

    if optimizer.l1 > 0:
        assert zeros_seen > 0  # the l1 branch (w = 0) was exercised
    assert_spilled(table, host_rows)
    rows = stored_rows(table)
    assert_close(rows[:, :DIM], oracle.w, "exported weights")
    assert_close(rows[:, DIM : 2 * DIM], oracle.accum, "accumulator n", STATE_RTOL)
    z_error = np.abs(rows[:, 2 * DIM :] - oracle.linear)
    z_bound = ATOL + Z_RTOL * oracle.z_scale
    assert np.all(z_error <= z_bound), f"linear z: worst error/bound {np.max(z_error / z_bound)}"
    if optimizer.lr >= 0.1:  # no large intermediates: the plain state tolerance holds
        assert_close(rows[:, 2 * DIM :], oracle.linear, "linear z", STATE_RTOL)


# -- defaults and validation ------------------------------------------------------------


def torch_default(cls: type, name: str) -> object:
    return inspect.signature(cls.__init__).parameters[name].default


# (kind, torch argument) whose torch default differs from ours by design: torch's momentum
# defaults to 0, which is plain SGD, and nesterov to False.
NOT_TORCH_DEFAULTS = {("momentum", "momentum"), ("nesterov", "momentum"), ("nesterov", "nesterov")}


@pytest.mark.parametrize(
    "cls",
    [cls for cls in optim.OPTIMIZERS.values() if cls.torch_reference is not None],
    ids=lambda cls: cls.kind,
)
def test_defaults_equal_torch(cls: type[optim.Optimizer]) -> None:
    reference = cls.torch_reference
    torch_class = getattr(torch.optim, reference.name)
    compared = 0
    for name, ours in reference.arguments(cls()).items():
        if (cls.kind, name) in NOT_TORCH_DEFAULTS:
            continue
        assert ours == torch_default(torch_class, name), f"{cls.__name__} argument {name!r}"
        compared += 1
    assert compared >= 1


def test_ftrl_defaults_equal_tensorflow() -> None:
    """tf.keras.optimizers.Ftrl: learning_rate=0.001, learning_rate_power=-0.5,
    initial_accumulator_value=0.1, l1/l2 regularization strength 0.0."""
    ftrl = optim.FTRL()
    assert (ftrl.lr, ftrl.lr_power, ftrl.initial_accumulator_value) == (1e-3, -0.5, 0.1)
    assert (ftrl.l1, ftrl.l2) == (0.0, 0.0)


def test_size_factor_and_state_fill() -> None:
    assert [c.size_factor for c in (optim.SGD, optim.Momentum, optim.Nesterov)] == [1, 2, 2]
    assert [c.size_factor for c in (optim.Adagrad, optim.Adam, optim.FTRL)] == [2, 3, 3]
    assert optim.SGD().state_fill() == ()
    assert optim.Momentum().state_fill() == (0.0,)
    assert optim.Adagrad(initial_accumulator_value=0.25).state_fill() == (0.25,)
    assert optim.Adam().state_fill() == (0.0, 0.0)
    assert optim.FTRL(initial_accumulator_value=0.3).state_fill() == (0.3, 0.0)
    for cls in optim.OPTIMIZERS.values():
        assert len(cls().state_fill()) == cls.size_factor - 1


# (class, field, bad value, the expected range as the message must spell it)
BAD_VALUES = [
    (optim.SGD, "lr", -0.1, "(0.0, inf]"),
    (optim.SGD, "lr", 0.0, "(0.0, inf]"),
    (optim.Momentum, "lr", -1.0, "(0.0, inf]"),
    (optim.Momentum, "momentum", 1.0, "(0.0, 1.0)"),
    (optim.Momentum, "momentum", -0.5, "(0.0, 1.0)"),
    (optim.Nesterov, "momentum", 1.0, "(0.0, 1.0)"),
    (optim.Nesterov, "lr", -0.01, "(0.0, inf]"),
    (optim.Adagrad, "lr", -0.01, "(0.0, inf]"),
    (optim.Adagrad, "eps", -1e-10, "[0.0, inf]"),
    (optim.Adagrad, "initial_accumulator_value", -0.1, "[0.0, inf]"),
    (optim.Adam, "lr", -1e-3, "(0.0, inf]"),
    (optim.Adam, "beta1", 1.0, "[0.0, 1.0)"),
    (optim.Adam, "beta1", -0.1, "[0.0, 1.0)"),
    (optim.Adam, "beta2", 1.0, "[0.0, 1.0)"),
    (optim.Adam, "beta2", 1.5, "[0.0, 1.0)"),
    (optim.Adam, "eps", 0.0, "(0.0, inf]"),
    (optim.RMSprop, "lr", -0.01, "(0.0, inf]"),
    (optim.RMSprop, "alpha", 1.0, "[0.0, 1.0)"),
    (optim.RMSprop, "alpha", -0.1, "[0.0, 1.0)"),
    (optim.RMSprop, "eps", 0.0, "(0.0, inf]"),
    (optim.FTRL, "lr", -0.1, "(0.0, inf]"),
    (optim.FTRL, "lr_power", 0.5, "[-inf, 0.0]"),
    (optim.FTRL, "l1", -0.1, "[0.0, inf]"),
    (optim.FTRL, "l2", -0.1, "[0.0, inf]"),
    (optim.FTRL, "initial_accumulator_value", -0.1, "[0.0, inf]"),
]


@pytest.mark.parametrize(
    ("cls", "field", "value", "interval"),
    BAD_VALUES,
    ids=[f"{c.__name__}.{f}={v}" for c, f, v, _ in BAD_VALUES],
)
def test_bad_value_names_field_range_and_value(
    cls: type, field: str, value: float, interval: str
) -> None:
    with pytest.raises(ValueError) as raised:
        cls(**{field: value})
    message = str(raised.value)
    assert f"'{field}'" in message
    assert interval in message
    assert repr(value) in message
    assert cls.__name__ in message


def all_fields() -> list[tuple[type, str]]:
    return [(cls, f.name) for cls in optim.OPTIMIZERS.values() for f in dataclasses.fields(cls)]


@pytest.mark.parametrize(
    ("cls", "field"), all_fields(), ids=[f"{c.__name__}.{f}" for c, f in all_fields()]
)
@pytest.mark.parametrize("value", [float("nan"), "0.1", True], ids=["nan", "str", "bool"])
def test_non_number_refused_naming_field_and_value(cls: type, field: str, value: object) -> None:
    with pytest.raises(ValueError) as raised:
        cls(**{field: value})
    message = str(raised.value)
    assert f"'{field}'" in message
    assert repr(value) in message


def expected_interval(cls: type, field: str) -> str:
    """The interval each field's message spells for an out-of-range value."""
    for c, f, _, interval in BAD_VALUES:
        if c is cls and f == field:
            return interval
    raise AssertionError(f"no range recorded for {cls.__name__}.{field}")


def test_nan_message_names_the_expected_range() -> None:
    """A NaN is a bad value like any other: its message names the field's range too, so the
    user learns what to pass. (Today check_finite runs first and says only "expected a
    finite number, got nan".)"""
    missing = []
    for cls, field in all_fields():
        with pytest.raises(ValueError) as raised:
            cls(**{field: float("nan")})
        if expected_interval(cls, field) not in str(raised.value):
            missing.append(f"{cls.__name__}.{field}: {raised.value}")
    assert not missing, "NaN messages without the expected range:\n" + "\n".join(missing)


def test_every_field_has_a_bad_value_case() -> None:
    covered = {(c, f) for c, f, _, _ in BAD_VALUES}
    assert set(all_fields()) <= covered


def test_boundary_values_accepted() -> None:
    optim.Adam(beta1=0.0)
    optim.Adagrad(eps=0.0, initial_accumulator_value=1e-45)  # float32's least subnormal
    optim.Adagrad(eps=1e-45, initial_accumulator_value=0.0)
    optim.Adam(eps=1e-45)
    optim.RMSprop(alpha=0.0, eps=1e-45)
    optim.FTRL(lr_power=-0.5, l2=0.1, initial_accumulator_value=0.0)  # l2 keeps it > 0
    optim.FTRL(lr_power=0.0, l1=0.0, l2=0.0, initial_accumulator_value=0.0)
    optim.FTRL(lr_power=-2.0)
    optim.Momentum(momentum=0.999)
