"""EmbeddingTable: the tier cascade of one table (storage/table.py), its row origins and
fallbacks (storage/fallbacks.py) and the declared tier interface (storage/tiers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import export_dict
from tierps.core.errors import InvalidArgumentError
from tierps.storage import EmbeddingStore, TableConfig, optim
from tierps.storage.fallbacks import RowOrigin
from tierps.storage.tiers import CacheTier, DirectTier, Tier

DIM = 4


def test_empty_batches_work(store: EmbeddingStore) -> None:
    table = store.create_table(TableConfig("items", DIM, host_cache_bytes=4096))
    table.apply_gradients(np.arange(100), np.ones((100, DIM), np.float32), step=1)
    before = export_dict(table)
    empty = np.empty(0, dtype=np.int64)
    assert table.lookup(empty).shape == (0, DIM)
    table.apply_gradients(empty, np.empty((0, DIM), np.float32), 2)
    table.assign(empty, np.empty((0, DIM), np.float32))
    assert sorted(export_dict(table)) == sorted(before)


def test_negative_keys_are_padding(store: EmbeddingStore) -> None:
    config = TableConfig("t", DIM, optimizer=optim.SGD(lr=1.0))
    table = store.create_table(config)
    keys = np.array([-1, 5, -7, 5, -(2**63)], dtype=np.int64)
    out = table.lookup(keys)
    np.testing.assert_array_equal(out[[0, 2, 4]], 0.0)
    expected = config.initial_rows(np.array([5]))[0]
    np.testing.assert_array_equal(out[[1, 3]], [expected, expected])
    table.apply_gradients(keys, np.ones((5, DIM), np.float32), 1)
    table.assign(np.array([-3]), np.ones((1, DIM), np.float32))
    stored = export_dict(table)
    assert sorted(stored) == [5]
    np.testing.assert_allclose(stored[5], expected - 2.0)  # two occurrences, lr 1


def test_lookup_without_create_stores_nothing(store: EmbeddingStore) -> None:
    config = TableConfig("t", DIM, host_cache_bytes=4096)
    table = store.create_table(config)
    keys = np.arange(50, dtype=np.int64)
    got = table.lookup(keys, create=False)
    np.testing.assert_array_equal(got, config.initial_rows(keys)[:, :DIM])
    assert export_dict(table) == {}
    assert table.stats()["created"] == 0


def test_smaller_integer_dtypes_are_accepted(store: EmbeddingStore) -> None:
    table = store.create_table(TableConfig("t", DIM))
    np.testing.assert_array_equal(
        table.lookup(np.array([1, 2], dtype=np.int32)),
        table.lookup(np.array([1, 2], dtype=np.int64)),
    )


def test_gathered_rows_say_where_they_came_from(store: EmbeddingStore) -> None:
    """peek reports each row's origin: a tier (and which), or the initializer; an
    admission refusal and a bucket row have origins of their own."""
    config = TableConfig("t", DIM, optimizer=optim.SGD(lr=1.0), host_cache_bytes=1 << 20)
    table = store.create_table(config)
    table.lookup(np.arange(4, dtype=np.int64))  # stored in the host tier
    table.flush()
    gathered = table.peek(np.array([0, 1, 9], dtype=np.int64))
    np.testing.assert_array_equal(
        gathered.origin, [RowOrigin.TIER, RowOrigin.TIER, RowOrigin.INITIALIZER]
    )
    np.testing.assert_array_equal(gathered.level, [0, 0, -1])
    np.testing.assert_array_equal(gathered.rows[2], config.initial_rows(np.array([9]))[0])
    assert table.stats()["initialized"] == 4  # peek stores and counts nothing

    admit = store.create_table(TableConfig("admit", DIM, admit_after=2, default_value=0.5))
    refused = admit.peek(np.array([3], dtype=np.int64))
    assert refused.origin[0] == RowOrigin.REFUSED and (refused.rows[0, :DIM] == 0.5).all()
    bucketed = store.create_table(
        TableConfig("adaptive", DIM, hash_bucket_size=8, promote_after=3)
    ).peek(np.array([3], dtype=np.int64))
    assert bucketed.origin[0] == RowOrigin.BUCKET


def test_the_fallbacks_run_in_order_after_the_stored_tiers(store: EmbeddingStore) -> None:
    config = TableConfig("t", DIM, admit_after=2)
    table = store.create_table(config)
    kinds = [type(fallback).__name__ for fallback in table.fallbacks]
    assert kinds == ["Admission", "Initializer"]
    keys = np.array([5, 6], dtype=np.int64)
    table.lookup(keys)  # the first sighting: refused
    assert export_dict(table) == {}
    table.lookup(keys)  # the second: admitted, initialised and stored
    assert sorted(export_dict(table)) == [5, 6]


def test_every_tier_declares_the_interface_and_its_capability(store: EmbeddingStore) -> None:
    """Tier is an ABC: a tier must implement every call (contains included); trains_in_place
    is a property, False unless a tier says otherwise."""

    class Partial(Tier):
        name = "partial"

        def find(self, keys):  # the rest left out
            raise AssertionError

    with pytest.raises(TypeError, match="abstract"):
        Partial()  # type: ignore[abstract]
    config = TableConfig("t", DIM, host_cache_bytes=1 << 20)
    direct = DirectTier(TableConfig("d", DIM, use_hashtable=False, capacity=10))
    host = CacheTier(config, 1 << 20)
    assert not direct.trains_in_place and not host.trains_in_place
    assert CacheTier(config, 1 << 20, trains_in_place=True).trains_in_place
    table = store.create_table(config)
    table.lookup(np.array([1, 2], dtype=np.int64))
    table.flush()
    probe = np.array([1, 3, 2], dtype=np.int64)
    for tier in table.tiers:  # the host tier and RocksDB
        np.testing.assert_array_equal(tier.contains(probe), [True, False, True])


def _reply_buffer(n: int, dim: int) -> tuple[bytearray, np.ndarray]:
    """A caller's reply buffer and the float32 [n, dim] view of it a lookup writes into."""
    buffer = bytearray(b"\xff" * (n * dim * 4))  # NaN bits: a row left unwritten shows
    return buffer, np.frombuffer(buffer, dtype=np.float32).reshape(n, dim)


