"""One contract suite, run against every tier set-up: all must hold the same rows and
optimizer state as an unbounded in-memory reference written here with per-key loops."""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import export_dict
from tests.optimizers import EXAMPLES, each, kind_id
from tierps.core.xp import gpu_module
from tierps.storage import EmbeddingStore, TableConfig, init, optim
from tierps.storage.fallbacks import Answer, RowOrigin, Stateless
from tierps.storage.tiers import host_rows_for_budget

DIM = 8
UNIVERSE = 300  # distinct keys the trace draws from
BATCH = 40
STEPS = 300
CAPACITY = UNIVERSE + 20  # direct set-ups: keys in [0, CAPACITY), probes included


class ReferenceTable:
    """Unbounded dict model: key -> full row (weights | optimizer state)."""

    def __init__(self, config: TableConfig, refuse_above: int | None = None) -> None:
        self.config = config
        self.rows: dict[int, np.ndarray] = {}
        self.refuse_above = refuse_above  # keys above it without a row: default_value only

    def sync(self, keys: np.ndarray) -> None:
        """Called before the table serves each call of the trace (ColdReference reads the
        table's rows there); nothing to do for an exact reference."""

    def _refused(self, key: int) -> bool:
        return self.refuse_above is not None and key > self.refuse_above and key not in self.rows

    def _row(self, key: int) -> np.ndarray:
        if key in self.rows:
            return self.rows[key].copy()
        return self.config.initial_rows(np.array([key], dtype=np.int64))[0]

    def lookup(self, keys: np.ndarray, create: bool) -> np.ndarray:
        out = np.zeros((keys.size, self.config.dim), dtype=np.float32)
        for i, key in enumerate(keys.tolist()):
            if key < 0:
                continue
            if self._refused(key):
                out[i] = self.config.default_value
                continue
            row = self._row(key)
            if create:
                self.rows.setdefault(key, row)
            out[i] = row[: self.config.dim]
        return out

    def apply_gradients(self, keys: np.ndarray, grads: np.ndarray, step: int) -> None:
        summed: dict[int, np.ndarray] = {}
        for key, grad in zip(keys.tolist(), grads, strict=True):
            if key >= 0:
                summed[key] = summed.get(key, np.zeros(self.config.dim, np.float32)) + grad
        for key, grad in summed.items():
            if self._refused(key):
                continue
            row = self._row(key)[None, :]
            self.config.optimizer.apply(row, grad[None, :], step)
            self.rows[key] = row[0]

    def assign(self, keys: np.ndarray, values: np.ndarray) -> None:
        for key, value in zip(keys.tolist(), values, strict=True):
            if key >= 0:
                self.rows[key] = self.config.initial_rows(np.array([key]), value[None, :])[0]


def row_bytes(optimizer: optim.Optimizer) -> int:
    return 4 * DIM * optimizer.size_factor


SETUPS = {
    # every row fits in the host tier
    "roomy": dict(host_cache_bytes=64 << 20),
    # a budget for ~6 rows: every batch of 40 spills to RocksDB
    "tiny": dict(host_cache_bytes=-6),
    # no host tier at all
    "no_host": dict(host_cache_bytes=0),
    "tiny_lfu": dict(host_cache_bytes=-6, eviction="lfu"),
    "write_through": dict(host_cache_bytes=-50, write_policy="write_through"),
    # no hash table: row i of a preallocated arena holds key i; the host budget (0 here)
    # does not apply, every row stays in memory
    "direct": dict(host_cache_bytes=0, use_hashtable=False, capacity=CAPACITY),
    "direct_write_through": dict(
        use_hashtable=False, capacity=CAPACITY, write_policy="write_through"
    ),
}
# The GPU tier on top (gpu_cache_bytes < 0: a budget in rows). Run on numpy arrays (the same
# tier code) everywhere, and on cupy where a GPU is usable.
GPU_SETUPS = {
    # every row fits on the GPU
    "gpu_roomy": dict(gpu_cache_bytes=64 << 20),
    # ~8 rows on the GPU over a roomy host tier: GPU rows, dirty ones too, evicted every batch
    "gpu_tiny": dict(gpu_cache_bytes=-8, host_cache_bytes=64 << 20),
    # ~8 on the GPU over ~20 on the host: rows travel through all three tiers
    "gpu_tiny_host_tiny": dict(gpu_cache_bytes=-8, host_cache_bytes=-20),
    "gpu_no_host": dict(gpu_cache_bytes=-30, host_cache_bytes=0),
    "gpu_lfu": dict(gpu_cache_bytes=-8, host_cache_bytes=-20, eviction="lfu"),
    "gpu_write_through": dict(gpu_cache_bytes=-30, write_policy="write_through"),
    "gpu_direct": dict(gpu_cache_bytes=-8, use_hashtable=False, capacity=CAPACITY),
    "gpu_steps": dict(gpu_cache_bytes=-8, host_cache_bytes=-20, steps_to_live=10_000),
}
OPTIMIZERS = each()  # one of every registered optimizer
# The fast loop (-m "not slow") runs every set-up with SGD and Adam, and every optimizer on
# one set-up of each kind; the default run, all of them.
FAST_OPTIMIZERS = ("sgd", "adam")


