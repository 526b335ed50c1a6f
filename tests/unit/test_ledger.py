"""The push ledger (server/ledger.py) over a real store: bounded, persisted, and one call of
an id at a time."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tierps.server import ledger
from tierps.server.ledger import KEY_PREFIX, PushId, PushLedger, parse_push_id
from tierps.storage import EmbeddingStore, InvalidArgumentError


def open_ledger(store: EmbeddingStore) -> PushLedger:
    return PushLedger(store.write_metadata_many, store.metadata(KEY_PREFIX), "shard 0 of 1")


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


def test_a_records_writes_land_together_in_one_write(tmp_path: Path) -> None:
    """write_metadata_many: puts and deletes of the shard's records in one write, all there
    after a reopen."""
    with EmbeddingStore(tmp_path / "db") as store:
        store.write_metadata_many([(KEY_PREFIX + b"a", b"1"), (KEY_PREFIX + b"b", b"2")])
        store.write_metadata_many([(KEY_PREFIX + b"a", None), (KEY_PREFIX + b"c", b"3")])
        store.write_metadata_many([])
    with EmbeddingStore(tmp_path / "db") as store:
        assert store.metadata(KEY_PREFIX) == [(KEY_PREFIX + b"b", b"2"), (KEY_PREFIX + b"c", b"3")]


# A process that records pushes of one client as fast as it can, each call forgetting the
# oldest (RECENT_PER_CLIENT 4), and prints each sequence once end() returned (acknowledged).
_RECORDING = """
import sys
from tierps.server import ledger
from tierps.server.ledger import KEY_PREFIX, PushId, PushLedger
from tierps.storage import EmbeddingStore

ledger.RECENT_PER_CLIENT = 4
store = EmbeddingStore(sys.argv[1])
book = PushLedger(store.write_metadata_many, store.metadata(KEY_PREFIX), "shard 0 of 1")
sequence = int(sys.argv[2])
while True:
    sequence += 1
    push = PushId("c", sequence)
    book.begin(push)
    book.end(push, {"t": sequence})
    print(sequence, flush=True)
"""


def test_a_call_writes_its_record_and_the_deletes_it_makes_in_one_write() -> None:
    """What makes the record and its deletes atomic: end() hands both to ONE write (the
    store's write_metadata_many, a RocksDB WriteBatch), never a write each."""
    writes: list[list[tuple[bytes, bytes | None]]] = []
    book = PushLedger(writes.append, [], "shard 0 of 1")
    bound = ledger.RECENT_PER_CLIENT
    for sequence in range(1, bound + 3):
        book.begin(PushId("c", sequence))
        book.end(PushId("c", sequence), {"t": sequence})
    assert len(writes) == bound + 2  # one write a call
    assert writes[0] == [(PushLedger.key(PushId("c", 1)), b'{"t": 1}')]
    # the last call forgets the oldest record beyond the bound, in the same write
    assert writes[-1] == [
        (PushLedger.key(PushId("c", 2)), None),
        (PushLedger.key(PushId("c", bound + 2)), json.dumps({"t": bound + 2}).encode()),
    ]


@pytest.mark.slow  # real subprocesses killed: seconds
def test_a_killed_shard_keeps_each_record_with_the_ones_it_forgot(tmp_path: Path) -> None:
    """kill -9 while a shard records pushes (each record written with the deletes of the one
    it makes the ledger forget): reopened, RocksDB holds the last acknowledged records (or
    the one after them, written but not yet acknowledged), never more than the bound and
    never with a gap: a record never lands without its deletes, nor they without it."""
    path = tmp_path / "db"
    acknowledged = 0
    for _ in range(3):
        with subprocess.Popen(
            [sys.executable, "-c", _RECORDING, str(path), str(acknowledged)],
            stdout=subprocess.PIPE,
            text=True,
        ) as child:
            assert child.stdout is not None
            for _ in range(200 + random.randrange(200)):
                line = child.stdout.readline()
                assert line, "the recording process ended"
                acknowledged = int(line)
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            acknowledged = max([acknowledged, *map(int, child.stdout.read().split())])
        with EmbeddingStore(path) as store:
            stored = store.metadata(KEY_PREFIX)
        sequences = [int(key.rsplit(b"/", 1)[1]) for key, _ in stored]
        last = sequences[-1]
        assert last in (acknowledged, acknowledged + 1), (sequences, acknowledged)
        assert sequences == list(range(last - 3, last + 1)), sequences
        assert [json.loads(value) for _, value in stored] == [{"t": s} for s in sequences]
        acknowledged = last
