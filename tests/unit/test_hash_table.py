"""HashTable (storage/hash_table.py) checked against independent models.

The models are a plain dict (key -> value) for the mapping and explicit per-key scores for
eviction. Nothing here trusts the table's own answers as the expectation: every check
compares the table with the model, or with a layout worked out by hand (linear probing over
keys that all share one home slot).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tierps.core.config import Eviction
from tierps.core.hashing import hash_keys
from tierps.storage.hash_table import EMPTY, TOMBSTONE, HashTable

I64_MAX = int(np.iinfo(np.int64).max)
I64_MIN = int(np.iinfo(np.int64).min)
LOWEST_KEY = I64_MIN + 2  # the lowest key that is not a sentinel


def arr(keys) -> np.ndarray:
    return np.asarray(list(keys), dtype=np.int64)


def home_of(keys: np.ndarray, slots: int) -> np.ndarray:
    """Home slot of each key in a table of `slots` slots (independent of any table)."""
    return (hash_keys(keys) & np.uint64(slots - 1)).astype(np.int64)


def colliding_keys(count: int, slots: int, home: int, start: int = 0) -> np.ndarray:
    """The first `count` keys >= start whose home slot in a `slots`-slot table is `home`."""
    found: list[np.ndarray] = []
    total = 0
    lo = start
    while total < count:
        cand = np.arange(lo, lo + (1 << 20), dtype=np.int64)
        hit = cand[home_of(cand, slots) == home]
        found.append(hit)
        total += hit.size
        lo += 1 << 20
    return np.concatenate(found)[:count]


def assert_matches(table: HashTable, model: dict[int, int]) -> None:
    """The table holds exactly the model's items."""
    assert table.size == len(model)
    keys, values = table.export()
    assert keys.dtype == np.int64
    assert len(keys) == len(model), "export has a different number of keys than the model"
    assert len(set(keys.tolist())) == len(keys), "export repeats a key"
    assert dict(zip(keys.tolist(), values.tolist(), strict=True)) == model
    if model:
        mkeys = arr(model)
        slots = table.find(mkeys)
        assert (slots >= 0).all(), f"present keys not found: {mkeys[slots < 0][:10]}"
        assert table.values[slots].tolist() == [model[k] for k in mkeys.tolist()]
    assert table.size <= table.max_load * table.slots


def insert_and_check(
    table: HashTable, model: dict[int, int], keys: list[int], values: dict[int, int]
) -> None:
    """Insert a batch, check slots/inserted against the model, then set the new values."""
    batch = arr(keys)
    before = dict(model)
    slots, inserted = table.insert(batch)
    assert slots.shape == batch.shape and inserted.shape == batch.shape
    assert inserted.dtype == np.bool_
    new_keys = set(keys) - before.keys()
    # exactly one True per distinct new key, none for keys already present
    flagged = batch[inserted].tolist()
    assert sorted(flagged) == sorted(new_keys)
    assert (slots >= 0).all()
    # every occurrence of a key gets the same slot; distinct keys get distinct slots
    slot_of: dict[int, int] = {}
    for k, s in zip(keys, slots.tolist(), strict=True):
        assert slot_of.setdefault(k, s) == s, f"key {k} got two slots in one batch"
    assert len(set(slot_of.values())) == len(slot_of)
    assert table.keys_at(slots).tolist() == keys
    # keys already present keep their values
    for k in set(keys) & before.keys():
        assert int(table.values[slot_of[k]]) == before[k]
    new_vals = np.asarray([values[k] for k in flagged], dtype=np.int64)
    table.values[slots[inserted]] = new_vals
    model.update((k, values[k]) for k in new_keys)


# --------------------------------------------------------------------------- stateful model

EXTREMES = [I64_MAX, I64_MAX - 1, I64_MAX - 2, LOWEST_KEY, LOWEST_KEY + 1, -1, 0]
key_st = st.one_of(
    st.integers(-4, 40),  # small pool: duplicates, reinserts and erases of present keys
    st.sampled_from(EXTREMES),
    st.integers(LOWEST_KEY, I64_MAX),
)
batch_st = st.lists(key_st, max_size=25)


class HashTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model: dict[int, int] = {}
        self.erased: set[int] = set()
        self.counter = itertools.count(1)

    @initialize(
        capacity=st.sampled_from([1, 16, 40]),
        max_load=st.sampled_from([0.25, 0.5, 0.75, 0.9]),
    )
    def make(self, capacity: int, max_load: float) -> None:
        self.table = HashTable(capacity, max_load=max_load)

    def _fresh_values(self, keys: list[int]) -> dict[int, int]:
        return {k: next(self.counter) for k in set(keys)}

    @rule(keys=batch_st)
    def insert(self, keys: list[int]) -> None:
        insert_and_check(self.table, self.model, keys, self._fresh_values(keys))
        self.erased -= set(keys)

    @precondition(lambda self: bool(self.erased))
    @rule(data=st.data())
    def reinsert_erased(self, data: st.DataObject) -> None:
        pool = sorted(self.erased)
        keys = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=15))
        insert_and_check(self.table, self.model, keys, self._fresh_values(keys))
        self.erased -= set(keys)

    @rule(keys=batch_st)
    def set_values(self, keys: list[int]) -> None:
        present = sorted(set(keys) & self.model.keys())
        slots = self.table.find(arr(present))
        assert (slots >= 0).all()
        vals = {k: next(self.counter) for k in present}
        self.table.values[slots] = arr(vals[k] for k in present)
        self.model.update(vals)

    @rule(keys=batch_st)
    def find(self, keys: list[int]) -> None:
        slots = self.table.find(arr(keys))
        assert slots.dtype == np.int64 and slots.shape == (len(keys),)
        for k, s in zip(keys, slots.tolist(), strict=True):
            if k in self.model:
                assert s >= 0 and int(self.table.values[s]) == self.model[k]
            else:
                assert s == -1, f"absent key {k} found at slot {s}"

    @rule(keys=batch_st, data=st.data())
    def erase(self, keys: list[int], data: st.DataObject) -> None:
        # mix in some present keys (with repeats) so erases hit as well as miss
        if self.model:
            keys = keys + data.draw(st.lists(st.sampled_from(sorted(self.model)), max_size=10))
        expected = set(keys) & self.model.keys()
        assert self.table.erase(arr(keys)) == len(expected)
        for k in expected:
            del self.model[k]
        self.erased |= expected

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def remove_slots(self, data: st.DataObject) -> None:
        keys = data.draw(st.sets(st.sampled_from(sorted(self.model)), max_size=5))
        slots = self.table.find(arr(keys))
        self.table.remove_slots(slots)
        for k in keys:
            del self.model[k]
        self.erased |= keys

    @invariant()
    def agrees_with_model(self) -> None:
        assert_matches(self.table, self.model)
        for k in list(self.erased)[:20]:
            assert self.table.find(arr([k])).tolist() == [-1]


HashTableMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHashTableMachine = HashTableMachine.TestCase


# ------------------------------------------------------------------- sequence of random ops

op_st = st.one_of(
    st.tuples(st.just("insert"), batch_st),
    st.tuples(st.just("erase"), batch_st),
    st.tuples(st.just("find"), batch_st),
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(op_st, max_size=30), capacity=st.sampled_from([1, 8, 64]))
def test_random_op_sequences_agree_with_dict(ops, capacity) -> None:
    table = HashTable(capacity)
    model: dict[int, int] = {}
    counter = itertools.count(100)
    for op, keys in ops:
        if op == "insert":
            insert_and_check(table, model, keys, {k: next(counter) for k in set(keys)})
        elif op == "erase":
            expected = set(keys) & model.keys()
            assert table.erase(arr(keys)) == len(expected)
            for k in expected:
                del model[k]
        else:
            got = table.find(arr(keys)).tolist()
            assert [s >= 0 for s in got] == [k in model for k in keys]
        assert_matches(table, model)


def test_large_random_batches_agree_with_dict() -> None:
    """Big batches drawn from a small key range: many duplicates, hits and misses at once."""
    rng = np.random.default_rng(7)
    table = HashTable(1)
    model: dict[int, int] = {}
    for round_ in range(30):
        keys = rng.integers(0, 6000, size=3000, dtype=np.int64)
        if round_ % 3 == 2:
            expected = set(keys.tolist()) & model.keys()
            assert table.erase(keys) == len(expected)
            for k in expected:
                del model[k]
        else:
            slots, inserted = table.insert(keys)
            new = set(keys.tolist()) - model.keys()
            assert sorted(keys[inserted].tolist()) == sorted(new)
            # all copies of a key share one slot: slot determined by key
            order = np.argsort(keys, kind="stable")
            same_key = keys[order][1:] == keys[order][:-1]
            assert (slots[order][1:][same_key] == slots[order][:-1][same_key]).all()
            table.values[slots[inserted]] = keys[inserted] * 7 + round_
            model.update((k, k * 7 + round_) for k in keys[inserted].tolist())
        assert_matches(table, model)


