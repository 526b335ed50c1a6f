"""EmbeddingClient end to end against in-process shard servers (port 0, real RocksDB in
tmp_path): routing, dedup, order and shape, pushes, assigns, chunking, one RPC per shard for a
multi-feature batch, admin calls, bad input refused before anything is sent, and failures
(a shard down, faults, deadlines) raised as ShardError naming the shard's address.

Oracles: TableConfig.initial_rows, numpy transcriptions of SGD and Adagrad, and
torch.optim.SparseAdam. Nothing of ours is mocked: calls are counted from the shard's own
metrics registry, and faults are injected by a gRPC server interceptor in front of the real
servicers (ShardServer builds its grpc.server itself and takes no interceptors).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tierps.client import (
    COO,
    EmbeddingClient,
    Feature,
    RetryPolicy,
    ShardError,
    TableConfig,
    init,
    optim,
)
from tierps.core.errors import InvalidArgumentError, Reason, TableNotFoundError, TierpsError
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto.wire import channel_options
from tierps.server.config import ServerConfig
from tierps.server.daemon import ShardServer
from tierps.server.servicers import AdminServicer, EmbeddingServicer, add_embedding_service
from tierps.server.shard import Shard
from tierps.server.status import abort

DIM = 8
CODE = grpc.StatusCode
FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)
DATA_METHODS = ("Lookup", "PushGradients", "Assign")

ServerFactory = Callable[..., ShardServer]


# -- helpers --------------------------------------------------------------------------------------


@pytest.fixture
def make_client() -> Iterator[Callable[..., EmbeddingClient]]:
    """Factory of EmbeddingClients (closed at teardown): make_client(servers_or_addresses,
    **EmbeddingClient options)."""
    opened: list[EmbeddingClient] = []

    def make(targets: Sequence[ShardServer | str], **options: Any) -> EmbeddingClient:
        addresses = [t.address if isinstance(t, ShardServer) else t for t in targets]
        options.setdefault("timeout_s", 20.0)
        client = EmbeddingClient(addresses, **options)
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()


def start_cluster(shard_server: ServerFactory, num_shards: int) -> list[ShardServer]:
    return [shard_server(shard_id=i, num_shards=num_shards) for i in range(num_shards)]


def config(name: str = "t", dim: int = DIM, optimizer: Any = None, **fields: Any) -> TableConfig:
    optimizer = optim.SGD(lr=0.5) if optimizer is None else optimizer
    fields.setdefault("initializer", init.Normal(std=0.5))
    return TableConfig(name, dim, optimizer=optimizer, seed=fields.pop("seed", 5), **fields)


def initial(table: TableConfig, keys: np.ndarray) -> np.ndarray:
    """Initial weights [*keys.shape, dim]; zeros for keys < 0."""
    flat = np.asarray(keys, np.int64).reshape(-1)
    out = np.zeros((flat.size, table.dim), np.float32)
    live = flat >= 0
    if live.any():
        out[live] = table.initial_rows(flat[live])[:, : table.dim]
    return out.reshape(*np.shape(keys), table.dim)


def family(method: str) -> str:
    """A data call's method, its one-message form counted as the streaming one: the client
    sends calls that fit in one message as LookupUnary / PushGradientsUnary."""
    return method.removesuffix("Unary")


def rpc_count(
    server: ShardServer, method: str, code: str | None = None, *, either_form: bool = True
) -> int:
    """Calls of `method` the shard has answered (its tierps_rpc_seconds metric): with
    `code`, only those answered with it; with `either_form`, a data call's one-message form
    counted as the streaming one (family)."""
    name = family if either_form else str
    return int(
        sum(
            sample.value
            for metric in server.metrics.registry.collect()
            for sample in metric.samples
            if sample.name == "tierps_rpc_seconds_count"
            and name(sample.labels["method"]) == method
            and (code is None or sample.labels["code"] == code)
        )
    )


def data_calls(servers: Sequence[ShardServer]) -> list[dict[str, int]]:
    return [{m: rpc_count(s, m) for m in DATA_METHODS} for s in servers]


def stored(shard: Shard, name: str) -> dict[int, np.ndarray]:
    """Every stored (key: full row, weights and optimizer state) of a table on one shard."""
    out: dict[int, np.ndarray] = {}
    for keys, rows in shard.store.table(name).export(chunk_rows=1000):
        out.update(zip(keys.tolist(), rows.copy(), strict=True))
    return out


def state(servers: Sequence[ShardServer]) -> list[dict[str, dict[int, np.ndarray]]]:
    return [{c.name: stored(s.shard, c.name) for c in s.shard.admin.list_tables()} for s in servers]


def assert_same_state(before: list[Any], after: list[Any]) -> None:
    assert len(before) == len(after)
    for shard_before, shard_after in zip(before, after, strict=True):
        assert sorted(shard_before) == sorted(shard_after)
        for name, rows in shard_before.items():
            assert sorted(rows) == sorted(shard_after[name]), name
            for key, row in rows.items():
                np.testing.assert_array_equal(shard_after[name][key], row, err_msg=name)


def created(client: EmbeddingClient, name: str) -> int:
    return sum(shard["created"] for shard in client.describe(name))


def keys_sent(client: EmbeddingClient, name: str) -> int:
    """Keys the shards were asked for (host tier hits + misses over the cluster)."""
    return sum(
        tier["hits"] + tier["misses"]
        for shard in client.describe(name)
        for tier in shard["tiers"]
        if tier["name"] == "host"
    )


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def normal(generator: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return generator.standard_normal(shape).astype(np.float32)


def sparse_keys(generator: np.random.Generator, n: int) -> np.ndarray:
    return generator.choice(10**12, size=n, replace=False).astype(np.int64)


# -- lookup ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_lookup_returns_rows_in_the_callers_order_and_shape(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient], num_shards: int
) -> None:
    client = make_client(start_cluster(shard_server, num_shards))
    table = config()
    assert client.create_table(table) is True
    universe = sparse_keys(rng(1), 20)
    keys = universe[rng(2).integers(0, 20, size=(6, 7))]
    keys[0, 0], keys[3, 5], keys[5, 6] = -1, -(2**63), -7  # padding: zero rows, no row stored

    got = client.lookup("t", keys)

    assert got.shape == (6, 7, DIM) and got.dtype == np.float32
    np.testing.assert_array_equal(got, initial(table, keys))
    np.testing.assert_array_equal(got[keys < 0], 0.0)
    assert created(client, "t") == np.unique(keys[keys >= 0]).size
    # Other shapes and array types: a list, a scalar, a torch tensor, no keys at all.
    np.testing.assert_array_equal(client.lookup("t", keys[1].tolist()), got[1])
    assert client.lookup("t", np.int64(keys[2, 2])).shape == (DIM,)
    np.testing.assert_array_equal(client.lookup("t", np.int64(keys[2, 2])), got[2, 2])
    assert client.lookup("t", np.zeros((0, 3), np.int64)).shape == (0, 3, DIM)
    torch = pytest.importorskip("torch")
    np.testing.assert_array_equal(client.lookup("t", torch.from_numpy(keys[4])), got[4])


def test_lookup_sends_each_distinct_key_once(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    servers = start_cluster(shard_server, 2)
    client = make_client(servers)
    client.create_table(config())
    universe = sparse_keys(rng(3), 50)
    keys = universe[rng(4).integers(0, 50, size=1000)]  # every key ~20 times
    distinct = np.unique(keys)

    client.lookup("t", keys)

    assert keys_sent(client, "t") == distinct.size
    per_shard = [shard["created"] for shard in client.describe("t")]
    assert per_shard == np.bincount(distinct % 2, minlength=2).tolist()
    assert [calls["Lookup"] for calls in data_calls(servers)] == [1, 1]
    client.lookup("t", np.concatenate([keys, [-1, -1]]))
    assert keys_sent(client, "t") == 2 * distinct.size  # padding is not sent either


def test_lookup_with_create_false_stores_nothing(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    servers = start_cluster(shard_server, 3)
    client = make_client(servers)
    table = config()
    client.create_table(table)
    keys = sparse_keys(rng(5), 40)

    got = client.lookup("t", keys, create=False)

    np.testing.assert_array_equal(got, initial(table, keys))
    assert created(client, "t") == 0
    assert all(not rows for shard in state(servers) for rows in shard.values())


# -- push and assign ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 3])
def test_push_gradients_sums_the_gradients_of_repeated_keys(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient], num_shards: int
) -> None:
    lr = 0.5
    client = make_client(start_cluster(shard_server, num_shards))
    table = config(optimizer=optim.SGD(lr=lr))
    client.create_table(table)
    universe = sparse_keys(rng(6), 30)
    keys = universe[rng(7).integers(0, 20, size=(25, 4))]
    keys[2, 1] = -1
    grads = normal(rng(8), (25, 4, DIM))

    assert client.push_gradients("t", keys, grads) == np.unique(keys[keys >= 0]).size

    expected = {int(k): initial(table, np.array([k]))[0].astype(np.float64) for k in universe}
    for key, grad in zip(keys.reshape(-1).tolist(), grads.reshape(-1, DIM), strict=True):
        if key >= 0:
            expected[key] = expected[key] - lr * grad.astype(np.float64)
    got = client.lookup("t", universe, create=False)
    np.testing.assert_allclose(got, np.stack([expected[int(k)] for k in universe]), atol=1e-5)
    assert created(client, "t") == np.unique(keys[keys >= 0]).size  # untouched keys: no rows


def test_push_without_step_counts_pushes_per_table_as_sparse_adam_steps(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """Adam's bias correction depends on the step: with step left out, each table counts its
    own pushes from 1, as each torch.optim.SparseAdam counts its own steps."""
    torch = pytest.importorskip("torch")
    hyper = {"lr": 0.05, "beta1": 0.7, "beta2": 0.9, "eps": 1e-6}
    client = make_client(start_cluster(shard_server, 2))
    rows = 12
    keys_of = np.arange(rows, dtype=np.int64) * 1009 + 7
    references = {}
    for name in ("a", "b"):
        table = config(name, optimizer=optim.Adam(**hyper))
        client.create_table(table)
        embedding = torch.nn.Embedding(rows, DIM, sparse=True)
        with torch.no_grad():
            embedding.weight.copy_(torch.from_numpy(initial(table, keys_of)))
        adam = torch.optim.SparseAdam(
            list(embedding.parameters()),
            lr=hyper["lr"],
            betas=(hyper["beta1"], hyper["beta2"]),
            eps=hyper["eps"],
        )
        references[name] = (embedding, adam)
    generator = rng(9)
    for name in ["a", "a", "b", "a", "b", "a", "a"]:  # a: 5 pushes, b: 2, interleaved
        index = generator.integers(0, rows, size=15)
        grads = normal(generator, (15, DIM))
        client.push_gradients(name, keys_of[index], grads)
        embedding, adam = references[name]
        adam.zero_grad()
        embedding(torch.from_numpy(index)).backward(torch.from_numpy(grads))
        adam.step()

    for name, (embedding, _) in references.items():
        got = client.lookup(name, keys_of, create=False)
        np.testing.assert_allclose(got, embedding.weight.detach().numpy(), atol=1e-5, err_msg=name)


@pytest.mark.parametrize("step", [0, -1, 1.5, True, "2"])
def test_push_refuses_a_bad_step_and_sends_nothing(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient], step: Any
) -> None:
    servers = start_cluster(shard_server, 1)
    client = make_client(servers)
    client.create_table(config())
    before = state(servers)
    with pytest.raises(InvalidArgumentError) as raised:
        client.push_gradients("t", [1, 2], np.ones((2, DIM), np.float32), step=step)
    assert "table 't': field 'step' expected an int >= 1" in str(raised.value)
    assert repr(step) in str(raised.value)
    assert_same_state(before, state(servers))
    assert data_calls(servers) == [{"Lookup": 0, "PushGradients": 0, "Assign": 0}]


def test_assign_last_value_wins_and_resets_the_optimizer_state(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    lr = 0.3
    servers = start_cluster(shard_server, 2)
    client = make_client(servers)
    client.create_table(config(optimizer=optim.Adagrad(lr=lr)))
    keys = np.array([5, 7, 5, -1, 9, 7, 5])
    values = normal(rng(10), (7, DIM))
    client.push_gradients("t", [5, 7, 9], normal(rng(11), (3, DIM)))  # some Adagrad state

    assert client.assign("t", keys, values) == 3

    last = {5: values[6], 7: values[5], 9: values[4]}
    np.testing.assert_array_equal(client.lookup("t", [5, 7, 9]), np.stack(list(last.values())))
    rows = {k: v for shard in state(servers) for k, v in shard["t"].items()}
    for key, value in last.items():
        np.testing.assert_array_equal(rows[key][:DIM], value)
        np.testing.assert_array_equal(rows[key][DIM:], 0.0)  # the accumulator starts over
    grads = normal(rng(12), (3, DIM))
    client.push_gradients("t", [5, 7, 9], grads)
    fresh = np.stack(list(last.values())).astype(np.float64)
    expected = fresh - lr * grads / (np.sqrt(grads.astype(np.float64) ** 2) + 1e-10)
    np.testing.assert_allclose(client.lookup("t", [5, 7, 9]), expected, atol=1e-5)


# -- chunking -------------------------------------------------------------------------------------


def test_chunked_calls_give_what_unchunked_calls_give(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """A client with tiny chunk_bytes (8 keys a message) and max_call_bytes (several calls a
    shard) against one with the defaults, over two identical Adam tables: every call of a
    chunked push must carry the push's one step."""
    servers = start_cluster(shard_server, 2)
    plain = make_client(servers)
    chunked = make_client(servers, chunk_bytes=64, max_call_bytes=2000)
    adam = optim.Adam(lr=0.02, eps=1e-6)
    plain.create_table(config("plain", optimizer=adam))
    chunked.create_table(config("chunked", optimizer=adam))
    generator = rng(13)
    universe = sparse_keys(generator, 400)
    results: dict[str, list[np.ndarray]] = {"plain": [], "chunked": []}
    batches = []
    for _ in range(3):
        keys = universe[generator.integers(0, 400, size=(60, 5))]
        keys[generator.random(keys.shape) < 0.1] = -1
        offsets = np.sort(generator.integers(0, keys.size, size=40))
        offsets[0] = 0
        grads = normal(generator, (*keys.shape, DIM))
        batches.append((keys, offsets, normal(generator, (40, DIM)), grads))
    calls: dict[str, list[dict[str, int]]] = {}
    for name, client in (("plain", plain), ("chunked", chunked)):
        before = data_calls(servers)
        client.assign(name, universe[:200], np.ones((200, DIM), np.float32))
        for keys, offsets, pooled_grad, grads in batches:
            results[name].append(client.lookup(name, keys))
            pooled = client.lookup_pooled(name, keys.reshape(-1), offsets, combiner="mean")
            results[name].append(pooled.output)
            pooled.push_gradients(pooled_grad)
            client.push_gradients(name, keys, grads)
        results[name].append(client.lookup(name, universe, create=False))
        calls[name] = [
            {m: after[m] - start[m] for m in DATA_METHODS}
            for start, after in zip(before, data_calls(servers), strict=True)
        ]

    for got, want in zip(results["chunked"], results["plain"], strict=True):
        np.testing.assert_array_equal(got, want)
    # One call a shard per client call without chunking: 7 lookups, 6 pushes, 1 assign.
    assert calls["plain"] == [{"Lookup": 7, "PushGradients": 6, "Assign": 1}] * 2
    for shard_calls in calls["chunked"]:
        assert shard_calls["Lookup"] > 7
        assert shard_calls["PushGradients"] > 6
        assert shard_calls["Assign"] > 1


