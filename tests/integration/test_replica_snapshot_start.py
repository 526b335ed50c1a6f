"""A new replica starts from the newest snapshot chain in the training cluster's snapshot dir,
then follows the changes since its cut (server/replica.py, seed_from_snapshot): it reads the
rows from the snapshot, not from the training shards, and resyncs only the tables whose
training shard can no longer answer from the cut. Real in-process shard servers over one
shared snapshot dir; the oracle is the training cluster's own lookups (create=false)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.integration.test_replica import converged, start_replicas, start_training, train
from tierps.storage import TableConfig, init, optim

DIM = 8


def resyncs(replicas: list[Any]) -> int:
    return sum(f.resyncs for server in replicas for f in server.shard.replica.followers)


def test_a_new_replica_starts_from_the_newest_chain_and_follows_from_its_cut(
    shard_server: Any,
) -> None:
    training, trainer = start_training(shard_server)
    config = TableConfig("items", DIM, optimizer=optim.Adam(lr=0.05), initializer=init.Normal())
    trainer.create_table(config)
    touched = [train(trainer, "items", 3, seed=1)]
    trainer.save_snapshot("full")
    touched.append(train(trainer, "items", 2, seed=2))
    trainer.save_snapshot("incremental", base="full")
    touched.append(train(trainer, "items", 2, seed=3))  # after the cut: sent as changes
    keys = np.unique(np.concatenate(touched))

    replicas, reader = start_replicas(shard_server, training, count=3)
    expected, got = converged(trainer, reader, "items", keys)
    np.testing.assert_array_equal(got, expected)
    assert resyncs(replicas) == 0  # every stream asked from the snapshot's cut
    # pooled lookups read a replica as they read the training cluster (mean of 4-key bags)
    bags = np.concatenate([keys[:398], np.arange(90_000, 90_002)]).reshape(-1, 4)
    pooled = [
        client.lookup_pooled("items", bags, combiner="mean", create=False).output
        for client in (trainer, reader)
    ]
    np.testing.assert_array_equal(pooled[1], pooled[0])
    for server in replicas:
        assert server.shard.replica.seeded  # it read the chain
    trainer.close()
    reader.close()


def test_a_training_shard_restarted_since_the_cut_resyncs_its_keys(
    shard_server: Any, tmp_path: Any
) -> None:
    training, trainer = start_training(shard_server)
    trainer.create_table(TableConfig("items", DIM, optimizer=optim.SGD(lr=0.5)))
    touched = train(trainer, "items", 3, seed=4)
    trainer.save_snapshot("full")
    # shard 1 stops cleanly and starts again on its data dir: its journal starts over
    data_dir = training[1].config.data_dir
    training[1].stop(grace_s=0.5)
    training[1] = shard_server(1, 2, data_dir=data_dir, port=training[1].port)
    trainer.close()
    trainer = type(trainer)([f"127.0.0.1:{s.port}" for s in training])
    more = train(trainer, "items", 2, seed=5)
    keys = np.union1d(touched, more)

    replicas, reader = start_replicas(shard_server, training, count=2)
    expected, got = converged(trainer, reader, "items", keys)
    np.testing.assert_array_equal(got, expected)
    # shard 0 still answers from the cut; shard 1 cannot: one resync per replica shard
    per_stream = {
        (server.shard.shard_id, f.training_shard): f.resyncs
        for server in replicas
        for f in server.shard.replica.followers
    }
    assert per_stream == {(0, 0): 0, (0, 1): 1, (1, 0): 0, (1, 1): 1}, per_stream
    trainer.close()
    reader.close()