def setup_by_optimizer(setups: list[str], every_optimizer_on: str) -> list[pytest.param]:
    """Each (set-up, optimizer) pair, those outside the fast loop's share marked slow."""
    return [
        pytest.param(
            setup,
            optimizer,
            id=f"{setup}-{optimizer.kind}",
            marks=()
            if optimizer.kind in FAST_OPTIMIZERS or setup == every_optimizer_on
            else pytest.mark.slow,
        )
        for setup in setups
        for optimizer in OPTIMIZERS
    ]


def make_config(setup: str, optimizer: optim.Optimizer) -> TableConfig:
    options = dict({**SETUPS, **GPU_SETUPS}[setup])
    stored = row_bytes(optimizer) + (8 if options.get("steps_to_live") else 0)
    for budget_field in ("host_cache_bytes", "gpu_cache_bytes"):
        if options.get(budget_field, 0) < 0:  # a budget in rows: the bytes that hold them
            want = -options[budget_field]
            budget = want * stored
            while host_rows_for_budget(budget, stored) < want:
                budget += 64
            options[budget_field] = budget
    return TableConfig(
        "t", DIM, initializer=init.Normal(0.0, 0.1), optimizer=optimizer, seed=7, **options
    )


def gpu_arrays_or_skip(arrays: str) -> str:
    """The store's gpu_arrays for a test run on `arrays` ("numpy" or "cupy")."""
    if arrays == "cupy":
        module, why = gpu_module()
        if module is None:
            pytest.skip(f"GPU tier on cupy: {why}")
        return "auto"
    return "numpy"


def run_trace(table, reference: ReferenceTable, seed: int) -> None:
    rng = np.random.default_rng(seed)
    step = 0
    for i in range(STEPS):
        keys = rng.zipf(1.3, BATCH).astype(np.int64) % UNIVERSE
        keys[rng.random(BATCH) < 0.05] = -1  # padding
        op = rng.choice(["lookup", "eval", "apply", "apply", "assign"])
        reference.sync(keys)
        if op in ("lookup", "eval"):
            create = op == "lookup"
            got = table.lookup(keys, create=create)
            np.testing.assert_allclose(
                got, reference.lookup(keys, create), atol=1e-6, err_msg=f"step {i} {op}"
            )
        elif op == "apply":
            step += 1
            grads = rng.normal(size=(BATCH, DIM)).astype(np.float32)
            table.apply_gradients(keys, grads, step)
            reference.apply_gradients(keys, grads, step)
        else:
            values = rng.normal(size=(BATCH, DIM)).astype(np.float32)
            table.assign(keys, values)
            reference.assign(keys, values)
        if i % 97 == 0:
            table.flush()


def assert_same_rows(table, reference: ReferenceTable) -> None:
    stored = export_dict(table)
    assert sorted(stored) == sorted(reference.rows)
    for key, row in reference.rows.items():
        np.testing.assert_allclose(stored[key], row, atol=1e-6, err_msg=f"key {key}")