# -- several features in one call -----------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [2, 3])
def test_features_over_two_tables_take_one_lookup_and_one_push_per_shard(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient], num_shards: int
) -> None:
    lr = 0.25
    servers = start_cluster(shard_server, num_shards)
    client = make_client(servers)
    users, items = config("users", 4, optim.SGD(lr=lr)), config("items", DIM, optim.SGD(lr=lr))
    client.create_table(users)
    client.create_table(items)
    generator = rng(14)
    universe = sparse_keys(generator, 30)
    features = [
        Feature("user", "users", "sum"),
        Feature("clicked", "items", "mean"),
        Feature("viewed", "items", "sqrtn"),  # shares the items table with "clicked"
    ]
    user_keys = universe[generator.integers(0, 30, size=(6, 3))]
    user_keys[1] = -1
    clicked = universe[generator.integers(0, 10, size=14)]
    clicked_offsets = np.array([0, 2, 2, 7, 9, 13])
    viewed_rows = np.array([0, 5, 3, 0, 5, 5, 1])
    viewed = universe[generator.integers(5, 15, size=7)]  # overlaps clicked's keys
    batch = {
        "user": user_keys,
        "clicked": (clicked, clicked_offsets),
        "viewed": COO(viewed_rows, viewed, (6, 3)),
    }
    before = data_calls(servers)

    pooled = client.lookup_pooled_features(batch, features)
    grads = {
        name: normal(generator, (6, t.dim))
        for name, t in (("user", users), ("clicked", items), ("viewed", items))
    }
    pushed = pooled.push_gradients(grads)

    after = data_calls(servers)
    for shard_before, shard_after in zip(before, after, strict=True):
        assert shard_after["Lookup"] - shard_before["Lookup"] == 1
        assert shard_after["PushGradients"] - shard_before["PushGradients"] == 1
    # Oracle: coefficient matrices [6 bags, keys] over each table's initial rows.
    bags = {
        "user": [(b, k, 1.0) for b in range(6) for k in user_keys[b] if k >= 0],
        "clicked": [
            (b, k, 1.0 / len(part))
            for b, part in enumerate(np.split(clicked, clicked_offsets[1:]))
            for k in part
        ],
        "viewed": [
            (b, k, 1.0 / np.sqrt(np.sum(viewed_rows == b)))
            for b, k in zip(viewed_rows, viewed, strict=True)
        ],
    }
    tables = {"user": users, "clicked": items, "viewed": items}
    expected_rows: dict[str, dict[int, np.ndarray]] = {"users": {}, "items": {}}
    for name, entries in bags.items():
        table = tables[name]
        want = np.zeros((6, table.dim))
        for b, key, c in entries:
            row = initial(table, np.array([key]))[0].astype(np.float64)
            want[b] += c * row
            current = expected_rows[table.name].setdefault(int(key), row.copy())
            current -= lr * c * grads[name][b]
        np.testing.assert_allclose(pooled.outputs[name], want, atol=1e-5, err_msg=name)
    assert pushed == sum(len(rows) for rows in expected_rows.values())
    for name, rows in expected_rows.items():
        keys = np.array(sorted(rows))
        got = client.lookup(name, keys, create=False)
        np.testing.assert_allclose(got, np.stack([rows[k] for k in keys]), atol=1e-5)