# ----------------------------------------------------------------------------- inserted mask


@settings(max_examples=100, deadline=None)
@given(present=st.sets(st.integers(-50, 50)), batch=st.lists(st.integers(-60, 60), max_size=60))
def test_inserted_mask_one_true_per_new_key(present, batch) -> None:
    table = HashTable(4)
    model: dict[int, int] = {}
    insert_and_check(table, model, sorted(present), {k: k for k in present})
    keys = arr(batch)
    slots, inserted = table.insert(keys)
    new = set(batch) - present
    for k in set(batch):
        occ = np.flatnonzero(keys == k)
        assert int(inserted[occ].sum()) == (1 if k in new else 0)
        assert len(set(slots[occ].tolist())) == 1
    # old keys kept their values; the slots of the new ones are theirs to fill
    assert all(int(table.values[table.find(arr([k]))[0]]) == k for k in present)
    assert table.size == len(present | set(batch))


def test_batch_of_one_key_repeated() -> None:
    table = HashTable(16)
    keys = np.full(1000, 12345, dtype=np.int64)
    slots, inserted = table.insert(keys)
    assert inserted.sum() == 1 and len(set(slots.tolist())) == 1
    assert table.size == 1
    slots2, inserted2 = table.insert(keys)
    assert not inserted2.any() and table.size == 1
    assert table.find(arr([12345]))[0] == slots2[0]


def test_distinct_new_keys_racing_for_one_slot() -> None:
    """Many new keys of one batch share a home slot: each gets its own slot, one True each."""
    table = HashTable(1024)
    keys = colliding_keys(64, table.slots, home=5)
    batch = np.concatenate([keys, keys[::-1], keys[:10]])
    slots, inserted = table.insert(batch)
    assert sorted(batch[inserted].tolist()) == sorted(keys.tolist())
    by_key = dict(zip(batch.tolist(), slots.tolist(), strict=False))
    for k, s in zip(batch.tolist(), slots.tolist(), strict=True):
        assert by_key[k] == s
    # an empty table probed linearly from slot 5: the 64 keys fill slots 5..68 exactly
    assert sorted(by_key.values()) == list(range(5, 69))


# ------------------------------------------------------------------------------------ growth


@pytest.mark.parametrize("max_load", [0.5, 0.9])
def test_growth_from_capacity_one(max_load: float) -> None:
    rng = np.random.default_rng(1)
    all_keys = rng.choice(np.int64(1) << np.int64(40), size=100_000, replace=False)
    all_keys = all_keys.astype(np.int64) - (1 << 39)  # negative and positive keys
    table = HashTable(1, max_load=max_load)
    assert table.slots >= 1 and table.size == 0
    for start in range(0, all_keys.size, 7_000):
        batch = all_keys[start : start + 7_000]
        slots, inserted = table.insert(batch)
        assert inserted.all()
        table.values[slots] = batch ^ 0x5A5A
        assert table.size == start + batch.size
        assert table.size / table.slots <= max_load
        slots_pow2 = table.slots
        assert slots_pow2 & (slots_pow2 - 1) == 0
        assert table.nbytes == 24 * table.slots
    found = table.find(all_keys)
    assert (found >= 0).all()
    assert (table.values[found] == (all_keys ^ 0x5A5A)).all()
    assert len(np.unique(found)) == all_keys.size
    # the table is the smallest power of two that holds 100k keys at max_load (or 2x it)
    need = int(np.ceil(100_000 / max_load))
    smallest = 1 << (need - 1).bit_length()
    assert smallest <= table.slots <= 2 * smallest
    absent = np.arange(1 << 40, (1 << 40) + 1000, dtype=np.int64)
    assert (table.find(absent) == -1).all()
    keys, values = table.export()
    assert np.array_equal(np.sort(keys), np.sort(all_keys))
    assert np.array_equal(values[np.argsort(keys)], (np.sort(all_keys) ^ 0x5A5A))


