"""The push ledger (server/ledger.py) over a real store: bounded, persisted, and one call of
an id at a time."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tierps.server import ledger
from tierps.server.ledger import KEY_PREFIX, PushId, PushLedger, parse_push_id
from tierps.storage import EmbeddingStore, InvalidArgumentError


def open_ledger(store: EmbeddingStore) -> PushLedger:
    return PushLedger(store.write_metadata, store.metadata(KEY_PREFIX), "shard 0 of 1")


def test_a_recorded_push_is_remembered_across_a_reopen(tmp_path: Path) -> None:
    with EmbeddingStore(tmp_path / "db") as store:
        book = open_ledger(store)
        push = PushId("c1", 5)
        assert book.begin(push) == {}
        book.end(push, {"a": 3, "b": 4})
    with EmbeddingStore(tmp_path / "db") as store:
        again = open_ledger(store)
        assert again.begin(push) == {"a": 3, "b": 4}
        again.end(push, {"a": 3, "b": 4})
        assert again.begin(PushId("c1", 6)) == {}


def test_the_record_is_bounded_and_what_it_forgets_leaves_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ledger, "RECENT_PER_CLIENT", 3)
    monkeypatch.setattr(ledger, "RECENT_CLIENTS", 2)
    with EmbeddingStore(tmp_path / "db") as store:
        book = open_ledger(store)
        for client in ("a", "b", "c"):
            for sequence in range(1, 6):
                push = PushId(client, sequence)
                book.begin(push)
                book.end(push, {"t": 1})
        assert book.size == 2 * 3
        kept = sorted(key[len(KEY_PREFIX) :].decode() for key, _ in store.metadata(KEY_PREFIX))
        assert kept == [f"{c}/{s:020d}" for c in ("b", "c") for s in (3, 4, 5)]
        assert book.begin(PushId("a", 5)) == {}  # forgotten: a new call
        book.end(PushId("a", 5), {})


def test_a_second_call_of_one_id_waits_for_the_first(tmp_path: Path) -> None:
    with EmbeddingStore(tmp_path / "db") as store:
        book = open_ledger(store)
        push = PushId("c", 1)
        book.begin(push)
        seen: list[dict[str, int]] = []
        other = threading.Thread(target=lambda: seen.append(book.begin(push)))
        other.start()
        time.sleep(0.2)
        assert seen == []  # still waiting
        book.end(push, {"t": 2})
        other.join(5)
        assert seen == [{"t": 2}]


@pytest.mark.parametrize(
    "value", ["", "x", ":1", "a:", "a:-1", "a b:1", "é:1", "a:" + "9" * 20, "a" * 65 + ":1"]
)
def test_a_malformed_push_id_is_the_callers_error(value: str) -> None:
    with pytest.raises(InvalidArgumentError, match="tierps-push-id"):
        parse_push_id(value)


def test_a_push_id_reads_back() -> None:
    assert parse_push_id("0f3a-b:42") == PushId("0f3a-b", 42)
    assert parse_push_id(None) is None


def test_records_of_many_tables_are_bounded_by_their_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call may name 1,024 tables: the record keeps its table entries within a bound, the
    least recently pushing client's oldest records going first."""
    monkeypatch.setattr(ledger, "RECENT_TABLE_ENTRIES", 10)
    with EmbeddingStore(tmp_path / "db") as store:
        book = open_ledger(store)
        for client in ("old", "new"):
            for sequence in (1, 2):
                push = PushId(client, sequence)
                book.begin(push)
                book.end(push, {f"t{i}": 1 for i in range(4)})  # 4 entries a record
        assert book.size == 2  # 16 entries > 10: old's two records went
        assert book.begin(PushId("old", 1)) == {}
        book.end(PushId("old", 1), {})
        assert book.begin(PushId("new", 2)) == {f"t{i}": 1 for i in range(4)}
        book.end(PushId("new", 2), {f"t{i}": 1 for i in range(4)})
