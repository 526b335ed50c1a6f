"""Which tables a replica follows: a table placed whole follows its owner in the replica's
own cluster; one placed whole on a shard the replica cluster does not have, and an adaptive
table (its bucket rows are not in the stream), are skipped, said in Stats, while the other
tables follow on. Real in-process shards; the oracle is the training cluster's lookups."""

from __future__ import annotations

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
