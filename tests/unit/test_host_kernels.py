"""The compiled host kernels (storage/host_kernels.py, and core/compiled.py's checks) against
the numpy array code on the same inputs: exact for index operations and initial rows; the
fused in-place train against optim.apply within test_kernels.py's derived float64 bound.
The CUDA kernels' twins (find, claim, upsert, find_rows, scatter, fused optimizers through
the Launcher) run in test_kernels.py under its "numba" backend."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.optimizers import each, kind_id
from tierps.core import init, optim
from tierps.core.codec import step_bits
from tierps.core.compiled import (
    ENV_SWITCH,
    all_distinct,
    distinct_nonnegative,
    first_non_finite_index,
    jit_kernel,
)
from tierps.core.config import TableConfig
from tierps.core.errors import InvalidArgumentError
from tierps.storage import EmbeddingStore, host_kernels
from tierps.storage.tiers import CacheTier, Spill

pytestmark = pytest.mark.skipif(
    host_kernels.host_launcher() is None,
    reason=f"host kernels unavailable: {host_kernels.unavailable_reason()}",
)


def _no_spill(spill: Spill) -> None:
    raise AssertionError(f"nothing should spill, got {spill.keys.size} rows")


def _tiers(config: TableConfig, keys: np.ndarray, rows: np.ndarray) -> tuple[CacheTier, ...]:
    """Two host tiers with the same rows: compiled kernels, and the numpy array code."""
    out = []
    for kernels in (None, False):
        tier = CacheTier(config, 1 << 22, kernels=kernels, trains_in_place=True)
        tier.insert(keys, rows, np.arange(keys.size) % 3 == 0, _no_spill)
        out.append(tier)
    assert out[0].compiled and not out[1].compiled
    return tuple(out)


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_lookup_matches_the_array_code(eviction: str) -> None:
    """find: the same hits, rows, dirty flags and eviction scores, misses and repeats in."""
    rng = np.random.default_rng(0)
    config = TableConfig("t", 8, optimizer=optim.Adam(), eviction=eviction)
    keys = rng.choice(10**12, 300, replace=False).astype(np.int64)
    rows = rng.standard_normal((300, config.stored_width), dtype=np.float32)
    compiled, reference = _tiers(config, keys, rows)  # the reference: pushes alike
    for _ in range(3):
        probe = np.concatenate([rng.choice(keys, 200), rng.integers(-5, 10**12, 50)])
        got, want = compiled.find(probe), reference.find(probe)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
        # a lookup's find into the caller's out: dim columns, padding zeroed, misses listed
        probe = np.concatenate([probe, [-1, -(2**63)]])
        outs = [np.full((probe.size, 8), np.nan, np.float32) for _ in range(2)]
        got = compiled.find_into(probe, outs[0], 8)[1]
        want = reference.find_into(probe, outs[1], 8)[1]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(outs[0], outs[1])
        assert np.isnan(outs[0][got]).all() and not np.isnan(np.delete(outs[0], got, 0)).any()
    assert (compiled.hits, compiled.misses) == (reference.hits, reference.misses)
    scores = [
        dict(
            zip(
                *t.index.export()[:1],
                t.index._scores[t.index.find(t.index.export()[0])],
                strict=True,
            )
        )
        for t in (compiled, reference)
    ]
    assert scores[0] == scores[1]


@pytest.mark.parametrize("spread", [1, 63, 64, 65, 10**6])  # span per key: bitmap or hash
@pytest.mark.parametrize("size", [1, 2, 1000])
def test_all_distinct_bitmap_and_hash_set_match_a_sort(size: int, spread: int) -> None:
    rng = np.random.default_rng(size * spread)
    base = 2**62 - size * spread - 1 if spread == 63 else 5  # far from 0 as well
    keys = base + rng.choice(size * spread, size, replace=False).astype(np.int64)
    keys[0], keys[-1] = base, base + size * spread - 1  # both ends of the span
    if size == 1:
        keys = keys[:1]
    cases = [keys]
    if size > 1:
        repeated = keys.copy()
        repeated[rng.integers(size)] = repeated[rng.integers(size)]  # may hit itself
        cases += [repeated, np.concatenate([keys, keys[-1:]]), np.concatenate([keys[:1], keys])]
    for case in cases:
        want = bool(np.unique(case).size == case.size)
        assert all_distinct(case) is want, (size, spread, case)


def test_all_distinct_matches_unique() -> None:
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 1000):
        keys = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
        assert all_distinct(keys) is (np.unique(keys).size == n)
        if n > 1:
            keys[-1] = keys[0]
            assert all_distinct(keys) is False
    extremes = np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).min + 1, -1, 0], np.int64)
    assert all_distinct(extremes)
    assert not all_distinct(np.repeat(extremes[:1], 2))


def test_distinct_nonnegative_is_distinct_and_no_key_below_zero() -> None:
    """distinct_nonnegative: all_distinct's answer, and False for any key < 0, over dense
    spans (the bitmap) and sparse ones (the hash set), up to int64's ends."""
    rng = np.random.default_rng(2)
    top = np.iinfo(np.int64).max
    for keys in (
        np.arange(1000, dtype=np.int64),
        rng.choice(10**6, 1000, replace=False).astype(np.int64),
        rng.integers(0, top, 1000, dtype=np.int64),
        np.array([0, top], np.int64),
        np.empty(0, np.int64),
    ):
        assert distinct_nonnegative(keys) is (np.unique(keys).size == keys.size)
        if keys.size:
            assert distinct_nonnegative(np.concatenate([keys, keys[-1:]])) is False
            assert distinct_nonnegative(np.concatenate([keys, [-1]])) is False
    assert distinct_nonnegative(np.array([np.iinfo(np.int64).min, top], np.int64)) is False


