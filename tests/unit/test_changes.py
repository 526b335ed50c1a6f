"""The change journal (storage/changes.py) and the table's use of it: a follower that copies
only the changes since its cursor ends with exactly the rows the table exports, whatever
mix of pushes, training lookups, assigns, restores, evictions and removals ran between."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import export_dict
from tierps.storage import EmbeddingStore, TableConfig, optim
from tierps.storage.changes import ChangeJournal, Cursor

DIM = 4


def test_journal_tells_the_keys_since_a_cursor_once_each() -> None:
    journal = ChangeJournal()
    start = journal.cursor()
    assert start.position == 0
    journal.record(np.array([5, 3, 5]))
    middle = journal.cursor()
    journal.record(np.array([9, -1, 3]))
    keys, head = journal.since(start)
    np.testing.assert_array_equal(keys, [3, 5, 9])
    assert head == Cursor(journal.id, 2)
    keys, _ = journal.since(middle)
    np.testing.assert_array_equal(keys, [3, 9])
    keys, same = journal.since(head)
    assert keys.size == 0 and same == head
    journal.record(np.array([-4]))  # padding only: not a change
    assert journal.cursor() == head


def test_journal_refuses_cursors_it_cannot_answer() -> None:
    journal = ChangeJournal(max_keys=10)
    start = journal.cursor()
    assert journal.since(Cursor("another journal", 0)) is None
    assert journal.since(Cursor(journal.id, 1)) is None  # beyond the head
    for first in range(0, 30, 5):
        journal.record(np.arange(first, first + 5))
    assert journal.since(start) is None  # let go of
    kept = Cursor(journal.id, journal.oldest)
    keys, _ = journal.since(kept)
    assert keys.size <= 10 and set(keys.tolist()) == set(range(30 - keys.size, 30))
    assert journal.time_of(journal.head) == journal.head_time
    assert journal.time_of(0) is None


@pytest.mark.parametrize("max_batches", [2, 5, 70, 4096])
def test_merged_batches_tell_every_change_since_a_cursor(max_batches: int) -> None:
    """Against the record itself: the keys since each cursor are at least those recorded
    after it (a merged batch may add some recorded before), never a key not recorded."""
    journal = ChangeJournal(max_batches=max_batches)
    rng = np.random.default_rng(max_batches)
    recorded: list[np.ndarray] = []
    cursors = [journal.cursor()]
    for _ in range(300):
        keys = rng.integers(0, 200, rng.integers(1, 9))
        journal.record(keys)
        recorded.append(keys)
        cursors.append(journal.cursor())
        assert journal.stats()["batches"] <= max_batches
    everything = set(np.concatenate(recorded).tolist())
    for cursor in cursors:
        told, head = journal.since(cursor)
        truth = set(np.concatenate(recorded[cursor.position :] or [np.empty(0, np.int64)]).tolist())
        assert truth <= set(told.tolist()) <= everything
        assert np.all(np.diff(told) > 0)  # ascending, distinct
        assert head == cursors[-1]
        if max_batches == 4096:
            assert set(told.tolist()) == truth
        when = journal.time_of(cursor.position + 1)
        assert (when is None) == (cursor == head)


def test_cursor_round_trips_as_text() -> None:
    cursor = Cursor("ab12", 77)
    assert Cursor.decoded(cursor.encoded()) == cursor
    with pytest.raises(ValueError, match="JOURNAL:POSITION"):
        Cursor.decoded("no-position")


class Follower:
    """A mirror of a table's stored rows kept only from the journal, as a replica does."""

    def __init__(self, table) -> None:
        self.table = table
        self.cursor = Cursor("none", 0)
        self.rows: dict[int, np.ndarray] = {}

    def catch_up(self) -> None:
        got = self.table.changed_since(self.cursor)
        if got is None:  # resync: the whole table
            self.rows = dict(export_dict(self.table))
            self.cursor = self.table.cursor()
            got = self.table.changed_since(self.cursor)
        keys, self.cursor = got
        held, rows, gone = self.table.read_stored(keys)
        width = self.table.config.row_width
        self.rows.update(zip(held.tolist(), rows[:, :width], strict=True))
        for key in gone.tolist():
            self.rows.pop(key, None)


@pytest.mark.parametrize("host_bytes", [0, 4096])
def test_follower_of_changes_matches_the_table(store: EmbeddingStore, host_bytes: int) -> None:
    config = TableConfig(
        "t", DIM, optimizer=optim.Adagrad(lr=0.1), steps_to_live=3, host_cache_bytes=host_bytes
    )
    table = store.create_table(config)
    follower = Follower(table)
    rng = np.random.default_rng(7)
    for step in range(1, 40):
        keys = rng.integers(0, 300, size=rng.integers(1, 60))
        kind = step % 6
        if kind in (0, 1):
            table.apply_gradients(keys, rng.normal(size=(keys.size, DIM)).astype(np.float32), step)
        elif kind == 2:
            table.lookup(keys, create=True)
        elif kind == 3:
            table.assign(keys, rng.normal(size=(keys.size, DIM)).astype(np.float32))
        elif kind == 4:
            table.evict()
        else:
            table.remove(keys[: keys.size // 2])
        if step % 4 == 0:
            follower.catch_up()
            expected = export_dict(table)
            assert sorted(follower.rows) == sorted(expected)
            for key, row in expected.items():
                np.testing.assert_array_equal(follower.rows[key], row)
    assert table.cursor().position > 0


def test_a_new_table_object_starts_a_new_journal(store: EmbeddingStore) -> None:
    table = store.create_table(TableConfig("t", DIM))
    table.assign(np.arange(3), np.ones((3, DIM), np.float32))
    old = table.cursor()
    store.drop_table("t")
    table = store.create_table(TableConfig("t", DIM))
    assert table.changed_since(old) is None
