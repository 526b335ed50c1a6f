"""Which tables a replica follows: a table placed whole follows its owner in the replica's
own cluster; one placed whole on a shard the replica cluster does not have, and an adaptive
table (its bucket rows are not in the stream), are skipped, said in Stats, while the other
tables follow on. Real in-process shards; the oracle is the training cluster's lookups."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tests.integration.test_replica import converged, start_replicas, start_training
from tierps.storage import TableConfig, optim

DIM = 4


def test_tables_a_replica_cannot_hold_are_skipped_and_the_others_followed(
    shard_server: Any,
) -> None:
    training, trainer = start_training(shard_server)
    sgd = optim.SGD(lr=0.5)
    trainer.create_table(TableConfig("rows", DIM, optimizer=sgd))
    trainer.create_table(TableConfig("whole", DIM, optimizer=sgd, placement="table", table_shard=0))
    trainer.create_table(TableConfig("far", DIM, optimizer=sgd, placement="table", table_shard=1))
    trainer.create_table(
        TableConfig("adaptive", DIM, optimizer=sgd, hash_bucket_size=8, promote_after=2)
    )
    keys = np.arange(0, 300, 7)
    for name in ("rows", "whole", "far", "adaptive"):
        trainer.push_gradients(name, keys, np.ones((keys.size, DIM), np.float32))

    replicas, reader = start_replicas(shard_server, training, count=1)
    for name in ("rows", "whole"):
        expected, got = converged(trainer, reader, name, keys)
        np.testing.assert_array_equal(got, expected)
    (stats,) = reader.stats()
    described = {table["config"]["name"]: table for table in stats["tables"]}
    assert sorted(described) == ["adaptive", "far", "rows", "whole"]
    for name in ("far", "adaptive"):
        assert described[name]["lifecycle"]["replica.skipped"] == 1.0
    for name in ("rows", "whole"):
        assert "replica.skipped" not in described[name]["lifecycle"]
    assert all(f.connected for f in replicas[0].shard.replica.followers)  # no failing stream
    trainer.close()
    reader.close()


def test_a_table_dropped_and_created_again_under_the_replica_converges(shard_server: Any) -> None:
    """Each training shard's stream tells of the drop in its own round, maybe after another
    stream already sent rows of the new table: whichever drop comes last, no stream's rows
    stay missing (the other streams are asked again from no cursor: a resync)."""
    training, trainer = start_training(shard_server)
    replicas, reader = start_replicas(shard_server, training, count=1)
    rng = np.random.default_rng(11)
    for round_index in range(4):
        config = TableConfig("t", DIM + round_index % 2, optimizer=optim.SGD(lr=0.5))
        trainer.create_table(config)
        keys = np.unique(rng.integers(0, 5_000, 400))
        grads = rng.normal(size=(keys.size, config.dim)).astype(np.float32)
        trainer.push_gradients("t", keys, grads, step=1)
        if round_index % 2:  # the replica may be anywhere in the old table's rows
            time.sleep(0.05 * round_index)
        expected, got = converged(trainer, reader, "t", keys)
        np.testing.assert_array_equal(got, expected)
        held, _, _ = replicas[0].shard.store.table("t").read_stored(np.arange(5_000))
        np.testing.assert_array_equal(held, keys)  # none of an earlier table's rows stayed
        trainer.drop_table("t")
    trainer.close()
    reader.close()


def test_a_stream_told_to_resync_a_table_sends_it_again(shard_server: Any) -> None:
    """resync_later, which a drop by another stream calls: the stream ends, opens again
    without a cursor of the table, and the training shard resyncs it; the rows converge."""
    training, trainer = start_training(shard_server)
    trainer.create_table(TableConfig("t", DIM, optimizer=optim.SGD(lr=0.5)))
    keys = np.arange(0, 600, 5)
    trainer.push_gradients("t", keys, np.ones((keys.size, DIM), np.float32))
    replicas, reader = start_replicas(shard_server, training, count=1)
    converged(trainer, reader, "t", keys)
    follower = replicas[0].shard.replica.followers[1]
    before = follower.resyncs
    follower.resync_later("t")
    deadline = time.monotonic() + 10
    while follower.resyncs == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert follower.resyncs == before + 1
    expected, got = converged(trainer, reader, "t", keys)
    np.testing.assert_array_equal(got, expected)
    trainer.close()
    reader.close()