@pytest.mark.parametrize("optimizer", each(), ids=kind_id)
def test_uniform_initial_rows_are_the_numpy_bits(optimizer: optim.Optimizer) -> None:
    """Initial rows at compiled speed: bit for bit the numpy counter-hash reference (a pure
    function of seed, key and column), the optimizer state filled as initial_rows does."""
    rng = np.random.default_rng(2)
    keys = np.concatenate([rng.integers(-(2**62), 2**62, 500), [0, -1, 2**63 - 1]])
    for initializer in (init.Uniform(), init.Uniform(-3.0, 1e-3), init.Uniform(1.0, 1.0 + 1e-6)):
        config = TableConfig("t", 12, optimizer=optimizer, initializer=initializer, seed=9)
        got = host_kernels.initial_rows(config, keys)
        np.testing.assert_array_equal(got, config.initial_rows(keys))
        weights = initializer.generate(keys, 12, 9)
        np.testing.assert_array_equal(got[:, :12], weights)
        for slot, fill in enumerate(optimizer.state_fill(), start=1):
            np.testing.assert_array_equal(got[:, slot * 12 : (slot + 1) * 12], np.float32(fill))
        assert got.shape == (keys.size, config.row_width)


def _same_tier(made: CacheTier, reference: CacheTier) -> None:
    """Two host tiers hold the same rows (bit for bit), flags, free rows and index."""
    assert made._high == reference._high
    high = made._high
    assert made.arena[:high].tobytes() == reference.arena[:high].tobytes()
    np.testing.assert_array_equal(made.dirty[:high], reference.dirty[:high])
    np.testing.assert_array_equal(made._free, reference._free)
    for ours, theirs in zip(made.index.saved(), reference.index.saved(), strict=True):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("steps", [0, 4])
@pytest.mark.parametrize("optimizer", each(), ids=kind_id)
def test_insert_initial_stores_what_insert_of_the_initial_rows_stores(
    optimizer: optim.Optimizer, steps: int
) -> None:
    """CacheTier.insert_initial (the compiled initializer writing each row straight into
    the arena) against insert of the numpy initial rows on a twin tier: the same arena
    bits, dirty flags, free rows, index (keys, row ids, scores) and weights handed back,
    both into never used rows (whose zero state slots it leaves unwritten) and into rows
    freed after training (non-zero state, which it must write over), in one call."""
    config = TableConfig("t", 16, optimizer=optimizer, steps_to_live=steps, seed=5)
    stamp = step_bits(7) if steps else None

    def initial(keys: np.ndarray) -> np.ndarray:  # the reference: as the cascade makes them
        return config.codec.widen(config.initial_rows(keys), 7 if steps else None)

    rng = np.random.default_rng(6)
    keys = rng.choice(10**12, 450, replace=False).astype(np.int64)
    first, second = keys[:300], keys[300:]
    made, reference = (CacheTier(config, 1 << 22, trains_in_place=True) for _ in range(2))
    assert made.can_insert_initial(first.size) and made.compiled
    out = np.full((first.size, 16), np.nan, np.float32)
    made.insert_initial(first, out, stamp)
    reference.insert(first, initial(first), np.ones(first.size, bool), _no_spill)
    assert out.tobytes() == initial(first)[:, :16].tobytes()  # a copy, not the arena's
    _same_tier(made, reference)
    grads = rng.standard_normal((first.size, 16), dtype=np.float32)
    for tier in (made, reference):  # every state slot moves off its fill
        hit, _, refused = tier.train_resident(first, grads, 1, 9 if steps else None)
        assert hit.size == first.size and refused is None
        assert tier.remove(first[::3]) == 100  # freed: reused before never used rows
    out = np.full((second.size, 16), np.nan, np.float32)  # 100 freed rows and 50 new
    made.insert_initial(second, out, stamp)
    reference.insert(second, initial(second), np.ones(second.size, bool), _no_spill)
    assert out.tobytes() == initial(second)[:, :16].tobytes()
    _same_tier(made, reference)
    hit, rows, dirty = made.find(second)
    assert hit.size == second.size and dirty.all()
    assert rows.tobytes() == initial(second).tobytes()  # the reused rows' state is fresh


