"""Admission filters (admit_after) through two real in-process shard servers
(port 0, RocksDB in tmp_path) and EmbeddingClient: keys without a row read default_value and
their pushes are dropped until their admit_after-th sighting; DescribeTable, ClusterAdmin's
dicts and `tierps admin describe` (a subprocess) show the filter's figures per shard.
Oracles: TableConfig.initial_rows and SGD written out in numpy."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from tierps.client import EmbeddingClient, TableConfig, init, optim
from tierps.server.daemon import ShardServer
from tierps.storage.admission import bloom_size

ServerFactory = Callable[..., ShardServer]
DIM = 4
LR = 0.5
DEFAULT = 0.25
COUNTER = TableConfig(
    "clicks",
    DIM,
    initializer=init.Normal(0.0, 0.1),
    optimizer=optim.SGD(lr=LR),
    seed=4,
    admit_after=3,
    default_value=DEFAULT,
)
BLOOM = TableConfig(
    "views",
    DIM,
    optimizer=optim.SGD(lr=LR),
    admit_after=3,
    admission="bloom",
    max_elements=1000,
    false_positive_rate=1e-6,
    default_value=DEFAULT,
)


@pytest.fixture
def cluster(shard_server: ServerFactory) -> Iterator[tuple[list[ShardServer], EmbeddingClient]]:
    servers = [shard_server(shard_id=i, num_shards=2) for i in range(2)]
    with EmbeddingClient([s.address for s in servers], timeout_s=10.0) as client:
        yield servers, client


def totals(client: EmbeddingClient, table: str) -> dict[str, float]:
    """The admission figures of a table summed over the shards."""
    described = client.describe(table)
    names = described[0]["lifecycle"].keys()
    return {name: sum(shard["lifecycle"][name] for shard in described) for name in names}


@pytest.mark.parametrize("config", [COUNTER, BLOOM], ids=["counter", "bloom"])
def test_keys_train_only_from_their_admit_after_th_sighting(
    cluster: tuple[list[ShardServer], EmbeddingClient], config: TableConfig
) -> None:
    _, client = cluster
    client.create_table(config)
    name = config.name
    keys = np.array([0, 1, 2, 3, 4, 5, 6, 7, 7, 8, 9])  # both shards; 7 repeats in each call
    distinct = np.unique(keys)
    rare = np.array([20, 21, 22, 23])  # sighted once only
    default = np.full((keys.size, DIM), DEFAULT, np.float32)
    grads = np.random.default_rng(0).standard_normal((keys.size, DIM)).astype(np.float32)

    np.testing.assert_array_equal(client.lookup(name, keys), default)  # sighting 1
    np.testing.assert_array_equal(client.lookup(name, rare), np.full((4, DIM), DEFAULT))
    assert client.push_gradients(name, keys, grads) == 0  # sighting 2: dropped
    np.testing.assert_array_equal(client.lookup(name, keys, create=False), default)  # no count
    initial = config.initial_rows(keys)[:, :DIM]
    np.testing.assert_array_equal(client.lookup(name, keys), initial)  # 3: admitted
    assert client.push_gradients(name, keys, grads) == distinct.size
    summed = grads.copy()
    summed[keys == 7] = grads[keys == 7].sum(axis=0)  # the two 7s' gradients add up
    np.testing.assert_allclose(client.lookup(name, keys), initial - LR * summed, rtol=1e-6)
    np.testing.assert_array_equal(
        client.lookup(name, rare, create=False), np.full((4, DIM), DEFAULT)
    )

    figures = totals(client, name)
    assert figures["admission.keys_admitted"] == distinct.size
    assert figures["admission.gradients_dropped"] == distinct.size
    assert figures["admission.sightings"] == 3 * distinct.size + rare.size
    # the client sends each distinct key once, so the shards count 7 once a lookup
    assert figures["admission.lookups_default"] == 2 * distinct.size + 2 * rare.size
    assert sum(d["created"] for d in client.describe(name)) == distinct.size
    if config.admission == "counter":
        assert figures["admission.keys_counted"] == rare.size
        assert figures["admission.hash_functions"] == 0
    else:
        m, k = bloom_size(config.max_elements, config.false_positive_rate)
        for shard in client.describe(name):  # every shard has a filter of its own
            assert shard["lifecycle"]["admission.counters"] == m
            assert shard["lifecycle"]["admission.hash_functions"] == k
            assert shard["lifecycle"]["admission.bytes"] == m  # uint8 counters
        assert figures["admission.counters_used"] > 0
    for shard in client.describe(name):
        assert shard["lifecycle"]["admission.bytes"] > 0


@pytest.mark.slow  # real subprocesses: seconds
def test_describe_and_the_admin_command_show_the_filter(
    cluster: tuple[list[ShardServer], EmbeddingClient],
) -> None:
    servers, client = cluster
    client.create_table(COUNTER)
    client.create_table(TableConfig("plain", DIM))
    client.lookup("clicks", np.arange(10))  # one sighting each, 5 keys a shard
    client.push_gradients("clicks", np.arange(6), np.ones((6, DIM), np.float32))
    assert [d["lifecycle"] for d in client.describe("plain")] == [{}, {}]
    for shard in client.describe("clicks"):
        lifecycle = shard["lifecycle"]
        assert lifecycle["admission.keys_counted"] == 5
        assert lifecycle["admission.gradients_dropped"] == 3
        assert lifecycle["admission.lookups_default"] == 5
    stats = client.stats()
    assert [t["lifecycle"] for t in stats[0]["tables"]] == [
        client.describe("clicks")[0]["lifecycle"],
        {},
    ]

    base = [
        sys.executable,
        "-m",
        "tierps.server.cli",
        "admin",
        "--addresses",
        ",".join(s.address for s in servers),
    ]
    done = subprocess.run([*base, "describe", "clicks"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "admission: counter filter, a row after 3 sightings; keys without one read 0.25" in (
        done.stdout
    )
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("shard  keys counted"))
    for column in (
        "counters used",
        "filter memory",
        "sightings",
        "admitted",
        "default lookups",
        "gradients dropped",
    ):
        assert column in lines[header]
    for shard_id, line in enumerate(lines[header + 1 : header + 3]):
        cells = line.split()
        assert cells[0] == str(shard_id) and cells[1] == "5", line  # keys counted
        assert cells[-4:] == ["8", "0", "5", "3"], line  # sightings, admitted, defaults, dropped
    plain = subprocess.run([*base, "describe", "plain"], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and "admission" not in plain.stdout, plain.stdout
    as_json = subprocess.run(
        [*base, "--json", "describe", "clicks"], capture_output=True, text=True, timeout=60
    )
    assert as_json.returncode == 0, as_json.stderr
    described = json.loads(as_json.stdout[as_json.stdout.index("[") :])
    assert [d["lifecycle"]["admission.sightings"] for d in described] == [8, 8]
