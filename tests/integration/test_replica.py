"""Read-only replica shards (server/replica.py), in process: a training cluster of 2 shards
and a replica cluster of 3 following it, read through the same EmbeddingClient. The oracle
is the training cluster's own lookups (create=false), and numpy's bfloat16 rounding bound
for a bfloat16 replica."""

from __future__ import annotations

import io
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tierps.client import EmbeddingClient
from tierps.client.admin import ShardError
from tierps.client.top import frame, render, take_sample
from tierps.core.errors import Reason, TableNotFoundError
from tierps.proto import tierps_service_pb2 as pb
from tierps.storage import TableConfig, init, optim

DIM = 8
TRAINING_SHARDS = 2
REPLICA_SHARDS = 3
CONVERGE_S = 15.0


def start_training(shard_server: Any) -> tuple[list[Any], EmbeddingClient]:
    servers = [shard_server(i, TRAINING_SHARDS) for i in range(TRAINING_SHARDS)]
    return servers, EmbeddingClient([f"127.0.0.1:{s.port}" for s in servers])


def start_replicas(
    shard_server: Any, training: list[Any], count: int = REPLICA_SHARDS, **fields: Any
) -> tuple[list[Any], EmbeddingClient]:
    follow = tuple(f"127.0.0.1:{s.port}" for s in training)
    servers = [shard_server(i, count, follow=follow, **fields) for i in range(count)]
    return servers, EmbeddingClient([f"127.0.0.1:{s.port}" for s in servers])


def converged(
    training: EmbeddingClient,
    replica: EmbeddingClient,
    table: str,
    keys: np.ndarray,
    same: Callable[[np.ndarray, np.ndarray], bool] = np.array_equal,
) -> tuple[np.ndarray, np.ndarray]:
    """Poll until the replica serves what the training cluster serves for keys (lookups
    create=false on both); (training's rows, replica's rows) at the end."""
    expected = training.lookup(table, keys, create=False)
    deadline = time.monotonic() + CONVERGE_S
    while True:
        try:
            got = replica.lookup(table, keys, create=False)
        except (ShardError, TableNotFoundError) as error:  # not on every replica shard yet
            missing = isinstance(error, TableNotFoundError) or (
                error.reason is Reason.TABLE_NOT_FOUND
            )
            # or created again with another dim: the client forgot the dim it knew, and its
            # next call learns the table's
            recreated = isinstance(error, ShardError) and error.facts.get("field") == "dim"
            if not (missing or recreated) or time.monotonic() > deadline:
                raise
            got = None
        if got is not None and same(got, expected):
            return expected, got
        if time.monotonic() > deadline:
            return expected, got
        time.sleep(0.05)


def train(client: EmbeddingClient, table: str, steps: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    touched = []
    for step in range(1, steps + 1):
        keys = rng.integers(0, 20_000, 3000)
        grads = rng.normal(size=(keys.size, DIM)).astype(np.float32)
        client.push_gradients(table, keys, grads, step=step)
        touched.append(keys)
    return np.unique(np.concatenate(touched))


def test_replicas_serve_the_training_rows_bit_for_bit(shard_server: Any) -> None:
    training, trainer = start_training(shard_server)
    config = TableConfig(
        "items", DIM, optimizer=optim.Adagrad(lr=0.1), initializer=init.Normal(std=0.1), seed=7
    )
    trainer.create_table(config)
    touched = train(trainer, "items", 4, seed=1)
    replicas, reader = start_replicas(shard_server, training)
    expected, got = converged(trainer, reader, "items", touched)
    np.testing.assert_array_equal(got, expected)

    # changes after the resync arrive as changes; keys never pushed read the initializer
    more = train(trainer, "items", 3, seed=2)
    keys = np.union1d(touched, more)
    never = np.arange(50_000, 50_100)
    expected, got = converged(trainer, reader, "items", np.concatenate([keys, never]))
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[-100:], config.initial_rows(never)[:, :DIM])

    # each replica shard holds its own cluster's keys only (k % 3), and all of them
    for shard_id, server in enumerate(replicas):
        table = server.shard.store.table("items")
        held, _, missing = table.read_stored(keys)
        np.testing.assert_array_equal(held, keys[keys % REPLICA_SHARDS == shard_id])
        assert table.config.optimizer == optim.SGD() and table.config.row_width == DIM

    # lag figures: every stream at its head once converged
    for described in reader.describe("items"):
        assert described["lifecycle"]["replica.lag_positions"] == 0.0
        assert described["lifecycle"]["replica.lag_s"] == 0.0
    trainer.close()
    reader.close()