def _float64_bound(opt: optim.Optimizer, rows: np.ndarray, grads: np.ndarray) -> list:
    from tests.unit.test_kernels import _float64_step  # the derived float64 reference

    return _float64_step(opt, rows, grads, 3)


@pytest.mark.parametrize(
    "optimizer",
    [*each(), optim.FTRL(lr=0.05, lr_power=-0.3, l2=0.1)],
    ids=lambda o: f"{o.kind}{'-power' if getattr(o, 'lr_power', -0.5) != -0.5 else ''}",
)
def test_train_in_place_matches_apply(optimizer: optim.Optimizer) -> None:
    """train_resident on the compiled tier: within the derived float64 bound of the update,
    the same as the array code's on its gathered rows, stamped, dirty, other rows alike."""
    from tests.unit.test_kernels import assert_within

    rng = np.random.default_rng(3)
    dim = 8
    config = TableConfig("t", dim, optimizer=optimizer, steps_to_live=10)
    keys = np.arange(100, dtype=np.int64) * 7919
    rows = config.initial_rows(keys)
    rows[:, :dim] = rng.standard_normal((100, dim), dtype=np.float32)
    stored = np.concatenate([rows, np.zeros((100, 2), np.float32)], axis=1)
    compiled, reference = _tiers(config, keys, stored)
    push = rng.permutation(keys)[:60]
    grads = rng.standard_normal((60, dim), dtype=np.float32)
    before = compiled.find(push)[1]
    hit, undo, refused = compiled.train_resident(push, grads, 3, 5)
    # an undo even when every key trained here: another table of the push may still fail
    assert hit.size == 60 and undo is not None and refused is None
    r_hit, _, r_refused = reference.train_resident(push, grads, 3, 5)
    assert r_hit.size == 60 and r_refused is None
    got, want = compiled.find(push), reference.find(push)
    width = config.row_width
    expected = _float64_bound(optimizer, before[:, :width], grads)
    assert_within(f"compiled {optimizer.kind}", got[1][:, :width], expected)
    assert_within(f"numpy {optimizer.kind}", want[1][:, :width], expected)
    np.testing.assert_array_equal(got[1][:, width:], want[1][:, width:])  # the stamp
    assert got[2].all() and want[2].all()
    rest = np.setdiff1d(keys, push)
    np.testing.assert_array_equal(compiled.find(rest)[1], stored[np.isin(keys, rest)])
    undo()
    np.testing.assert_array_equal(compiled.find(push)[1], before)


