"""Table-wise placement (placement="table") end to end: the table lives whole on its owner
shard (table_shard, or owner_shard's choice from the name), the client sends it there in the
same one RPC per shard, other shards refuse its data calls, a table_shard outside the
cluster is refused, and snapshots reshard it onto its owner among the new shards.

In-process servers on port 0 (real RocksDB in tmp_path) and one real LocalCluster
subprocess test (2 -> 3 -> 1 shards and back to 2, bit-exact). Oracles: a row-placed table
of the same config (same seed, initializer and optimizer: every result must be the same
bits), TableConfig.initial_rows, and the raw snapshot files."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tests.integration.conftest import Stubs
from tests.integration.test_client import data_calls, initial, stored
from tests.integration.test_cluster import assert_bits_equal, read_snapshot, running
from tierps.client import EmbeddingClient, Feature, ShardError, TableConfig, init, optim
from tierps.client.admin import ClusterAdmin
from tierps.core.config import owner_shard
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import wire
from tierps.proto.convert import table_config_to_proto
from tierps.server.cluster import LocalCluster
from tierps.server.daemon import ShardServer
from tierps.storage import InvalidArgumentError

DIM = 8
CODE = grpc.StatusCode
ServerFactory = Callable[..., ShardServer]
ClientFactory = Callable[..., EmbeddingClient]


def table(name: str, placement: str = "table", table_shard: int = -1, **fields: Any) -> TableConfig:
    fields.setdefault("optimizer", optim.Adam(lr=0.05))
    fields.setdefault("initializer", init.Normal(std=0.5))
    return TableConfig(
        name,
        DIM,
        placement=placement,
        table_shard=table_shard,
        seed=fields.pop("seed", 3),
        **fields,
    )


@pytest.fixture
def make_client() -> Iterator[ClientFactory]:
    """Factory of EmbeddingClients of in-process servers, closed at teardown."""
    opened: list[EmbeddingClient] = []

    def make(servers: Sequence[ShardServer]) -> EmbeddingClient:
        client = EmbeddingClient([server.address for server in servers], timeout_s=20.0)
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()


def start_cluster(shard_server: ServerFactory, num_shards: int) -> list[ShardServer]:
    return [shard_server(shard_id=i, num_shards=num_shards) for i in range(num_shards)]


def sparse_keys(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).choice(10**12, size=n, replace=False).astype(np.int64)


def normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def tier_rows(described: dict[str, Any]) -> dict[str, int]:
    return {tier["name"]: tier["rows"] for tier in described["tiers"]}


def assert_whole_on(client: ClusterAdmin, name: str, owner: int, rows: int) -> None:
    """Describe and stats of every shard: the owner holds `rows` rows of the table in
    RocksDB (flushed: after a load, or a flush), every other shard holds none in any tier and
    created none, and every shard shows the same config."""
    described = client.describe(name)
    assert len({json.dumps(d["config"], sort_keys=True) for d in described}) == 1
    tables = [
        next(t for t in stats["tables"] if t["config"]["name"] == name) for stats in client.stats()
    ]
    for shard, entry in [*enumerate(described), *enumerate(tables)]:
        held = tier_rows(entry)
        if shard == owner:
            assert held["rocksdb"] == rows, (shard, held)
        else:
            assert held == dict.fromkeys(held, 0), (shard, owner, held)
            assert entry["created"] == entry["initialized"] == 0, (shard, entry)


# -- routing --------------------------------------------------------------------------------------


@pytest.mark.parametrize("table_shard", [-1, 0, 2])  # -1: shard 1, chosen from "small"
def test_the_table_lives_whole_on_its_owner_shard(
    shard_server: ServerFactory, make_client: ClientFactory, table_shard: int
) -> None:
    servers = start_cluster(shard_server, 3)
    client = make_client(servers)
    placed = table("small", table_shard=table_shard)
    owner = owner_shard(placed, 3)
    if table_shard >= 0:
        assert owner == table_shard
    assert client.create_table(placed) is True
    keys = sparse_keys(1, 600)  # keys of every residue mod 3
    assert set(np.unique(keys % 3).tolist()) == {0, 1, 2}
    before = data_calls(servers)

    np.testing.assert_array_equal(client.lookup("small", keys), initial(placed, keys))
    client.push_gradients("small", keys[:400], normal(2, (400, DIM)))
    client.assign("small", keys[:10], np.ones((10, DIM), np.float32))

    calls = [
        {m: after[m] - was[m] for m in after}
        for was, after in zip(before, data_calls(servers), strict=True)
    ]
    for shard, made in enumerate(calls):
        expected = 1 if shard == owner else 0
        assert made == {"Lookup": expected, "PushGradients": expected, "Assign": expected}
    for shard, server in enumerate(servers):
        rows = stored(server.shard, "small")
        assert sorted(rows) == (sorted(keys.tolist()) if shard == owner else []), shard
    assert [d["created"] for d in client.describe("small")] == [
        keys.size if shard == owner else 0 for shard in range(3)
    ]
    for server in servers:
        server.shard.store.flush()
    assert_whole_on(client, "small", owner, keys.size)
    for server in servers:  # every shard keeps the config
        assert server.shard.admin.list_tables() == [placed]


def test_a_batch_of_placed_and_row_tables_is_one_rpc_per_shard(
    shard_server: ServerFactory, make_client: ClientFactory
) -> None:
    servers = start_cluster(shard_server, 3)
    client = make_client(servers)
    spread, whole = table("spread", placement="row"), table("whole", table_shard=1)
    client.create_table(spread)
    client.create_table(whole)
    keys = sparse_keys(3, 60).reshape(12, 5)
    batch = {"a": keys, "b": keys[::-1], "c": keys + 1}
    features = [Feature("a", "spread"), Feature("b", "whole"), Feature("c", "whole", "mean")]
    before = data_calls(servers)

    pooled = client.lookup_pooled_features(batch, features)
    pooled.push_gradients({name: normal(4, out.shape) for name, out in pooled.outputs.items()})

    after = data_calls(servers)
    for method in ("Lookup", "PushGradients"):
        made = [a[method] - b[method] for a, b in zip(after, before, strict=True)]
        assert made == [1, 1, 1], method
    np.testing.assert_array_equal(pooled.outputs["b"], initial(whole, keys[::-1]).sum(axis=1))
    distinct = np.unique(np.concatenate([keys, keys + 1]))
    assert [d["created"] for d in client.describe("whole")] == [0, distinct.size, 0]


def test_results_are_those_of_a_row_placed_table_of_the_same_config(
    shard_server: ServerFactory, make_client: ClientFactory
) -> None:
    """Lookups, pushes (repeated keys, padding, several steps), assigns and pooled lookups of
    a table placed whole give the same bits as a row-placed table of the same config, and
    leave the same rows and optimizer state."""
    servers = start_cluster(shard_server, 3)
    client = make_client(servers)
    configs = {"rows": table("rows", placement="row"), "whole": table("whole")}
    for config in configs.values():
        client.create_table(config)
    universe = sparse_keys(5, 300)
    picks = np.random.default_rng(6)

    def both(call: Callable[[str], Any]) -> list[Any]:
        return [call(name) for name in configs]

    keys = universe[picks.integers(0, 300, size=(40, 6))]
    keys[0, 0] = keys[7, 3] = -1
    got = both(lambda name: client.lookup(name, keys))
    assert_bits_equal(got[1], got[0], "lookup")
    for step in range(1, 4):
        keys = universe[picks.integers(0, 200, size=(50, 4))]  # repeats: gradients summed
        keys[3, 1] = -1
        grads = normal(10 + step, (50, 4, DIM))
        assert len(set(both(lambda name, k=keys, g=grads: client.push_gradients(name, k, g)))) == 1
        got = both(lambda name: client.lookup(name, universe, create=False))
        assert_bits_equal(got[1], got[0], f"lookup after push {step}")
    values = normal(20, (25, DIM))
    both(lambda name: client.assign(name, universe[:25], values))
    bags = universe[picks.integers(0, 300, size=(16, 7))]
    bags[2, 4:] = -1
    for step in (4, 5):
        pooled = both(
            lambda name: client.lookup_pooled_features(
                {"f": bags, "g": bags[:, :3]},
                [Feature("f", name, "mean"), Feature("g", name, "sum")],
            )
        )
        for feature in ("f", "g"):
            assert_bits_equal(pooled[1].outputs[feature], pooled[0].outputs[feature], feature)
        grads = {"f": normal(30 + step, (16, DIM)), "g": normal(40 + step, (16, DIM))}
        for lookup in pooled:
            lookup.push_gradients(grads, step=step)
    got = both(lambda name: client.lookup(name, universe, create=False))
    assert_bits_equal(got[1], got[0], "lookup at the end")
    # The same rows, optimizer state included: spread over the shards, or whole on one.
    rows: dict[str, dict[int, np.ndarray]] = {}
    for name in configs:
        rows[name] = {}
        for server in servers:
            rows[name].update(stored(server.shard, name))
    assert sorted(rows["rows"]) == sorted(rows["whole"])
    for key, row in rows["rows"].items():
        assert_bits_equal(rows["whole"][key], row, f"stored row of key {key}")
    held = [len(stored(server.shard, "whole")) for server in servers]
    assert sorted(held) == [0, 0, len(rows["whole"])]


# -- refusals -------------------------------------------------------------------------------------


def test_another_shard_refuses_the_tables_data_calls(
    shard_server: ServerFactory, make_client: ClientFactory, connect: Callable[..., Stubs]
) -> None:
    servers = start_cluster(shard_server, 3)
    client = make_client(servers)
    whole, spread = table("whole", table_shard=2), table("spread", placement="row")
    client.create_table(whole)
    client.create_table(spread)
    stubs = connect(servers[1])
    keys = np.array([1, 4, 7], np.int64)  # shard 1's keys of a row-placed table
    raw_keys, raw_rows = keys.astype("<i8").tobytes(), np.ones((3, DIM), "<f4").tobytes()
    calls = {
        "Lookup": lambda: list(
            stubs.embedding.Lookup(wire.lookup_requests("whole", DIM, raw_keys, create=True))
        ),
        "PushGradients": lambda: stubs.embedding.PushGradients(
            wire.push_requests("whole", DIM, 1, raw_keys, raw_rows)
        ),
        "Assign": lambda: stubs.embedding.Assign(
            wire.assign_requests("whole", DIM, raw_keys, raw_rows)
        ),
        # A call that also carries a good batch of another table is refused whole.
        "PushGradients of two tables": lambda: stubs.embedding.PushGradients(
            itertools.chain(
                wire.push_requests("spread", DIM, 1, raw_keys, raw_rows),
                wire.push_requests("whole", DIM, 1, raw_keys, raw_rows),
            )
        ),
        # Padding only: still the wrong shard for this table.
        "LookupUnary of padding": lambda: stubs.embedding.LookupUnary(
            pb.LookupBatches(
                batches=list(
                    wire.lookup_requests(
                        "whole", DIM, np.array([-1], "<i8").tobytes(), create=False
                    )
                )
            )
        ),
    }
    for what, call in calls.items():
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == CODE.INVALID_ARGUMENT, what
        message = refused.value.details()
        for part in ("table 'whole'", "placed whole on shard 2", "not on shard 1 of 3"):
            assert part in message, (what, message)
    assert stored(servers[1].shard, "whole") == {} and stored(servers[1].shard, "spread") == {}
    assert [d["created"] for d in client.describe("whole")] == [0, 0, 0]


def test_a_table_shard_outside_the_cluster_is_refused(
    shard_server: ServerFactory, make_client: ClientFactory, connect: Callable[..., Stubs]
) -> None:
    servers = start_cluster(shard_server, 3)
    client = make_client(servers)
    bad = table("small", table_shard=3)
    with pytest.raises(InvalidArgumentError) as refused:
        client.create_table(bad)  # refused before anything is sent
    message = str(refused.value)
    for part in ("table 'small'", "'table_shard'", "[0, 2]", "3 shards", "got 3"):
        assert part in message, message
    assert all(server.shard.admin.list_tables() == [] for server in servers)

    request = pb.CreateTableRequest(config=table_config_to_proto(bad.to_dict()))
    for shard, server in enumerate(servers):
        with pytest.raises(grpc.RpcError) as refused:
            connect(server).admin.CreateTable(request)
        assert refused.value.code() == CODE.INVALID_ARGUMENT
        message = refused.value.details()
        for part in ("table 'small'", "'table_shard'", "[0, 2]", "got 3", f"shard {shard} of 3"):
            assert part in message, message
        assert server.shard.admin.list_tables() == []
    # Nor may a daemon start with one.
    with pytest.raises(InvalidArgumentError, match=r"'small'.*'table_shard'.*got 3"):
        shard_server(shard_id=0, num_shards=3, tables=(bad,))


# -- snapshots (in process) -----------------------------------------------------------------------


def test_a_snapshot_whose_table_shard_is_outside_the_new_cluster_is_refused(
    shard_server: ServerFactory, make_client: ClientFactory
) -> None:
    client = make_client(start_cluster(shard_server, 3))
    pinned = table("pinned", table_shard=2)
    client.create_table(pinned)
    client.lookup("pinned", np.arange(50))
    client.save_snapshot("three")
    target = make_client(start_cluster(shard_server, 2))
    other = table("other", placement="row")
    target.create_table(other)
    before = target.lookup("other", np.arange(20))

    with pytest.raises(ShardError) as refused:
        target.load_snapshot("three")

    assert refused.value.code == CODE.FAILED_PRECONDITION
    for part in ("snapshot 'three'", "2 shards", "table 'pinned'", "'table_shard'", "got 2"):
        assert part in refused.value.details, refused.value.details
    assert [c.name for c in target.list_tables()] == ["other"]  # nothing changed
    assert_bits_equal(target.lookup("other", np.arange(20)), before, "rows after the refusal")


# -- snapshots across shard counts (subprocess cluster) -------------------------------------------

RESHARD_TABLES = (
    # Placed by name; a 16 KiB host tier (~85 rows of 192 bytes): most rows in RocksDB only.
    table("ads", host_cache_bytes=16 << 10),
    table("pinned", table_shard=0, optimizer=optim.Adagrad(lr=0.05)),
    table("spread", placement="row", optimizer=optim.Adagrad(lr=0.05)),
)
RESHARD_KEYS = 1500


def snapshot_parts(path: Path, name: str) -> dict[int, int]:
    """Rows of table `name` in each part (shard id) of a committed snapshot."""
    manifest = json.loads((path / "MANIFEST.json").read_text())
    return {p["shard_id"]: p["rows"] for p in manifest["tables"][name]["parts"]}


@pytest.mark.slow  # subprocess clusters
def test_snapshots_reshard_a_placed_table_onto_its_new_owner(tmp_path: Path) -> None:
    """2 -> 3 -> 1 shards and back to 2: each load puts a placed table whole on its owner
    among the new shards, with the same rows and optimizer state, bit for bit; a further
    step gives the same bits on every cluster."""
    ads = RESHARD_TABLES[0]
    assert [owner_shard(ads, n) for n in (2, 3, 1)] == [1, 2, 0]  # it moves every time
    snapshots = tmp_path / "snapshots"
    keys = {t.name: sparse_keys(100 + i, RESHARD_KEYS) for i, t in enumerate(RESHARD_TABLES)}
    placed = [t for t in RESHARD_TABLES if t.placement == "table"]
    with (
        running(LocalCluster(2, tmp_path / "two", snapshots)) as two,
        EmbeddingClient(two.addresses, timeout_s=30) as client_two,
    ):
        for config in RESHARD_TABLES:
            client_two.create_table(config)
            client_two.lookup(config.name, keys[config.name])
        for step in range(1, 4):
            for config in RESHARD_TABLES:
                chosen = keys[config.name][step::2]  # repeats, some keys left out
                grads = normal(step, (chosen.size, DIM))
                client_two.push_gradients(config.name, chosen, grads, step=step)
        weights = {
            t.name: client_two.lookup(t.name, keys[t.name], create=False) for t in RESHARD_TABLES
        }
        for config in placed:
            owner = owner_shard(config, 2)
            assert [d["created"] for d in client_two.describe(config.name)] == [
                RESHARD_KEYS if shard == owner else 0 for shard in range(2)
            ]
        client_two.save_snapshot("s")
        for config in placed:
            owner = owner_shard(config, 2)
            assert snapshot_parts(snapshots / "s", config.name) == {
                shard: RESHARD_KEYS if shard == owner else 0 for shard in range(2)
            }

        clients = {2: client_two}
        saved = {2: "s"}
        with (
            running(LocalCluster(3, tmp_path / "three", snapshots)) as three,
            EmbeddingClient(three.addresses, timeout_s=30) as client_three,
            running(LocalCluster(1, tmp_path / "one", snapshots)) as one,
            EmbeddingClient(one.addresses, timeout_s=30) as client_one,
        ):
            clients.update({3: client_three, 1: client_one})
            for num_shards, source, name in ((3, "s", "from-three"), (1, "from-three", "one")):
                client = clients[num_shards]
                loaded = client.load_snapshot(source)
                assert loaded["rows"] == RESHARD_KEYS * len(RESHARD_TABLES)
                assert client.list_tables() == sorted(RESHARD_TABLES, key=lambda t: t.name)
                for config in placed:
                    assert_whole_on(
                        client, config.name, owner_shard(config, num_shards), RESHARD_KEYS
                    )
                for config in RESHARD_TABLES:
                    got = client.lookup(config.name, keys[config.name], create=False)
                    assert_bits_equal(got, weights[config.name], f"{config.name} on {num_shards}")
                client.save_snapshot(name)
                saved[num_shards] = name
                for config in RESHARD_TABLES:
                    keys_s, rows_s = read_snapshot(snapshots / "s", config)
                    keys_n, rows_n = read_snapshot(snapshots / name, config)
                    assert keys_n.tobytes() == keys_s.tobytes(), (config.name, name)
                    assert rows_n.tobytes() == rows_s.tobytes(), (config.name, name)  # + state
                for config in placed:
                    owner = owner_shard(config, num_shards)
                    assert snapshot_parts(snapshots / name, config.name) == {
                        shard: RESHARD_KEYS if shard == owner else 0 for shard in range(num_shards)
                    }

            # The same further step everywhere: Adam and Adagrad read the restored state.
            after = {}
            for num_shards, client in clients.items():
                for config in RESHARD_TABLES:
                    grads = normal(99, (RESHARD_KEYS, DIM))
                    client.push_gradients(config.name, keys[config.name], grads, step=4)
                after[num_shards] = {
                    t.name: client.lookup(t.name, keys[t.name], create=False)
                    for t in RESHARD_TABLES
                }
            for config in RESHARD_TABLES:
                assert not np.array_equal(after[2][config.name], weights[config.name])
                for num_shards in (3, 1):
                    assert_bits_equal(
                        after[num_shards][config.name],
                        after[2][config.name],
                        f"{config.name}: a further step on {num_shards} shards",
                    )

        # Back to 2 shards: the 3-shard snapshot puts the tables on their owners among 2.
        client_two.load_snapshot("from-three")
        for config in placed:
            assert_whole_on(client_two, config.name, owner_shard(config, 2), RESHARD_KEYS)
        for config in RESHARD_TABLES:
            got = client_two.lookup(config.name, keys[config.name], create=False)
            assert_bits_equal(got, weights[config.name], f"{config.name}: back on 2 shards")