@pytest.mark.parametrize(("setup", "optimizer"), setup_by_optimizer(list(SETUPS), "tiny"))
def test_setup_matches_unbounded_reference(
    tmp_path: Path, setup: str, optimizer: optim.Optimizer
) -> None:
    config = make_config(setup, optimizer)
    reference = ReferenceTable(config)
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        run_trace(table, reference, seed=zlib.crc32(setup.encode()) % 1000)
        tiers = table.stats()["tiers"]
        if not config.use_hashtable:
            assert list(tiers) == ["direct", "rocksdb"]
            assert tiers["direct"]["rows"] == len(reference.rows)  # nothing is ever evicted
            assert tiers["direct"]["capacity_rows"] == CAPACITY
        elif config.host_cache_bytes == 0:
            assert list(tiers) == ["rocksdb"]
        else:
            assert tiers["host"]["rows"] <= tiers["host"]["capacity_rows"]
            assert tiers["host"]["bytes"] <= config.host_cache_bytes
        assert_same_rows(table, reference)
        probe = np.arange(-2, UNIVERSE + 20, dtype=np.int64)
        before = table.lookup(probe, create=False)
    with EmbeddingStore(tmp_path / "db") as reopened:
        table = reopened.table("t")
        assert table.config == config
        np.testing.assert_array_equal(table.lookup(probe, create=False), before)
        assert_same_rows(table, reference)


@pytest.mark.parametrize("arrays", ["numpy", "cupy"])
@pytest.mark.parametrize(
    ("setup", "optimizer"), setup_by_optimizer(list(GPU_SETUPS), "gpu_tiny_host_tiny")
)
def test_gpu_setup_matches_unbounded_reference(
    tmp_path: Path, setup: str, optimizer: optim.Optimizer, arrays: str
) -> None:
    """The same trace and reference with a GPU tier on top: rows trained in place on the
    GPU, evicted dirty to the host, flushed, exported and reopened agree with the
    reference within 1e-6."""
    gpu_arrays = gpu_arrays_or_skip(arrays)
    config = make_config(setup, optimizer)
    reference = ReferenceTable(config)
    with EmbeddingStore(tmp_path / "db", gpu_arrays=gpu_arrays) as store:
        table = store.create_table(config)
        run_trace(table, reference, seed=zlib.crc32(setup.encode()) % 1000)
        tiers = table.stats()["tiers"]
        assert list(tiers)[0] == "gpu"
        assert tiers["gpu"]["rows"] <= tiers["gpu"]["capacity_rows"]
        assert tiers["gpu"]["bytes"] <= config.gpu_cache_bytes
        assert tiers["gpu"]["hits"] > 0
        if config.gpu_cache_bytes < 1 << 20:  # a small GPU tier spilled rows below it
            assert table.spilled > 0
        assert_same_rows(table, reference)
        probe = np.arange(-2, UNIVERSE + 20, dtype=np.int64)
        before = table.lookup(probe, create=False)
    with EmbeddingStore(tmp_path / "db", gpu_arrays=gpu_arrays) as reopened:
        table = reopened.table("t")
        np.testing.assert_array_equal(table.lookup(probe, create=False), before)
        assert_same_rows(table, reference)


def test_tiny_budget_spills_every_batch(tmp_path: Path) -> None:
    config = make_config("tiny", optim.SGD(lr=0.1))
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        keys = np.arange(BATCH, dtype=np.int64)
        table.lookup(keys)
        stats = table.stats()
        assert stats["tiers"]["host"]["rows"] == 6
        assert stats["tiers"]["rocksdb"]["rows_written"] == BATCH - 6
        table.lookup(keys + BATCH)
        assert table.stats()["tiers"]["rocksdb"]["rows_written"] == 2 * BATCH - 6


def test_write_through_reaches_rocksdb_before_returning(tmp_path: Path) -> None:
    config = make_config("write_through", optim.Adagrad())
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        keys = np.array([3, 5, 5, 9], dtype=np.int64)
        table.apply_gradients(keys, np.ones((4, DIM), np.float32), step=1)
        rocks = table.tiers[-1]
        present = rocks.contains(np.array([3, 5, 9, 11], dtype=np.int64))
        np.testing.assert_array_equal(present, [True, True, True, False])
        assert table.stats()["tiers"]["host"]["dirty_rows"] == 0
        _, rows, _ = rocks.find(np.array([5], dtype=np.int64))
        np.testing.assert_array_equal(rows[0, :DIM], table.lookup(np.array([5]))[0])


