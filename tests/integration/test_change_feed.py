"""The Follow stream of a real shard server (server/change_feed.py): a follower that applies
its batches to a plain dict holds exactly the weights the shard serves for the follower's
keys, through resyncs, pushes, assigns, evictions and a snapshot load under it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from tierps.client import EmbeddingClient
from tierps.proto import tierps_service_pb2 as pb
from tierps.storage import TableConfig, optim

DIM = 8


class DictFollower:
    """Applies a Follow stream's batches to {table: {key: weights}}, on its own thread."""

    def __init__(self, stubs: Any, shard: int, shard_count: int) -> None:
        self.rows: dict[str, dict[int, np.ndarray]] = {}
        self.cursors: dict[str, str] = {}
        self.resyncs: list[str] = []  # tables whose resync began, in order
        self.resynced: list[str] = []  # tables whose resync ended
        self._sent_in_resync: dict[str, set[int]] = {}
        self._cond = threading.Condition()
        self._call = stubs.changes.Follow(pb.FollowRequest(shard=shard, shard_count=shard_count))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for batch in self._call:
                self._apply(batch)
        except grpc.RpcError as error:
            assert error.code() is grpc.StatusCode.CANCELLED, error

    def _apply(self, batch: pb.ChangeBatch) -> None:
        with self._cond:
            table = self.rows.setdefault(batch.table, {})
            if batch.dropped:
                del self.rows[batch.table]
                self.cursors.pop(batch.table, None)
            if batch.resync:
                self.resyncs.append(batch.table)
                self._sent_in_resync[batch.table] = set()
            keys = np.frombuffer(batch.keys, dtype="<i8")
            values = np.frombuffer(batch.values, dtype="<f4").reshape(keys.size, DIM)
            table.update(zip(keys.tolist(), values.copy(), strict=True))
            if batch.table in self._sent_in_resync:
                self._sent_in_resync[batch.table].update(keys.tolist())
            for key in np.frombuffer(batch.removed, dtype="<i8").tolist():
                table.pop(key, None)
            if batch.resync_done:
                self.resynced.append(batch.table)
                kept = self._sent_in_resync.pop(batch.table)
                for key in [k for k in table if k not in kept]:
                    del table[key]
            if batch.cursor:
                self.cursors[batch.table] = batch.cursor
            self._cond.notify_all()

    def wait_for(self, table: str, head_at_least: int, timeout_s: float = 10.0) -> None:
        """Until the table's cursor covers position head_at_least."""

        def reached() -> bool:
            cursor = self.cursors.get(table, "")
            return bool(cursor) and int(cursor.rpartition(":")[2]) >= head_at_least

        with self._cond:
            assert self._cond.wait_for(reached, timeout_s), (table, self.cursors)

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(5)


@pytest.fixture
def follower_of(connect: Any) -> Iterator[Any]:
    made: list[DictFollower] = []

    def make(server: Any, shard: int = 0, shard_count: int = 1) -> DictFollower:
        follower = DictFollower(connect(server), shard, shard_count)
        made.append(follower)
        return follower

    yield make
    for follower in made:
        follower.close()


def head_of(server: Any, table: str) -> int:
    return server.shard.store.table(table).cursor().position


def served(server: Any, table: str, keys: np.ndarray) -> np.ndarray:
    """What the shard holds now: its table's stored weights of keys (export: no oracle of
    ours, the table's own rows as RocksDB holds them after a flush)."""
    rows = {}
    for chunk_keys, chunk_rows in server.shard.store.table(table).export():
        rows.update(zip(chunk_keys.tolist(), chunk_rows[:, :DIM], strict=True))
    return {int(k): rows[int(k)] for k in keys if int(k) in rows}


def assert_mirrors(follower: DictFollower, server: Any, table: str, shard: int, count: int) -> None:
    stored = served(server, table, np.arange(100_000))
    owned = {k: v for k, v in stored.items() if k % count == shard}
    assert sorted(follower.rows[table]) == sorted(owned)
    for key, row in owned.items():
        np.testing.assert_array_equal(follower.rows[table][key], row)


def test_follower_gets_a_resync_then_each_change(shard_server: Any, follower_of: Any) -> None:
    server = shard_server()
    client = EmbeddingClient([f"127.0.0.1:{server.port}"])
    config = TableConfig("items", DIM, optimizer=optim.Adagrad(lr=0.1), min_l2_norm=0.05)
    client.create_table(config)
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 5000, 2000)
    client.push_gradients("items", keys, rng.normal(size=(keys.size, DIM)).astype(np.float32))
    follower = follower_of(server, shard=1, shard_count=3)
    follower.wait_for("items", head_of(server, "items"))
    assert follower.resyncs == ["items"]
    assert_mirrors(follower, server, "items", 1, 3)

    # pushes, an assign and an eviction after the resync arrive as changes, not a resync
    for step in range(2, 6):
        more = rng.integers(0, 8000, 500)
        grads = rng.normal(size=(more.size, DIM)).astype(np.float32)
        client.push_gradients("items", more, grads, step=step)
    client.assign("items", np.arange(30), np.full((30, DIM), 0.01, np.float32))  # small: evicted
    assert client.evict("items")["removed"] >= 30
    follower.wait_for("items", head_of(server, "items"))
    assert follower.resyncs == ["items"]
    assert_mirrors(follower, server, "items", 1, 3)
    assert not set(range(30)) & set(follower.rows["items"])  # tombstoned
    client.close()


def test_a_load_or_a_drop_under_the_follower_is_told(shard_server: Any, follower_of: Any) -> None:
    server = shard_server()
    client = EmbeddingClient([f"127.0.0.1:{server.port}"])
    client.create_table(TableConfig("a", DIM, optimizer=optim.SGD(lr=0.5)))
    client.create_table(TableConfig("b", DIM, optimizer=optim.SGD(lr=0.5)))
    keys = np.arange(0, 400, 3)
    client.push_gradients("a", keys, np.ones((keys.size, DIM), np.float32))
    client.save_snapshot("base")
    follower = follower_of(server)
    follower.wait_for("a", head_of(server, "a"))
    client.push_gradients("a", keys, np.ones((keys.size, DIM), np.float32), step=2)
    client.load_snapshot("base")  # a new generation: the journal starts over, a resync
    client.drop_table("b")
    with follower._cond:
        # the new journal's positions start over: wait for the resync's end, not a position
        assert follower._cond.wait_for(lambda: follower.resynced.count("a") == 2, 10)
    follower.wait_for("a", head_of(server, "a"))
    assert_mirrors(follower, server, "a", 0, 1)
    with follower._cond:
        assert follower._cond.wait_for(lambda: "b" not in follower.rows, 10)
    client.close()


def test_follow_refuses_a_bad_request(connect: Any, shard_server: Any) -> None:
    stubs = connect(shard_server())
    with pytest.raises(grpc.RpcError) as refused:
        next(iter(stubs.changes.Follow(pb.FollowRequest(shard=2, shard_count=2))))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "shard 2 of 2" in refused.value.details()
    bad = pb.FollowRequest(shard=0, shard_count=1, cursors=[pb.FollowCursor(table="t", cursor="x")])
    with pytest.raises(grpc.RpcError) as refused:
        next(iter(stubs.changes.Follow(bad)))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "JOURNAL:POSITION" in refused.value.details()