# -- admin through the client ---------------------------------------------------------------------


def test_a_push_failing_in_part_on_one_shard_names_that_shard_not_succeeded(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """A shard's part of a push over max_call_bytes goes as several calls; when one of them
    fails (an UNAVAILABLE injected into the second), the ShardError must not count that
    shard as succeeded, although some of its calls went through and their rows changed."""
    servers = start_cluster(shard_server, 1)
    client = make_client(servers, max_call_bytes=1000)
    client.create_table(config("t", optimizer=optim.SGD(lr=1.0)))
    keys = np.arange(100, dtype=np.int64)
    before = client.lookup("t", keys)
    real_push, calls = client._transport.push_one[0], []

    class Unavailable(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "injected: shard stopping"

    def second_call_fails(request: Any, **options: Any) -> Any:
        calls.append(request)
        if len(calls) == 2:
            raise Unavailable()
        return real_push(request, **options)

    client._transport.push_one[0] = second_call_fails
    with pytest.raises(ShardError) as raised:
        client.push_gradients("t", keys, np.ones((keys.size, DIM), np.float32))
    assert len(calls) > 2, "the push was not split into several calls"
    assert raised.value.succeeded == []
    changed = int((client.lookup("t", keys) != before).any(axis=1).sum())
    assert 0 < changed < keys.size  # applied in part: why the shard is not "succeeded"


def test_admin_calls_through_the_client(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    servers = start_cluster(shard_server, 2)
    client = make_client(servers)
    table = config("items", optimizer=optim.Adam(lr=0.01))
    assert client.create_table(table) is True
    assert client.create_table(table) is False
    client.create_table(config("users", 4))
    assert client.list_tables() == [table, config("users", 4)]
    keys = sparse_keys(rng(15), 50)
    client.push_gradients("items", keys, normal(rng(16), (50, DIM)))
    saved = client.lookup("items", keys)

    descriptions = client.describe("items")
    assert [d["shard_id"] for d in descriptions] == [0, 1]
    assert all(d["num_shards"] == 2 and d["config"] == table.to_dict() for d in descriptions)
    assert sum(d["created"] for d in descriptions) == 50
    stats = client.stats()
    assert [s["shard_id"] for s in stats] == [0, 1]

    info = client.save_snapshot("snap")
    assert info["rows"] == 50
    assert [s["name"] for s in client.list_snapshots()] == ["snap"]
    client.assign("items", keys, np.zeros((50, DIM), np.float32))
    assert client.load_snapshot("snap")["rows"] == 50
    np.testing.assert_array_equal(client.lookup("items", keys), saved)

    client.drop_table("users")
    assert [t.name for t in client.list_tables()] == ["items"]
    with pytest.raises(TableNotFoundError, match="'users'"):
        client.lookup("users", [1])


# -- bad input: refused before anything is sent ---------------------------------------------------


@pytest.fixture
def loaded(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> tuple[list[ShardServer], EmbeddingClient]:
    """Two shards with table 't' (dim 8) holding some rows."""
    servers = start_cluster(shard_server, 2)
    client = make_client(servers)
    client.create_table(config())
    client.push_gradients("t", np.arange(20), normal(rng(17), (20, DIM)))
    return servers, client


NAN_GRADS = np.ones((4, DIM), np.float32)
NAN_GRADS[2, 3] = np.nan


@pytest.mark.parametrize(
    ("call", "error", "needles"),
    [
        (
            lambda c: c.lookup("t", [1.5, 2.0]),
            InvalidArgumentError,
            ["table 't'", "'keys'", "integer", "float64"],
        ),
        (
            lambda c: c.push_gradients("t", [1, 2, 3, 4], np.ones((4, DIM + 1), np.float32)),
            InvalidArgumentError,
            ["table 't'", "shape (4, 8)", "got (4, 9)"],
        ),
        (
            lambda c: c.push_gradients("t", [[1, 2], [3, 4]], np.ones((4, DIM), np.float32)),
            InvalidArgumentError,
            ["table 't'", "shape (2, 2, 8)", "got (4, 8)"],
        ),
        (
            lambda c: c.push_gradients("t", [1, 2, 3, 4], np.ones((4, DIM), np.int64)),
            InvalidArgumentError,
            ["table 't'", "float array", "int64"],
        ),
        (
            lambda c: c.push_gradients("t", [1, 2, 3, 4], NAN_GRADS),
            InvalidArgumentError,
            ["table 't'", "finite", "nan at [2, 3]"],
        ),
        (
            lambda c: c.assign("t", [1, 2, 3], np.ones((3, 4), np.float32)),
            InvalidArgumentError,
            ["table 't'", "shape (3, 8)", "got (3, 4)"],
        ),
        (
            lambda c: c.assign("t", [1, 2, 3, 4], NAN_GRADS),
            InvalidArgumentError,
            ["table 't'", "finite", "nan at [2, 3]"],
        ),
        (
            lambda c: c.lookup_pooled("t", [1, 2, 3, 4, 5, 6], [0, 4, 2]),
            InvalidArgumentError,
            ["table 't'", "offsets must not decrease, but offsets[2]=2 < offsets[1]=4"],
        ),
        (
            lambda c: c.lookup_pooled("t", [1, 2, 3], [0, 5]),
            InvalidArgumentError,
            ["table 't'", "'offsets'", "len(values)=3", "offsets[1]=5"],
        ),
        (
            lambda c: c.lookup_pooled("t", [1, 2, 3], [2]),
            InvalidArgumentError,
            ["table 't'", "offsets[0] = 0", "got 2"],
        ),
        (
            lambda c: c.lookup_pooled("t", [1, 2, 3], [0, 1], per_sample_weights=[1.0, 2.0]),
            InvalidArgumentError,
            ["table 't'", "'per_sample_weights'", "shape (3,)", "got (2,)"],
        ),
        (
            lambda c: c.lookup_pooled("t", [[1, 2]], per_sample_weights=[[1.0, np.inf]]),
            InvalidArgumentError,
            ["table 't'", "'per_sample_weights'", "finite", "inf at [0, 1]"],
        ),
        (
            lambda c: c.lookup_pooled("t", [[1, 2]], combiner="max"),
            InvalidArgumentError,
            ["'combiner'", "'sum', 'mean', 'sqrtn'", "got 'max'"],
        ),
        (
            lambda c: c.lookup_pooled("t", COO([0, 4], [1, 2], (3, 2))),
            InvalidArgumentError,
            ["table 't'", "COO field 'rows'", "[0, 3)", "rows[1]=4"],
        ),
        (
            lambda c: c.lookup_pooled_features(
                {"f": [[1]], "g": [[2]]}, [Feature("f", "t"), Feature("h", "t")]
            ),
            InvalidArgumentError,
            ["features ['f', 'h']", "missing ['h']", "unknown ['g']"],
        ),
        (
            lambda c: c.lookup_pooled_features(
                {"f": [[1]]}, [Feature("f", "t"), Feature("f", "t")]
            ),
            InvalidArgumentError,
            ["distinct names"],
        ),
        (
            lambda c: c.lookup_pooled_features({"f": ([1, 2], [0], [1.0], 4)}, [Feature("f", "t")]),
            InvalidArgumentError,
            ["feature 'f'", "(values, offsets)", "got 4 items"],
        ),
        (
            lambda c: c.lookup("nope", [1, 2]),
            TableNotFoundError,
            ["table 'nope' not found", "(tables: t)"],
        ),
        (
            lambda c: c.push_gradients("nope", [1], np.ones((1, DIM), np.float32)),
            TableNotFoundError,
            ["table 'nope' not found"],
        ),
        (
            lambda c: c.lookup_pooled_features({"f": [[1]]}, [Feature("f", "nope")]),
            TableNotFoundError,
            ["table 'nope' not found"],
        ),
    ],
)
def test_bad_input_is_refused_with_a_clear_error_and_nothing_sent(
    loaded: tuple[list[ShardServer], EmbeddingClient],
    call: Callable[[EmbeddingClient], Any],
    error: type[Exception],
    needles: list[str],
) -> None:
    servers, client = loaded
    before, calls = state(servers), data_calls(servers)
    with pytest.raises(error) as raised:
        call(client)
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))
    assert data_calls(servers) == calls  # no data call reached a shard
    assert_same_state(before, state(servers))


@pytest.mark.parametrize(
    ("grads", "needles"),
    [
        (np.ones((3, DIM), np.float32), ["feature 't'", "shape (4, 8)", "got (3, 8)"]),
        (NAN_GRADS, ["feature 't'", "finite", "nan at [2, 3]"]),
        (
            {"t": np.zeros((4, DIM)), "other": NAN_GRADS},
            ["features expected among ['t']", "['other']"],
        ),
    ],
)
def test_bad_gradients_of_a_pooled_lookup_push_nothing(
    loaded: tuple[list[ShardServer], EmbeddingClient], grads: Any, needles: list[str]
) -> None:
    servers, client = loaded
    pooled = client.lookup_pooled("t", [3, 4, 5, 3, 9], [0, 2, 2, 4], combiner="mean")
    before, calls = state(servers), data_calls(servers)
    with pytest.raises(InvalidArgumentError) as raised:
        pooled.push_gradients(grads)
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))
    assert data_calls(servers) == calls
    assert_same_state(before, state(servers))