def test_growth_keeps_eviction_scores() -> None:
    table = HashTable(1, eviction=Eviction.LFU)
    keys = arr(range(10))
    slots, _ = table.insert(keys)
    for i in range(10):
        table.touch(np.repeat(slots[i : i + 1], 10 - i))  # key i touched 10 - i times
    more = arr(range(100, 5000))
    table.insert(more)
    assert table.slots >= 2 * 4_910  # grew (rehashed) several times since the touches
    table.touch(np.repeat(table.find(more), 11))  # every new key: 11 touches
    got = table.keys_at(table.eviction_candidates(3)).tolist()
    assert sorted(got) == [7, 8, 9]  # touched 3, 2 and 1 times: the least of all
    got = table.keys_at(table.eviction_candidates(10)).tolist()
    assert sorted(got) == list(range(10))


def test_duplicates_in_a_batch_do_not_inflate_growth() -> None:
    """Growth should be sized by the distinct new keys of a batch, not its occurrences:
    duplicates are a supported input (hot keys repeat a lot in a training batch)."""
    table = HashTable(16)  # 32 slots: room for 16 keys at max_load 0.5
    slots_before = table.slots
    table.insert(np.full(100_000, 42, dtype=np.int64))  # one distinct key
    assert table.size == 1
    assert table.slots == slots_before, (
        f"one key, repeated 100k times, grew the table from {slots_before} to "
        f"{table.slots} slots ({table.nbytes} bytes)"
    )
    table = HashTable(1024)  # 2048 slots, room for 1024 keys
    table.insert(arr(range(1000)))
    slots_before = table.slots
    table.insert(np.full(100, -7, dtype=np.int64))  # 1001 distinct keys still fit
    assert table.size == 1001
    assert table.slots == slots_before


def test_capacity_and_max_load_validation() -> None:
    for bad in (0.0, 1.0, -0.5, 1.5):
        with pytest.raises(ValueError):
            HashTable(16, max_load=bad)
    assert HashTable(1000).nbytes == HashTable.nbytes_for(1000)
    assert HashTable(1000).slots >= 2000


# ---------------------------------------------------------------------- adversarial key sets

