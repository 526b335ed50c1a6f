"""The service end to end, in-process: real shard servers on port 0 over real RocksDB in
tmp_path, driven through raw gRPC stubs (and ClusterAdmin for snapshots). Expected values
come from numpy oracles, TableConfig.initial_rows and torch.optim.SparseAdam; nothing of
ours is mocked except to observe or inject (a wrapped on_serving_change)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import Stubs
from tierps.client.admin import ClusterAdmin, ShardError
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import wire
from tierps.proto.convert import table_config_to_dict, table_config_to_proto
from tierps.server.config import ServerConfig
from tierps.server.daemon import ShardServer
from tierps.storage import TableConfig, host_kernels, init, optim

DIM = 8
T = 20.0  # seconds: deadline of every call, so a hang fails instead of blocking the run
CODE = grpc.StatusCode
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

ServerFactory = Callable[..., ShardServer]
Connect = Callable[..., Stubs]

# -- helpers ----------------------------------------------------------------------------------


def as_keys(keys: Iterable[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(keys, dtype=np.int64))


def create_table(stubs: Stubs, config: TableConfig) -> bool:
    request = pb.CreateTableRequest(config=table_config_to_proto(config.to_dict()))
    return stubs.admin.CreateTable(request, timeout=T).created


def lookup_responses(
    stubs: Stubs,
    table: str,
    keys: Any,
    dim: int = DIM,
    *,
    create: bool = True,
    chunk_bytes: int = wire.CHUNK_BYTES,
) -> list[pb.LookupResponse]:
    requests = wire.lookup_requests(
        table, dim, as_keys(keys).tobytes(), create=create, chunk_bytes=chunk_bytes
    )
    return list(stubs.embedding.Lookup(requests, timeout=T))


def lookup(stubs: Stubs, table: str, keys: Any, dim: int = DIM, **kwargs: Any) -> np.ndarray:
    """Weights [n, dim] of keys; checks the response framing on the way."""
    keys = as_keys(keys)
    responses = lookup_responses(stubs, table, keys, dim, **kwargs)
    for response in responses:
        assert len(response.values) == 4 * dim * response.num_rows
    assert sum(response.num_rows for response in responses) == keys.size
    return np.frombuffer(wire.join_values(responses), dtype="<f4").reshape(keys.size, dim)


def push(
    stubs: Stubs,
    table: str,
    keys: Any,
    grads: np.ndarray,
    step: int,
    *,
    chunk_bytes: int = wire.CHUNK_BYTES,
) -> int:
    keys, grads = as_keys(keys), np.ascontiguousarray(grads, dtype="<f4")
    dim = grads.shape[1]
    requests = wire.push_requests(
        table, dim, step, keys.tobytes(), grads.tobytes(), chunk_bytes=chunk_bytes
    )
    return stubs.embedding.PushGradients(requests, timeout=T).num_keys


def assign(
    stubs: Stubs, table: str, keys: Any, values: np.ndarray, *, chunk_bytes: int = wire.CHUNK_BYTES
) -> int:
    keys, values = as_keys(keys), np.ascontiguousarray(values, dtype="<f4")
    dim = values.shape[1]
    requests = wire.assign_requests(
        table, dim, keys.tobytes(), values.tobytes(), chunk_bytes=chunk_bytes
    )
    return stubs.embedding.Assign(requests, timeout=T).num_keys


def describe(stubs: Stubs, table: str) -> pb.TableDescription:
    return stubs.admin.DescribeTable(pb.DescribeTableRequest(table=table), timeout=T)


def tier(description: pb.TableDescription, name: str) -> pb.TierStats:
    return next(t for t in description.tiers if t.name == name)


def list_tables(stubs: Stubs) -> list[TableConfig]:
    reply = stubs.admin.ListTables(pb.ListTablesRequest(), timeout=T)
    return [TableConfig.from_dict(table_config_to_dict(t)) for t in reply.tables]


def table_rows(server: ShardServer, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Every stored (key, full row: weights and optimizer state) of a table, in key order,
    read through the storage export (it flushes first)."""
    table = server.shard.store.table(name)
    chunks = list(table.export(chunk_rows=1000))
    if not chunks:
        return np.empty(0, np.int64), np.empty((0, table.config.row_width), np.float32)
    return np.concatenate([k for k, _ in chunks]), np.concatenate([r for _, r in chunks])


def shard_state(server: ShardServer) -> dict[str, Any]:
    """Tables and their stored rows, to check that a refused call changed nothing."""
    return {
        config.name: (config, *table_rows(server, config.name))
        for config in server.shard.admin.list_tables()
    }


def assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert sorted(before) == sorted(after)
    for name, (config, keys, rows) in before.items():
        assert after[name][0] == config, name
        np.testing.assert_array_equal(after[name][1], keys, err_msg=name)
        np.testing.assert_array_equal(after[name][2], rows, err_msg=name)