def test_an_evicted_row_is_gone_from_the_replica(shard_server: Any) -> None:
    training, trainer = start_training(shard_server)
    config = TableConfig("t", DIM, optimizer=optim.SGD(lr=1.0), min_l2_norm=0.5, seed=3)
    trainer.create_table(config)
    replicas, reader = start_replicas(shard_server, training)
    keys = np.arange(0, 600)
    trainer.assign("t", keys, np.ones((keys.size, DIM), np.float32))
    converged(trainer, reader, "t", keys)
    small = keys[:60]
    trainer.assign("t", small, np.full((small.size, DIM), 0.01, np.float32))
    assert trainer.evict("t")["removed"] == small.size
    expected, got = converged(trainer, reader, "t", keys)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[:60], config.initial_rows(small)[:, :DIM])
    for server in replicas:
        held, _, _ = server.shard.store.table("t").read_stored(small)
        assert held.size == 0, held
    trainer.close()
    reader.close()


def test_a_bfloat16_replica_is_within_bfloat16_rounding(shard_server: Any) -> None:
    training, trainer = start_training(shard_server)
    trainer.create_table(TableConfig("b", DIM, optimizer=optim.SGD(lr=0.5), seed=5))
    touched = train(trainer, "b", 3, seed=4)
    replicas, reader = start_replicas(shard_server, training, count=1, replica_dtype="bfloat16")
    # bfloat16 keeps 8 significant bits (7 stored): rounding to nearest is off by at most
    # half a unit in the last place, 2**-8 of the value's magnitude
    bound = 2.0**-8

    def close(got: np.ndarray, expected: np.ndarray) -> bool:
        return bool(np.all(np.abs(got - expected) <= bound * np.abs(expected)))

    expected, got = converged(trainer, reader, "b", touched, close)
    assert close(got, expected), np.max(np.abs(got - expected) / np.abs(expected))
    # rows the replica flushed and read back from RocksDB are rounded: not all bit-exact
    server = replicas[0]
    server.shard.store.flush()
    stored = {}
    for chunk_keys, rows in server.shard.store.table("b").durable.export(4096):
        stored.update(zip(chunk_keys.tolist(), rows[:, :DIM], strict=True))
    cold = np.stack([stored[int(k)] for k in touched])
    assert close(cold, expected) and not np.array_equal(cold, expected)
    assert server.shard.store.table("b").config.cold_dtype == "bfloat16"
    trainer.close()
    reader.close()


def test_every_write_is_refused_read_only_and_changes_nothing(shard_server: Any) -> None:
    training, trainer = start_training(shard_server)
    trainer.create_table(TableConfig("w", DIM, optimizer=optim.SGD(lr=1.0), min_l2_norm=0.1))
    keys = np.arange(100)
    trainer.assign("w", keys, np.ones((keys.size, DIM), np.float32))
    replicas, reader = start_replicas(shard_server, training, count=1)
    before, _ = converged(trainer, reader, "w", keys)
    grads = np.ones((keys.size, DIM), np.float32)
    writes: dict[str, Callable[[], object]] = {
        "PushGradients": lambda: reader.push_gradients("w", keys, grads, step=9),
        "Assign": lambda: reader.assign("w", keys, grads),
        "Lookup create=true": lambda: reader.lookup("w", np.arange(900, 910), create=True),
        "CreateTable": lambda: reader.create_table(TableConfig("new", DIM)),
        "DropTable": lambda: reader.drop_table("w"),
        "Evict": lambda: reader.evict("w"),
        "LoadSnapshot": lambda: reader.load_snapshot("any"),
        "SaveSnapshot": lambda: reader.save_snapshot("s"),
    }
    follows = ",".join(f"127.0.0.1:{s.port}" for s in training)
    for what, write in writes.items():
        with pytest.raises(ShardError) as refused:
            write()
        assert refused.value.reason is Reason.READ_ONLY, (what, refused.value)
        assert refused.value.code.name == "FAILED_PRECONDITION", what
        assert "shard 0 of 1" in refused.value.details and follows in refused.value.details
    assert [t.name for t in reader.list_tables()] == ["w"]
    np.testing.assert_array_equal(reader.lookup("w", keys, create=False), before)
    table = replicas[0].shard.store.table("w")
    assert table.read_stored(np.arange(900, 910))[0].size == 0
    assert table.current_step == 0
    trainer.close()
    reader.close()