ADVERSARIAL = {
    "sequential": np.arange(0, 20_000, dtype=np.int64),
    "negative_sequential": -np.arange(1, 20_001, dtype=np.int64),
    "multiples_of_2": np.arange(0, 40_000, 2, dtype=np.int64),
    "multiples_of_4": np.arange(4, 80_004, 4, dtype=np.int64),
    "multiples_of_8": np.arange(0, 160_000, 8, dtype=np.int64),
    "multiples_of_2_32": np.arange(1, 20_001, dtype=np.int64) << np.int64(32),
    "top_of_int64": I64_MAX - np.arange(20_000, dtype=np.int64),
    "bottom_of_int64": LOWEST_KEY + np.arange(20_000, dtype=np.int64),
    "both_ends_and_zero": np.concatenate(
        [
            I64_MAX - np.arange(5_000, dtype=np.int64),
            LOWEST_KEY + np.arange(5_000, dtype=np.int64),
            np.arange(-5_000, 5_000, dtype=np.int64),
        ]
    ),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_adversarial_key_sets(name: str) -> None:
    keys = ADVERSARIAL[name]
    assert len(np.unique(keys)) == keys.size and keys.min() >= LOWEST_KEY
    table = HashTable(64)
    for chunk in np.array_split(keys, 5):
        slots, inserted = table.insert(chunk)
        assert inserted.all()
        table.values[slots] = np.arange(chunk.size) + chunk.size  # arbitrary, model below
    model_vals = np.concatenate(
        [np.arange(c.size) + c.size for c in np.array_split(keys, 5)]
    ).astype(np.int64)
    found = table.find(keys)
    assert (found >= 0).all()
    assert (table.values[found] == model_vals).all()
    # erase every other key; the rest are still found past the tombstones
    gone, kept = keys[::2], keys[1::2]
    assert table.erase(gone) == gone.size
    assert (table.find(gone) == -1).all()
    assert (table.values[table.find(kept)] == model_vals[1::2]).all()
    assert table.size == kept.size
    # reinsert: all new again
    slots, inserted = table.insert(gone)
    assert inserted.all() and table.size == keys.size
    assert (table.find(keys) >= 0).all()
    # the hash spreads these keys: distinct home slots close to what random homes give
    slots_n = 1 << 15
    homes = np.unique(home_of(keys[:10_000], slots_n)).size
    expected = slots_n * (1 - np.exp(-10_000 / slots_n))
    assert homes > 0.9 * expected, f"{name}: only {homes} home slots for 10k keys"


@pytest.mark.parametrize("home", [3, "last"])
def test_long_probe_chain_with_erase_in_the_middle(home) -> None:
    table = HashTable(1024)  # 2048 slots, room for 1024 keys before any growth
    n_slots = table.slots
    home = n_slots - 1 if home == "last" else home  # "last": the chain wraps around slot 0
    keys = colliding_keys(300, n_slots, home)
    assert (home_of(keys, n_slots) == home).all()
    model: dict[int, int] = {}
    # one at a time: each new key walks the whole chain to its end
    for k in keys[:150].tolist():
        insert_and_check(table, model, [k], {k: k + 1})
    # then the rest in one batch: 150 keys racing down the same chain
    insert_and_check(table, model, keys[150:].tolist(), {k: k + 1 for k in keys[150:].tolist()})
    assert table.slots == n_slots, "no growth expected for 300 keys in 2048 slots"
    chain = [(home + i) % n_slots for i in range(300)]
    slots = table.find(keys).tolist()
    assert slots[:150] == chain[:150]  # linear probing, one key at a time: insertion order
    assert sorted(slots[150:]) == sorted(chain[150:])  # the batch fills the next 150 slots
    assert_matches(table, model)

    # erase a block in the middle of the chain and a few scattered ones
    erased = np.concatenate([keys[100:200], keys[[5, 250, 299]]])
    erased_slots = table.find(erased).tolist()
    assert table.erase(erased) == erased.size
    for k in erased.tolist():
        del model[k]
    assert (table.find(erased) == -1).all()
    assert_matches(table, model)  # keys after the tombstones are still reachable
    survivors = np.setdiff1d(keys, erased)
    assert table.find(survivors).tolist() == [slots[i] for i in np.searchsorted(keys, survivors)]

    # absent keys with the same home walk past the tombstones and report -1
    strangers = colliding_keys(20, n_slots, home, start=int(keys[-1]) + 1)
    assert (table.find(strangers) == -1).all()

    # reinsert the block: its 100 keys take the first 100 tombstones along the chain (from
    # home: chain position 5, 100..149, then the earliest tombstones left by the batch), and
    # nothing else moves or grows
    tombs = sorted(erased_slots, key=lambda s: (s - home) % n_slots)
    block = keys[100:200]
    slots_b, inserted = table.insert(block)
    assert inserted.all()
    assert sorted(slots_b.tolist()) == sorted(tombs[:100])
    table.values[slots_b] = block + 1
    model.update((k, k + 1) for k in block.tolist())
    assert table.slots == n_slots
    assert_matches(table, model)
    assert (table.find(survivors) >= 0).all()
    # one more key on the chain takes the first remaining free slot: a leftover tombstone
    slots_s, inserted = table.insert(strangers[:1])
    assert inserted.all() and slots_s.tolist() == [tombs[100]]


# ----------------------------------------------------------------------------- sentinel keys


@pytest.mark.parametrize("sentinel", [EMPTY, TOMBSTONE])
def test_sentinel_keys(sentinel) -> None:
    assert int(EMPTY) == I64_MIN and int(TOMBSTONE) == I64_MIN + 1
    table = HashTable(16)
    model: dict[int, int] = {}
    insert_and_check(table, model, [1, 2, 3, LOWEST_KEY], {1: 10, 2: 20, 3: 30, LOWEST_KEY: 40})
    table.erase(arr([2]))  # leave a tombstone slot in the table
    del model[2]
    with pytest.raises(ValueError):
        table.insert(arr([sentinel]))
    # a bad batch changes nothing, not even its valid keys
    with pytest.raises(ValueError):
        table.insert(arr([7, 8, sentinel, 9]))
    assert_matches(table, model)
    assert table.find(arr([sentinel, 1, sentinel])).tolist()[0::2] == [-1, -1]
    assert table.find(arr([EMPTY, TOMBSTONE])).tolist() == [-1, -1]
    assert table.erase(arr([EMPTY, TOMBSTONE])) == 0
    assert_matches(table, model)


# ---------------------------------------------------------------------------- tombstone churn


def test_tombstone_churn_keeps_slots_bounded() -> None:
    """A working set of 100 keys with 50 replaced per cycle, 400 cycles (20k distinct keys):
    a table that never rehashed away its tombstones would fill up or keep growing."""
    table = HashTable(100)
    bound = table.slots  # 256: 100 live + 50 arriving fit in it at max_load 0.5
    model: dict[int, int] = {}
    next_key = itertools.count(0)
    first = [next(next_key) for _ in range(100)]
    insert_and_check(table, model, first, {k: -k for k in first})
    for cycle in range(400):
        victims = sorted(model)[:50] if cycle % 2 else sorted(model)[-50:]
        assert table.erase(arr(victims + victims[:5])) == 50
        for k in victims:
            del model[k]
        new = [next(next_key) * 3 for _ in range(50)]
        insert_and_check(table, model, new, {k: -k for k in new})
        assert table.slots <= bound, f"cycle {cycle}: grew to {table.slots} slots"
        if cycle % 50 == 0:
            assert_matches(table, model)
    assert_matches(table, model)


def test_tombstone_churn_same_keys() -> None:
    """Erase and reinsert the same keys over and over."""
    table = HashTable(64)
    bound = table.slots
    keys = arr(range(1000, 1064))
    model: dict[int, int] = {}
    for cycle in range(300):
        vals = {k: k * cycle for k in keys.tolist()}
        insert_and_check(table, model, keys.tolist(), vals)
        assert table.slots <= bound
        assert_matches(table, model)
        half = keys[cycle % 2 :: 2]
        assert table.erase(half) == half.size
        for k in half.tolist():
            del model[k]
        assert_matches(table, model)


# --------------------------------------------------------------------------- eviction scores


def _eviction_check(table, model_score, count, protect_keys) -> None:
    """eviction_candidates(count, protect) against per-key model scores (ties allowed)."""
    live_keys = sorted(model_score)
    protect = table.find(arr(protect_keys)) if protect_keys is not None else None
    eligible = [k for k in live_keys if protect_keys is None or k not in protect_keys]
    got_slots = table.eviction_candidates(count, protect)
    got = table.keys_at(got_slots).tolist()
    assert len(set(got_slots.tolist())) == len(got_slots)
    assert set(got) <= set(eligible)
    assert len(got) == max(0, min(count, len(eligible)))
    if got and len(got) < len(eligible):
        worst_taken = max(model_score[k] for k in got)
        best_left = min(model_score[k] for k in set(eligible) - set(got))
        assert worst_taken <= best_left, "a higher-score key was chosen over a lower one"
    # with the scores sorted, the chosen scores are exactly the lowest `count` of them
    want = sorted(model_score[k] for k in eligible)[: len(got)]
    assert sorted(model_score[k] for k in got) == want


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 40),
    touches=st.lists(st.lists(st.integers(0, 39), max_size=8), max_size=25),
    count=st.integers(0, 50),
    protect=st.sets(st.integers(0, 39), max_size=10),
    policy=st.sampled_from([Eviction.LRU, Eviction.LFU]),
)
def test_eviction_candidates_against_model(n, touches, count, protect, policy) -> None:
    table = HashTable(4, eviction=policy)
    keys = arr(range(1000, 1000 + n))
    table.insert(keys)
    # model: every key touched once first (LRU tick 1, LFU count 1)
    table.touch(table.find(keys))
    score = {k: 1 for k in keys.tolist()}
    for tick, batch in enumerate(touches, start=2):
        picked = [1000 + i for i in batch if i < n]
        table.touch(table.find(arr(picked)))
        for k in picked:
            score[k] = tick if policy is Eviction.LRU else score[k] + 1
    protect_keys = {1000 + i for i in protect if i < n}
    _eviction_check(table, score, count, protect_keys)
    _eviction_check(table, score, count, None)


