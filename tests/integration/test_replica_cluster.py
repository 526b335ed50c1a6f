"""Replica clusters as real subprocesses (LocalCluster with follow=): a training cluster of
2 shards behind tokens and a replica cluster of 3 following it with a replica token. Each
side is compared row by row with the training cluster's own lookups (create=false), through
kill -9 and restart of a replica shard (it resumes from its saved cursors) and of a training
shard (the replicas resync its tables, rows it lost included)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from tests.integration.test_crash_safety import free_base_port
from tierps.client import ChannelSecurity, EmbeddingClient, ShardError
from tierps.core.errors import Reason, TableNotFoundError
from tierps.server.cluster import LocalCluster
from tierps.server.config import REPLICA_TOKEN_ENV
from tierps.storage import TableConfig, init, optim

pytestmark = pytest.mark.slow  # five shard subprocesses, killed and restarted

DIM = 8
TOKENS = {
    "admin": "admin-token-0123456789abcdef",
    "trainer": "trainer-token-0123456789abcdef",
    "reader": "reader-token-0123456789abcdef",
    "replica": "replica-token-0123456789abcdef",
}
TABLE = TableConfig(
    "items", DIM, optimizer=optim.Adagrad(lr=0.1), initializer=init.Normal(std=0.1), seed=11
)
CONVERGE_S = 30.0


@dataclass
class Clusters:
    training: LocalCluster
    replicas: LocalCluster
    trainer: EmbeddingClient
    admin: EmbeddingClient  # of the training cluster

    def client(self, role: str, replicas: bool = True) -> EmbeddingClient:
        cluster = self.replicas if replicas else self.training
        return EmbeddingClient(
            cluster.addresses, timeout_s=20, security=ChannelSecurity(token=TOKENS[role])
        )


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: Any) -> Iterator[Clusters]:
    root = tmp_path_factory.mktemp("replica-cluster")
    tokens = root / "tokens"
    tokens.write_text("".join(f"{role}:{token}\n" for role, token in TOKENS.items()))
    serve_args = ("--tokens-file", str(tokens))
    with pytest.MonkeyPatch.context() as env:
        env.setenv(REPLICA_TOKEN_ENV, TOKENS["replica"])  # the replicas' daemons inherit it
        training = LocalCluster(
            2, root / "training", base_port=free_base_port(2), extra_args=serve_args
        )
        replicas = LocalCluster(
            3, root / "replicas", extra_args=(*serve_args, "--replica-save-s", "1"), follow=()
        )
        with training:
            replicas.follow = tuple(training.addresses)
            with replicas:
                admin = EmbeddingClient(
                    training.addresses,
                    timeout_s=20,
                    security=ChannelSecurity(token=TOKENS["admin"]),
                )
                admin.create_table(TABLE)
                both = Clusters(training, replicas, admin, admin)
                yield both
                admin.close()


def push(client: EmbeddingClient, steps: range, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    touched = []
    for step in steps:
        keys = rng.integers(0, 30_000, 4000)
        grads = rng.normal(size=(keys.size, DIM)).astype(np.float32)
        client.push_gradients(TABLE.name, keys, grads, step=step)
        touched.append(keys)
    return np.unique(np.concatenate(touched))


def assert_converges(both: Clusters, keys: np.ndarray) -> None:
    """The replicas serve, row by row and bit for bit, what a fresh admin client of the
    training cluster reads (create=false) for keys, within CONVERGE_S."""
    with both.client("admin", replicas=False) as training:
        expected = training.lookup(TABLE.name, keys, create=False)
    deadline = time.monotonic() + CONVERGE_S
    got = None
    while time.monotonic() < deadline:
        with both.client("reader") as reader:
            try:
                got = reader.lookup(TABLE.name, keys, create=False)
            except (ShardError, TableNotFoundError):
                got = None  # a replica shard restarting, or its table not created yet
        if got is not None and np.array_equal(got, expected):
            return
        time.sleep(0.2)
    assert got is not None, "the replicas never served the table"
    differ = np.flatnonzero(np.any(got != expected, axis=1))
    raise AssertionError(f"{differ.size} of {keys.size} rows differ, e.g. keys {keys[differ[:5]]}")


def log_lines(cluster: LocalCluster, shard_id: int, start: int = 0) -> list[dict[str, Any]]:
    text = (cluster.data_dir / f"shard-{shard_id}.log").read_bytes()[start:].decode()
    lines = []
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return lines


def test_replicas_mirror_training_and_tokens_hold(clusters: Clusters) -> None:
    keys = push(clusters.trainer, range(1, 6), seed=1)
    assert_converges(clusters, np.concatenate([keys, np.arange(90_000, 90_050)]))

    # a replica's token may follow, never write, on either cluster
    for replicas in (False, True):
        with clusters.client("replica", replicas) as follower:
            with pytest.raises(ShardError) as refused:
                follower.push_gradients(TABLE.name, keys[:4], np.ones((4, DIM), np.float32))
            assert refused.value.reason is Reason.ROLE_NOT_ALLOWED
            with pytest.raises(ShardError) as refused:
                follower.lookup(TABLE.name, keys[:4], create=False)
            assert refused.value.reason is Reason.ROLE_NOT_ALLOWED
    # an admin's token is refused writes on the replicas: they are read-only
    with clusters.client("admin") as admin:
        with pytest.raises(ShardError) as refused:
            admin.push_gradients(TABLE.name, keys[:4], np.ones((4, DIM), np.float32))
        assert refused.value.reason is Reason.READ_ONLY
        stats = admin.stats()
    assert [s["shard_id"] for s in stats] == [0, 1, 2]
    for shard in stats:
        lifecycle = shard["tables"][0]["lifecycle"]
        assert lifecycle["replica.lag_s"] >= 0 and lifecycle["replica.lag_positions"] >= 0


def test_a_replica_killed_and_restarted_resumes(clusters: Clusters) -> None:
    keys = push(clusters.trainer, range(10, 13), seed=2)
    assert_converges(clusters, keys)
    time.sleep(2.5)  # past a cursor save (--replica-save-s 1)
    clusters.replicas.stop_shard(1, sig=signal.SIGKILL)
    more = push(clusters.trainer, range(13, 16), seed=3)
    start = (clusters.replicas.data_dir / "shard-1.log").stat().st_size
    clusters.replicas.start_shard(1)
    assert_converges(clusters, np.union1d(keys, more))
    restarted = log_lines(clusters.replicas, 1, start)
    resyncs = [line for line in restarted if "resync of table" in line.get("msg", "")]
    assert not resyncs, resyncs  # resumed from the saved cursors: changes only


def test_a_training_shard_killed_and_restarted_is_resynced(clusters: Clusters) -> None:
    keys = push(clusters.trainer, range(20, 23), seed=4)
    assert_converges(clusters, keys)
    starts = [(clusters.replicas.data_dir / f"shard-{i}.log").stat().st_size for i in range(3)]
    # killed: its updates since its last flush are gone from it, and must go from the replicas
    clusters.training.stop_shard(0, sig=signal.SIGKILL)
    clusters.training.start_shard(0)  # the same port: the replicas find it again
    with clusters.client("trainer", replicas=False) as trainer:
        more = push(trainer, range(23, 25), seed=5)
    assert_converges(clusters, np.union1d(keys, more))
    for shard_id, start in enumerate(starts):
        lines = log_lines(clusters.replicas, shard_id, start)
        messages = [line.get("msg", "") for line in lines]
        assert any("resync of table 'items'" in m and "cannot answer" in m for m in messages), (
            shard_id,
            messages[-10:],
        )
        assert any("the stream broke" in m for m in messages)
