"""Adaptive embedding (hash_bucket_size, promote_after) through two real
in-process shard servers (port 0, RocksDB in tmp_path) and EmbeddingClient: keys without a
row of their own read and train their shard's bucket rows until their promote_after-th
sighting, then get their own row from the bucket's current weights; DescribeTable,
ClusterAdmin's dicts and `tierps admin describe` (a subprocess) show the adaptive figures.
Oracle: dicts and SGD in plain numpy, the bucket index from tierps' bucket_of."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from tierps.client import EmbeddingClient, TableConfig, init, optim
from tierps.server.daemon import ShardServer
from tierps.storage.adaptive import bucket_of, bucket_seed

ServerFactory = Callable[..., ShardServer]
DIM = 4
LR = 0.5
SHARDS = 2
CONFIG = TableConfig(
    "clicks",
    DIM,
    initializer=init.Normal(0.0, 0.1),
    optimizer=optim.SGD(lr=LR),
    seed=4,
    hash_bucket_size=5,
    promote_after=3,
)


@pytest.fixture
def cluster(shard_server: ServerFactory) -> Iterator[tuple[list[ShardServer], EmbeddingClient]]:
    servers = [shard_server(shard_id=i, num_shards=SHARDS) for i in range(SHARDS)]
    with EmbeddingClient([s.address for s in servers], timeout_s=10.0) as client:
        yield servers, client


class Reference:
    """Each shard's own rows and bucket rows (key k on shard k % 2), SGD, sighting counts."""

    def __init__(self, config: TableConfig) -> None:
        self.config = config
        index = np.arange(config.hash_bucket_size, dtype=np.int64)
        initial = config.initializer.generate(index, DIM, bucket_seed(config))
        self.buckets = [initial.astype(np.float64) for _ in range(SHARDS)]
        self.own: dict[int, np.ndarray] = {}
        self.counts: Counter[int] = Counter()

    def _bucket(self, key: int) -> tuple[np.ndarray, int]:
        b = bucket_of(np.array([key]), self.config.hash_bucket_size, self.config.seed)[0]
        return self.buckets[key % SHARDS], int(b)

    def _sight(self, keys: set[int]) -> None:
        for key in keys - set(self.own):
            self.counts[key] += 1
            if self.counts[key] >= self.config.promote_after:
                del self.counts[key]
                rows, b = self._bucket(key)
                self.own[key] = rows[b].copy()

    def lookup(self, keys: np.ndarray, create: bool) -> np.ndarray:
        if create:
            self._sight({k for k in keys.tolist() if k >= 0})
        out = np.zeros((keys.size, DIM))
        for i, key in enumerate(keys.tolist()):
            if key >= 0:
                rows, b = self._bucket(key)
                out[i] = self.own[key] if key in self.own else rows[b]
        return out

    def push(self, keys: np.ndarray, grads: np.ndarray) -> None:
        summed: dict[int, np.ndarray] = {}
        for key, grad in zip(keys.tolist(), grads.astype(np.float64), strict=True):
            if key >= 0:
                summed[key] = summed.get(key, 0) + grad
        self._sight(set(summed))
        for key, grad in summed.items():
            if key in self.own:
                self.own[key] -= LR * grad
            else:  # the bucket's keys' gradients add up: one step a bucket
                rows, b = self._bucket(key)
                rows[b] -= LR * grad


def totals(client: EmbeddingClient, table: str) -> dict[str, float]:
    described = client.describe(table)
    names = described[0]["lifecycle"].keys()
    return {name: sum(shard["lifecycle"][name] for shard in described) for name in names}