@pytest.mark.parametrize("policy", [Eviction.LRU, Eviction.LFU])
def test_eviction_exact_order(policy) -> None:
    table = HashTable(16, eviction=policy)
    keys = arr(range(20))
    slots, _ = table.insert(keys)
    order = [13, 2, 19, 0, 7, 11, 4, 16, 1, 9, 18, 3, 6, 15, 8, 12, 5, 17, 10, 14]
    for rank, k in enumerate(order):
        reps = 1 if policy is Eviction.LRU else rank + 1  # LFU: key order[r] touched r+1 times
        table.touch(np.repeat(slots[k : k + 1], reps))
    for count in (1, 3, 7, 19):
        got = table.keys_at(table.eviction_candidates(count)).tolist()
        assert sorted(got) == sorted(order[:count])
    protect = table.find(arr(order[:2]))
    got = table.keys_at(table.eviction_candidates(3, protect)).tolist()
    assert sorted(got) == sorted(order[2:5])
    # count beyond the eligible: all eligible, never a protected one
    got = table.keys_at(table.eviction_candidates(100, protect)).tolist()
    assert sorted(got) == sorted(order[2:])
    assert table.eviction_candidates(0).size == 0
    assert table.eviction_candidates(0, protect).size == 0
    # erased keys are never candidates
    table.erase(arr(order[:4]))
    got = table.keys_at(table.eviction_candidates(2)).tolist()
    assert sorted(got) == sorted(order[4:6])
    # everything protected: nothing to evict
    assert table.eviction_candidates(5, table.find(arr(order[4:]))).size == 0