@pytest.mark.parametrize("setup", ["host", "rocksdb_only", "direct"])
def test_lookup_out_writes_the_plain_lookups_rows_into_the_callers_buffer(
    tmp_path, setup: str
) -> None:
    """lookup(out=) on one store gives, in the caller's buffer, the rows a plain lookup
    gives on a twin store: host hits, rows only RocksDB holds, new rows, padding, repeats;
    and both leave the same rows stored."""
    dim = 8
    config = TableConfig(
        "t",
        dim,
        optimizer=optim.Adam(),  # stored rows are 3 * dim wide: only dim columns come out
        host_cache_bytes={"host": 1 << 20, "rocksdb_only": 0, "direct": 1 << 20}[setup],
        use_hashtable=setup != "direct",
        capacity=1000 if setup == "direct" else 0,
    )
    stored = np.arange(0, 400, 2, dtype=np.int64)
    values = np.random.default_rng(0).standard_normal((stored.size, dim), dtype=np.float32)
    paths = [tmp_path / "plain", tmp_path / "out"]
    for path in paths:
        with EmbeddingStore(path) as twin:
            twin.create_table(config).assign(stored, values)
    keys = np.array([4, 5, -1, 4, 398, 999, 6, 1, -3, 100, 5], dtype=np.int64)
    with EmbeddingStore(paths[0]) as plain, EmbeddingStore(paths[1]) as given:
        for twin in (plain, given):  # reopened: RocksDB holds every row; the host tier 4, 6
            twin.lookup("t", np.array([4, 6]))
        want = plain.lookup("t", keys)
        buffer, out = _reply_buffer(keys.size, dim)
        got = given.lookup("t", keys, out=out)
        assert got is out
        np.testing.assert_array_equal(np.frombuffer(buffer, np.float32).reshape(-1, dim), want)
        # independent of the cascade: assigned rows, initial rows for new keys, padding zeros
        np.testing.assert_array_equal(want[[0, 3]], values[[2, 2]])
        np.testing.assert_array_equal(want[4], values[199])
        np.testing.assert_array_equal(want[[1, 10]], config.initial_rows(np.array([5, 5]))[:, :dim])
        np.testing.assert_array_equal(want[[2, 8]], 0.0)
        # a hit in the host tier (written by the compiled pass there), and with create=False
        for create in (True, False):
            _, out = _reply_buffer(3, dim)
            given.lookup("t", np.array([6, 777, 6]), create=create, out=out)
            np.testing.assert_array_equal(
                out, plain.lookup("t", np.array([6, 777, 6]), create=create)
            )
        assert sorted(export_dict(given.table("t"))) == sorted(export_dict(plain.table("t")))