def test_refused_train_changes_nothing_and_undo_puts_rows_back() -> None:
    """A push whose update goes non-finite in a late row leaves every row as it was (the
    rows before it are put back); a partial push's undo restores rows, stamps and flags."""
    dim = 4
    config = TableConfig("t", dim, optimizer=optim.Adam(), steps_to_live=10)
    keys = np.arange(50, dtype=np.int64)
    stored = np.concatenate([config.initial_rows(keys), np.zeros((50, 2), np.float32)], axis=1)
    compiled, _ = _tiers(config, keys, stored)
    snapshot = compiled.find(keys)
    grads = np.full((50, dim), 1e-3, np.float32)
    grads[40, 2] = 1e20  # v = (1 - beta2) * g * g overflows float32
    hit, undo, refused = compiled.train_resident(keys, grads, 1, 1)
    assert undo is None and refused is not None and not np.isfinite(refused[40]).all()
    assert np.isfinite(refused[:40]).all()
    after = compiled.find(keys)
    np.testing.assert_array_equal(after[1].view(np.uint32), snapshot[1].view(np.uint32))
    np.testing.assert_array_equal(after[2], snapshot[2])
    partial = np.concatenate([keys[:10], [1000, 1001]])
    hit, undo, refused = compiled.train_resident(partial, np.ones((12, dim), np.float32), 1, 7)
    assert hit.tolist() == list(range(10)) and undo is not None and refused is None
    assert not np.array_equal(compiled.find(keys[:10])[1], snapshot[1][:10])
    undo()
    again = compiled.find(keys)
    np.testing.assert_array_equal(again[1].view(np.uint32), snapshot[1].view(np.uint32))
    np.testing.assert_array_equal(again[2], snapshot[2])


def test_refused_train_among_missing_keys_counts_and_touches_every_hit() -> None:
    """The compiled pass finds its rows by key: a refusal mid-pass among keys not held
    names the hits in order (those after the refused one too), puts every row back, and
    counts and touches each hit once (LFU: +1), as the array code's find-then-train does."""
    dim = 4
    config = TableConfig("t", dim, optimizer=optim.Adam(), eviction="lfu")
    keys = np.arange(0, 100, 2, dtype=np.int64)
    stored = config.initial_rows(keys)
    tiers = _tiers(config, keys, stored)
    push = np.array([1, 0, 2, 3, 4, 5, 6, 7, 8, 9], np.int64)  # odd keys are not held
    grads = np.full((push.size, dim), 1e-3, np.float32)
    grads[4, 1] = 1e20  # key 4: v = (1 - beta2) * g * g overflows float32
    held = push[push % 2 == 0]
    for tier in tiers:
        snapshot = tier.find(keys)
        scores = tier.index._scores[tier.index.find(held)].copy()
        hits = tier.hits
        hit, undo, refused = tier.train_resident(push, grads, 1, None)
        assert hit.tolist() == [1, 2, 4, 6, 8] and undo is None and refused is not None
        rows_left = np.flatnonzero(~np.isfinite(refused).all(axis=1))
        assert rows_left.tolist() == [2]  # key 4, the third hit
        assert tier.hits - hits == held.size
        assert (tier.index._scores[tier.index.find(held)] - scores).tolist() == [1] * held.size
        after = tier.find(keys)
        np.testing.assert_array_equal(after[1].view(np.uint32), snapshot[1].view(np.uint32))
        np.testing.assert_array_equal(after[2], snapshot[2])


def _dim_beside_the_stream_threshold(optimizer: optim.Optimizer, streamed: bool) -> int:
    """The dim nearest the training loop's threshold on the side asked: it saves the row_width
    floats of a row (a push without a stamp) by non-temporal stores when they are
    TRAIN_STREAM_BYTES or more. Dims of 16 floats: rows of whole cache lines, which
    _streams takes; only the threshold then decides."""
    dims = range(16, host_kernels.TRAIN_STREAM_BYTES, 16)
    side = [
        dim
        for dim in dims
        if (
            4 * TableConfig("t", dim, optimizer=optimizer).row_width
            >= host_kernels.TRAIN_STREAM_BYTES
        )
        is streamed
    ]
    return side[0] if streamed else side[-1]