def test_assign_refusal_names_the_values_field(
    loaded: tuple[list[ShardServer], EmbeddingClient],
) -> None:
    _, client = loaded
    with pytest.raises(InvalidArgumentError) as raised:
        client.assign("t", [1, 2, 3], np.ones((3, 4), np.float32))
    message = str(raised.value)
    assert "'values'" in message and "gradient" not in message, message


# -- failures: a shard down, injected faults, deadlines -------------------------------------------


def free_address() -> str:
    """An address of this machine where nothing listens (a port bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_a_shard_that_is_down_fails_the_call_naming_its_address_in_bounded_time(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    servers = start_cluster(shard_server, 2)
    client = make_client(servers, timeout_s=2.0, retry=FAST_RETRY)
    client.create_table(config())
    client.lookup("t", np.arange(10))
    down = servers[1].address
    servers[1].stop(grace_s=0)

    for call in (
        lambda: client.lookup("t", np.arange(10)),
        lambda: client.push_gradients("t", np.arange(10), np.ones((10, DIM), np.float32)),
        lambda: client.describe("t"),
    ):
        started = time.monotonic()
        with pytest.raises(ShardError) as raised:
            call()
        assert time.monotonic() - started < 5.0
        assert raised.value.shard_id == 1 and raised.value.address == down
        assert f"shard 1 at {down}" in str(raised.value)
        assert raised.value.code in (CODE.UNAVAILABLE, CODE.DEADLINE_EXCEEDED)
    # Keys of the live shard alone still work.
    assert client.lookup("t", np.arange(0, 10, 2)).shape == (5, DIM)


def test_a_client_of_an_address_where_nothing_listens_fails_naming_it(
    make_client: Callable[..., EmbeddingClient],
) -> None:
    address = free_address()
    client = make_client([address], timeout_s=2.0, retry=FAST_RETRY)
    started = time.monotonic()
    with pytest.raises(ShardError) as raised:
        client.create_table(config())
    assert time.monotonic() - started < 5.0
    assert raised.value.code is CODE.UNAVAILABLE
    assert str(raised.value).startswith(f"shard 0 at {address}: UNAVAILABLE")


# The reason a shard's refusal with each injected code carries (a shard sends one with every
# refusal it makes; gRPC's own failures carry none).
INJECTED_REASON = {
    CODE.UNAVAILABLE: Reason.BACKEND_FAILED,
    CODE.RESOURCE_EXHAUSTED: Reason.OUT_OF_MEMORY,
    CODE.INVALID_ARGUMENT: Reason.INVALID_ARGUMENT,
    CODE.INTERNAL: Reason.INTERNAL,
    CODE.PERMISSION_DENIED: Reason.ROLE_NOT_ALLOWED,
}


def _inject(context: grpc.ServicerContext, code: grpc.StatusCode, when: str = "") -> None:
    """Refuse the call as a shard does (server/status.py: its code and ErrorInfo)."""
    abort(context, TierpsError(f"injected {code.name}{when}", reason=INJECTED_REASON[code]))


@dataclass
class Fault:
    """What the interceptor does to one call before the real handler: wait, then abort."""

    code: grpc.StatusCode | None = None
    wait_s: float = 0.0
    after: bool = False  # abort after the real handler ran: a reply lost on its way back


@dataclass
class Interceptor(grpc.ServerInterceptor):
    """Counts the calls that reach the handlers of a server, records the keys of data calls,
    and injects the n-th Fault of faults[method] into that method's n-th call."""

    faults: dict[str, list[Fault]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    sent: list[tuple[str, str, np.ndarray]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return handler
        method = family(details.method.rsplit("/", 1)[-1])
        kind = (
            ("stream" if handler.request_streaming else "unary")
            + "_"
            + ("stream" if handler.response_streaming else "unary")
        )
        behaviour = getattr(handler, kind)

        def intercepted(request: Any, context: grpc.ServicerContext) -> Any:
            with self.lock:
                n = self.calls.get(method, 0)
                self.calls[method] = n + 1
            faults = self.faults.get(method, [])
            if n < len(faults):
                fault = faults[n]
                if fault.wait_s:
                    self.release.wait(fault.wait_s)
                if fault.code is not None and not fault.after:
                    _inject(context, fault.code)
            if handler.request_streaming:
                request = self._record(method, request)
            elif hasattr(request, "batches"):  # the one-message form of a data call
                list(self._record(method, iter(request.batches)))
            if n < len(faults) and faults[n].after and faults[n].code is not None:
                behaviour(request, context)
                _inject(context, faults[n].code, " after the handler")
            return behaviour(request, context)

        return handler._replace(**{kind: intercepted})

    def _record(self, method: str, requests: Iterator[Any]) -> Iterator[Any]:
        for message in requests:
            self.sent.append((method, message.table, np.frombuffer(message.keys, "<i8").copy()))
            yield message


@dataclass
class FaultyShard:
    address: str
    shard: Shard
    interceptor: Interceptor


@pytest.fixture
def faulty_shard(tmp_path: Path) -> Iterator[Callable[..., FaultyShard]]:
    """Factory of a shard served by a grpc.server with an Interceptor in front of the real
    servicers: faulty_shard(shard_id=0, num_shards=1, faults={method: [Fault, ...]})."""
    made: list[tuple[grpc.Server, FaultyShard]] = []

    def make(
        shard_id: int = 0, num_shards: int = 1, faults: dict[str, list[Fault]] | None = None
    ) -> FaultyShard:
        shard = Shard(ServerConfig(shard_id, num_shards, tmp_path / f"faulty-{len(made)}"))
        interceptor = Interceptor(faults=dict(faults or {}))
        server = grpc.server(
            ThreadPoolExecutor(8), interceptors=[interceptor], options=channel_options()
        )
        add_embedding_service(EmbeddingServicer(shard, lambda *_: None), server)
        pb_grpc.add_AdminServiceServicer_to_server(AdminServicer(shard, lambda *_: None), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        served = FaultyShard(f"127.0.0.1:{port}", shard, interceptor)
        made.append((server, served))
        return served

    yield make
    for server, served in made:
        served.interceptor.release.set()
        server.stop(grace=1.0).wait()
        served.shard.close()


@pytest.mark.parametrize("method", ["Lookup", "Assign"])
def test_a_lookup_or_assign_failing_with_unavailable_is_retried(
    faulty_shard: Callable[..., FaultyShard],
    make_client: Callable[..., EmbeddingClient],
    method: str,
) -> None:
    shard = faulty_shard(faults={method: [Fault(CODE.UNAVAILABLE)] * 2})
    client = make_client([shard.address], timeout_s=5.0, retry=FAST_RETRY)
    table = config(optimizer=optim.SGD(lr=0.5))
    client.create_table(table)
    keys = np.array([3, 1, 4, 1, 5])
    values = normal(rng(18), (5, DIM))

    if method == "Lookup":
        np.testing.assert_array_equal(client.lookup("t", keys), initial(table, keys))
    else:
        assert client.assign("t", keys, values) == 4

    assert shard.interceptor.calls[method] == 3  # two refused attempts, then the handler
    rows = stored(shard.shard, "t")
    assert sorted(rows) == [1, 3, 4, 5]
    if method == "Assign":  # the last value of a repeated key wins
        for i in (0, 2, 3, 4):
            np.testing.assert_array_equal(rows[int(keys[i])][:DIM], values[i])


@pytest.mark.parametrize("after", [False, True], ids=["refused", "reply-lost"])
def test_a_push_failing_with_unavailable_is_retried_and_applied_once(
    faulty_shard: Callable[..., FaultyShard],
    make_client: Callable[..., EmbeddingClient],
    after: bool,
) -> None:
    """A push failing with UNAVAILABLE is sent again with the same push id: refused before
    the handler (nothing applied) or after it (applied, the reply lost), the shard applies
    it exactly once, and the push takes one step."""
    lr = 0.5
    shard = faulty_shard(faults={"PushGradients": [Fault(CODE.UNAVAILABLE, after=after)]})
    client = make_client([shard.address], timeout_s=5.0, retry=FAST_RETRY)
    table = config(optimizer=optim.SGD(lr=lr))
    client.create_table(table)
    keys = np.array([3, 1, 4, 1, 5])
    grads = normal(rng(18), (5, DIM))
    assert client.push_gradients("t", keys, grads) == 4
    assert shard.interceptor.calls["PushGradients"] == 2
    assert client._pushes.last_step("t") == 1
    want = initial(table, keys).astype(np.float64) - lr * grads
    want[1] -= lr * grads[3]
    rows = stored(shard.shard, "t")
    for i in (0, 1, 2, 4):
        np.testing.assert_allclose(rows[int(keys[i])][:DIM], want[i], atol=1e-6)


def test_unavailable_on_every_attempt_fails_after_max_attempts(
    faulty_shard: Callable[..., FaultyShard], make_client: Callable[..., EmbeddingClient]
) -> None:
    shard = faulty_shard(faults={"Lookup": [Fault(CODE.UNAVAILABLE)] * 10})
    client = make_client([shard.address], timeout_s=5.0, retry=FAST_RETRY)
    client.create_table(config())
    with pytest.raises(ShardError) as raised:
        client.lookup("t", [1, 2])
    assert raised.value.code is CODE.UNAVAILABLE
    assert f"shard 0 at {shard.address}: UNAVAILABLE: injected UNAVAILABLE" == str(raised.value)
    assert shard.interceptor.calls["Lookup"] == FAST_RETRY.max_attempts
    no_retry = make_client([shard.address], retry=RetryPolicy(max_attempts=1))
    with pytest.raises(ShardError):
        no_retry.lookup("t", [1, 2])
    assert shard.interceptor.calls["Lookup"] == FAST_RETRY.max_attempts + 1


@pytest.mark.parametrize("code", [CODE.INVALID_ARGUMENT, CODE.INTERNAL, CODE.RESOURCE_EXHAUSTED])
@pytest.mark.parametrize("method", ["Lookup", "PushGradients"])
def test_other_failures_are_not_retried(
    faulty_shard: Callable[..., FaultyShard],
    make_client: Callable[..., EmbeddingClient],
    code: grpc.StatusCode,
    method: str,
) -> None:
    shard = faulty_shard(faults={method: [Fault(code)]})
    client = make_client([shard.address], timeout_s=5.0, retry=FAST_RETRY)
    client.create_table(config())
    with pytest.raises(ShardError) as raised:
        if method == "Lookup":
            client.lookup("t", [1, 2])
        else:
            client.push_gradients("t", [1, 2], np.ones((2, DIM), np.float32))
    assert raised.value.code is code
    assert (raised.value.shard_id, raised.value.address) == (0, shard.address)
    assert shard.interceptor.calls[method] == 1  # the handler ran once
    assert stored(shard.shard, "t") == {}


def test_snapshot_saves_are_not_retried_on_unavailable(
    faulty_shard: Callable[..., FaultyShard], make_client: Callable[..., EmbeddingClient]
) -> None:
    shard = faulty_shard(faults={"SaveSnapshot": [Fault(CODE.UNAVAILABLE)] * 3})
    client = make_client([shard.address], timeout_s=5.0, retry=FAST_RETRY)
    with pytest.raises(ShardError) as raised:
        client.save_snapshot("s")
    assert raised.value.code is CODE.UNAVAILABLE
    assert shard.interceptor.calls["SaveSnapshot"] == 1


def test_a_call_past_its_deadline_fails_with_deadline_exceeded(
    faulty_shard: Callable[..., FaultyShard], make_client: Callable[..., EmbeddingClient]
) -> None:
    shard = faulty_shard(faults={"Lookup": [Fault(wait_s=5.0)]})
    client = make_client([shard.address], timeout_s=0.3, retry=FAST_RETRY)
    client.create_table(config())
    started = time.monotonic()
    with pytest.raises(ShardError) as raised:
        client.lookup("t", [1, 2])
    elapsed = time.monotonic() - started
    shard.interceptor.release.set()
    assert 0.25 <= elapsed < 2.0
    assert raised.value.code is CODE.DEADLINE_EXCEEDED
    assert f"shard 0 at {shard.address}: DEADLINE_EXCEEDED" in str(raised.value)
    assert shard.interceptor.calls["Lookup"] == 1  # a deadline is not retried
    assert client.lookup("t", [1, 2]).shape == (2, DIM)  # the next call is on time


def test_each_shard_is_sent_only_its_distinct_keys_once_in_one_call(
    faulty_shard: Callable[..., FaultyShard], make_client: Callable[..., EmbeddingClient]
) -> None:
    """What crosses the wire, seen by the interceptor: per shard one Lookup call carrying each
    of its distinct keys once (no padding); a two-table lookup_pooled_features as one call."""
    shards = [faulty_shard(shard_id=i, num_shards=3) for i in range(3)]
    client = make_client([s.address for s in shards])
    client.create_table(config("a"))
    client.create_table(config("b", 4))
    keys = np.array([7, 7, 8, -1, 9, 10, 7, 11, 12, 9, 3])
    client.lookup("a", keys)
    for i, shard in enumerate(shards):
        ((method, table, sent),) = shard.interceptor.sent
        want = np.unique(keys[(keys >= 0) & (keys % 3 == i)])
        assert (method, table) == ("Lookup", "a")
        np.testing.assert_array_equal(np.sort(sent), want)
        shard.interceptor.sent.clear()

    client.lookup_pooled_features(
        {"x": keys.reshape(1, -1), "y": (np.array([5, 6, 7]), [0]), "z": keys[:4].reshape(2, 2)},
        [Feature("x", "a"), Feature("y", "b"), Feature("z", "a")],
    )
    for i, shard in enumerate(shards):
        assert shard.interceptor.calls["Lookup"] == 2
        by_table: dict[str, list[int]] = {}
        for method, table, sent in shard.interceptor.sent:
            assert method == "Lookup"
            by_table.setdefault(table, []).extend(sent.tolist())
        want_a = np.unique(keys[(keys >= 0) & (keys % 3 == i)])
        want_b = np.array([k for k in (5, 6, 7) if k % 3 == i])
        assert sorted(by_table.get("a", [])) == want_a.tolist()
        assert sorted(by_table.get("b", [])) == want_b.tolist()


# -- the torch module's prefetch ------------------------------------------------------------------


def test_prefetch_looks_each_batch_up_once_and_gives_what_a_plain_forward_gives(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    torch = pytest.importorskip("torch")
    from tierps.client.torch import EmbeddingBagCollection

    servers = start_cluster(shard_server, 2)
    client = make_client(servers)
    client.create_table(config())
    features = [Feature("a", "t"), Feature("b", "t", "mean")]
    generator = rng(40)
    batches = [
        {"a": generator.integers(0, 50, (4, 3)), "b": generator.integers(-1, 50, (4, 2))}
        for _ in range(4)
    ]
    module = EmbeddingBagCollection(client, features).eval()  # eval: nothing pushed
    plain = [{k: v.numpy().copy() for k, v in module(batch).items()} for batch in batches]
    lookups = sum(rpc_count(s, "Lookup") for s in servers)

    module.prefetch(batches[0])
    got = []
    for index, batch in enumerate(batches):
        if index + 1 < len(batches):
            module.prefetch(batches[index + 1])  # the next batch, while this one computes
        got.append({k: v.numpy() for k, v in module(batch).items()})

    assert sum(rpc_count(s, "Lookup") for s in servers) - lookups == 2 * len(batches)
    for want, have in zip(plain, got, strict=True):
        for name in want:
            np.testing.assert_array_equal(have[name], want[name])
    assert module._prefetched == []  # every prefetched batch was used by its forward
    with torch.no_grad():
        other = {"a": np.array([[1, 2, 3]]), "b": np.array([[4, 5]])}
        module.prefetch(other)
        module({"a": np.array([[1, 2, 3]]), "b": np.array([[4, 5]])})  # an equal, other object
    assert len(module._prefetched) == 1  # not taken: only the same batch object is


def test_a_push_failing_on_one_shard_names_the_shards_it_reached_and_keeps_its_step(
    faulty_shard: Callable[..., FaultyShard], make_client: Callable[..., EmbeddingClient]
) -> None:
    shards = [
        faulty_shard(shard_id=0, num_shards=2),
        faulty_shard(
            shard_id=1, num_shards=2, faults={"PushGradients": [Fault(CODE.RESOURCE_EXHAUSTED)]}
        ),
    ]
    client = make_client([s.address for s in shards], timeout_s=5.0, retry=FAST_RETRY)
    client.create_table(config(optimizer=optim.SGD(lr=0.5)))
    keys = np.array([2, 3, 4, 5])
    with pytest.raises(ShardError) as raised:
        client.push_gradients("t", keys, np.ones((4, DIM), np.float32))
    error = raised.value
    assert error.shard_id == 1 and error.succeeded == [0], (error.shard_id, error.succeeded)
    assert error.failed == [1]
    assert "of tables ['t'] was applied on shards [0], and not on shards [1]" in str(error)
    assert shards[1].address in str(error)
    assert sorted(stored(shards[0].shard, "t")) == [2, 4] and stored(shards[1].shard, "t") == {}
    assert client._pushes.last_step("t") == 1  # shard 0 applied step 1: the next push is step 2


def test_pushing_the_gradients_of_some_features_moves_only_their_keys(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """Adam moves a row even for a zero gradient: a feature left out of push_gradients must
    not send its keys at all (as torch, where an unused EmbeddingBag gives no indices)."""
    servers = start_cluster(shard_server, 2)
    client = make_client(servers)
    client.create_table(config(optimizer=optim.Adam(lr=0.1)))
    features = [Feature("a", "t"), Feature("b", "t")]
    batch = {"a": np.array([[1, 2], [3, -1]]), "b": np.array([[2, 7], [8, 9]])}
    before = client.lookup("t", np.arange(10), create=False)
    pooled = client.lookup_pooled_features(batch, features)
    assert pooled.push_gradients({"a": np.ones((2, DIM), np.float32)}) == 3  # keys 1, 2, 3
    after = client.lookup("t", np.arange(10), create=False)
    moved = sorted(int(k) for k in np.flatnonzero((after != before).any(axis=1)))
    assert moved == [1, 2, 3], moved


def test_a_client_refused_stats_still_looks_up_and_asks_once(
    faulty_shard: Callable[..., FaultyShard], make_client: Callable[..., EmbeddingClient]
) -> None:
    """A reader on a shard that refuses it Stats (a shard older than readers' Stats) looks up
    without a life rather than not at all; and a client that learns no generation for a
    table (a reader's Stats names no tables) does not ask again at every call."""
    denied = [Fault(CODE.PERMISSION_DENIED)] * 50
    shard = faulty_shard(faults={"Stats": denied})
    client = make_client([shard.address], timeout_s=5.0)
    client.create_table(config())
    keys = np.array([3, 1, 4])
    for _ in range(5):
        client.lookup("t", keys, create=False)
    assert shard.interceptor.calls["Stats"] == 1  # asked once, refused, not again
    assert client._life_denied == {0} and client._lives[0] is None
    assert client._generations[0] == {"t": 0}