@pytest.mark.parametrize("policy", [Eviction.LRU, Eviction.LFU])
def test_reinserted_key_does_not_inherit_the_erased_score(policy) -> None:
    """A key erased and inserted again lands on its old (tombstone) slot; it must start with a
    fresh score, not the one the slot held."""
    table = HashTable(16, eviction=policy)
    keys = arr(range(10))
    slots, _ = table.insert(keys)
    if policy is Eviction.LRU:
        for k in range(10):
            table.touch(slots[k : k + 1])  # key 0 the least recent, 9 the most
    else:
        table.touch(np.repeat(slots, [50] + [5] * 9))  # key 0 the most frequent
    table.erase(arr([0]))
    new_slots, inserted = table.insert(arr([0]))
    assert inserted.all() and new_slots[0] == slots[0]  # its own tombstone, reused
    got = table.keys_at(table.eviction_candidates(1)).tolist()
    # LRU: the reinsert is the newest event, so key 1 (touched longest ago) goes first.
    # LFU: the reinserted key has no touches yet, so it goes first.
    assert got == ([1] if policy is Eviction.LRU else [0])


def test_lru_touch_batch_shares_one_tick() -> None:
    table = HashTable(16, eviction="lru")
    keys = arr(range(6))
    slots, _ = table.insert(keys)
    table.touch(slots[[0, 1, 2]])  # tick 1
    table.touch(slots[[3, 4, 5]])  # tick 2
    table.touch(slots[[0]])  # tick 3: key 0 now the most recent
    got = table.keys_at(table.eviction_candidates(2)).tolist()
    assert sorted(got) == [1, 2]


# ----------------------------------------------------------------------------- empty batches


@pytest.mark.parametrize("policy", [Eviction.LRU, Eviction.LFU])
def test_empty_batches(policy) -> None:
    empty = np.empty(0, dtype=np.int64)
    for populated in (False, True):
        table = HashTable(1, eviction=policy)
        model: dict[int, int] = {}
        if populated:
            insert_and_check(table, model, [5, 6, 7], {5: 50, 6: 60, 7: 70})
            table.touch(table.find(arr([5, 6, 7])))
        slots_before = table.slots
        found = table.find(empty)
        assert found.shape == (0,) and found.dtype == np.int64
        slots, inserted = table.insert(empty)
        assert slots.shape == (0,) and inserted.shape == (0,) and inserted.dtype == np.bool_
        assert table.erase(empty) == 0
        table.remove_slots(empty)
        table.touch(empty)
        assert table.eviction_candidates(0).size == 0
        assert table.eviction_candidates(0, empty).size == 0
        got = table.keys_at(table.eviction_candidates(10, empty)).tolist()
        assert sorted(got) == sorted(model)
        keys, values = table.export()
        assert keys.dtype == np.int64 and values.dtype == np.int64
        assert table.slots == slots_before
        assert_matches(table, model)


def test_insert_absent_agrees_with_dict_model_through_growth() -> None:
    rng = np.random.default_rng(11)
    table = HashTable(1)
    model: dict[int, int] = {}
    for round_ in range(20):
        fresh = rng.choice(2**50, 700, replace=False).astype(np.int64)
        fresh = fresh[table.find(fresh) < 0]
        slots = table.insert_absent(fresh)
        assert len(set(slots.tolist())) == fresh.size
        table.values[slots] = fresh * 3 + round_
        model.update(zip(fresh.tolist(), (fresh * 3 + round_).tolist(), strict=True))
        assert table.size == len(model)
        assert table.size <= table.max_load * table.slots
    keys = np.array(list(model), dtype=np.int64)
    np.testing.assert_array_equal(table.values[table.find(keys)], [model[k] for k in keys.tolist()])


def _one_buffer(table: HashTable) -> bool:
    """Whether the table's keys, values and scores are the columns of one [slots, 3] array."""
    base = table._keys.base
    return (
        base is not None
        and base.shape == (table.slots, 3)
        and table.values.base is base
        and table._scores.base is base
    )