def test_export_is_a_snapshot_of_the_call(tmp_path: Path) -> None:
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(make_config("tiny", optim.SGD(lr=1.0)))
        keys = np.arange(100, dtype=np.int64)
        table.assign(keys, np.zeros((100, DIM), np.float32))
        chunks = table.export(chunk_rows=10)
        table.apply_gradients(keys, np.ones((100, DIM), np.float32), step=1)
        table.lookup(np.arange(100, 150, dtype=np.int64))
        exported = dict(
            (int(k), row) for ks, rows in chunks for k, row in zip(ks, rows, strict=True)
        )
        assert sorted(exported) == list(range(100))
        assert all(not row[:DIM].any() for row in exported.values())


def test_checkpoint_opens_as_a_store(tmp_path: Path) -> None:
    config = make_config("tiny", optim.Adam())
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        keys = np.arange(50, dtype=np.int64)
        table.apply_gradients(keys, np.full((50, DIM), 0.5, np.float32), step=1)
        expected = export_dict(table)
        store.checkpoint(tmp_path / "ckpt")
        table.apply_gradients(keys, np.ones((50, DIM), np.float32), step=2)
    with EmbeddingStore(tmp_path / "ckpt") as restored:
        got = export_dict(restored.table("t"))
    assert sorted(got) == sorted(expected)
    for key, row in expected.items():
        np.testing.assert_array_equal(got[key], row)


class RefuseAbove(Stateless):
    """A trivial lifecycle policy, written here against storage/fallbacks.py's interface
    only: keys above `limit` without a row read default_value and are never stored or
    trained (until assigned). It keeps no soft state (Stateless: no sightings to undo)."""

    def __init__(self, limit: int, config: TableConfig) -> None:
        self.limit, self.config = limit, config

    def answer(self, keys: np.ndarray, *, sight: bool) -> Answer:
        index = np.flatnonzero(keys > self.limit)
        rows = np.full((index.size, self.config.stored_width), self.config.default_value)
        origin = np.full(index.size, RowOrigin.REFUSED, dtype=np.int8)
        return Answer(index, rows.astype(np.float32), origin)


@pytest.mark.parametrize("optimizer", [EXAMPLES["sgd"], EXAMPLES["adam"]], ids=kind_id)
@pytest.mark.parametrize("setup", ["roomy", "tiny", "write_through", "direct"])
def test_a_policy_added_from_outside_passes_the_contract(
    tmp_path: Path, setup: str, optimizer: optim.Optimizer
) -> None:
    """A policy added to a table's fallbacks, with no change to the cascade, holds the
    contract: the table agrees with the reference that refuses the same keys."""
    limit = UNIVERSE // 3
    config = dataclasses.replace(make_config(setup, optimizer), default_value=0.25)
    reference = ReferenceTable(config, refuse_above=limit)
    probe = np.arange(-2, UNIVERSE + 20, dtype=np.int64)
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        table.fallbacks.insert(0, RefuseAbove(limit, config))
        run_trace(table, reference, seed=zlib.crc32(setup.encode()) % 1000)
        assert_same_rows(table, reference)
        assert any(key > limit for key in reference.rows)  # assigned keys above it
        refused = [key for key in range(limit + 1, UNIVERSE) if key not in reference.rows]
        assert refused and table.stats()["initialized"] > 0
        assert table.gradients_dropped > 0 and table.lookups_default > 0
        before = table.lookup(probe, create=False)
        np.testing.assert_array_equal(before[np.array(refused) + 2], 0.25)  # probe from -2
    with EmbeddingStore(tmp_path / "db") as reopened:
        table = reopened.table("t")
        table.fallbacks.insert(0, RefuseAbove(limit, config))
        np.testing.assert_array_equal(table.lookup(probe, create=False), before)
        assert_same_rows(table, reference)


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to `dtype` by references outside tierps: numpy's float16,
    torch's bfloat16 (both round to nearest, ties to even)."""
    if dtype == "float32":
        return values
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float32)
    torch = pytest.importorskip("torch")
    as_tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return as_tensor.to(torch.bfloat16).to(torch.float32).numpy()


# half an ulp, relative, of each cold dtype (11 and 8 significant bits), and of float16's
# subnormals (absolute): how far rounding moves a value
HALF_ULP = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}
HALF_ULP_ABS = {"float32": 0.0, "float16": 2.0**-25, "bfloat16": 0.0}