def test_raw_writes_and_creating_lookups_are_refused(shard_server: Any, connect: Any) -> None:
    training, trainer = start_training(shard_server)
    trainer.create_table(TableConfig("p", DIM, optimizer=optim.SGD(lr=1.0)))
    replicas, reader = start_replicas(shard_server, training, count=1)
    converged(trainer, reader, "p", np.arange(10))
    stubs = connect(replicas[0])
    keys = np.arange(5, dtype="<i8").tobytes()
    batch = pb.LookupRequest(table="p", dim=DIM, keys=keys, create=True)
    calls = {
        "PushThenLookup": lambda: stubs.embedding.PushThenLookup(pb.PushThenLookupRequest()),
        "PushGradientsUnary": lambda: stubs.embedding.PushGradientsUnary(pb.PushGradientsBatches()),
        "LookupUnary": lambda: stubs.embedding.LookupUnary(pb.LookupBatches(batches=[batch])),
        "Lookup": lambda: list(stubs.embedding.Lookup(iter([batch]))),
        "DeleteSnapshot": lambda: stubs.admin.DeleteSnapshot(pb.DeleteSnapshotRequest(name="s")),
    }
    for method, call in calls.items():
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION, method
        assert method in refused.value.details() and "read-only replica" in refused.value.details()
    assert replicas[0].shard.store.table("p").read_stored(np.arange(5))[0].size == 0
    # reads pass: the replica's Stats names its tables
    stats = stubs.admin.Stats(pb.StatsRequest())
    assert stats.shard_id == 0 and [t.config.name for t in stats.tables] == ["p"]
    assert "replica.lag_s" in stats.tables[0].lifecycle
    trainer.close()
    reader.close()


def test_lag_in_stats_metrics_and_top(shard_server: Any) -> None:
    training, trainer = start_training(shard_server)
    trainer.create_table(TableConfig("l", DIM, optimizer=optim.SGD(lr=1.0)))
    keys = train(trainer, "l", 2, seed=6)
    replicas, reader = start_replicas(shard_server, training, count=1, metrics_port=0)
    converged(trainer, reader, "l", keys)
    sample = take_sample(reader)
    time.sleep(0.3)
    figures = frame(sample, take_sample(reader), reader.addresses)
    assert figures["tables"][0]["lag_s"] == 0.0 and figures["tables"][0]["lag_positions"] == 0
    assert "0.00 s, 0 changes" in _rendered(figures)

    # a training shard gone: the replica is behind since it last heard it was current
    training[1].stop(grace_s=0)
    time.sleep(1.0)
    lag = reader.describe("l")[0]["lifecycle"]["replica.lag_s"]
    assert 0.8 <= lag < 30, lag
    url = f"http://127.0.0.1:{replicas[0].metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        scraped = {
            (family.name, sample.labels.get("table")): sample.value
            for family in text_string_to_metric_families(reply.read().decode())
            for sample in family.samples
        }
    assert scraped[("tierps_replica_lag_seconds", "l")] >= 0.8
    assert ("tierps_replica_lag_positions", "l") in scraped
    trainer.close()
    reader.close()


def _rendered(figures: dict[str, Any]) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render(figures))
    return console.export_text()