@pytest.mark.parametrize("kernels", [None, False])
def test_host_layout_interleaved_through_rebuilds(kernels) -> None:
    """On the host (compiled kernels or the array code) a slot's key, value and score share
    one [slots, 3] array, the same 24 bytes a slot, through growth, a prepare_room rebuild
    and a restore; the mapping and the scores stay those of a dict model throughout."""
    rng = np.random.default_rng(7)
    table = HashTable(16, kernels=kernels)
    model: dict[int, int] = {}
    keys = rng.choice(2**40, 3000, replace=False).astype(np.int64)
    for batch in np.split(keys[:2000], 8):  # growth rehashes several times
        slots, inserted = table.insert(batch)
        table.values[slots[inserted]] = batch[inserted] * 3
        model.update((int(k), int(k) * 3) for k in batch)
    assert _one_buffer(table) and table.nbytes == 24 * table.slots
    saved = table.saved()
    leaving = table.find(keys[:500])
    rebuilt = table.prepare_room(2500, leaving)
    assert rebuilt is not None
    table.install(rebuilt)
    assert _one_buffer(table)
    for k in keys[:500]:
        del model[int(k)]
    live, values = table.export()
    assert dict(zip(live.tolist(), values.tolist(), strict=True)) == model
    table.restore(saved)
    assert _one_buffer(table)
    found = table.find(keys[:2000])
    np.testing.assert_array_equal(table.values[found], keys[:2000] * 3)


def test_given_launcher_keeps_separate_arrays() -> None:
    """A launcher given to the table (the GPU kernels' emulation takes raw pointers) gets
    three contiguous arrays, as on the GPU."""
    from tierps.storage import host_kernels

    launcher = host_kernels.host_launcher()
    if launcher is None:
        pytest.skip("numba is not installed")
    table = HashTable(64, kernels=lambda name, threads, args: launcher(name, threads, args))
    assert not _one_buffer(table)
    assert all(a.flags.c_contiguous for a in (table._keys, table.values, table._scores))
    keys = np.arange(1, 200, dtype=np.int64)
    slots, inserted = table.insert(keys)
    table.values[slots] = keys + 1
    np.testing.assert_array_equal(table.values[table.find(keys)], keys + 1)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_compiled_rebuild_matches_the_array_code(policy: str) -> None:
    """A rebuild (prepare_room: growth, tombstones dropped, victims left out) gives the
    same keys, values and scores by the compiled kernel as by the array code, from tables
    built by the same calls: live keys, erased ones (tombstones), a run of keys sharing
    the last slot as home (their probes wrap round to slot 0), touches; each rebuilt
    table finds every kept key at its value and none of those left out."""
    from tierps.storage import host_kernels

    if host_kernels.host_launcher() is None:
        pytest.skip(f"host kernels unavailable: {host_kernels.unavailable_reason()}")
    rng = np.random.default_rng(5)
    slots = 4096
    wrapping = colliding_keys(40, slots, home=slots - 1, start=1 << 41)
    keys = np.concatenate([rng.choice(2**40, 1500, replace=False).astype(np.int64), wrapping])
    erased, leaving_keys = keys[::7], keys[3::11]
    outcomes = []
    for kernels in (None, False):
        table = HashTable(slots // 2, eviction=policy, kernels=kernels)
        assert table.slots == slots and table.compiled_on_host == (kernels is None)
        for batch in np.array_split(keys, 5):
            placed, inserted = table.insert(batch)
            table.values[placed[inserted]] = batch[inserted] * 5 + 1
            table.touch(table.find(batch[: batch.size // 3]))
        table.erase(erased)
        assert table.tombstones > 0
        kept = np.setdiff1d(keys, np.union1d(erased, leaving_keys))
        rebuilt = table.prepare_room(slots, table.find(np.setdiff1d(leaving_keys, erased)))
        assert rebuilt is not None, "a rebuild was due: the test exercises nothing"
        table.install(rebuilt)
        assert table.tombstones == 0 and table.size == kept.size
        found = table.find(kept)
        assert (found >= 0).all()
        np.testing.assert_array_equal(table.values[found], kept * 5 + 1)
        assert (table.find(np.union1d(erased, leaving_keys)) == -1).all()
        live, values = table.export()
        scores = table._scores[table.find(live)]
        held = zip(live.tolist(), values.tolist(), scores.tolist(), strict=True)
        outcomes.append({k: (v, s) for k, v, s in held})
    assert outcomes[0] == outcomes[1]