@pytest.mark.parametrize(
    ("optimizer", "streamed"),
    [(optim.Adam(lr=0.01), True), (optim.SGD(lr=1.0), False)],
    ids=["adam-streamed", "sgd-plain"],
)
def test_a_large_push_saves_its_rows_streamed_or_not(
    optimizer: optim.Optimizer, streamed: bool
) -> None:
    """A push whose saved values reach STREAM_BYTES: rows of TRAIN_STREAM_BYTES or more are
    saved by non-temporal stores, narrower ones (here just narrower) by plain stores, as
    the kernel's own checks of its backup say. Either way a push refused mid-batch (Adam:
    v from a 1e20 gradient overflows; SGD: -3e38 - 3e38) leaves every row and flag as it
    was, bit for bit; an accepted one lands within the float64 bound of the update, as
    the numpy reference does; a partial push's undo puts every row back."""
    from tests.unit.test_kernels import _float64_step, assert_within

    rng = np.random.default_rng(12)
    dim = _dim_beside_the_stream_threshold(optimizer, streamed)
    config = TableConfig("t", dim, optimizer=optimizer)
    touched = config.row_width  # the floats the training loop saves a row (no stamp)
    n = host_kernels.STREAM_BYTES // (4 * touched) + 7
    keys = rng.choice(10**12, n, replace=False).astype(np.int64)
    rows = config.initial_rows(keys)
    rows[:, :dim] = rng.standard_normal((n, dim), dtype=np.float32)
    push = rng.permutation(keys)
    bad = 2 * n // 3
    rows[keys == push[bad], :dim] = -3e38  # finite; SGD's step below takes it past float32
    compiled, reference = (
        CacheTier(config, 1 << 27, kernels=k, trains_in_place=True) for k in (None, False)
    )
    for tier in (compiled, reference):
        tier.insert(keys, rows, np.arange(n) % 3 == 0, _no_spill)
    grads = rng.standard_normal((n, dim), dtype=np.float32)
    spoiled = grads.copy()
    spoiled[bad] = 1e20 if isinstance(optimizer, optim.Adam) else 3e38

    def state() -> tuple[np.ndarray, np.ndarray]:
        return compiled.arena[:n].view(np.uint32).copy(), compiled.dirty[:n].copy()

    before = state()
    _, undo, refused = compiled.train_resident(push, spoiled, 1, None)
    assert undo is None and refused is not None
    assert np.flatnonzero(~np.isfinite(refused).all(axis=1)).tolist() == [bad]
    for got, want in zip(state(), before, strict=True):
        np.testing.assert_array_equal(got, want)
    width = config.row_width
    expected = _float64_step(optimizer, reference.find(push)[1][:, :width], grads, 1)
    for tier in (compiled, reference):
        hit, _, refused = tier.train_resident(push, grads, 1, None)
        assert hit.size == n and refused is None
        assert_within(f"{tier.compiled}", tier.find(push)[1][:, :width], expected)
    trained = state()
    backup = compiled._scratch_rows(n, touched)  # where the training loop saved the rows
    stream = bool(host_kernels._streams(backup, touched))  # the kernel's own checks
    assert (touched * 4 >= host_kernels.TRAIN_STREAM_BYTES and stream) is streamed
    assert stream  # so that the plain case is plain by the threshold alone
    partial = np.concatenate([push, [10**13]])  # one key not here: an undo is returned
    hit, undo, refused = compiled.train_resident(
        partial, np.ones((n + 1, dim), np.float32), 2, None
    )
    assert hit.size == n and undo is not None and refused is None
    assert not np.array_equal(state()[0], trained[0])
    undo()
    for got, want in zip(state(), trained, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_table_push_refused_in_place_names_the_key(tmp_path: Path) -> None:
    """Through EmbeddingTable: the host tier trains in place, and a refusal names the key."""
    with EmbeddingStore(tmp_path / "s") as store:
        table = store.create_table(TableConfig("t", 4, optimizer=optim.Adam()))
        keys = np.arange(20, dtype=np.int64)
        table.lookup(keys)
        assert table.tiers[0].trains_in_place
        before = table.lookup(keys)
        grads = np.full((20, 4), 1e-3, np.float32)
        grads[13, 0] = 1e20
        with pytest.raises(InvalidArgumentError, match="key 13"):
            table.apply_gradients(keys, grads, 1)
        np.testing.assert_array_equal(table.lookup(keys), before)


def test_rocksdb_reads_only_keys_in_the_stored_range(tmp_path: Path) -> None:
    """The RocksDB tier skips keys outside the range of keys ever written: empty at first,
    widened by writes, read again from the column family after a restart."""
    config = TableConfig("t", 4, optimizer=optim.SGD(), host_cache_bytes=0)
    with EmbeddingStore(tmp_path / "s") as store:
        table = store.create_table(config)
        durable = table.durable
        probe = np.array([5, 50, 500], np.int64)
        assert durable.may_hold(probe).tolist() == [False, False, False]
        table.assign(np.array([10, 100], np.int64), np.ones((2, 4), np.float32))
        assert durable.may_hold(probe).tolist() == [False, True, False]
        assert durable.find(np.array([10, 50, 100, 7], np.int64))[0].tolist() == [0, 2]
    with EmbeddingStore(tmp_path / "s") as store:
        durable = store.table("t").durable
        assert durable.may_hold(np.array([9, 10, 100, 101], np.int64)).tolist() == [
            False,
            True,
            True,
            False,
        ]
        assert durable.may_hold(np.array([10, 100], np.int64)) is None  # all within


def test_env_switch_keeps_the_array_code() -> None:
    """TIERPS_HOST_KERNELS=0: the host tier runs the numpy reference (no compiled path)."""
    code = (
        "from tierps.storage.hash_table import HashTable; "
        "from tierps.core.compiled import all_distinct; "
        "assert not HashTable(16).uses_kernels; "
        "assert all_distinct(__import__('numpy').arange(3)) is None"
    )
    env = {**os.environ, ENV_SWITCH: "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


# Trains one row with SGD, then with Momentum, through their compiled loops; prints the
# rows and each loop's (cache hits, misses).
_TRAIN_TWO = """
import numpy as np
from tierps.core import optim
from tierps.storage import host_kernels
out = []
for optimizer in (optim.SGD(lr=0.5), optim.Momentum(lr=0.5, momentum=0.5)):
    train, hyper = host_kernels.fused_trainer(optimizer, 1)
    size = optimizer.size_factor
    arena = np.ones((1, 2 * size), np.float32)
    args = (np.zeros(1, np.int64), np.ones((1, 2), np.float32), hyper, size, True,
            np.empty((1, 2 * size), np.float32), np.empty(1, bool), np.empty(0, np.float32),
            False, 2 * size, np.zeros(1, bool))
    assert train(arena, *args) == -1
    stats = train.stats
    out.append((arena.tolist(), sum(stats.cache_hits.values()), sum(stats.cache_misses.values())))
print(out)
"""


@pytest.mark.slow  # a subprocess
def test_each_training_loop_is_cached_on_disk_apart(tmp_path: Path) -> None:
    """The training loops, one compiled copy per optimizer kernel, load from numba's disk
    cache in a second process (no compile), each its own: SGD's loop is not loaded for
    Momentum's."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    first, second = (
        ast.literal_eval(
            subprocess.run(
                [sys.executable, "-c", _TRAIN_TWO],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for _ in range(2)
    )
    # SGD: w = 1 - 0.5 * 1. Momentum: b = 0.5 * 1 + 1, w = 1 - 0.5 * b.
    rows = [[[0.5, 0.5]], [[0.25, 0.25, 1.5, 1.5]]]
    assert [trained for trained, _, _ in first] == [trained for trained, _, _ in second] == rows
    assert [(hits, misses) for _, hits, misses in first] == [(0, 1), (0, 1)]
    assert [(hits, misses) for _, hits, misses in second] == [(1, 0), (1, 0)]


def test_no_writable_cache_compiles_in_memory_and_warns_once(monkeypatch) -> None:
    """A kernel numba cannot cache (no locator: here, source without a file, as for a
    read-only install without a writable user cache) still compiles, with one warning."""
    import numba

    monkeypatch.setattr(numba.config, "CACHE_DIR", "")  # as without NUMBA_CACHE_DIR
    monkeypatch.setattr("tierps.core.compiled._cache_warned", False)
    namespace: dict = {}
    exec(compile("def twice(x):\n    return 2 * x\n", "<no file>", "exec"), namespace)  # noqa: S102
    exec(compile("def thrice(x):\n    return 3 * x\n", "<no file>", "exec"), namespace)  # noqa: S102
    with pytest.warns(RuntimeWarning, match="no writable numba cache") as caught:
        twice = jit_kernel(namespace["twice"])
        thrice = jit_kernel(namespace["thrice"])
    assert len(caught) == 1
    assert (twice(21), thrice(2)) == (42, 6)


def test_large_lookups_stream_the_same_rows_as_the_array_code() -> None:
    """An output of STREAM_BYTES or more is written by non-temporal stores where its rows
    are whole cache lines, else by plain copies: the same rows either way, as the array
    code's, for an aligned buffer, one 4 bytes off alignment and rows of 12 bytes."""
    rng = np.random.default_rng(5)
    for dim in (64, 3):
        config = TableConfig("t", dim, optimizer=optim.SGD())
        n = host_kernels.STREAM_BYTES // (4 * dim) + 7
        keys = rng.choice(10**12, n, replace=False).astype(np.int64)
        rows = rng.standard_normal((n, config.stored_width), dtype=np.float32)
        compiled, reference = (
            CacheTier(config, 1 << 28, kernels=kernels) for kernels in (None, False)
        )
        for tier in (compiled, reference):
            tier.insert(keys, rows, np.zeros(n, bool), _no_spill)
        probe = rng.permutation(np.concatenate([keys, [-1, 10**13]]))
        want = np.zeros((probe.size, dim), np.float32)
        reference.find_into(probe, want, dim)
        buffer = host_kernels.aligned_empty(1, probe.size * dim + 1)[0]
        buffer[:] = np.nan
        for offset in (0, 1):  # on a cache line, then 4 bytes off
            out = buffer[offset : offset + probe.size * dim].reshape(probe.size, dim)
            streamed = dim == 64 and offset == 0
            assert host_kernels._streams(out, dim) is streamed
            written, missed = compiled.find_into(probe, out, dim)
            assert written is out
            assert probe[missed].tolist() == [10**13]
            out[missed] = 0.0
            np.testing.assert_array_equal(out, want)
        slots, found, _, _ = compiled.index.lookup_rows(probe, compiled.arena, compiled.dirty)
        hit = slots >= 0
        np.testing.assert_array_equal(found[hit, :dim], want[hit])


def test_first_non_finite_matches_numpy() -> None:
    """validation.first_non_finite at compiled speed: the first inf or NaN in row-major
    order, as numpy's isfinite and argwhere find it, for any shape and placement (and
    another dtype, which numpy checks)."""
    from tierps.core.validation import first_non_finite

    rng = np.random.default_rng(6)
    shapes = [(0, 4), (1, 1), (3, 5), (100, 64), (999, 7), (300,), (7, 3, 2)]
    for shape, dtype in [*((shape, np.float32) for shape in shapes), ((9, 4), np.float64)]:
        values = rng.uniform(-3e38, 3e38, shape).astype(dtype)  # x - x stays 0
        assert first_non_finite(values) is None
        for bad in (np.inf, -np.inf, np.nan) if values.size else ():
            for _ in range(10):
                spoiled = values.copy()
                spoiled.flat[rng.integers(values.size, size=2)] = bad
                want = np.argwhere(~np.isfinite(spoiled))[0]
                assert first_non_finite(spoiled) == tuple(int(i) for i in want)
    assert first_non_finite_index(np.ones((2, 2), np.float32)) == -1


def test_training_scratch_grows_is_kept_and_shrinks() -> None:
    """train_resident saves into the tier's scratch: grown to a push's need (or twice the
    last size), kept for the next, shrunk to twice the need after SCRATCH_SHRINK_CALLS
    small pushes in a row, shown as scratch_bytes beside the budgeted bytes; a refused
    push still changes nothing (test_train_in_place_matches_apply checks the values)."""
    from tierps.storage.tiers import SCRATCH_SHRINK_CALLS

    config = TableConfig("t", 8, optimizer=optim.Adam(lr=0.01))
    rng = np.random.default_rng(7)
    keys = np.arange(1, 401, dtype=np.int64)
    rows = config.initial_rows(keys)
    compiled = _tiers(config, keys, rows)[0]
    floats = config.row_width  # saved per trained row (no step slots)
    budgeted = compiled.stats()["bytes"]

    def push(batch: np.ndarray, step: int) -> None:
        grads = rng.standard_normal((batch.size, 8), dtype=np.float32)
        hit, _, refused = compiled.train_resident(batch, grads, step, None)
        assert hit.size == batch.size and refused is None

    push(keys[:300], 1)
    assert compiled.stats()["scratch_bytes"] == 300 * floats * 4
    assert compiled.stats()["bytes"] == budgeted
    push(keys[:310], 2)  # grows to twice the last size
    assert compiled.stats()["scratch_bytes"] == 600 * floats * 4
    for step in range(3, 3 + SCRATCH_SHRINK_CALLS):
        push(keys[step : step + 10], step)
    assert compiled.stats()["scratch_bytes"] == 20 * floats * 4
    before = compiled.arena.copy(), compiled.dirty.copy()
    grads = np.ones((100, 8), np.float32)
    grads[60] = 1e30  # v = g * g overflows: refused, every row put back
    _, undo, refused = compiled.train_resident(keys[:100], grads, 99, None)
    assert refused is not None and undo is None
    np.testing.assert_array_equal(compiled.arena, before[0])
    np.testing.assert_array_equal(compiled.dirty, before[1])
    compiled.close()
    assert compiled.arena is None