class ColdReference(ReferenceTable):
    """Rounding-aware: a stored row is, at any moment, either the reference's row or that
    row rounded to the cold dtypes (its only copy went through RocksDB since it last
    changed). Before each call the reference reads the table's rows of the call's stored
    keys (EmbeddingTable.peek), checks that each is one of the two, and goes on from it.

    "The reference's row" within the suite's atol (1e-6: the compiled kernels may fuse a
    multiply-add); "rounded" means every value is one the cold dtype holds (rounding it
    again changes nothing, checked with numpy's float16 and torch's bfloat16) and lies
    within half an ulp of the reference's (plus atol). `rounded_rows` counts rows found
    rounded."""

    def __init__(self, config: TableConfig, table) -> None:
        super().__init__(config)
        self.table = table
        self.rounded_rows = 0
        dim = config.dim
        self.dtypes = [(slice(0, dim), config.cold_dtype), (slice(dim, None), config.cold_state)]

    def is_rounding_of(self, actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
        """bool [n]: rows of `actual` that are `expected` rounded to the cold dtypes."""
        ok = np.ones(actual.shape[0], dtype=bool)
        for columns, dtype in self.dtypes:
            got, want = actual[:, columns], expected[:, columns]
            bound = np.abs(want) * HALF_ULP[dtype] + HALF_ULP_ABS[dtype] + 1e-6
            ok &= (rounded(got, dtype) == got).all(axis=1)
            ok &= (np.abs(got - want) <= bound).all(axis=1)
        return ok

    def sync(self, keys: np.ndarray) -> None:
        stored = np.array(sorted({k for k in keys.tolist() if k in self.rows}), dtype=np.int64)
        if stored.size == 0:
            return
        actual = self.table.peek(stored).rows[:, : self.config.row_width]
        expected = np.stack([self.rows[k] for k in stored.tolist()])
        exact = (np.abs(actual - expected) <= 1e-6).all(axis=1)
        was_rounded = self.is_rounding_of(actual, expected)
        assert (exact | was_rounded).all(), f"keys {stored[~(exact | was_rounded)]}"
        self.rounded_rows += int(np.count_nonzero(was_rounded & ~exact))
        for key, row in zip(stored.tolist(), actual, strict=True):
            self.rows[key] = row.copy()


COLD_CASES = {
    "f16-sgd": ("float16", "", optim.SGD(lr=0.1)),
    "f16-weights-adagrad": ("float16", "float32", optim.Adagrad(lr=0.1)),
    "bf16-adam": ("bfloat16", "", optim.Adam(lr=0.01)),
    "bf16-momentum": ("bfloat16", "", optim.Momentum(lr=0.05, momentum=0.8)),
}


@pytest.mark.parametrize("case", list(COLD_CASES))
@pytest.mark.parametrize("setup", ["roomy", "tiny", "no_host", "write_through"])
def test_cold_rows_match_the_rounding_aware_reference(
    tmp_path: Path, setup: str, case: str
) -> None:
    """float16 / bfloat16 cold rows hold the contract: every row is the reference's or its
    rounding, and RocksDB (export, a reopened store) holds the rounded rows."""
    cold, cold_state, optimizer = COLD_CASES[case]
    config = dataclasses.replace(
        make_config(setup, optimizer), cold_dtype=cold, cold_state_dtype=cold_state
    )
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        reference = ColdReference(config, table)
        run_trace(table, reference, seed=zlib.crc32(setup.encode()) % 1000)
        reference.sync(np.array(list(reference.rows), dtype=np.int64))
        if setup != "roomy":  # rows went down to RocksDB and came back rounded
            assert reference.rounded_rows > 0
        stored = export_dict(table)  # RocksDB's rows: every one rounded
        assert sorted(stored) == sorted(reference.rows)
        keys = np.array(sorted(stored), dtype=np.int64)
        on_disk = np.stack([stored[k] for k in keys.tolist()])
        expected = np.stack([reference.rows[k] for k in keys.tolist()])
        assert reference.is_rounding_of(on_disk, expected).all()
        assert table.tiers[-1].codec.value_bytes < config.row_bytes  # half-size weights
    with EmbeddingStore(tmp_path / "db") as reopened:
        table = reopened.table("t")
        assert table.config == config
        np.testing.assert_array_equal(table.lookup(keys, create=False), on_disk[:, : config.dim])