def test_lookups_and_pushes_match_the_reference_across_two_shards(
    cluster: tuple[list[ShardServer], EmbeddingClient],
) -> None:
    _, client = cluster
    client.create_table(CONFIG)
    reference = Reference(CONFIG)
    rng = np.random.default_rng(2)
    for step in range(1, 16):
        keys = (rng.zipf(1.3, 40) % 60).astype(np.int64)
        keys[rng.random(keys.size) < 0.1] = -1  # padding
        np.testing.assert_allclose(
            client.lookup("clicks", keys), reference.lookup(keys, True), rtol=1e-5, atol=1e-6
        )
        grads = rng.standard_normal((keys.size, DIM)).astype(np.float32)
        client.push_gradients("clicks", keys, grads, step=step)
        reference.push(keys, grads)
    probe = np.arange(-1, 80, dtype=np.int64)
    np.testing.assert_allclose(
        client.lookup("clicks", probe, create=False),
        reference.lookup(probe, False),
        rtol=1e-5,
        atol=1e-6,
    )
    figures = totals(client, "clicks")
    assert figures["adaptive.keys_promoted"] == len(reference.own) > 0
    assert figures["adaptive.keys_counted"] == len(+reference.counts) > 0
    assert figures["adaptive.bucket_rows"] == SHARDS * CONFIG.hash_bucket_size
    assert sum(d["created"] for d in client.describe("clicks")) == len(reference.own)


def test_a_zipf_trace_gives_few_keys_their_own_row_and_describe_shows_it(
    cluster: tuple[list[ShardServer], EmbeddingClient],
) -> None:
    servers, client = cluster
    config = TableConfig(
        "views", 8, optimizer=optim.SGD(lr=0.1), hash_bucket_size=1000, promote_after=3
    )
    client.create_table(config)
    client.create_table(TableConfig("plain", 8))
    rng = np.random.default_rng(1)
    distinct: set[int] = set()
    for step in range(1, 51):  # 50 steps of 2000 keys: ~100k sightings over a large space
        keys = (rng.zipf(1.2, 2000) % 10**12).astype(np.int64)
        distinct.update(keys.tolist())
        client.lookup("views", keys)
        client.push_gradients("views", keys, np.full((keys.size, 8), 0.01, np.float32), step)
    figures = totals(client, "views")
    promoted = figures["adaptive.keys_promoted"]
    assert promoted < 0.25 * len(distinct), (promoted, len(distinct))
    assert promoted + figures["adaptive.keys_counted"] == len(distinct)
    described = client.describe("views")
    assert sum(d["tiers"][0]["rows"] for d in described) == promoted  # own rows only
    assert figures["adaptive.lookups_from_buckets"] > 0
    assert figures["adaptive.gradients_to_buckets"] > 0
    assert [d["lifecycle"] for d in client.describe("plain")] == [{}, {}]

    base = [
        sys.executable,
        "-m",
        "tierps.server.cli",
        "admin",
        "--addresses",
        ",".join(s.address for s in servers),
    ]
    done = subprocess.run([*base, "describe", "views"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "adaptive: 1,000 bucket rows a shard, a row of its own after 3 sightings" in (
        done.stdout
    )
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("shard  bucket rows"))
    for column in (
        "bucket memory",
        "keys counted",
        "sightings",
        "promoted",
        "bucket lookups",
        "bucket gradients",
        "bucket updates",
    ):
        assert column in lines[header]
    for shard_id, line in enumerate(lines[header + 1 : header + 3]):
        cells = line.split()
        lifecycle = described[shard_id]["lifecycle"]
        assert cells[0] == str(shard_id) and cells[1] == "1,000", line
        assert cells[-4:] == [
            f"{lifecycle[f'adaptive.{name}']:,.0f}"
            for name in (
                "keys_promoted",
                "lookups_from_buckets",
                "gradients_to_buckets",
                "bucket_updates",
            )
        ], line
    plain = subprocess.run([*base, "describe", "plain"], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and "adaptive" not in plain.stdout, plain.stdout
    as_json = subprocess.run(
        [*base, "--json", "describe", "views"], capture_output=True, text=True, timeout=60
    )
    assert as_json.returncode == 0, as_json.stderr
    shards = json.loads(as_json.stdout[as_json.stdout.index("[") :])
    assert [s["lifecycle"]["adaptive.keys_promoted"] for s in shards] == [
        d["lifecycle"]["adaptive.keys_promoted"] for d in described
    ]