def test_lookup_out_is_refused_unless_a_writable_contiguous_float32_array_of_the_shape(
    store: EmbeddingStore,
) -> None:
    table = store.create_table(TableConfig("items", DIM))
    keys = np.array([1, 2, 3], dtype=np.int64)
    wrong = {
        "shape (3, 5)": np.zeros((3, 5), np.float32),
        "dtype float64": np.zeros((3, DIM), np.float64),
        "a non-contiguous array": np.zeros((3, 2 * DIM), np.float32)[:, ::2],
        "a read-only array": np.frombuffer(bytes(3 * DIM * 4), np.float32).reshape(3, DIM),
        "list": [[0.0] * DIM] * 3,
    }
    for got, out in wrong.items():
        with pytest.raises(InvalidArgumentError) as refused:
            table.lookup(keys, out=out)
        message = str(refused.value)
        assert "'items'" in message and "field 'out'" in message, message
        assert f"shape (3, {DIM})" in message and f"got {got}" in message, message
    assert table.stats()["created"] == 0 and export_dict(table) == {}  # refused: nothing stored


def _cascade_only(table) -> None:
    """The reference: this table's top tier makes no rows in place, so its first touches
    run the cascade (initial rows made, then inserted)."""
    table.tiers[0].can_insert_initial = lambda count: False


@pytest.mark.parametrize(
    "config",
    [
        TableConfig("t", 8, optimizer=optim.Adam(), host_cache_bytes=1 << 20),
        TableConfig("t", 8, optimizer=optim.SGD(), host_cache_bytes=1 << 20),  # rows: dim wide
        TableConfig("t", 8, optimizer=optim.Adagrad(), host_cache_bytes=1 << 20, steps_to_live=5),
    ],
    ids=["adam", "sgd", "adagrad-steps"],
)
def test_a_first_touch_made_in_place_is_the_cascades(tmp_path, config: TableConfig) -> None:
    """A first touch whose rows the host tier makes where it stores them (insert_initial)
    against the cascade on a twin store: the same answers, stored rows (state and step
    stamp too), counts and changed keys, through a push, a removal whose freed rows (their
    state trained off its fill) the next first touch reuses, a flush, and keys RocksDB may
    then hold (the cascade's, both) or not (in place again). An answer is a copy: training
    its rows afterwards leaves it as it was."""
    rng = np.random.default_rng(1)
    keys = 10**9 + rng.choice(10**9, 400, replace=False).astype(np.int64)
    first, second = keys[:300], keys[300:]
    within = np.arange(keys.min() + 1, keys.min() + 40, dtype=np.int64)  # none of them stored
    outside = np.arange(1, 50, dtype=np.int64)  # below every key RocksDB holds
    grads = rng.standard_normal((first.size, 8), dtype=np.float32)
    with EmbeddingStore(tmp_path / "made") as one, EmbeddingStore(tmp_path / "cascade") as two:
        made, reference = one.create_table(config), two.create_table(config)
        _cascade_only(reference)
        cursors = made.cursor(), reference.cursor()
        tier, made_in_place = made.tiers[0], []
        insert_initial = tier.insert_initial
        tier.insert_initial = lambda *args: (
            made_in_place.append(args[0].size),
            insert_initial(*args),
        )[-1]

        def both(call):
            answers = call(made), call(reference)
            if isinstance(answers[0], np.ndarray):
                assert answers[0].tobytes() == answers[1].tobytes()
            else:
                assert answers[0] == answers[1]
            return answers[0]

        answer = both(lambda t: t.lookup(first))
        kept = answer.copy()
        both(lambda t: t.apply_gradients(first, grads, 1))
        assert answer.tobytes() == kept.tobytes()  # not a view of the rows just trained
        assert not np.array_equal(both(lambda t: t.lookup(first)), kept)
        both(lambda t: t.remove(first[::2]))  # 150 rows freed, their state trained
        high = tier._high
        _, out = _reply_buffer(second.size, 8)
        assert both(lambda t: t.lookup(second, out=out.copy())).shape == (second.size, 8)
        assert tier._high == high  # the 100 new rows took freed ones
        both(lambda t: t.flush())
        both(lambda t: t.lookup(within))  # RocksDB may hold them: the cascade
        both(lambda t: t.lookup(outside))
        assert made_in_place == [first.size, second.size, outside.size]
        every = np.concatenate([keys, within, outside])
        assert made.peek(every).rows.tobytes() == reference.peek(every).rows.tobytes()
        stored, wanted = export_dict(made), export_dict(reference)
        assert sorted(stored) == sorted(wanted)
        assert all(stored[k].tobytes() == wanted[k].tobytes() for k in stored)
        assert made.stats() == reference.stats()
        changed = made.changed_since(cursors[0]), reference.changed_since(cursors[1])
        np.testing.assert_array_equal(changed[0][0], changed[1][0])
