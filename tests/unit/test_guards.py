"""Numeric and step guards, and the bounded admission counter, on real stores (RocksDB in
tmp_path).

A push whose update would make a stored value non-finite (weights, optimizer state, a bucket
row), a push with an out-of-range step, and an optimizer config that turns finite input into
NaN are refused; a refused push changes NOTHING. "Nothing" is checked the same way in every
test (`snapshot` / `assert_unchanged`): every stored row and its last-update step bit for bit,
the table's clock (current_step, first_step, the held-back leap), its figures (created,
initialized, spilled, gradients_dropped), the admission, eviction and adaptive counts in
stats(), the exact counts by key, and the bucket rows with their dirty flags.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierps.core.validation import MAX_STEP
from tierps.storage import (
    EmbeddingStore,
    EmbeddingTable,
    InvalidArgumentError,
    TableConfig,
    TableNotFoundError,
    init,
    optim,
)
from tierps.storage.admission import DEFAULT_COUNTER_KEYS, CounterFilter, make_filter

DIM = 4
WHERE = "table 'g' on shard 0"
COUNT_FIELDS = (  # counts in stats(); a filter's slots and bytes may grow and stay grown
    "keys_counted",
    "counters_used",
    "sightings",
    "keys_admitted",
    "keys_dropped",
    "lookups_default",
    "gradients_dropped",
)

# What overflows float32 from finite input, per optimizer: Adam squares the gradient into v
# (1e20**2 is inf), SGD with a huge lr moves the weights past float32's range.
BAD = {
    "adam-square": (optim.Adam(lr=0.01), 1e20, "optimizer state"),
    "sgd-overflow": (optim.SGD(lr=1e30), 1e10, "weights"),
}


# -- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[Callable[..., EmbeddingStore]]:
    """opened(**store_kwargs): an EmbeddingStore in tmp_path, closed after the test."""
    stores: list[EmbeddingStore] = []

    def make(**kwargs: Any) -> EmbeddingStore:
        store = EmbeddingStore(tmp_path / f"db{len(stores)}", **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def config(optimizer: Any = None, **fields: Any) -> TableConfig:
    fields.setdefault("initializer", init.Zeros())
    return TableConfig("g", DIM, optimizer=optimizer or optim.Adam(lr=0.01), **fields)


def keys_of(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def grads(n: int, value: float = 0.5) -> np.ndarray:
    return np.full((n, DIM), value, dtype=np.float32)


def push(table: EmbeddingTable, keys: np.ndarray, g: np.ndarray, step: int) -> int:
    with np.errstate(all="ignore"):  # the refused update overflows (or divides by 0)
        return table.apply_gradients(keys, g, step)


def snapshot(table: EmbeddingTable) -> dict[str, Any]:
    """Everything a refused call must leave as it was (see the module docstring). The dirty
    flags (cache tiers, bucket rows) are read first: the export flushes, which clears them."""
    dirty = [np.sort(tier.dirty_keys()) for tier in table.tiers[:-1]]
    bucket_dirty = None if table.buckets is None else table.buckets.dirty.copy()
    rows: dict[int, tuple[np.ndarray, int | None]] = {}
    for keys, chunk, steps in table.export_stored(chunk_rows=97):
        for i, key in enumerate(keys.tolist()):
            rows[key] = (chunk[i].copy(), None if steps is None else int(steps[i]))
    stats = table.stats()
    out: dict[str, Any] = {
        "rows": rows,
        "clock": (table.current_step, table.first_step, table.leap_step),
        "figures": (table.created, table.initialized, table.spilled, table.gradients_dropped),
        "eviction": stats["eviction"],
        "adaptive": stats["adaptive"],
        "dirty": dirty,
    }
    if table.admission is not None:
        out["admission"] = {name: stats["admission"][name] for name in COUNT_FIELDS}
        if isinstance(table.admission, CounterFilter):
            out["admission_counts"] = table.admission.export_counts()
            out["admission_calls"] = table.admission.calls
    if table.buckets is not None:
        out["bucket_rows"] = table.buckets.rows.copy()
        out["bucket_dirty"] = bucket_dirty
        out["promotion_counts"] = table.buckets.counts.export_counts()
        out["promotion_calls"] = table.buckets.counts.calls
    return out


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert sorted(after["rows"]) == sorted(before["rows"]), "rows were added or removed"
    for key, (row, step) in before["rows"].items():
        now, now_step = after["rows"][key]
        assert np.array_equal(now.view(np.uint32), row.view(np.uint32)), (
            f"key {key}: {row} -> {now}"
        )
        assert now_step == step, f"key {key}: last-update step {step} -> {now_step}"
    assert after.keys() == before.keys()
    for name, value in before.items():
        if name == "rows":
            continue
        if name == "dirty":
            assert len(value) == len(after[name])
            for level, keys in enumerate(value):
                assert np.array_equal(after[name][level], keys), f"dirty keys of tier {level}"
        elif isinstance(value, np.ndarray):
            assert value.dtype == after[name].dtype
            assert np.array_equal(value.view(np.uint8), after[name].view(np.uint8)), name
        else:
            assert after[name] == value, name


def refused(
    table: EmbeddingTable,
    keys: np.ndarray,
    g: np.ndarray,
    step: Any,
    *needles: str,
    probe: Callable[[], None] | None = None,
) -> str:
    """Push, expect InvalidArgumentError naming the table and each needle, and check that
    nothing changed; returns the message. `probe` runs right after the refusal, before the
    export (which flushes) reads the table again."""
    table.flush()  # every row clean: a dirty flag the refused push left shows
    before = snapshot(table)
    with pytest.raises(InvalidArgumentError) as caught:
        push(table, keys, g, step)
    if probe is not None:
        probe()
    message = str(caught.value)
    for needle in (WHERE, *needles):
        assert needle in message, f"{needle!r} not in {message!r}"
    assert_unchanged(before, snapshot(table))
    return message


# -- 1, 2: non-finite updates on the host path ------------------------------------------------

SETUPS = {
    # where the rows of the pushed keys are when the bad push comes
    "new": dict(host_cache_bytes=256 << 10),  # nowhere: initialised by the push
    "host": dict(host_cache_bytes=256 << 10),  # in the host tier (trained once)
    "rocksdb": dict(host_cache_bytes=0),  # RocksDB only: the table has no host tier
    "write_through": dict(host_cache_bytes=256 << 10, write_policy="write_through"),
    "direct": dict(use_hashtable=False, capacity=64),  # the direct arena (row i = key i)
}


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("mixed", [False, True], ids=["alone", "mixed"])
def test_a_non_finite_update_is_refused_whole_and_changes_nothing(
    opened, setup: str, bad: str, mixed: bool
) -> None:
    optimizer, huge, part = BAD[bad]
    table = opened().create_table(config(optimizer, **SETUPS[setup]))
    if setup == "rocksdb":
        assert [tier.name for tier in table.tiers] == ["rocksdb"]
    trained = keys_of(*range(10, 20))
    push(table, trained, grads(trained.size), step=1)  # rows other than the pushed ones
    pushed = keys_of(1, 2, 3, 4) if setup == "new" else trained[:4]
    if setup != "new":  # the pushed keys live where the setup says, trained once already
        hit, _, _ = table.tiers[0].find(pushed)
        assert hit.size == pushed.size
    bad_key = int(pushed[2])
    keys = pushed if mixed else keys_of(bad_key)
    g = grads(keys.size)
    g[list(keys).index(bad_key), 1] = huge
    message = refused(table, keys, g, 2, f"key {bad_key}", part, "nothing was changed")
    assert "apply_gradients" in message
    # the table still trains: the same keys with a finite gradient are accepted
    assert push(table, keys, grads(keys.size), step=2) == keys.size
    assert table.current_step == 2


def test_a_bad_key_repeated_in_a_batch_is_refused_by_its_summed_gradient(opened) -> None:
    """Duplicates are summed first: two halves of an overflowing gradient are refused too."""
    table = opened().create_table(config(optim.Adam(lr=0.01)))
    push(table, keys_of(1, 2), grads(2), step=1)
    keys = keys_of(1, 2, 1)
    g = grads(3)
    g[[0, 2], 0] = 1.5e19  # each squared is 2.25e38 (finite); the sum squared is 9e38 (inf)
    refused(table, keys, g, 2, "key 1")


def test_a_refused_first_push_leaves_the_table_without_a_clock(opened) -> None:
    table = opened().create_table(config(steps_to_live=10))
    g = grads(2)
    g[0, 0] = 1e20
    refused(table, keys_of(1, 2), g, 7, "key 1")
    assert (table.current_step, table.first_step, table.leap_step) == (0, 0, 0)
    assert snapshot(table)["rows"] == {}
    push(table, keys_of(1, 2), grads(2), step=7)
    assert (table.current_step, table.first_step) == (7, 7)


NAN_STEP = 0x7FC00000  # its low int64 word, read as float32, is a NaN


@pytest.mark.parametrize("gpu", [False, True], ids=["host", "gpu"])
def test_step_slots_whose_bits_read_as_nan_are_not_refused(opened, gpu: bool) -> None:
    """The guard looks at weights and optimizer state only, not at the step slots after
    them (int64 bits, never numbers)."""
    store = opened(gpu_arrays="numpy")
    table = store.create_table(
        config(steps_to_live=10**12, gpu_cache_bytes=GPU_BYTES if gpu else 0)
    )
    assert push(table, keys_of(1, 2), grads(2), NAN_STEP) == 2  # new rows
    if gpu:  # the next push trains them in place
        assert table.tiers[0].name == "gpu" and table.tiers[0].find(keys_of(1, 2))[0].size == 2
    assert push(table, keys_of(1, 2), grads(2), NAN_STEP + 1) == 2
    rows = snapshot(table)["rows"]
    assert rows[1][1] == NAN_STEP + 1 and np.isfinite(rows[1][0]).all()


# -- 3: adaptive embedding: bucket rows ------------------------------------------------------


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_non_finite_bucket_row_is_refused_and_no_promotion_counts(opened, bad: str) -> None:
    optimizer, huge, _ = BAD[bad]
    table = opened().create_table(
        config(optimizer, hash_bucket_size=8, promote_after=3, host_cache_bytes=64 << 10)
    )
    # keys 0..5 sighted twice (one more sighting promotes them), 100 promoted (own row)
    for step in (1, 2):
        push(table, keys_of(0, 1, 2, 3, 4, 5), grads(6), step)
    for step in (1, 2, 3):
        push(table, keys_of(100), grads(1), step)
    assert 100 in snapshot(table)["rows"]
    bucketed = keys_of(50, 51, 52)  # never sighted: this push trains their buckets
    bad_bucket = int(table.buckets.of(bucketed[1:2])[0])
    keys = np.concatenate([bucketed, keys_of(0, 1, 100)])  # 0 and 1 would be promoted now
    g = grads(keys.size)
    g[1, 3] = huge
    refused(table, keys, g, 4, f"bucket row {bad_bucket}")
    # the refused push promoted nobody: 0 and 1 have no row and need exactly one sighting
    rows = snapshot(table)["rows"]
    assert 0 not in rows and 1 not in rows
    assert table.buckets.counts.estimate(keys_of(0, 1, 50)).tolist() == [2, 2, 0]
    push(table, keys_of(0, 50), grads(2), step=4)
    rows = snapshot(table)["rows"]
    assert 0 in rows and 50 not in rows


def test_a_non_finite_promoted_row_rolls_the_promotion_back(opened) -> None:
    """The key promoted by the refused push itself overflows: its row is not stored and
    its count goes back to promote_after - 1; the buckets trained beside it are put back."""
    table = opened().create_table(
        config(optim.SGD(lr=1e30), hash_bucket_size=8, promote_after=2, host_cache_bytes=0)
    )
    push(table, keys_of(7, 8), grads(2, 1e-3), step=1)  # sighted once: bucket-trained
    keys = keys_of(7, 9)  # 7 is promoted by this push, 9 trains its bucket
    g = grads(2, 1e-3)
    g[0] = 1e10
    refused(table, keys, g, 2, "key 7", "weights")
    assert table.buckets.counts.estimate(keys_of(7, 9)).tolist() == [1, 0]
    push(table, keys_of(7), grads(1, 1e-3), step=2)
    assert 7 in snapshot(table)["rows"]


# -- 4: admission --------------------------------------------------------------------------

ADMIT_AFTER = 3


@pytest.mark.parametrize("admission", ["counter", "bloom"])
@pytest.mark.parametrize(
    ("prior", "culprit"),
    [(0, "other"), (ADMIT_AFTER - 1, "other"), (ADMIT_AFTER - 1, "itself")],
    ids=["unseen-other", "one-short-other", "one-short-itself"],
)
def test_a_refused_push_does_not_count_its_sightings(
    opened, admission: str, prior: int, culprit: str
) -> None:
    """Key 5 is sighted `prior` times, then by a refused push (the admitting sighting when
    prior = ADMIT_AFTER - 1); afterwards it needs exactly ADMIT_AFTER - prior accepted
    sightings. The push is refused because of key 1 (a row set by assign), or because of
    key 5 itself, whose fresh row overflows once admitted."""
    table = opened().create_table(
        config(
            optim.SGD(lr=1e30),
            admit_after=ADMIT_AFTER,
            admission=admission,
            max_elements=1000 if admission == "bloom" else 0,
        )
    )
    table.assign(keys_of(1, 2), np.zeros((2, DIM), np.float32))
    for step in range(1, prior + 1):
        push(table, keys_of(5, 6), grads(2, 1e-3), step)
    keys = keys_of(1, 5, 6)
    g = grads(3, 1e-3)
    bad = 1 if culprit == "other" else 5
    g[list(keys).index(bad)] = 1e10
    refused(table, keys, g, prior + 1, f"key {bad}")
    assert table.admission.estimate(keys_of(5)).tolist() == [prior]
    for sighting in range(prior + 1, ADMIT_AFTER + 1):
        assert 5 not in snapshot(table)["rows"], f"admitted after {sighting - 1} sightings"
        push(table, keys_of(5), grads(1, 1e-3), step=sighting)
    assert 5 in snapshot(table)["rows"]


# -- 5: the GPU path (its tier code on numpy arrays) ------------------------------------------

GPU_BYTES = 2048  # 16 rows (dim 4, SGD or Adam, with step slots): the rest go to the host tier


def gpu_table(opened, optimizer: Any) -> tuple[EmbeddingTable, np.ndarray, np.ndarray]:
    """A table whose top tier is a GPU tier training in place, with keys 0..47 trained;
    returns it with (the keys resident in the GPU tier, those in the host tier below)."""
    store = opened(gpu_arrays="numpy")
    table = store.create_table(
        config(optimizer, gpu_cache_bytes=GPU_BYTES, steps_to_live=100, host_cache_bytes=64 << 10)
    )
    assert table.tiers[0].name == "gpu" and table.tiers[0].trains_in_place
    trained = np.arange(48, dtype=np.int64)
    for step in (1, 2):
        push(table, trained, grads(trained.size, 1e-3), step)
    hit, _, _ = table.tiers[0].find(trained)
    resident = trained[hit]
    assert 0 < resident.size < trained.size
    return table, resident, np.setdiff1d(trained, resident)


def gpu_rows(table: EmbeddingTable, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hit, rows, dirty = table.tiers[0].find(keys)
    assert hit.size == keys.size, "a resident row left the GPU tier"
    return rows.view(np.uint32).copy(), dirty.copy()


def refused_on_gpu(
    table: EmbeddingTable, resident: np.ndarray, keys: np.ndarray, g: np.ndarray, bad: int
) -> None:
    """refused, and the resident rows and their dirty flags, read from the GPU tier itself,
    bit-identical."""
    table.flush()  # as refused does: the dirty flags compared are all clean
    before = gpu_rows(table, resident)

    def same_resident_rows() -> None:
        after = gpu_rows(table, resident)
        assert np.array_equal(after[0], before[0]), "a resident row changed"
        assert np.array_equal(after[1], before[1]), "a resident row's dirty flag changed"

    refused(table, keys, g, 3, f"key {bad}", probe=same_resident_rows)
    assert (table.current_step, table.first_step, table.leap_step) == (2, 1, 0)


def test_gpu_path_refuses_an_overflowing_square_on_a_resident_key(opened) -> None:
    """Adam: a resident key's gradient whose square is inf is refused before any row is
    trained in place (the pre-check)."""
    table, resident, below = gpu_table(opened, optim.Adam(lr=0.01))
    keys = np.concatenate([resident[:4], below[:2], keys_of(1000, 1001)])
    g = grads(keys.size, 1e-3)
    g[1, 0] = 1e20
    refused_on_gpu(table, resident, keys, g, int(keys[1]))


@pytest.mark.parametrize("where", ["new", "host"])
def test_gpu_path_refuses_a_non_finite_non_resident_key_and_undoes_the_resident_ones(
    opened, where: str
) -> None:
    """SGD(lr=1e30): the resident keys train in place (finite), then the other keys'
    update overflows on the host path: refused, and the in-place update is undone."""
    table, resident, below = gpu_table(opened, optim.SGD(lr=1e30))
    bad = 1000 if where == "new" else int(below[0])
    keys = np.concatenate([resident[:4], keys_of(bad, 1001)])
    g = grads(keys.size, 1e-33)  # lr * 1e-33 = 1e-3: finite
    g[4] = 1e10
    refused_on_gpu(table, resident, keys, g, bad)


@pytest.mark.parametrize("mixed", [False, True], ids=["all-resident", "resident-and-new"])
def test_gpu_path_refuses_a_non_finite_resident_key_trained_in_place(opened, mixed: bool) -> None:
    """SGD(lr=1e30) on a resident key: w overflows in the GPU tier's in-place update,
    which the squares pre-check cannot see (SGD squares nothing)."""
    table, resident, _ = gpu_table(opened, optim.SGD(lr=1e30))
    keys = np.concatenate([resident[:4], keys_of(1000, 1001)]) if mixed else resident[:4]
    g = grads(keys.size, 1e-33)
    g[2] = 1e10
    refused_on_gpu(table, resident, keys, g, int(keys[2]))


# -- 6: step bounds ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step",
    [0, -1, 2**53, 2**63, np.uint64(2**63), np.uint64(2**64 - 1), np.int64(0), 1.0, True],
    ids=repr,
)
def test_a_step_out_of_bounds_is_refused_naming_the_bound(opened, step: Any) -> None:
    table = opened().create_table(config(steps_to_live=10))
    push(table, keys_of(1, 2), grads(2), step=5)
    refused(table, keys_of(1, 3), grads(2), step, "'step'", "2**53", repr(step))


@pytest.mark.parametrize("step", [MAX_STEP, np.int64(MAX_STEP), np.uint64(MAX_STEP)], ids=repr)
def test_the_largest_step_is_accepted_and_kept_exactly(opened, step: Any) -> None:
    """The largest step, as a table's first push (which may start anywhere) and held back
    as a leap then confirmed with the step limit off (max_step_leap=0)."""
    assert MAX_STEP == 2**53 - 1
    first = opened().create_table(config(steps_to_live=10))
    assert push(first, keys_of(1), grads(1), step=step) == 1
    assert (first.current_step, first.first_step, first.leap_step) == (MAX_STEP, MAX_STEP, 0)
    store = opened(max_step_leap=0)
    table = store.create_table(config(steps_to_live=10))
    push(table, keys_of(1), grads(1), step=5)
    assert push(table, keys_of(1, 2), grads(2), step=step - 1) == 2
    assert (table.current_step, table.leap_step) == (5, MAX_STEP - 1)  # a leap: held back
    assert push(table, keys_of(1, 2), grads(2), step=step) == 2  # another step: confirmed
    assert (table.current_step, table.leap_step) == (MAX_STEP, 0)
    rows = snapshot(table)["rows"]
    assert rows[1][1] == rows[2][1] == MAX_STEP
    refused(table, keys_of(1), grads(1), MAX_STEP + 1, "2**53")
    store.flush()  # the clock goes through JSON: exact below 2**53
    store.close()
    with EmbeddingStore(store.path) as again:
        assert again.table("g").current_step == MAX_STEP


# -- 7: the eviction guard against a leap of the clock ----------------------------------------

LIVE = 10


def leaping_table(opened) -> EmbeddingTable:
    """steps_to_live = LIVE; keys A = 0..3 pushed at steps 1..5 (clock 5). The step limit
    is off (max_step_leap=0): these tests show the eviction guard on its own."""
    table = opened(max_step_leap=0).create_table(config(steps_to_live=LIVE))
    for step in range(1, 6):
        push(table, keys_of(0, 1, 2, 3), grads(4), step)
    assert (table.current_step, table.first_step) == (5, 1)
    return table


def test_one_leap_does_not_move_the_clock_and_evicts_nothing(opened) -> None:
    """A push LIVE or more steps ahead of the clock (a leap) trains and stamps its own rows,
    but the clock stays: alone, a push at 10**12 would make every other row stale and the
    next evict would remove them all. What confirms a leap is a later push that leaps too,
    to within LIVE of it: only then does the clock move (to that push's step). Here 1000
    does not confirm 10**12 (it is a new leap), 1001 confirms 1000: the clock moves to 1001
    and the evict removes A's rows, last updated at step 5."""
    table = leaping_table(opened)
    push(table, keys_of(100), grads(1), step=10**12)
    assert (table.current_step, table.first_step, table.leap_step) == (5, 1, 10**12)
    rows = snapshot(table)["rows"]
    assert rows[100][1] == 10**12  # the leap's own row carries its step
    assert table.evict() == 0
    assert sorted(snapshot(table)["rows"]) == [0, 1, 2, 3, 100]
    push(table, keys_of(200), grads(1), step=1000)
    assert (table.current_step, table.leap_step) == (5, 1000)  # a new leap, not confirmed
    assert table.evict() == 0
    push(table, keys_of(201), grads(1), step=1001)
    assert (table.current_step, table.leap_step) == (1001, 0)  # confirmed: the clock moves
    assert table.evict() == 4
    assert sorted(snapshot(table)["rows"]) == [100, 200, 201]


def test_a_leap_confirmed_within_steps_to_live_moves_the_clock(opened) -> None:
    table = leaping_table(opened)
    push(table, keys_of(100), grads(1), step=10**12)
    push(table, keys_of(101), grads(1), step=10**12 + LIVE - 1)
    assert (table.current_step, table.leap_step) == (10**12 + LIVE - 1, 0)
    assert table.evict() == 4
    assert sorted(snapshot(table)["rows"]) == [100, 101]


def test_a_push_that_does_not_leap_forgets_the_leap(opened) -> None:
    table = leaping_table(opened)
    push(table, keys_of(100), grads(1), step=10**12)
    push(table, keys_of(0), grads(1), step=6)  # no leap: the held-back one is forgotten
    assert (table.current_step, table.leap_step) == (6, 0)
    push(table, keys_of(101), grads(1), step=10**12 + 1)  # within LIVE of it, but forgotten
    assert (table.current_step, table.leap_step) == (6, 10**12 + 1)
    assert table.evict() == 0


def test_a_refused_push_does_not_hold_or_confirm_a_leap(opened) -> None:
    table = leaping_table(opened)
    g = grads(1)
    g[0, 0] = 1e20  # Adam's v overflows
    refused(table, keys_of(100), g, 10**12, "key 100")
    assert table.leap_step == 0
    push(table, keys_of(100), grads(1), step=10**12)
    refused(table, keys_of(101), g, 10**12 + 1, "key 101")  # would confirm: does not
    assert (table.current_step, table.leap_step) == (5, 10**12)
    assert table.evict() == 0


def test_the_same_leap_step_again_does_not_confirm_it(opened) -> None:
    """One key pushed twice at a leap's step (a repeated push, a second worker of that
    step) is no sign that the trainer moved on: the clock stays, evict removes nothing."""
    table = leaping_table(opened)
    for _ in range(3):
        push(table, keys_of(100), grads(1), step=10**12)
        assert (table.current_step, table.leap_step) == (5, 10**12)
    assert table.evict() == 0
    push(table, keys_of(100), grads(1), step=10**12 + 1)  # the next step: it moved on
    assert (table.current_step, table.leap_step) == (10**12 + 1, 0)


# -- 7b: how far one push may move the clock (max_step_leap) -----------------------------------

LEAP = 1000


def test_a_push_beyond_max_step_leap_is_refused_naming_step_clock_and_limit(opened) -> None:
    table = opened(max_step_leap=LEAP).create_table(config(steps_to_live=LIVE))
    push(table, keys_of(0, 1), grads(2), step=5)
    message = refused(
        table,
        keys_of(1, 2),
        grads(2),
        5 + LEAP + 1,
        "'step'",
        f"at most {5 + LEAP}",
        "clock",
        "is 5",
        f"max_step_leap {LEAP}",
        f"got {5 + LEAP + 1}",
        "--max-step-leap",
    )
    assert "shard 0" in message
    assert push(table, keys_of(1, 2), grads(2), step=5 + LEAP) == 2  # at the limit: taken
    assert table.leap_step == 5 + LEAP  # and held back by the eviction guard, as before


def test_the_limit_is_checked_before_anything_changes_and_older_steps_pass(opened) -> None:
    table = opened(max_step_leap=LEAP).create_table(config(steps_to_live=LIVE))
    push(table, keys_of(0), grads(1), step=10**6)
    refused(table, keys_of(0, 7), grads(2), MAX_STEP, "'step'", str(MAX_STEP))
    assert push(table, keys_of(7), grads(1), step=1) == 1  # behind the clock: never refused
    assert table.current_step == 10**6


@pytest.mark.parametrize("start", [1, 1_000_000, 10**12, MAX_STEP])
def test_a_tables_first_push_may_start_at_any_step(opened, start: int) -> None:
    """Clock 0 (no push yet): a trainer resuming from its checkpoint at step 1,000,000 into
    a new table starts there; the limit counts from the clock that push sets."""
    table = opened(max_step_leap=LEAP).create_table(config(steps_to_live=LIVE))
    assert push(table, keys_of(0), grads(1), step=start) == 1
    assert table.current_step == start
    if start + LEAP + 1 <= MAX_STEP:
        refused(table, keys_of(1), grads(1), start + LEAP + 1, f"is {start}")


def test_max_step_leap_zero_is_no_limit(opened) -> None:
    table = opened(max_step_leap=0).create_table(config())
    push(table, keys_of(0), grads(1), step=1)
    assert push(table, keys_of(0), grads(1), step=MAX_STEP) == 1


def test_a_key_pushed_twice_at_the_largest_step_does_not_empty_the_table(opened) -> None:
    """1,001 rows pushed at steps 1..3, then one key pushed twice at 2**53-1: the default
    limit refuses both pushes, the clock stays at 3, and an evict (what a save with
    evict_before_snapshot runs) keeps every row. With the limit off, the eviction guard
    holds the leap back (the same step twice confirms nothing) and the rows stay too."""
    for limit in (None, 0):
        store = opened() if limit is None else opened(max_step_leap=limit)
        table = store.create_table(config(steps_to_live=LIVE, evict_before_snapshot=True))
        keys = np.arange(1001, dtype=np.int64)
        for step in (1, 2, 3):
            push(table, keys, grads(keys.size), step)
        for _ in range(2):
            if limit is None:
                refused(table, keys_of(7), grads(1), MAX_STEP, "max_step_leap 1000000000")
            else:
                push(table, keys_of(7), grads(1), step=MAX_STEP)
        assert table.current_step == 3
        assert table.evict() == 0
        assert len(snapshot(table)["rows"]) == 1001


# -- 8: optimizer configs that turn finite input into NaN or inf -------------------------------

BAD_CONFIGS = {
    "adagrad eps=0 acc=0": (
        optim.Adagrad,
        dict(eps=0.0, initial_accumulator_value=0.0),
        ["'eps'", "'initial_accumulator_value'"],
    ),
    "adagrad eps 0 in float32": (
        optim.Adagrad,
        dict(eps=1e-50, initial_accumulator_value=0.0),
        ["'eps'", "'initial_accumulator_value'", "float32"],
    ),
    "adam eps=0": (optim.Adam, dict(eps=0.0), ["'eps'"]),
    "adam eps 0 in float32": (optim.Adam, dict(eps=1e-46), ["'eps'", "float32"]),
    "rmsprop eps 0 in float32": (optim.RMSprop, dict(eps=1e-46), ["'eps'", "float32"]),
    "ftrl n**-p = 0": (
        optim.FTRL,
        dict(initial_accumulator_value=0.0, l2=0.0),
        ["'initial_accumulator_value'", "'lr_power'", "l2=0.0"],
    ),
    "ftrl n**-p 0 in float32": (
        optim.FTRL,
        dict(initial_accumulator_value=1e-30, lr_power=-2.0, l2=0.0),
        ["'initial_accumulator_value'", "'lr_power'"],
    ),
    "ftrl n**-p inf in float32": (
        optim.FTRL,
        dict(initial_accumulator_value=1e30, lr_power=-2.0, l2=1.0),
        ["'initial_accumulator_value'", "'lr_power'"],
    ),
    "sgd lr beyond float32": (optim.SGD, dict(lr=1e39), ["'lr'", "float32"]),
    "adam lr beyond float32": (optim.Adam, dict(lr=1e39), ["'lr'", "float32"]),
    "momentum lr beyond float32": (optim.Momentum, dict(lr=1e39), ["'lr'", "float32"]),
    "adagrad accumulator beyond float32": (
        optim.Adagrad,
        dict(initial_accumulator_value=1e39),
        ["'initial_accumulator_value'", "float32"],
    ),
    "ftrl l1 beyond float32": (optim.FTRL, dict(l1=1e39), ["'l1'", "float32"]),
    "ftrl l2 beyond float32": (optim.FTRL, dict(l2=1e39), ["'l2'", "float32"]),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_an_optimizer_config_that_makes_nan_or_inf_is_refused_and_no_table_is_made(
    opened, name: str
) -> None:
    kind, fields, needles = BAD_CONFIGS[name]
    store = opened()
    description = {"name": "g", "dim": DIM, "optimizer": {"kind": kind.kind, **fields}}
    for make in (
        lambda: TableConfig("g", DIM, optimizer=kind(**fields)),
        lambda: TableConfig.from_dict(description),  # the server's path: a config's dict
    ):
        with pytest.raises(ValueError) as caught:
            store.create_table(make())
        for needle in needles:
            assert needle in str(caught.value), f"{needle} not in {caught.value}"
    assert store.tables() == []
    with pytest.raises(TableNotFoundError):
        store.table("g")
    store.close()
    with EmbeddingStore(store.path) as again:  # nothing was persisted either
        assert again.tables() == []


GOOD_CONFIGS = {  # each one field away from a refused one: the guard is not too broad
    "adagrad eps=0 acc>0": optim.Adagrad(eps=0.0, initial_accumulator_value=0.1),
    "adagrad eps>0 acc=0": optim.Adagrad(eps=1e-10, initial_accumulator_value=0.0),
    "adam eps smallest float32": optim.Adam(eps=1.5e-45),
    "rmsprop eps smallest float32": optim.RMSprop(eps=1.5e-45),
    "ftrl n**-p = 0 with l2>0": optim.FTRL(initial_accumulator_value=0.0, l2=0.1),
    "sgd lr float32 max": optim.SGD(lr=float(np.finfo(np.float32).max)),
}


@pytest.mark.parametrize("name", sorted(GOOD_CONFIGS))
def test_a_neighbouring_config_is_accepted_and_trains_finite(opened, name: str) -> None:
    table = opened().create_table(config(GOOD_CONFIGS[name], initializer=init.Zeros()))
    keys = keys_of(1, 2)
    g = np.zeros((2, DIM), np.float32)  # a zero gradient component: 0 / 0 where unguarded
    g[1, 0] = 1e-30 if name.startswith("sgd") else 0.5
    push(table, keys, g, step=1)
    rows = snapshot(table)["rows"]
    assert all(np.isfinite(rows[key][0]).all() for key in (1, 2))


def test_ftrl_whose_l2_is_zero_in_float32_is_refused_like_l2_zero(opened) -> None:
    with pytest.raises(ValueError, match="'lr_power'"):
        optim.FTRL(initial_accumulator_value=0.0, l2=1e-50)


# -- 9: the exact admission counter's bound ----------------------------------------------------


def reference_observe(
    model: dict[int, tuple[int, int]], call: int, keys: list[int], admit_after: int, max_keys: int
) -> set[int]:
    """The documented CounterFilter in plain Python: model maps key -> (count, latest call);
    returns the admitted keys. After a call leaves more than max_keys keys, the least
    recently sighted are dropped (ties: lower count, then smaller key) until
    max_keys - max_keys // 4 remain."""
    admitted = set()
    for key in sorted(set(keys)):
        count = model.get(key, (0, 0))[0] + 1
        if count >= admit_after:
            model.pop(key, None)
            admitted.add(key)
        else:
            model[key] = (count, call)
    if len(model) > max_keys:
        order = sorted(model, key=lambda k: (model[k][1], model[k][0], k))
        for key in order[: len(model) - (max_keys - max_keys // 4)]:
            del model[key]
    return admitted


def counts_of(model: dict[int, tuple[int, int]]) -> np.ndarray:
    rows = [(key, count, seen) for key, (count, seen) in sorted(model.items())]
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


@pytest.mark.parametrize("max_keys", [1, 3, 16])
@pytest.mark.parametrize("seed", range(3))
def test_the_counter_holds_at_most_max_keys_and_drops_the_least_recent(
    seed: int, max_keys: int
) -> None:
    rng = np.random.default_rng(seed)
    admit_after = 4
    counter = CounterFilter(admit_after, max_keys)
    model: dict[int, tuple[int, int]] = {}
    for call in range(1, 200):
        keys = rng.integers(0, 60, size=int(rng.integers(1, 12)))
        admitted = counter.observe(keys.astype(np.int64))
        expected = reference_observe(model, call, keys.tolist(), admit_after, max_keys)
        assert set(keys[admitted].tolist()) == expected, call
        assert counter.stats()["keys_counted"] == len(model) <= max_keys
        assert np.array_equal(counter.export_counts(), counts_of(model)), call
    assert counter.stats()["keys_dropped"] > 0, "the bound was never reached"


def test_a_dropped_key_starts_over_and_a_recent_one_keeps_its_count() -> None:
    counter = CounterFilter(admit_after=3, max_keys=8)  # a trim leaves 6
    for key in range(8):  # one call each: key 0 is the least recent
        counter.observe(keys_of(key))
    counter.observe(keys_of(0))  # key 0 the most recent now, count 2
    counter.observe(keys_of(8))  # 9 > 8: drops 1, 2, 3 (least recently sighted)
    stats = counter.stats()
    assert (stats["keys_counted"], stats["keys_dropped"]) == (6, 3)
    assert counter.estimate(np.arange(9, dtype=np.int64)).tolist() == [2, 0, 0, 0, 1, 1, 1, 1, 1]
    assert counter.observe(keys_of(0, 1)).tolist() == [True, False]  # 0: third sighting
    assert counter.estimate(keys_of(0, 1)).tolist() == [0, 1]  # 1 counts from 1 again


def test_max_elements_bounds_a_tables_counter(opened) -> None:
    table = opened().create_table(config(admit_after=3, max_elements=8, host_cache_bytes=0))
    assert isinstance(table.admission, CounterFilter) and table.admission.max_keys == 8
    assert make_filter(config(admit_after=3)).max_keys == DEFAULT_COUNTER_KEYS == 2**18
    for step, key in enumerate(range(8), start=1):
        push(table, keys_of(key), grads(1), step)
    push(table, keys_of(0), grads(1), step=9)  # key 0: count 2, the most recent
    push(table, keys_of(8), grads(1), step=10)  # drops keys 1, 2, 3
    stats = table.stats()["admission"]
    assert (stats["keys_counted"], stats["keys_dropped"]) == (6, 3)
    push(table, keys_of(0), grads(1), step=11)  # third sighting: admitted
    assert 0 in snapshot(table)["rows"]
    for step in (12, 13):  # key 1 was dropped: it needs 3 sightings again
        assert 1 not in snapshot(table)["rows"]
        push(table, keys_of(1), grads(1), step)
    assert 1 not in snapshot(table)["rows"]
    push(table, keys_of(1), grads(1), step=14)
    assert 1 in snapshot(table)["rows"]
    assert table.stats()["admission"]["keys_counted"] <= 8


def filter_state(counter: CounterFilter) -> tuple[Any, ...]:
    stats = counter.stats()
    figures = tuple(stats[name] for name in ("keys_counted", "sightings", "keys_admitted"))
    return counter.export_counts(), counter.calls, figures, stats["keys_dropped"]


def assert_same_filter(a: CounterFilter, b: CounterFilter) -> None:
    sa, sb = filter_state(a), filter_state(b)
    assert np.array_equal(sa[0], sb[0])
    assert sa[1:] == sb[1:]


@pytest.mark.parametrize("max_keys", [2, 5, 12])
@pytest.mark.parametrize("seed", range(3))
def test_rollback_restores_the_counter_exactly(seed: int, max_keys: int) -> None:
    """A filter that observes, rolls back and goes on behaves as a twin that never saw the
    rolled-back calls: same counts by key (and latest call), clock, figures, and the same
    admissions and drops afterwards. The rolled-back calls admit keys and trim."""
    rng = np.random.default_rng(seed)
    counter, twin = CounterFilter(3, max_keys), CounterFilter(3, max_keys)
    undone = {"trims": 0, "admissions": 0}

    def calls(n: int) -> list[np.ndarray]:
        universe = 3 * max_keys + 4  # small enough that keys reach 3 sightings
        return [rng.integers(0, universe, size=int(rng.integers(1, 10))) for _ in range(n)]

    for keys in calls(20):
        assert np.array_equal(counter.observe(keys), twin.observe(keys))
    for _ in range(10):
        before = filter_state(counter)
        counter.begin()
        dropped, admitted = counter.keys_dropped, counter.keys_admitted
        for keys in calls(int(rng.integers(1, 6))):
            counter.observe(keys)
        undone["trims"] += counter.keys_dropped > dropped
        undone["admissions"] += counter.keys_admitted > admitted
        counter.rollback()
        assert_same_filter(counter, twin)
        assert np.array_equal(filter_state(counter)[0], before[0])
        counter.begin()
        for keys in calls(3):  # a committed stretch: both go on the same
            assert np.array_equal(counter.observe(keys), twin.observe(keys))
        counter.commit()
        assert_same_filter(counter, twin)
    assert twin.keys_admitted > 0 and twin.keys_dropped > 0
    assert undone["trims"] > 0 and undone["admissions"] > 0, undone


def test_rollback_puts_back_a_count_the_rolled_back_call_trimmed() -> None:
    counter = CounterFilter(admit_after=5, max_keys=4)  # a trim leaves 3
    counter.observe(keys_of(1, 2, 3))
    counter.observe(keys_of(1))
    before = filter_state(counter)
    counter.begin()
    counter.observe(keys_of(10, 11))  # 5 keys > 4: drops 2 and 3
    counter.observe(keys_of(2))  # 2 counts from 1 again
    assert counter.estimate(keys_of(1, 2, 3)).tolist() == [2, 1, 0]
    counter.rollback()
    after = filter_state(counter)
    assert np.array_equal(after[0], before[0]) and after[1:] == before[1:]
    assert counter.estimate(keys_of(1, 2, 3, 10, 11)).tolist() == [2, 1, 1, 0, 0]