def refused(code: grpc.StatusCode, call: Callable[[], Any], *needles: str) -> str:
    """Run call, expect it to fail with code; the details must contain every needle."""
    with pytest.raises(grpc.RpcError) as raised:
        call()
    error = raised.value
    assert error.code() == code, (error.code(), error.details())
    details = error.details() or ""
    for needle in needles:
        assert needle in details, (needle, details)
    return details


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def normal(generator: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return generator.standard_normal(shape).astype(np.float32)


def sgd_oracle(
    config: TableConfig, keys: np.ndarray, grads: np.ndarray, lr: float
) -> dict[int, np.ndarray]:
    """{key: weights} after one SGD push from the initial rows: duplicates summed, keys < 0
    ignored (float64)."""
    out: dict[int, np.ndarray] = {}
    for key, grad in zip(keys.tolist(), grads.astype(np.float64), strict=True):
        if key < 0:
            continue
        if key not in out:
            out[key] = config.initial_rows(as_keys([key]))[0, : config.dim].astype(np.float64)
        out[key] = out[key] - lr * grad
    return out


# -- data path --------------------------------------------------------------------------------


@pytest.mark.parametrize("create", [True, False], ids=["create", "no-create"])
def test_lookup_of_new_keys_gives_their_initial_rows(
    shard_server: ServerFactory, connect: Connect, create: bool
) -> None:
    config = TableConfig(
        "items", DIM, initializer=init.Normal(std=0.3), optimizer=optim.SGD(lr=0.1), seed=7
    )
    server = shard_server()
    stubs = connect(server)
    assert create_table(stubs, config) is True
    keys = np.unique(rng(1).integers(0, 2**63 - 1, size=300, dtype=np.int64))
    rng(2).shuffle(keys)

    got = lookup(stubs, "items", keys, create=create)

    np.testing.assert_array_equal(got, config.initial_rows(keys)[:, :DIM])
    description = describe(stubs, "items")
    assert description.initialized == keys.size
    assert description.created == (keys.size if create else 0)
    assert tier(description, "host").rows == (keys.size if create else 0)
    stored, _ = table_rows(server, "items")
    np.testing.assert_array_equal(stored, np.sort(keys) if create else np.empty(0, np.int64))
    # The same values again: stored (create) or generated again (a pure function of the key).
    np.testing.assert_array_equal(lookup(stubs, "items", keys, create=False), got)
    assert describe(stubs, "items").initialized == keys.size * (1 if create else 2)


def test_padding_keys_look_up_as_zeros_and_take_no_row(
    shard_server: ServerFactory, connect: Connect
) -> None:
    config = TableConfig("t", DIM, optimizer=optim.SGD(lr=0.5), seed=3)
    server = shard_server()
    stubs = connect(server)
    create_table(stubs, config)
    keys = as_keys([-1, 4, np.iinfo(np.int64).min, 4, 11, -5])

    got = lookup(stubs, "t", keys)

    real = keys >= 0
    np.testing.assert_array_equal(got[~real], 0.0)
    np.testing.assert_array_equal(got[real], config.initial_rows(keys[real])[:, :DIM])
    assert describe(stubs, "t").created == 2
    assert lookup_responses(stubs, "t", []) == []  # no keys: no rows, no messages
    assert lookup(stubs, "t", [-3, -4]).tolist() == [[0.0] * DIM] * 2
    # Gradients of padding keys are ignored; num_keys counts distinct real keys.
    grads = normal(rng(4), (keys.size, DIM))
    assert push(stubs, "t", keys, grads, step=1) == 2
    expected = sgd_oracle(config, keys, grads, lr=0.5)
    stored, rows = table_rows(server, "t")
    assert stored.tolist() == [4, 11]
    np.testing.assert_allclose(rows, np.stack([expected[4], expected[11]]), rtol=1e-6, atol=1e-7)


def test_sgd_push_subtracts_lr_times_the_summed_gradients_of_repeated_keys(
    shard_server: ServerFactory, connect: Connect
) -> None:
    lr = 0.05
    config = TableConfig("t", DIM, initializer=init.Uniform(-1, 1), optimizer=optim.SGD(lr=lr))
    server = shard_server()
    stubs = connect(server)
    create_table(stubs, config)
    generator = rng(5)
    universe = as_keys(generator.choice(10**15, size=100, replace=False))
    initial = config.initial_rows(universe)[:, :DIM].astype(np.float64)
    expected = dict(zip(universe.tolist(), initial, strict=True))
    for step in (1, 2, 3):
        keys = universe[generator.integers(0, 60, size=400)]  # duplicates; 40 keys untouched
        grads = normal(generator, (keys.size, DIM))
        assert push(stubs, "t", keys, grads, step=step) == np.unique(keys).size
        for key, grad in zip(keys.tolist(), grads.astype(np.float64), strict=True):
            expected[key] = expected[key] - lr * grad

    got = lookup(stubs, "t", universe, create=False)

    np.testing.assert_allclose(got, np.stack([expected[k] for k in universe.tolist()]), atol=2e-6)
    assert describe(stubs, "t").created == 60


def test_adam_push_matches_torch_sparse_adam_with_the_given_step(
    shard_server: ServerFactory, connect: Connect
) -> None:
    torch = pytest.importorskip("torch")
    hyper = {"lr": 0.01, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6}
    config = TableConfig("adam", DIM, optimizer=optim.Adam(**hyper), seed=11)
    server = shard_server()
    stubs = connect(server)
    create_table(stubs, config)
    universe = as_keys(np.arange(60) * 1_000_003 + 17)
    weight = torch.nn.Parameter(torch.from_numpy(config.initial_rows(universe)[:, :DIM].copy()))
    reference = torch.optim.SparseAdam(
        [weight], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"]
    )
    generator = rng(6)
    # Keys first touched at a later step get the bias correction of that step (lazy moments,
    # one step count per table), so each step draws from a moving window.
    windows = {1: (0, 20), 2: (10, 40), 3: (30, 60), 4: (0, 60)}
    for step, (low, high) in windows.items():
        index = generator.integers(low, high, size=80)
        grads = normal(generator, (index.size, DIM))
        push(stubs, "adam", universe[index], grads, step=step)
        weight.grad = torch.sparse_coo_tensor(
            torch.from_numpy(index[None, :]),
            torch.from_numpy(grads),
            tuple(weight.shape),
            check_invariants=True,
        )
        reference.step()

    got = lookup(stubs, "adam", universe, create=False)

    np.testing.assert_allclose(got, weight.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_assign_sets_weights_and_resets_the_optimizer_state(
    shard_server: ServerFactory, connect: Connect
) -> None:
    lr, b1, b2, eps = 0.01, 0.9, 0.99, 1e-8
    config = TableConfig("t", DIM, optimizer=optim.Adam(lr=lr, beta1=b1, beta2=b2, eps=eps))
    server = shard_server()
    stubs = connect(server)
    create_table(stubs, config)
    generator = rng(7)
    push(stubs, "t", np.arange(20), normal(generator, (20, DIM)), step=1)
    _, pushed_rows = table_rows(server, "t")
    assert np.all(pushed_rows[:, DIM:] != 0)  # m and v are set

    keys = as_keys([*range(10), 3, 5, -1])  # 3 and 5 repeat: the last value wins
    values = normal(generator, (keys.size, DIM))
    assert assign(stubs, "t", keys, values) == 10

    expected = values[:10].copy()
    expected[3], expected[5] = values[10], values[11]
    np.testing.assert_array_equal(lookup(stubs, "t", np.arange(10)), expected)
    stored, rows = table_rows(server, "t")
    assert stored.tolist() == list(range(20))
    np.testing.assert_array_equal(rows[:10, :DIM], expected)
    np.testing.assert_array_equal(rows[:10, DIM:], 0.0)  # state reset
    np.testing.assert_array_equal(rows[10:], pushed_rows[10:])  # other keys untouched
    # The next Adam step starts from fresh moments (numpy oracle of the SparseAdam formulas).
    grads = normal(generator, (10, DIM)).astype(np.float64)
    step = 2
    m = (1 - b1) * grads
    v = (1 - b2) * grads * grads
    step_size = lr * np.sqrt(1 - b2**step) / (1 - b1**step)
    oracle = expected - step_size * m / (np.sqrt(v) + eps)
    push(stubs, "t", np.arange(10), grads.astype(np.float32), step=step)
    np.testing.assert_allclose(lookup(stubs, "t", np.arange(10)), oracle, rtol=1e-5, atol=1e-6)


def test_batches_of_many_chunks_give_what_small_batches_give(
    shard_server: ServerFactory, connect: Connect
) -> None:
    chunk = 64 << 10
    server = shard_server(chunk_bytes=chunk, max_message_bytes=256 << 10)
    stubs = connect(server)
    dim = 16
    base = TableConfig("big", dim, optimizer=optim.Adagrad(lr=0.1), seed=5)
    create_table(stubs, base)
    create_table(stubs, TableConfig.from_dict({**base.to_dict(), "name": "small"}))
    generator = rng(8)
    keys = as_keys(generator.choice(10**12, size=20_000, replace=False))
    small = [slice(start, start + 1000) for start in range(0, keys.size, 1000)]

    # Lookup: the request and the response both travel in many chunks.
    key_chunk = 8 << 10  # keys are small: smaller request chunks to make many of them
    requests = list(
        wire.lookup_requests("big", dim, keys.tobytes(), create=True, chunk_bytes=key_chunk)
    )
    assert len(requests) >= 20
    responses = list(stubs.embedding.Lookup(iter(requests), timeout=T))
    assert len(responses) >= 20
    for response in responses:
        assert len(response.values) <= chunk
        assert len(response.values) == 4 * dim * response.num_rows
    big_rows = np.frombuffer(wire.join_values(responses), "<f4").reshape(-1, dim)
    small_rows = np.concatenate([lookup(stubs, "small", keys[s], dim) for s in small])
    np.testing.assert_array_equal(big_rows, small_rows)
    np.testing.assert_array_equal(big_rows, base.initial_rows(keys)[:, :dim])

    # Push: distinct keys, so one big batch and its slices run the same per-row arithmetic.
    grads = normal(generator, (keys.size, dim))
    pushes = list(wire.push_requests("big", dim, 1, keys.tobytes(), grads.tobytes(), chunk))
    assert len(pushes) >= 20 and all(p.ByteSize() <= chunk + 100 for p in pushes)
    assert stubs.embedding.PushGradients(iter(pushes), timeout=T).num_keys == keys.size
    assert sum(push(stubs, "small", keys[s], grads[s], step=1) for s in small) == keys.size

    # Assign half the keys the same way.
    half = keys[::2]
    values = normal(generator, (half.size, dim))
    assert assign(stubs, "big", half, values, chunk_bytes=chunk) == half.size
    for start in range(0, half.size, 1000):
        part = slice(start, start + 1000)
        assign(stubs, "small", half[part], values[part])

    got = lookup(stubs, "big", keys, dim, chunk_bytes=chunk)
    np.testing.assert_array_equal(got, lookup(stubs, "small", keys, dim))
    np.testing.assert_array_equal(got[::2], values)
    big_keys, big_full = table_rows(server, "big")
    small_keys, small_full = table_rows(server, "small")
    np.testing.assert_array_equal(big_keys, small_keys)
    np.testing.assert_array_equal(big_full, small_full)  # optimizer state too


def split_anywhere(data: bytes, generator: np.random.Generator, pieces: int) -> list[bytes]:
    cuts = np.sort(generator.choice(np.arange(1, len(data)), size=pieces - 1, replace=False))
    bounds = [0, *cuts.tolist(), len(data)]
    return [data[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def test_bulk_fields_may_be_split_anywhere_across_messages(
    shard_server: ServerFactory, connect: Connect
) -> None:
    """The contract: a bulk field is the concatenation over the messages, split anywhere
    (not at key or row boundaries); headers may be repeated or left unset."""
    config = TableConfig("whole", DIM, optimizer=optim.Momentum(lr=0.1, momentum=0.5), seed=2)
    server = shard_server()
    stubs = connect(server)
    create_table(stubs, config)
    create_table(stubs, TableConfig.from_dict({**config.to_dict(), "name": "split"}))
    generator = rng(9)
    keys = as_keys(generator.choice(10**9, size=300, replace=False))
    grads = normal(generator, (keys.size, DIM))
    key_parts = split_anywhere(keys.tobytes(), generator, 7)
    grad_parts = split_anywhere(grads.tobytes(), generator, 5)
    messages = [
        pb.PushGradientsRequest(
            table="split" if i in (0, 3) else "",
            dim=DIM if i in (0, 2) else 0,
            step=1 if i in (0, 4) else 0,
            keys=key_parts[i] if i < len(key_parts) else b"",
            grads=grad_parts[i] if i < len(grad_parts) else b"",
        )
        for i in range(max(len(key_parts), len(grad_parts)))
    ]
    assert stubs.embedding.PushGradients(iter(messages), timeout=T).num_keys == keys.size
    push(stubs, "whole", keys, grads, step=1)

    lookups = [
        pb.LookupRequest(table="split" if i == 0 else "", dim=DIM if i == 0 else 0, keys=part)
        for i, part in enumerate(split_anywhere(keys.tobytes(), generator, 9))
    ]
    lookups[0].create = True
    split_rows = wire.join_values(stubs.embedding.Lookup(iter(lookups), timeout=T))
    np.testing.assert_array_equal(
        np.frombuffer(split_rows, "<f4").reshape(-1, DIM), lookup(stubs, "whole", keys)
    )
    np.testing.assert_array_equal(table_rows(server, "split")[1], table_rows(server, "whole")[1])


KEYS_3 = as_keys([1, 2, 3]).tobytes()
GRADS_3 = np.ones((3, DIM), np.float32).tobytes()
MISMATCHED_HEADERS = {
    "lookup dim": (
        "Lookup",
        [
            pb.LookupRequest(table="t", dim=DIM, create=True, keys=KEYS_3),
            pb.LookupRequest(table="t", dim=4, keys=KEYS_3),
        ],
        "'dim'",
    ),
    "lookup create": (
        "Lookup",
        [
            pb.LookupRequest(table="t", dim=DIM, create=False, keys=KEYS_3),
            pb.LookupRequest(create=True, keys=KEYS_3),
        ],
        "'create'",
    ),
    "push step": (
        "PushGradients",
        [
            pb.PushGradientsRequest(table="t", dim=DIM, step=1, keys=KEYS_3, grads=GRADS_3),
            pb.PushGradientsRequest(step=2, keys=KEYS_3, grads=GRADS_3),
        ],
        "'step'",
    ),
    "push dim": (
        "PushGradients",
        [
            pb.PushGradientsRequest(table="t", dim=DIM, step=1, keys=KEYS_3, grads=GRADS_3),
            pb.PushGradientsRequest(dim=DIM * 2, keys=KEYS_3, grads=GRADS_3),
        ],
        "'dim'",
    ),
    "assign dim": (
        "Assign",
        [
            pb.AssignRequest(table="t", dim=DIM, keys=KEYS_3, values=GRADS_3),
            pb.AssignRequest(dim=1, keys=KEYS_3, values=GRADS_3),
        ],
        "'dim'",
    ),
}


def call_raw(stubs: Stubs, method: str, messages: list[Any]) -> Any:
    """A data call with hand-made request messages; a response stream is drained."""
    reply = getattr(stubs.embedding, method)(iter(messages), timeout=T)
    return list(reply) if method == "Lookup" else reply


@pytest.mark.parametrize("case", MISMATCHED_HEADERS, ids=list(MISMATCHED_HEADERS))
def test_header_fields_that_disagree_between_messages_are_refused(
    shard_server: ServerFactory, connect: Connect, case: str
) -> None:
    server = shard_server()
    stubs = connect(server)
    create_table(stubs, TableConfig("t", DIM, optimizer=optim.SGD(lr=0.1)))
    create_table(stubs, TableConfig("u", DIM, optimizer=optim.SGD(lr=0.1)))
    push(stubs, "t", [7], np.ones((1, DIM), np.float32), step=1)
    before = shard_state(server)
    method, messages, field = MISMATCHED_HEADERS[case]

    refused(CODE.INVALID_ARGUMENT, lambda: call_raw(stubs, method, messages), "message 1", field)

    assert_same_state(before, shard_state(server))
    assert describe(stubs, "t").created == 1
    # The same stream with the later headers left unset is fine.
    for message in messages[1:]:
        for header in ("table", "dim", "create", "step"):
            if header in message.DESCRIPTOR.fields_by_name:
                message.ClearField(header)
    call_raw(stubs, method, messages)


# -- several tables in one call ---------------------------------------------------------------


def two_tables(stubs: Stubs) -> None:
    create_table(stubs, TableConfig("t", DIM, optimizer=optim.SGD(lr=0.1)))
    create_table(stubs, TableConfig("w", 2 * DIM, optimizer=optim.Adagrad(lr=0.1)))


def test_a_call_carrying_several_tables_answers_what_separate_calls_answer(
    shard_server: ServerFactory, connect: Connect
) -> None:
    together, apart = connect(shard_server()), connect(shard_server())
    generator = rng(3)
    keys_t, keys_w = as_keys([5, 1, 9]), as_keys([2, 5, 7, 11])
    grads_t = normal(generator, (3, DIM))
    grads_w = normal(generator, (4, 2 * DIM))
    for stubs in (together, apart):
        two_tables(stubs)
    lookups = [
        *wire.lookup_requests("t", DIM, keys_t.tobytes(), create=True),
        *wire.lookup_requests("w", 2 * DIM, keys_w.tobytes(), create=False),
    ]
    rows = np.frombuffer(
        wire.join_values(together.embedding.Lookup(iter(lookups), timeout=T)), "<f4"
    )
    np.testing.assert_array_equal(rows[: 3 * DIM].reshape(3, DIM), lookup(apart, "t", keys_t))
    np.testing.assert_array_equal(
        rows[3 * DIM :].reshape(4, 2 * DIM), lookup(apart, "w", keys_w, 2 * DIM, create=False)
    )
    pushes = [
        *wire.push_requests("t", DIM, 1, keys_t.tobytes(), grads_t.tobytes()),
        *wire.push_requests("w", 2 * DIM, 4, keys_w.tobytes(), grads_w.tobytes()),
    ]
    assert together.embedding.PushGradients(iter(pushes), timeout=T).num_keys == 7
    push(apart, "t", keys_t, grads_t, step=1)
    push(apart, "w", keys_w, grads_w, step=4)
    np.testing.assert_array_equal(lookup(together, "t", keys_t), lookup(apart, "t", keys_t))
    np.testing.assert_array_equal(
        lookup(together, "w", keys_w, 2 * DIM), lookup(apart, "w", keys_w, 2 * DIM)
    )


def test_a_bad_batch_of_a_later_table_refuses_the_whole_call_and_changes_nothing(
    shard_server: ServerFactory, connect: Connect
) -> None:
    server = shard_server()
    stubs = connect(server)
    two_tables(stubs)
    push(stubs, "t", [1, 2], np.ones((2, DIM), np.float32), step=1)
    before = shard_state(server)
    good = list(wire.push_requests("t", DIM, 2, KEYS_3, GRADS_3))
    nan = np.ones((3, 2 * DIM), np.float32)
    nan[2, 1] = np.nan
    cases = {
        "NaN in the second table": (
            good + list(wire.push_requests("w", 2 * DIM, 2, KEYS_3, nan.tobytes())),
            CODE.INVALID_ARGUMENT,
            "finite",
        ),
        "unknown second table": (
            good + list(wire.push_requests("nope", DIM, 2, KEYS_3, GRADS_3)),
            CODE.NOT_FOUND,
            "nope",
        ),
        "a table in two batches": (
            good
            + list(
                wire.push_requests(
                    "w", 2 * DIM, 2, KEYS_3, np.ones((3, 2 * DIM), np.float32).tobytes()
                )
            )
            + good,
            CODE.INVALID_ARGUMENT,
            "one batch per call",
        ),
    }
    for name, (messages, code, needle) in cases.items():
        refused(code, lambda m=messages: call_raw(stubs, "PushGradients", m), needle)
        assert_same_state(before, shard_state(server))
        if "NaN" in name:
            continue  # lookups carry no values
        # The same batches as a training lookup: refused before any row is created.
        lookups = [
            pb.LookupRequest(table=m.table, dim=m.dim, create=True, keys=m.keys) for m in messages
        ]
        refused(code, lambda m=lookups: call_raw(stubs, "Lookup", m), needle)
        assert_same_state(before, shard_state(server))


def test_a_key_of_another_shard_in_a_later_batch_refuses_the_whole_call(
    shard_server: ServerFactory, connect: Connect
) -> None:
    server = shard_server(shard_id=1, num_shards=2)
    stubs = connect(server)
    two_tables(stubs)
    before = shard_state(server)
    good = pb.LookupRequest(table="t", dim=DIM, create=True, keys=as_keys([1, 3]).tobytes())
    wrong = pb.LookupRequest(table="w", dim=2 * DIM, create=True, keys=as_keys([5, 2]).tobytes())
    for call in (
        lambda: call_raw(stubs, "Lookup", [good, wrong]),
        lambda: stubs.embedding.LookupUnary(pb.LookupBatches(batches=[good, wrong]), timeout=T),
    ):
        refused(CODE.INVALID_ARGUMENT, call, "table 'w'", "key 2 at index 1", "shard 0")
        assert_same_state(before, shard_state(server))  # not even table t's rows were created


def test_the_one_message_forms_answer_what_the_streams_answer(
    shard_server: ServerFactory, connect: Connect
) -> None:
    unary_server = shard_server()
    unary, stream = connect(unary_server), connect(shard_server())
    generator = rng(4)
    keys_t, keys_w = as_keys([5, 1, 9, 5]), as_keys([2, 7, -1])
    grads_t, grads_w = normal(generator, (4, DIM)), normal(generator, (3, 2 * DIM))
    for stubs in (unary, stream):
        two_tables(stubs)
    lookups = [
        pb.LookupRequest(table="t", dim=DIM, create=True, keys=keys_t.tobytes()),
        pb.LookupRequest(table="w", dim=2 * DIM, create=True, keys=keys_w.tobytes()),
    ]
    pushes = [
        pb.PushGradientsRequest(
            table="t", dim=DIM, step=1, keys=keys_t.tobytes(), grads=grads_t.tobytes()
        ),
        pb.PushGradientsRequest(
            table="w", dim=2 * DIM, step=3, keys=keys_w.tobytes(), grads=grads_w.tobytes()
        ),
    ]
    for _ in range(2):
        reply = unary.embedding.LookupUnary(pb.LookupBatches(batches=lookups), timeout=T)
        streamed = wire.join_values(stream.embedding.Lookup(iter(lookups), timeout=T))
        assert reply.num_rows == 7
        assert reply.values == streamed
        pushed = unary.embedding.PushGradientsUnary(
            pb.PushGradientsBatches(batches=pushes), timeout=T
        )
        assert pushed.num_keys == stream.embedding.PushGradients(iter(pushes), timeout=T).num_keys
    # Refused as the streams are, changing nothing.
    before = shard_state(unary_server)
    bad = [
        pushes[0],
        pb.PushGradientsRequest(table="nope", dim=DIM, step=1, keys=KEYS_3, grads=GRADS_3),
    ]
    refused(
        CODE.NOT_FOUND,
        lambda: unary.embedding.PushGradientsUnary(pb.PushGradientsBatches(batches=bad)),
        "nope",
    )
    refused(
        CODE.INVALID_ARGUMENT,
        lambda: unary.embedding.LookupUnary(
            pb.LookupBatches(batches=[pb.LookupRequest(table="t", dim=DIM + 1, keys=KEYS_3)])
        ),
        "'dim'",
    )
    assert_same_state(before, shard_state(unary_server))


# -- bad input --------------------------------------------------------------------------------

BAD_DIM = 4
MINE = as_keys([1000, 1003, 1])  # keys of shard 1 of 3; 1000 and 1003 are not stored yet
MINE_B = MINE.tobytes()


def grads_b(n: int = 3, dim: int = BAD_DIM, value: float = 1.0) -> bytes:
    return np.full((n, dim), value, np.float32).tobytes()


def with_value(value: float, row: int = 1, col: int = 2) -> bytes:
    grads = np.ones((3, BAD_DIM), np.float32)
    grads[row, col] = value
    return grads.tobytes()


def lookup_msg(**fields: Any) -> pb.LookupRequest:
    return pb.LookupRequest(**{"table": "items", "dim": BAD_DIM, "create": True, **fields})


def push_msg(**fields: Any) -> pb.PushGradientsRequest:
    base = {"table": "items", "dim": BAD_DIM, "step": 2, "keys": MINE_B, "grads": grads_b()}
    return pb.PushGradientsRequest(**{**base, **fields})


def assign_msg(**fields: Any) -> pb.AssignRequest:
    base = {"table": "items", "dim": BAD_DIM, "keys": MINE_B, "values": grads_b()}
    return pb.AssignRequest(**{**base, **fields})


INVALID = CODE.INVALID_ARGUMENT
BAD_DATA_CALLS: dict[str, tuple[str, list[Any], grpc.StatusCode, list[str]]] = {
    "lookup unknown table": (
        "Lookup",
        [lookup_msg(table="nope", keys=MINE_B)],
        CODE.NOT_FOUND,
        ["'nope'", "not found"],
    ),
    "push unknown table": ("PushGradients", [push_msg(table="nope")], CODE.NOT_FOUND, ["'nope'"]),
    "assign unknown table": ("Assign", [assign_msg(table="nope")], CODE.NOT_FOUND, ["'nope'"]),
    "lookup keys not a multiple of 8": (
        "Lookup",
        [lookup_msg(keys=MINE_B[:-3])],
        INVALID,
        ["'keys'", "multiple of 8", "21 bytes"],
    ),
    "push keys not a multiple of 8": (
        "PushGradients",
        [push_msg(keys=MINE_B + b"\x01")],
        INVALID,
        ["'keys'", "multiple of 8", "25 bytes"],
    ),
    "assign keys not a multiple of 8": (
        "Assign",
        [assign_msg(keys=MINE_B[:-1])],
        INVALID,
        ["'keys'", "multiple of 8"],
    ),
    "grads not a multiple of 4*dim": (
        "PushGradients",
        [push_msg(grads=grads_b()[:-4])],
        INVALID,
        ["'grads'", "expected 48 bytes", "got 44", "4*dim=16"],
    ),
    "grads for another key count": (
        "PushGradients",
        [push_msg(grads=grads_b(2))],
        INVALID,
        ["'grads'", "3 keys", "expected 48 bytes", "got 32"],
    ),
    "values not a multiple of 4*dim": (
        "Assign",
        [assign_msg(values=grads_b()[:-2])],
        INVALID,
        ["'values'", "4*dim=16"],
    ),
    "values for another key count": (
        "Assign",
        [assign_msg(values=grads_b(4))],
        INVALID,
        ["'values'", "3 keys", "got 64"],
    ),
    "lookup dim mismatch": (
        "Lookup",
        [lookup_msg(dim=5, keys=MINE_B)],
        INVALID,
        ["'items'", "'dim'", "expected 4", "got 5"],
    ),
    "push dim mismatch": (
        "PushGradients",
        [push_msg(dim=5, grads=grads_b(dim=5))],
        INVALID,
        ["'dim'", "expected 4", "got 5"],
    ),
    "assign dim mismatch": (
        "Assign",
        [assign_msg(dim=2, values=grads_b(dim=2))],
        INVALID,
        ["'dim'", "expected 4", "got 2"],
    ),
    "lookup dim 0": ("Lookup", [lookup_msg(dim=0, keys=MINE_B)], INVALID, ["'dim'", "got 0"]),
    "push dim 0": ("PushGradients", [push_msg(dim=0, grads=b"")], INVALID, ["'dim'", "got 0"]),
    "assign dim 0": ("Assign", [assign_msg(dim=0, values=b"")], INVALID, ["'dim'", "got 0"]),
    "lookup key of another shard": (
        "Lookup",
        [lookup_msg(keys=as_keys([1000, 1, 3]).tobytes())],
        INVALID,
        ["key 3", "index 2", "shard 0", "shard 1 of 3"],
    ),
    "push key of another shard": (
        "PushGradients",
        [push_msg(keys=as_keys([1000, 3, 1]).tobytes())],
        INVALID,
        ["key 3", "index 1", "shard 1 of 3"],
    ),
    "assign key of another shard": (
        "Assign",
        [assign_msg(keys=as_keys([5, 1000, 1]).tobytes())],
        INVALID,
        ["key 5", "index 0", "shard 2"],
    ),
    "NaN gradient": (
        "PushGradients",
        [push_msg(grads=with_value(np.nan))],
        INVALID,
        ["'grads'", "finite", "nan", "[1, 2]"],
    ),
    "Inf gradient": (
        "PushGradients",
        [push_msg(grads=with_value(np.inf, 2, 3))],
        INVALID,
        ["'grads'", "finite", "inf", "[2, 3]"],
    ),
    "-Inf gradient": (
        "PushGradients",
        [push_msg(grads=with_value(-np.inf, 0, 0))],
        INVALID,
        ["'grads'", "finite", "-inf"],
    ),
    "NaN gradient of a padding key": (
        "PushGradients",
        [push_msg(keys=as_keys([1000, -1, 1]).tobytes(), grads=with_value(np.nan))],
        INVALID,
        ["'grads'", "finite"],
    ),
    "NaN in assigned values": (
        "Assign",
        [assign_msg(values=with_value(np.nan))],
        INVALID,
        ["'values'", "finite", "nan"],
    ),
    "Inf in assigned values": (
        "Assign",
        [assign_msg(values=with_value(np.inf))],
        INVALID,
        ["'values'", "finite", "inf"],
    ),
    "step 0": ("PushGradients", [push_msg(step=0)], INVALID, ["'step'", ">= 1", "got 0"]),
    "empty lookup stream": ("Lookup", [], INVALID, ["at least one message"]),
    "empty push stream": ("PushGradients", [], INVALID, ["at least one message"]),
    "empty assign stream": ("Assign", [], INVALID, ["at least one message"]),
}


@pytest.fixture
def shard_1_of_3(shard_server: ServerFactory, connect: Connect) -> tuple[ShardServer, Stubs]:
    """Shard 1 of 3 with table 'items' (Adam, dim 4) holding 40 pushed keys."""
    server = shard_server(shard_id=1, num_shards=3)
    stubs = connect(server)
    create_table(stubs, TableConfig("items", BAD_DIM, optimizer=optim.Adam(lr=0.1), seed=1))
    keys = 1 + 3 * np.arange(40)
    push(stubs, "items", keys, normal(rng(10), (40, BAD_DIM)), step=1)
    return server, stubs


def assert_still_serving(server: ShardServer, stubs: Stubs, before: dict[str, Any]) -> None:
    """Nothing changed, and the shard answers correctly: stored keys read back as stored,
    and a good push lands."""
    assert_same_state(before, shard_state(server))
    _, keys, rows = before["items"]
    np.testing.assert_array_equal(lookup(stubs, "items", keys, BAD_DIM), rows[:, :BAD_DIM])
    assert push(stubs, "items", keys[:5], np.ones((5, BAD_DIM), np.float32), step=2) == 5
    assert not np.array_equal(table_rows(server, "items")[1][:5], rows[:5])


@pytest.mark.parametrize("case", BAD_DATA_CALLS, ids=list(BAD_DATA_CALLS))
def test_bad_data_call_is_refused_and_changes_nothing(
    shard_1_of_3: tuple[ShardServer, Stubs], case: str
) -> None:
    server, stubs = shard_1_of_3
    method, messages, code, needles = BAD_DATA_CALLS[case]
    before = shard_state(server)

    refused(code, lambda: call_raw(stubs, method, messages), *needles)

    assert_still_serving(server, stubs, before)


@pytest.mark.parametrize("method", ["Lookup", "PushGradients", "Assign"])
def test_a_message_over_the_servers_limit_is_resource_exhausted(
    shard_server: ServerFactory, connect: Connect, method: str
) -> None:
    server = shard_server(max_message_bytes=1 << 20, chunk_bytes=256 << 10)
    stubs = connect(server, max_message_bytes=64 << 20)  # so the client sends it
    config = TableConfig("items", BAD_DIM, optimizer=optim.SGD(lr=0.1))
    create_table(stubs, config)
    assign(stubs, "items", [1, 2], np.ones((2, BAD_DIM), np.float32))
    before = shard_state(server)
    n = (2 << 20) // 8 if method == "Lookup" else 100_000  # 2 MiB of keys; 2.4 MiB with grads
    keys = np.arange(10, 10 + n, dtype=np.int64)
    rows = np.ones((n, BAD_DIM), np.float32).tobytes()
    message = {
        "Lookup": lookup_msg(keys=keys.tobytes()),
        "PushGradients": push_msg(keys=keys.tobytes(), grads=rows),
        "Assign": assign_msg(keys=keys.tobytes(), values=rows),
    }[method]
    assert message.ByteSize() > 2 << 20

    refused(CODE.RESOURCE_EXHAUSTED, lambda: call_raw(stubs, method, [message]), "larger than max")

    assert_same_state(before, shard_state(server))
    # The same batch in chunks under the limit is fine.
    if method == "Lookup":
        got = lookup(stubs, "items", keys, BAD_DIM, create=False, chunk_bytes=256 << 10)
        np.testing.assert_array_equal(got, config.initial_rows(keys)[:, :BAD_DIM])
    else:
        pieces = {"PushGradients": wire.push_requests, "Assign": wire.assign_requests}[method]
        args = (1,) if method == "PushGradients" else ()
        requests = pieces("items", BAD_DIM, *args, keys.tobytes(), rows, chunk_bytes=256 << 10)
        assert getattr(stubs.embedding, method)(requests, timeout=T).num_keys == n


def test_an_oversized_message_is_counted_as_ended_by_the_transport_not_internal(
    shard_server: ServerFactory, connect: Connect
) -> None:
    server = shard_server(max_message_bytes=1 << 20, chunk_bytes=256 << 10, metrics_port=0)
    stubs = connect(server, max_message_bytes=64 << 20)
    create_table(stubs, TableConfig("items", BAD_DIM))
    message = lookup_msg(keys=np.arange(1 << 18, dtype=np.int64).tobytes())
    refused(CODE.RESOURCE_EXHAUSTED, lambda: call_raw(stubs, "Lookup", [message]))
    counts = rpc_counts(scrape(server))
    # The servicer cannot tell a message over the limit from a client cancel (gRPC ends the
    # request stream either way, and has told the client why): it counts CANCELLED. When
    # gRPC ends the stream cleanly before it marks the call inactive, the servicer sees an
    # empty stream and counts INVALID_ARGUMENT - a race inside gRPC; never INTERNAL.
    lookups = {code: n for (method, code), n in counts.items() if method == "Lookup"}
    assert sum(lookups.values()) == 1
    assert set(lookups) <= {"CANCELLED", "INVALID_ARGUMENT"}, lookups


def test_a_call_over_max_batch_bytes_is_resource_exhausted(
    shard_server: ServerFactory, connect: Connect
) -> None:
    server = shard_server(max_batch_bytes=100_000)
    stubs = connect(server)
    create_table(stubs, TableConfig("items", BAD_DIM, optimizer=optim.SGD(lr=0.1)))
    before = shard_state(server)
    keys = np.arange(5000, dtype=np.int64)  # 40 KB of keys + 80 KB of grads, in 16 KiB chunks
    grads = np.ones((keys.size, BAD_DIM), np.float32)

    refused(
        CODE.RESOURCE_EXHAUSTED,
        lambda: push(stubs, "items", keys, grads, step=1, chunk_bytes=16 << 10),
        "at most 100000 bytes",
        "split the batch",
    )

    assert_same_state(before, shard_state(server))
    assert push(stubs, "items", keys[:2000], grads[:2000], step=1) == 2000


def test_a_lookup_whose_reply_is_over_max_batch_bytes_is_resource_exhausted(
    shard_server: ServerFactory, connect: Connect
) -> None:
    server = shard_server(max_batch_bytes=100_000)
    stubs = connect(server)
    create_table(stubs, TableConfig("items", BAD_DIM, optimizer=optim.SGD(lr=0.1)))
    before = shard_state(server)
    keys = np.arange(10_000, dtype=np.int64)  # 80 KB of keys ask for a 160 KB reply

    refused(
        CODE.RESOURCE_EXHAUSTED,
        lambda: lookup(stubs, "items", keys, BAD_DIM, create=True),
        "at most 100000",
        "split the batch",
    )

    assert_same_state(before, shard_state(server))  # nothing created
    np.testing.assert_array_equal(
        lookup(stubs, "items", keys[:100], BAD_DIM),
        TableConfig("items", BAD_DIM).initial_rows(keys[:100])[:, :BAD_DIM],
    )


def test_a_one_message_lookup_whose_reply_is_over_the_message_limit_is_resource_exhausted(
    shard_server: ServerFactory, connect: Connect
) -> None:
    server = shard_server(chunk_bytes=4096, max_message_bytes=8192)
    stubs = connect(server)
    create_table(stubs, TableConfig("items", BAD_DIM, optimizer=optim.SGD(lr=0.1)))
    before = shard_state(server)
    keys = np.arange(400, dtype=np.int64)  # 3.2 KB of keys ask for a 6.4 KB reply in one message
    request = pb.LookupBatches(
        batches=[pb.LookupRequest(table="items", dim=BAD_DIM, create=True, keys=keys.tobytes())]
    )
    refused(
        CODE.RESOURCE_EXHAUSTED,
        lambda: stubs.embedding.LookupUnary(request, timeout=T),
        "at most 4096",
        "split the batch",
    )
    assert_same_state(before, shard_state(server))  # nothing created
    # The stream answers it in chunks.
    np.testing.assert_array_equal(
        lookup(stubs, "items", keys, BAD_DIM),
        TableConfig("items", BAD_DIM).initial_rows(keys)[:, :BAD_DIM],
    )


# -- admin: bad input ---------------------------------------------------------------------------


def config_message(**changes: Any) -> pb.TableConfig:
    message = table_config_to_proto(TableConfig("new", DIM, optimizer=optim.Adam()).to_dict())
    for path, value in changes.items():
        if path == "optimizer_params":
            message.optimizer.params.update(value)
        elif path == "optimizer_kind":
            message.optimizer.kind = value
        elif path == "initializer_kind":
            message.initializer.kind = value
        else:
            setattr(message, path, value)
    return message


BAD_CONFIGS = {
    "dim 0": (config_message(dim=0), ["'dim'", "got 0"]),
    "dim too big": (config_message(dim=65537), ["'dim'", "65537"]),
    "unknown optimizer kind": (
        config_message(optimizer_kind="unregistered"),
        ["'optimizer.kind'", "'unregistered'", "adam"],
    ),
    "unknown optimizer param": (config_message(optimizer_params={"momentum": 0.9}), ["momentum"]),
    "optimizer param out of range": (
        config_message(optimizer_params={"beta1": 1.5}),
        ["'beta1'", "1.5"],
    ),
    "NaN learning rate": (config_message(optimizer_params={"lr": float("nan")}), ["'lr'", "nan"]),
    "unknown initializer kind": (
        config_message(initializer_kind="xavier"),
        ["'initializer.kind'", "'xavier'"],
    ),
    "bad name": (config_message(name="a/b"), ["'name'", "'a/b'"]),
    "empty name": (config_message(name=""), ["'name'"]),
    "dtype": (config_message(dtype="float16"), ["'dtype'", "'float16'"]),
    "eviction": (config_message(eviction="fifo"), ["'eviction'", "'fifo'"]),
    "write policy": (config_message(write_policy="never"), ["'write_policy'", "'never'"]),
}


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=list(BAD_CONFIGS))
def test_create_table_with_a_bad_config_is_invalid_argument(
    shard_server: ServerFactory, connect: Connect, case: str
) -> None:
    server = shard_server()
    stubs = connect(server)
    create_table(stubs, TableConfig("old", DIM))
    before = shard_state(server)
    message, needles = BAD_CONFIGS[case]

    refused(
        INVALID,
        lambda: stubs.admin.CreateTable(pb.CreateTableRequest(config=message), timeout=T),
        "'config'",
        *needles,
    )

    assert_same_state(before, shard_state(server))
    assert [c.name for c in list_tables(stubs)] == ["old"]


def test_create_table_with_only_name_and_dim_takes_the_defaults(
    shard_server: ServerFactory, connect: Connect
) -> None:
    stubs = connect(shard_server())
    request = pb.CreateTableRequest(config=pb.TableConfig(name="bare", dim=DIM))
    assert stubs.admin.CreateTable(request, timeout=T).created is True
    assert list_tables(stubs) == [TableConfig("bare", DIM)]


def test_create_table_again_same_config_is_a_no_op_and_another_config_is_refused(
    shard_server: ServerFactory, connect: Connect
) -> None:
    server = shard_server()
    stubs = connect(server)
    config = TableConfig("t", DIM, optimizer=optim.Adagrad(lr=0.2), seed=4)
    assert create_table(stubs, config) is True
    push(stubs, "t", np.arange(30), normal(rng(11), (30, DIM)), step=1)
    before = shard_state(server)

    assert create_table(stubs, config) is False
    assert_same_state(before, shard_state(server))
    for other in (
        TableConfig("t", DIM, optimizer=optim.Adagrad(lr=0.3), seed=4),
        TableConfig("t", DIM * 2, optimizer=optim.Adagrad(lr=0.2), seed=4),
        TableConfig("t", DIM, optimizer=optim.Adagrad(lr=0.2), seed=5),
    ):
        refused(
            CODE.FAILED_PRECONDITION,
            lambda other=other: create_table(stubs, other),
            "'t'",
            "another config",
        )
    assert_same_state(before, shard_state(server))
    assert list_tables(stubs) == [config]


def test_drop_table_deletes_every_row_and_unknown_tables_are_not_found(
    shard_server: ServerFactory, connect: Connect
) -> None:
    server = shard_server()
    stubs = connect(server)
    config = TableConfig("t", DIM, optimizer=optim.SGD(lr=1.0), host_cache_bytes=20_000)
    create_table(stubs, config)
    keys = np.arange(2000)  # more than the host tier holds: rows in both tiers
    push(stubs, "t", keys, np.ones((keys.size, DIM), np.float32), step=1)
    assert tier(describe(stubs, "t"), "host").rows < keys.size

    for call, needle in (
        (lambda: stubs.admin.DropTable(pb.DropTableRequest(table="nope"), timeout=T), "'nope'"),
        (lambda: describe(stubs, "nope"), "'nope'"),
        (lambda: stubs.admin.DropTable(pb.DropTableRequest(table=""), timeout=T), "''"),
    ):
        refused(CODE.NOT_FOUND, call, needle)
    stubs.admin.DropTable(pb.DropTableRequest(table="t"), timeout=T)

    assert list_tables(stubs) == []
    refused(CODE.NOT_FOUND, lambda: lookup(stubs, "t", keys), "'t'")
    refused(CODE.NOT_FOUND, lambda: stubs.admin.DropTable(pb.DropTableRequest(table="t")), "'t'")
    assert create_table(stubs, config) is True  # a new table: initial rows, no old ones
    np.testing.assert_array_equal(
        lookup(stubs, "t", keys, create=False), config.initial_rows(keys)[:, :DIM]
    )
    assert table_rows(server, "t")[0].size == 0


def save_request(name: str, phase: int = pb.SAVE_PHASE_WRITE_PART, save_id: str = "id1") -> Any:
    return pb.SaveSnapshotRequest(name=name, phase=phase, save_id=save_id)


def save(stubs: Stubs, name: str, **kwargs: Any) -> list[pb.SnapshotProgress]:
    return list(stubs.admin.SaveSnapshot(save_request(name, **kwargs), timeout=T))


def load(stubs: Stubs, name: str) -> list[pb.SnapshotProgress]:
    return list(stubs.admin.LoadSnapshot(pb.LoadSnapshotRequest(name=name), timeout=T))


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def test_save_snapshot_with_phase_unspecified_is_invalid_argument(
    shard_server: ServerFactory, connect: Connect, tmp_path: Path
) -> None:
    stubs = connect(shard_server())
    create_table(stubs, TableConfig("t", DIM))
    refused(
        INVALID,
        lambda: save(stubs, "s", phase=pb.SAVE_PHASE_UNSPECIFIED),
        "'phase'",
        "SAVE_PHASE_WRITE_PART",
    )
    refused(INVALID, lambda: save(stubs, "s", phase=7), "'phase'", "got 7")
    refused(INVALID, lambda: save(stubs, "s", save_id=""), "save_id")
    assert files_under(tmp_path / "snapshots") == []


@pytest.mark.parametrize("name", ["a/b", "..", "../x", "/abs", "", "a..b", ".hidden", "x" * 129])
def test_snapshot_names_that_are_not_one_directory_name_are_refused(
    shard_server: ServerFactory, connect: Connect, tmp_path: Path, name: str
) -> None:
    server = shard_server()
    stubs = connect(server)
    create_table(stubs, TableConfig("t", DIM))
    listing = files_under(tmp_path)
    for call in (
        lambda: save(stubs, name),
        lambda: save(stubs, name, phase=pb.SAVE_PHASE_COMMIT),
        lambda: load(stubs, name),
    ):
        refused(INVALID, call, "snapshot name", repr(name))
    assert files_under(tmp_path) == listing  # nothing written anywhere
    assert [c.name for c in list_tables(stubs)] == ["t"]


def test_snapshot_calls_without_a_snapshot_dir_are_failed_precondition(
    shard_server: ServerFactory, connect: Connect
) -> None:
    stubs = connect(shard_server(snapshot_dir=None))
    create_table(stubs, TableConfig("t", DIM))
    for call in (
        lambda: save(stubs, "s"),
        lambda: save(stubs, "s", phase=pb.SAVE_PHASE_COMMIT),
        lambda: load(stubs, "s"),
        lambda: stubs.admin.ListSnapshots(pb.ListSnapshotsRequest(), timeout=T),
    ):
        refused(CODE.FAILED_PRECONDITION, call, "no snapshot directory")


def test_missing_or_uncommitted_snapshots(
    shard_server: ServerFactory, connect: Connect, tmp_path: Path
) -> None:
    server = shard_server()
    stubs = connect(server)
    create_table(stubs, TableConfig("t", DIM))
    lookup(stubs, "t", np.arange(10))
    refused(CODE.NOT_FOUND, lambda: load(stubs, "missing"), "'missing'", "not found")
    refused(
        CODE.NOT_FOUND,
        lambda: save(stubs, "missing", phase=pb.SAVE_PHASE_COMMIT),
        "'missing'",
    )
    # A part written but not committed: listed as incomplete, refused by load; committing it
    # under another save id is refused too.
    assert save(stubs, "half", save_id="A")[-1].done
    info = stubs.admin.ListSnapshots(pb.ListSnapshotsRequest(), timeout=T).snapshots
    assert [(s.name, s.complete, s.num_shards) for s in info] == [("half", False, 0)]
    refused(CODE.FAILED_PRECONDITION, lambda: load(stubs, "half"), "incomplete", "MANIFEST.json")
    refused(
        CODE.FAILED_PRECONDITION,
        lambda: save(stubs, "half", phase=pb.SAVE_PHASE_COMMIT, save_id="B"),
        "incomplete",
    )
    assert not (tmp_path / "snapshots" / "half" / "MANIFEST.json").exists()
    last = save(stubs, "half", phase=pb.SAVE_PHASE_COMMIT, save_id="A")[-1]
    assert last.done and last.rows_done == 10
    assert load(stubs, "half")[-1].rows_kept == 10


# -- concurrency ------------------------------------------------------------------------------


def test_concurrent_pushes_to_the_same_keys_lose_no_update(
    shard_server: ServerFactory, connect: Connect
) -> None:
    lr = 0.01
    config = TableConfig("t", DIM, optimizer=optim.SGD(lr=lr), seed=12)
    server = shard_server()
    create_table(connect(server), config)
    universe = as_keys(np.arange(64) * 7 + 1)
    threads, rounds = 4, 30
    generator = rng(13)
    work = [
        [
            (universe[generator.integers(0, 64, size=96)], normal(generator, (96, DIM)))
            for _ in range(rounds)
        ]
        for _ in range(threads)
    ]
    channels = [connect(server) for _ in range(threads)]
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def pusher(stubs: Stubs, batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
        try:
            start.wait()
            for step, (keys, grads) in enumerate(batches, start=1):
                push(stubs, "t", keys, grads, step=step)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    workers = [threading.Thread(target=pusher, args=(channels[i], work[i])) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert not errors, errors

    total = np.zeros((universe.size, DIM))
    position = {key: i for i, key in enumerate(universe.tolist())}
    for batches in work:
        for keys, grads in batches:
            np.add.at(total, [position[k] for k in keys.tolist()], grads.astype(np.float64))
    expected = config.initial_rows(universe)[:, :DIM] - lr * total
    got = lookup(channels[0], "t", universe, create=False)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


def test_a_push_during_a_save_is_wholly_in_or_out_of_the_snapshot(
    shard_server: ServerFactory, connect: Connect
) -> None:
    config = TableConfig("t", DIM, initializer=init.Zeros(), optimizer=optim.SGD(lr=1.0))
    server = shard_server()
    stubs = connect(server)
    create_table(stubs, config)
    keys = np.arange(3000)
    ones = np.ones((keys.size, DIM), np.float32)
    push(stubs, "t", keys, ones, step=1)
    acked = [1]  # pushes acknowledged so far: every weight is exactly -acked
    stop = threading.Event()
    pusher_stubs = connect(server)

    def pusher() -> None:
        while not stop.is_set():
            push(pusher_stubs, "t", keys, ones, step=1)
            acked[0] += 1

    thread = threading.Thread(target=pusher)
    thread.start()
    try:
        time.sleep(0.05)
        acked_before = acked[0]
        with ClusterAdmin([server.address]) as admin:
            admin.save_snapshot("during")
        acked_after = acked[0]
    finally:
        stop.set()
        thread.join(timeout=30)

    fresh = shard_server()  # same snapshot dir
    with ClusterAdmin([fresh.address]) as admin:
        admin.load_snapshot("during")
    _, rows = table_rows(fresh, "t")
    assert rows.shape == (keys.size, DIM)
    count = -rows[0, 0]
    np.testing.assert_array_equal(rows, -count)  # every key saw the same pushes
    assert acked_before <= count <= acked_after + 1, (acked_before, count, acked_after)


# -- snapshots ----------------------------------------------------------------------------------

ADAM = TableConfig("adam", DIM, optimizer=optim.Adam(lr=0.02), seed=21)
ADAGRAD = TableConfig("ada", 4, optimizer=optim.Adagrad(lr=0.1), seed=22, host_cache_bytes=4096)


def train(stubs: Stubs, keys: np.ndarray, seed: int, steps: Iterable[int] = (1, 2)) -> None:
    generator = rng(seed)
    for step in steps:
        push(stubs, "adam", keys, normal(generator, (keys.size, DIM)), step=step)
        push(stubs, "ada", keys, normal(generator, (keys.size, 4)), step=step)


def test_save_then_load_restores_weights_and_optimizer_state_bit_exactly(
    shard_server: ServerFactory, connect: Connect, tmp_path: Path
) -> None:
    server = shard_server()
    stubs = connect(server)
    empty = TableConfig("empty", 2, optimizer=optim.FTRL())
    for config in (ADAM, ADAGRAD, empty):
        create_table(stubs, config)
    keys = np.arange(0, 3000, 3)
    train(stubs, keys, seed=1)
    saved = shard_state(server)

    with ClusterAdmin([server.address]) as admin:
        info = admin.save_snapshot("snap")
        assert info["rows"] == 2 * keys.size
        listed = admin.list_snapshots()
        assert [(s["name"], s["complete"], s["num_shards"]) for s in listed] == [("snap", True, 1)]
        assert listed[0]["table_rows"] == {"adam": keys.size, "ada": keys.size, "empty": 0}
        # What the format says is on disk: keys ascending, full rows in their order.
        part = part_of(tmp_path / "snapshots" / "snap")
        for name, (config, stored_keys, stored_rows) in saved.items():
            on_disk = np.fromfile(part / f"{name}.keys", dtype="<i8")
            rows = np.fromfile(part / f"{name}.rows", dtype="<f4").reshape(-1, config.row_width)
            np.testing.assert_array_equal(on_disk, stored_keys)
            np.testing.assert_array_equal(rows, stored_rows)

        # Modify everything: more steps, assigns, new keys, another table.
        train(stubs, np.arange(0, 6000, 2), seed=2, steps=(3,))
        assign(stubs, "adam", keys[:10], np.zeros((10, DIM), np.float32))
        assign(stubs, "empty", [1], np.ones((1, 2), np.float32))
        extra = TableConfig("extra", 4, optimizer=optim.SGD(lr=1.0))
        create_table(stubs, extra)
        push(stubs, "extra", [5, 6], np.ones((2, 4), np.float32), step=1)
        extra_before = table_rows(server, "extra")

        loaded = admin.load_snapshot("snap")

    assert loaded["rows"] == 2 * keys.size
    after = shard_state(server)
    assert_same_state(saved, {name: after[name] for name in saved})
    # A table the snapshot does not hold is left as it is.
    np.testing.assert_array_equal(after["extra"][2], extra_before[1])
    # Lookups serve the loaded rows, and keys added after the save are gone.
    np.testing.assert_array_equal(lookup(stubs, "adam", keys), saved["adam"][2][:, :DIM])
    np.testing.assert_array_equal(
        lookup(stubs, "adam", [4], create=False), ADAM.initial_rows(as_keys([4]))[:, :DIM]
    )


def test_two_shards_save_and_load_and_the_snapshot_reshards_into_one(
    shard_server: ServerFactory, connect: Connect
) -> None:
    servers = [shard_server(0, 2), shard_server(1, 2)]
    stubs = [connect(s) for s in servers]
    keys = as_keys(rng(3).choice(10**9, size=2000, replace=False))
    with ClusterAdmin([s.address for s in servers]) as admin:
        assert admin.create_table(ADAM) is True
        assert admin.create_table(ADAGRAD) is True
        assert admin.create_table(ADAM) is False
        for shard_id in (0, 1):
            train(stubs[shard_id], keys[keys % 2 == shard_id], seed=4 + shard_id)
        saved = [shard_state(s) for s in servers]

        admin.save_snapshot("pair")
        for shard_id in (0, 1):
            train(stubs[shard_id], keys[keys % 2 == shard_id], seed=9, steps=(3,))
        loaded = admin.load_snapshot("pair")

        assert loaded["rows"] == 2 * keys.size
        for server, state in zip(servers, saved, strict=True):
            assert_same_state(state, shard_state(server))
        with pytest.raises(ShardError) as raised:
            admin.save_snapshot("pair")
        assert raised.value.code == CODE.FAILED_PRECONDITION
        assert "already exists" in raised.value.details

    with ClusterAdmin([servers[1].address, servers[0].address]) as swapped:
        with pytest.raises(ShardError) as raised:
            swapped.load_snapshot("pair")
        assert raised.value.code == CODE.FAILED_PRECONDITION

    # One shard takes every part's keys.
    single = shard_server(0, 1)
    with ClusterAdmin([single.address]) as admin:
        assert admin.load_snapshot("pair")["rows"] == 2 * keys.size
    merged = shard_state(single)
    for name in ("adam", "ada"):
        union_keys = np.concatenate([state[name][1] for state in saved])
        union_rows = np.concatenate([state[name][2] for state in saved])
        order = np.argsort(union_keys)
        np.testing.assert_array_equal(merged[name][1], union_keys[order])
        np.testing.assert_array_equal(merged[name][2], union_rows[order])


def test_saving_an_existing_name_is_failed_precondition(
    shard_server: ServerFactory, connect: Connect, tmp_path: Path
) -> None:
    server = shard_server()
    stubs = connect(server)
    create_table(stubs, ADAM)
    lookup(stubs, "adam", np.arange(100))
    with ClusterAdmin([server.address]) as admin:
        admin.save_snapshot("s")
    manifest = tmp_path / "snapshots" / "s" / "MANIFEST.json"
    content = manifest.read_bytes()
    files = {p: p.read_bytes() for p in (tmp_path / "snapshots").rglob("*") if p.is_file()}
    lookup(stubs, "adam", np.arange(100, 200))

    refused(CODE.FAILED_PRECONDITION, lambda: save(stubs, "s"), "'s'", "already exists")
    save_id = json.loads(content)["save_id"]  # committing the same save again
    refused(
        CODE.FAILED_PRECONDITION,
        lambda: save(stubs, "s", phase=pb.SAVE_PHASE_COMMIT, save_id=save_id),
        "already exists",
    )
    with ClusterAdmin([server.address]) as admin, pytest.raises(ShardError) as raised:
        admin.save_snapshot("s")
    assert raised.value.code == CODE.FAILED_PRECONDITION

    assert manifest.read_bytes() == content
    assert {p: p.read_bytes() for p in files} == files
    assert load(stubs, "s")[-1].rows_kept == 100


def flip_byte(path: Path, at: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def edit_manifest(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def edit(snapshot: Path) -> None:
        manifest = json.loads((snapshot / "MANIFEST.json").read_text())
        change(manifest)
        (snapshot / "MANIFEST.json").write_text(json.dumps(manifest))

    return edit


def _more_rows(manifest: dict[str, Any]) -> None:
    manifest["tables"]["adam"]["parts"][0]["rows"] += 1


def _sgd_config(manifest: dict[str, Any]) -> None:
    manifest["tables"]["adam"]["config"]["optimizer"] = {"kind": "sgd", "lr": 0.1}


PART = "part-00000-of-00001"


def part_of(snapshot: Path) -> Path:
    """The part directory of a committed snapshot: under the id of the save that wrote it."""
    save_id = json.loads((snapshot / "MANIFEST.json").read_text())["save_id"]
    return snapshot / save_id / PART


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "flipped byte in a rows file": (
        lambda s: flip_byte(part_of(s) / "adam.rows", 100),
        [f"{PART}/adam.rows", "corrupted", "sha256"],
    ),
    "flipped byte in a keys file": (
        lambda s: flip_byte(part_of(s) / "ada.keys"),
        [f"{PART}/ada.keys", "corrupted", "sha256"],
    ),
    "truncated keys file": (
        lambda s: (part_of(s) / "adam.keys").write_bytes(
            (part_of(s) / "adam.keys").read_bytes()[:-8]
        ),
        [f"{PART}/adam.keys", "corrupted", "bytes"],
    ),
    "missing rows file": (
        lambda s: (part_of(s) / "ada.rows").unlink(),
        [f"{PART}/ada.rows", "missing"],
    ),
    "no manifest (incomplete)": (
        lambda s: (s / "MANIFEST.json").unlink(),
        ["incomplete", "MANIFEST.json"],
    ),
    "garbled manifest": (
        lambda s: (s / "MANIFEST.json").write_bytes(b'{"format_version": 1, "tab'),
        ["MANIFEST.json", "corrupted"],
    ),
    "manifest of another format version": (
        edit_manifest(lambda m: m.update(format_version=99)),
        ["MANIFEST.json", "format_version", "99"],
    ),
    "manifest without tables": (
        edit_manifest(lambda m: m.pop("tables")),
        ["MANIFEST.json", "field 'tables' expected an object"],
    ),
    "manifest with a bad table config": (
        edit_manifest(lambda m: m["tables"]["ada"]["config"].update(dim=0)),
        ["MANIFEST.json", "'dim'"],
    ),
}
# The manifest's counts and configs must agree with its file sizes.
CORRUPTIONS_INCONSISTENT = {
    "manifest row count disagrees with the files": (
        edit_manifest(_more_rows),
        ["MANIFEST.json", "adam"],
    ),
    "manifest config disagrees with the row width": (
        edit_manifest(_sgd_config),
        ["MANIFEST.json", "adam"],
    ),
}


@pytest.mark.parametrize(
    "case",
    [*CORRUPTIONS, *CORRUPTIONS_INCONSISTENT],
)
def test_a_corrupted_snapshot_is_refused_before_anything_changes(
    shard_server: ServerFactory, connect: Connect, tmp_path: Path, case: str
) -> None:
    server = shard_server()
    stubs = connect(server)
    for config in (ADAM, ADAGRAD):
        create_table(stubs, config)
    keys = np.arange(400)
    train(stubs, keys, seed=5)
    with ClusterAdmin([server.address]) as admin:
        admin.save_snapshot("snap")
    train(stubs, np.arange(200, 600), seed=6, steps=(3,))  # live rows now differ
    live = shard_state(server)
    corrupt, needles = {**CORRUPTIONS, **CORRUPTIONS_INCONSISTENT}[case]
    corrupt(tmp_path / "snapshots" / "snap")

    refused(CODE.FAILED_PRECONDITION, lambda: load(stubs, "snap"), "'snap'", *needles)

    assert_same_state(live, shard_state(server))
    status = stubs.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=T).status
    assert status == SERVING
    _, live_keys, live_rows = live["adam"]
    np.testing.assert_array_equal(lookup(stubs, "adam", live_keys), live_rows[:, :DIM])


def test_health_is_not_serving_while_a_snapshot_loads_and_data_calls_wait(
    shard_server: ServerFactory, connect: Connect
) -> None:
    server = shard_server()
    stubs = connect(server)
    create_table(stubs, ADAM)
    keys = np.arange(50)
    push(stubs, "adam", keys, normal(rng(15), (50, DIM)), step=1)
    saved = lookup(stubs, "adam", keys)
    with ClusterAdmin([server.address]) as admin:
        admin.save_snapshot("h")
    assign(stubs, "adam", keys, np.zeros((50, DIM), np.float32))

    probe, waiter = connect(server), connect(server)
    original = server.shard.health.on_serving_change
    seen: list[tuple[bool, int, int, float]] = []
    waiting: dict[str, Any] = {}

    def lookup_meanwhile() -> None:
        waiting["rows"] = lookup(waiter, "adam", keys)
        waiting["at"] = time.monotonic()

    def spy(serving: bool) -> None:
        original(serving)
        statuses = [
            probe.health.Check(health_pb2.HealthCheckRequest(service=s), timeout=T).status
            for s in ("", "tierps.v1.EmbeddingService")
        ]
        seen.append((serving, *statuses, time.monotonic()))
        if not serving:  # a data call arriving now must wait for the load
            waiting["thread"] = threading.Thread(target=lookup_meanwhile)
            waiting["thread"].start()
            time.sleep(0.2)

    server.shard.health.on_serving_change = spy
    with ClusterAdmin([server.address]) as admin:
        admin.load_snapshot("h")
    waiting["thread"].join(timeout=T)

    assert [entry[:3] for entry in seen] == [
        (False, NOT_SERVING, NOT_SERVING),
        (True, SERVING, SERVING),
    ]
    np.testing.assert_array_equal(waiting["rows"], saved)  # it read the loaded rows
    assert waiting["at"] > seen[1][3]  # and answered only after the load
    for service in ("", "tierps.v1.EmbeddingService", "tierps.v1.AdminService"):
        request = health_pb2.HealthCheckRequest(service=service)
        assert stubs.health.Check(request, timeout=T).status == SERVING

    server.stop()
    try:
        status = probe.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
    except grpc.RpcError as error:
        assert error.code() in (CODE.UNAVAILABLE, CODE.DEADLINE_EXCEEDED), error
    else:
        assert status == NOT_SERVING


# -- metrics, stats, reflection -------------------------------------------------------------------


def scrape(server: ShardServer) -> str:
    assert server.metrics_port
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=T) as response:
        return response.read().decode()


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def rpc_counts(text: str) -> dict[tuple[str, str], float]:
    return {
        (labels["method"], labels["code"]): value
        for labels, value in samples(text, "tierps_rpc_seconds_count")
    }


def test_metrics_report_table_rows_and_rpc_counts(
    shard_server: ServerFactory, connect: Connect
) -> None:
    server = shard_server(shard_id=1, num_shards=2, metrics_port=0)
    stubs = connect(server)
    create_table(stubs, TableConfig("items", DIM, optimizer=optim.SGD(lr=0.1)))
    create_table(stubs, TableConfig("users", 4, optimizer=optim.SGD(lr=0.1)))
    keys = 1 + 2 * np.arange(100)
    for _ in range(3):
        lookup(stubs, "items", keys)
    lookup(stubs, "users", keys[:7], 4)
    refused(CODE.NOT_FOUND, lambda: lookup(stubs, "nope", keys))
    refused(INVALID, lambda: lookup(stubs, "items", [0]))  # shard 0's key
    push(stubs, "items", keys, np.ones((100, DIM), np.float32), step=1)

    text = scrape(server)

    rows = {(lb["table"], lb["tier"]): v for lb, v in samples(text, "tierps_table_rows")}
    assert rows[("items", "host")] == 100
    assert rows[("users", "host")] == 7
    assert all(lb["shard"] == "1" for lb, _ in samples(text, "tierps_table_rows"))
    hits = {(lb["table"], lb["tier"]): v for lb, v in samples(text, "tierps_table_hits_total")}
    assert hits[("items", "host")] == 300  # lookups 2 and 3, and the push
    # the push's kept scratch (its saved rows), as DescribeTable reports it; the compiled
    # host tier saves at least the 100 rows' weights there
    scratch = {
        (lb["table"], lb["tier"]): v for lb, v in samples(text, "tierps_table_scratch_bytes")
    }
    described = {tier.name: tier.scratch_bytes for tier in describe(stubs, "items").tiers}
    assert scratch[("items", "host")] == described["host"]
    assert scratch[("items", "rocksdb")] == described["rocksdb"] == 0
    if host_kernels.unavailable_reason() is None:
        assert described["host"] >= 100 * DIM * 4
    counts = rpc_counts(text)
    assert counts[("Lookup", "OK")] == 4
    assert counts[("Lookup", "NOT_FOUND")] == 1
    assert counts[("Lookup", "INVALID_ARGUMENT")] == 1
    assert counts[("PushGradients", "OK")] == 1
    assert counts[("CreateTable", "OK")] == 2
    server.stop()
    with pytest.raises(OSError):
        scrape(server)


def test_stats_describe_the_shard(shard_server: ServerFactory, connect: Connect) -> None:
    server = shard_server(shard_id=1, num_shards=2)
    stubs = connect(server)
    for name in ("zeta", "alpha"):
        create_table(stubs, TableConfig(name, 4, optimizer=optim.SGD(lr=0.1)))
    lookup(stubs, "alpha", [1, 3, 5], 4)

    stats = stubs.admin.Stats(pb.StatsRequest(), timeout=T)

    assert (stats.shard_id, stats.num_shards) == (1, 2)
    assert [t.config.name for t in stats.tables] == ["alpha", "zeta"]
    alpha = stats.tables[0]
    assert (alpha.shard_id, alpha.num_shards, alpha.created) == (1, 2, 3)
    assert [t.name for t in alpha.tiers] == ["host", "rocksdb"]
    assert tier(alpha, "host").rows == 3
    assert tier(alpha, "host").hit_rate == 0.0
    assert 0 < stats.rss_bytes <= stats.peak_rss_bytes
    assert 0 <= stats.uptime_s < 600
    lookup(stubs, "alpha", [1, 3, 5, 7], 4)
    host = tier(describe(stubs, "alpha"), "host")
    assert (host.hits, host.misses, host.hit_rate) == (3, 4, 3 / 7)


def test_reflection_lists_our_services_and_health(
    shard_server: ServerFactory, connect: Connect
) -> None:
    stubs = connect(shard_server())
    reflection = reflection_pb2_grpc.ServerReflectionStub(stubs.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    replies = list(reflection.ServerReflectionInfo(iter([request]), timeout=T))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {
        "tierps.v1.EmbeddingService",
        "tierps.v1.AdminService",
        "grpc.health.v1.Health",
    } <= names
    # The descriptors are served too: a client can decode our messages without the .proto.
    by_symbol = reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="tierps.v1.EmbeddingService"
    )
    reply = next(iter(reflection.ServerReflectionInfo(iter([by_symbol]), timeout=T)))
    assert reply.file_descriptor_response.file_descriptor_proto


# -- ServerConfig -------------------------------------------------------------------------------

TOML = """
shard_id = 1
num_shards = 4
data_dir = "{data}"
snapshot_dir = "{snapshots}"
port = 0
metrics_port = 9100
chunk_bytes = 1048576
max_message_bytes = 2097152
grace_s = 2.5

[[tables]]
name = "items"
dim = 16
seed = 3
initializer = {{ kind = "normal", std = 0.01 }}
optimizer = {{ kind = "adam", lr = 0.001 }}
eviction = "lfu"

[[tables]]
name = "users"
dim = 4
initializer = {{ kind = "zeros" }}
optimizer = {{ kind = "sgd", lr = 0.5 }}
host_cache_bytes = 0
"""


def test_server_config_from_a_toml_file_with_tables_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "shard.toml"
    path.write_text(TOML.format(data=tmp_path / "data", snapshots=tmp_path / "snaps"))

    config = ServerConfig.from_file(path, port=5005, shard_id=2, metrics_port=None)

    assert (config.shard_id, config.num_shards, config.port) == (2, 4, 5005)
    assert config.metrics_port == 9100  # an override of None is "not given"
    assert config.data_dir == tmp_path / "data" and isinstance(config.data_dir, Path)
    assert config.snapshot_dir == tmp_path / "snaps"
    assert (config.chunk_bytes, config.max_message_bytes, config.grace_s) == (1 << 20, 2 << 20, 2.5)
    assert config.tables == (
        TableConfig(
            "items",
            16,
            seed=3,
            initializer=init.Normal(std=0.01),
            optimizer=optim.Adam(lr=0.001),
            eviction="lfu",
        ),
        TableConfig(
            "users", 4, initializer=init.Zeros(), optimizer=optim.SGD(lr=0.5), host_cache_bytes=0
        ),
    )
    assert ServerConfig.from_file(path).shard_id == 1


def test_a_server_from_a_config_file_serves_its_tables(
    shard_server: ServerFactory, connect: Connect, tmp_path: Path
) -> None:
    path = tmp_path / "shard.toml"
    path.write_text(TOML.format(data=tmp_path / "data", snapshots=tmp_path / "snaps"))
    file_config = ServerConfig.from_file(path, shard_id=0, num_shards=1)
    server = shard_server(
        data_dir=file_config.data_dir,
        tables=file_config.tables,
        chunk_bytes=file_config.chunk_bytes,
        max_message_bytes=file_config.max_message_bytes,
    )
    stubs = connect(server)
    assert list_tables(stubs) == list(file_config.tables)
    np.testing.assert_array_equal(lookup(stubs, "users", [1, 2], 4), np.zeros((2, 4)))


@pytest.mark.parametrize(
    ("fields", "needles"),
    [
        ({"num_shards": 0}, ["'num_shards'", "got 0"]),
        ({"shard_id": 4, "num_shards": 4}, ["'shard_id'", "[0, 3]", "got 4"]),
        ({"shard_id": -1}, ["'shard_id'"]),
        ({"port": 70000}, ["'port'", "70000"]),
        ({"port": "80"}, ["'port'", "int", "'80'"]),
        ({"metrics_port": -1}, ["'metrics_port'"]),
        ({"max_workers": 0}, ["'max_workers'"]),
        ({"chunk_bytes": 100}, ["'chunk_bytes'", "100"]),
        ({"chunk_bytes": 1 << 20, "max_message_bytes": 1 << 20}, ["'max_message_bytes'"]),
        ({"max_batch_bytes": 0}, ["'max_batch_bytes'"]),
        ({"grace_s": -1.0}, ["'grace_s'", "-1.0"]),
        ({"grace_s": float("nan")}, ["'grace_s'", "nan"]),
        ({"host": ""}, ["'host'"]),
        ({"tables": ({"name": "t", "dim": 4},)}, ["'tables'", "TableConfig", "dict"]),
    ],
)
def test_server_config_refuses_bad_values_naming_the_field(
    tmp_path: Path, fields: dict[str, Any], needles: list[str]
) -> None:
    args = {"shard_id": 0, "num_shards": 1, "data_dir": tmp_path, **fields}
    with pytest.raises(ValueError) as raised:
        ServerConfig(**args)
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ('shard = 1\nnum_shards = 1\ndata_dir = "d"\n', ["unknown keys ['shard']", "shard_id"]),
        ('shard_id = 0\nnum_shards = 1\ndata_dir = "d"\nport = "x"\n', ["'port'", "'x'"]),
        (
            'shard_id = 0\nnum_shards = 1\ndata_dir = "d"\n[[tables]]\nname = "t"\ndim = 0\n'
            'initializer = { kind = "zeros" }\noptimizer = { kind = "sgd" }\n',
            ["'dim'", "got 0"],
        ),
        (
            'shard_id = 0\nnum_shards = 1\ndata_dir = "d"\n[[tables]]\nname = "t"\ndim = 4\n'
            'initializer = { kind = "zeros" }\noptimizer = { kind = "sgd", rate = 1 }\n',
            ["rate"],
        ),
    ],
)
def test_server_config_file_errors_name_the_field(
    tmp_path: Path, text: str, needles: list[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises((ValueError, TypeError)) as raised:
        ServerConfig.from_file(path)
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))
