"""The data calls' wire, against real shards on port 0: one message each way where it fits
(its bytes encoded and decoded by hand in tierps.proto.wire, byte for byte what protobuf
writes), a stream otherwise or when a shard refuses one message as too large; and a shard
serving concurrent clients of two tables as a serial numpy oracle says."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.integration.test_client import rpc_count
from tierps.client import EmbeddingClient, routing, transport
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import wire
from tierps.server.daemon import ShardServer
from tierps.storage import TableConfig, init, optim

DIM = 8
LR = 0.5  # gradients are multiples of 1/4 below: lr * their sums are exact in float32
ServerFactory = Callable[..., ShardServer]


@pytest.fixture
def make_client() -> Iterator[Callable[..., EmbeddingClient]]:
    opened: list[EmbeddingClient] = []

    def make(servers: Sequence[ShardServer], **options: Any) -> EmbeddingClient:
        client = EmbeddingClient([s.address for s in servers], timeout_s=20.0, **options)
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()


def calls(server: ShardServer, method: str, code: str = "OK") -> int:
    """Calls of exactly `method` the shard answered with `code`."""
    return rpc_count(server, method, code, either_form=False)


def sgd_table(name: str, dim: int = DIM, lr: float = LR) -> TableConfig:
    return TableConfig(
        name, dim, optimizer=optim.SGD(lr=lr), initializer=init.Normal(std=0.5), seed=3
    )


def initial(config: TableConfig, keys: np.ndarray) -> np.ndarray:
    """The table's initial weights of keys [..., dim] (TableConfig.initial_rows, numpy's
    reference code); zeros for keys < 0."""
    flat = keys.reshape(-1)
    out = np.zeros((flat.size, config.dim), np.float32)
    live = flat >= 0
    out[live] = config.initial_rows(flat[live])[:, : config.dim]
    return out.reshape(*keys.shape, config.dim)


def quarter_grads(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Multiples of 1/4 in [-2, 2]: their sums and products with LR are exact in float32."""
    return (rng.integers(-8, 9, size=shape) / 4).astype(np.float32)


# -- the hand-written codec ------------------------------------------------------------------

names = st.text(max_size=12)
dims = st.integers(0, 2**32 - 1)
blobs = st.binary(max_size=48)
lookup_batches = st.lists(st.tuples(names, dims, st.booleans(), blobs), max_size=4)
push_batches = st.lists(st.tuples(names, dims, st.integers(0, 2**64 - 1), blobs, blobs), max_size=4)


@settings(max_examples=60, deadline=None)
@given(lookup_batches, push_batches)
def test_hand_encoded_requests_are_protobufs_bytes(lookups: list, pushes: list) -> None:
    ours = wire.encode_batches([(t, d, c, (k,)) for t, d, c, k in lookups])
    theirs = pb.LookupBatches(
        batches=[pb.LookupRequest(table=t, dim=d, create=c, keys=k) for t, d, c, k in lookups]
    ).SerializeToString()
    assert ours == theirs
    ours = wire.encode_batches([(t, d, s, (k, g)) for t, d, s, k, g in pushes])
    assert ours == _protobufs_push(pushes)


def _protobufs_push(pushes: list) -> bytes:
    return pb.PushGradientsBatches(
        batches=[
            pb.PushGradientsRequest(table=t, dim=d, step=s, keys=k, grads=g)
            for t, d, s, k, g in pushes
        ]
    ).SerializeToString()


@settings(max_examples=60, deadline=None)
@given(push_batches)
def test_requests_built_in_place_are_protobufs_bytes(pushes: list) -> None:
    """encode_batches_in_place, its views filled with the bulk fields, gives protobuf's bytes
    (the views of empty fields are left out, as protobuf leaves the fields out)."""
    data, fields = wire.encode_batches_in_place(
        [(t, d, s, (len(k), len(g))) for t, d, s, k, g in pushes]
    )
    for (*_, k, g), views in zip(pushes, fields, strict=True):
        filled = [blob for blob in (k, g) if blob]
        assert [view.size for view in views] == [len(blob) for blob in filled]
        for view, blob in zip(views, filled, strict=True):
            view[...] = np.frombuffer(blob, np.uint8)
    assert data == _protobufs_push(pushes)


@settings(max_examples=60, deadline=None)
@given(
    names,
    st.integers(1, 300),
    st.integers(0, 2**64 - 1),
    st.integers(0, 500),
    st.integers(12, 5000),
)
def test_declared_stream_bytes_are_protobufs_sizes(
    table: str, dim: int, step: int, n: int, chunk_bytes: int
) -> None:
    """What a client declares before streaming (wire.stream_bytes) is what protobuf
    serializes for the stream's messages, for each of the three streamed calls."""
    keys = np.arange(n, dtype="<i8").tobytes()
    rows = np.zeros((n, dim), "<f4").tobytes()
    streams = [
        (wire.lookup_requests(table, dim, keys, create=True, chunk_bytes=chunk_bytes), True, 0),
        (wire.push_requests(table, dim, step, keys, rows, chunk_bytes), step, 4 * dim),
        (wire.assign_requests(table, dim, keys, rows, chunk_bytes), 0, 4 * dim),
    ]
    for messages, third, row_bytes in streams:
        sizes = sum(message.ByteSize() for message in messages)
        assert wire.stream_bytes(table, dim, third, n, row_bytes, chunk_bytes) == sizes


@pytest.mark.parametrize("shapes", [[], [(0, 4)], [(3, 4)], [(2, 3), (0, 3), (5, 3)], [(70, 33)]])
def test_a_hand_encoded_reply_is_protobufs_bytes(shapes: list[tuple[int, int]]) -> None:
    rng = np.random.default_rng(len(shapes))
    rows = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
    values = b"".join(r.tobytes() for r in rows)
    expected = pb.LookupResponse(values=values, num_rows=sum(r.shape[0] for r in rows))
    encoded, views = wire.lookup_reply([r.shape for r in rows])
    for view, r in zip(views, rows, strict=True):
        view[...] = r
    assert encoded == expected.SerializeToString()
    assert bytes(wire.lookup_reply_values(encoded)) == values


@settings(max_examples=60, deadline=None)
@given(push_batches, push_batches, blobs)
def test_hand_decoding_reads_what_protobuf_reads(first: list, second: list, junk: bytes) -> None:
    """Batches whose bytes hold two messages merged (later fields win, as in protobuf) and
    unknown fields of every wire type, decoded by hand and by protobuf."""
    unknown = (
        b"\x30\x05"  # field 6, varint
        + b"\x39"
        + bytes(8)  # field 7, 64-bit
        + b"\x42"
        + bytes([len(junk)])
        + junk  # field 8, length-delimited
        + b"\x4d"
        + bytes(4)  # field 9, 32-bit
    )
    batches = b""
    for a, b in zip(first, second, strict=False):
        inner = b"".join(
            pb.PushGradientsRequest(table=t, dim=d, step=s, keys=k, grads=g).SerializeToString()
            for t, d, s, k, g in (a, b)
        )
        inner += unknown
        batches += b"\x0a" + wire._varint(len(inner)) + inner
    theirs = pb.PushGradientsBatches.FromString(batches).batches
    ours = wire.decode_push_batches(batches).batches
    assert [(b.table, b.dim, b.step, bytes(b.keys), bytes(b.grads)) for b in ours] == [
        (b.table, b.dim, b.step, b.keys, b.grads) for b in theirs
    ]
    lookups = pb.LookupBatches(
        batches=[
            pb.LookupRequest(table=t, dim=d, create=s % 2 == 1, keys=k) for t, d, s, k, _ in first
        ]
    ).SerializeToString()
    ours_lookups = wire.decode_lookup_batches(lookups).batches
    theirs_lookups = pb.LookupBatches.FromString(lookups).batches
    assert [(b.table, b.dim, b.create, bytes(b.keys)) for b in ours_lookups] == [
        (b.table, b.dim, b.create, b.keys) for b in theirs_lookups
    ]


def test_bytes_that_are_not_the_message_are_invalid_argument(
    shard_server: ServerFactory,
) -> None:
    server = shard_server()
    with grpc.insecure_channel(server.address, options=wire.channel_options()) as channel:
        for method in ("LookupUnary", "PushGradientsUnary"):
            call = channel.unary_unary(f"/tierps.v1.EmbeddingService/{method}")
            for bad in (b"\x0a\x05ab", b"\x0a\x03\x0a\x01\xff", b"\x0f"):
                with pytest.raises(grpc.RpcError) as raised:
                    call(bad, timeout=10)
                assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "do not decode" in raised.value.details()


# -- one message and the stream --------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 2])
def test_one_message_and_streamed_calls_agree_with_numpy(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient], num_shards: int
) -> None:
    """The same lookups and pushes, in one message each way and streamed in small chunks,
    over two identical tables: both equal the tables' initial rows, then those rows less
    lr times each key's summed gradients (keys repeat, -1 is padding)."""
    servers = [shard_server(shard_id=i, num_shards=num_shards) for i in range(num_shards)]
    clients = {
        "one": make_client(servers),
        "streamed": make_client(servers, one_message_bytes=0, chunk_bytes=256),
    }
    rng = np.random.default_rng(7)
    universe = rng.choice(1 << 40, 300, replace=False).astype(np.int64)
    keys = universe[rng.integers(0, 300, size=(50, 9))]
    keys[rng.random(keys.shape) < 0.1] = -1
    grads = quarter_grads(rng, (*keys.shape, DIM))
    seen = {}
    for name, client in clients.items():
        config = sgd_table(name)
        client.create_table(config)
        before = initial(config, keys)
        np.testing.assert_array_equal(client.lookup(name, keys), before)
        assert client.push_gradients(name, keys, grads) == np.unique(keys[keys >= 0]).size
        flat, flat_grads = keys.reshape(-1), grads.reshape(-1, DIM)
        unique, inverse = np.unique(flat, return_inverse=True)
        sums = np.zeros((unique.size, DIM), np.float64)
        np.add.at(sums, inverse, flat_grads.astype(np.float64))
        expected = initial(config, unique) - np.float32(LR) * sums.astype(np.float32)
        expected[unique < 0] = 0.0
        after = client.lookup(name, unique, create=False)
        np.testing.assert_array_equal(after, expected)  # exact: quarters sum exactly
        seen[name] = after
    np.testing.assert_array_equal(seen["one"], seen["streamed"])
    for method in ("LookupUnary", "PushGradientsUnary", "Lookup", "PushGradients"):
        assert sum(calls(s, method) for s in servers) >= num_shards, method


@pytest.mark.parametrize("num_shards", [1, 2])
def test_distinct_keys_and_lookups_in_pieces_agree_with_numpy(
    shard_server: ServerFactory,
    make_client: Callable[..., EmbeddingClient],
    num_shards: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Distinct keys >= 0 in any order go as given (no dedup, no reordering), and a lookup
    of LOOKUP_PIECE_BYTES or more per shard goes as LOOKUP_PIECES calls at once: the rows,
    a copy=False lookup's and a push's, equal numpy's, in the keys' order."""
    monkeypatch.setattr(routing, "LOOKUP_PIECE_BYTES", 4 << 10)
    servers = [shard_server(shard_id=i, num_shards=num_shards) for i in range(num_shards)]
    client = make_client(servers)
    dim = 16
    config = sgd_table("t", dim)
    client.create_table(config)
    rng = np.random.default_rng(11)
    keys = rng.choice(1 << 40, 2000, replace=False).astype(np.int64).reshape(40, 50)
    rows = client.lookup("t", keys)  # 128 KB of rows: 4 pieces of at least 4 KiB per shard
    np.testing.assert_array_equal(rows, initial(config, keys))
    assert rows.flags.writeable
    assert sum(calls(s, "LookupUnary") for s in servers) == routing.LOOKUP_PIECES * num_shards
    few = keys[0, :20]  # below a piece: one call per shard, its reply in the keys' order
    view = client.lookup("t", few, copy=False)
    np.testing.assert_array_equal(view, initial(config, few))
    assert view.flags.writeable is (num_shards > 1)  # one shard: a view of its reply
    grads = quarter_grads(rng, (*keys.shape, dim))
    assert client.push_gradients("t", keys, grads) == keys.size
    expected = initial(config, keys) - np.float32(LR) * grads
    np.testing.assert_array_equal(client.lookup("t", keys, create=False), expected)


@pytest.mark.parametrize("num_shards", [1, 2])
def test_two_pieces_a_shard_run_at_once_on_every_shard(
    shard_server: ServerFactory,
    make_client: Callable[..., EmbeddingClient],
    num_shards: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup of two pieces a shard (transport.PIECES_AT_ONCE) sends all of them at once,
    on one shard and on two: each piece's call waits here, up to 10 s, until every piece
    of the lookup is in flight; no shard ever has more than two at once. The rows equal
    numpy's initial rows, in the keys' order."""
    monkeypatch.setattr(routing, "LOOKUP_PIECE_BYTES", 4 << 10)
    monkeypatch.setattr(routing, "LOOKUP_PIECES", 2)
    servers = [shard_server(shard_id=i, num_shards=num_shards) for i in range(num_shards)]
    client = make_client(servers)
    config = sgd_table("t", 16)
    client.create_table(config)
    keys = np.random.default_rng(12).choice(1 << 40, 400 * num_shards, replace=False)
    pieces = 2 * num_shards  # 25 KiB of rows a shard: two pieces of 4 KiB or more each
    state = {"in_flight": [0] * num_shards, "most": [0] * num_shards, "all": 0}
    changed = threading.Condition()

    def waiting(shard: int, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(request: bytes, **options: Any) -> Any:
            with changed:
                state["in_flight"][shard] += 1
                state["most"][shard] = max(state["most"][shard], state["in_flight"][shard])
                state["all"] = max(state["all"], sum(state["in_flight"]))
                changed.notify_all()
                changed.wait_for(lambda: state["all"] >= pieces, timeout=10.0)
            try:
                return real(request, **options)
            finally:
                with changed:
                    state["in_flight"][shard] -= 1

        return call

    for shard in range(num_shards):
        client._transport.lookup_one[shard] = waiting(shard, client._transport.lookup_one[shard])
    np.testing.assert_array_equal(client.lookup("t", keys), initial(config, keys))
    assert state["all"] == pieces and state["most"] == [2] * num_shards
    assert sum(calls(s, "LookupUnary") for s in servers) == pieces


def test_a_third_piece_to_one_shard_waits_for_the_others(
    shard_server: ServerFactory,
    make_client: Callable[..., EmbeddingClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup of three pieces to one shard sends two at once (transport.PIECES_AT_ONCE)
    and the third once they have ended: each call waits here, up to 0.5 s, for a third
    call in flight, which must never come. The rows equal numpy's initial rows."""
    monkeypatch.setattr(routing, "LOOKUP_PIECE_BYTES", 4 << 10)
    monkeypatch.setattr(routing, "LOOKUP_PIECES", 3)
    server = shard_server()
    client = make_client([server])
    config = sgd_table("t", 16)
    client.create_table(config)
    keys = np.random.default_rng(13).choice(1 << 40, 600, replace=False)  # 37.5 KiB of rows
    state = {"in_flight": 0, "most": 0}
    changed = threading.Condition()
    real = client._transport.lookup_one[0]

    def call(request: bytes, **options: Any) -> Any:
        with changed:
            state["in_flight"] += 1
            state["most"] = max(state["most"], state["in_flight"])
            changed.notify_all()
            changed.wait_for(lambda: state["in_flight"] > transport.PIECES_AT_ONCE, timeout=0.5)
        try:
            return real(request, **options)
        finally:
            with changed:
                state["in_flight"] -= 1

    client._transport.lookup_one[0] = call
    np.testing.assert_array_equal(client.lookup("t", keys), initial(config, keys))
    assert calls(server, "LookupUnary") == 3
    assert state["most"] == transport.PIECES_AT_ONCE == 2


def test_rows_written_into_the_reply_equal_numpy_at_any_alignment(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """The shard's storage lookup writes the rows straight into the reply's bytes
    (wire.lookup_reply): its rows start 4-byte aligned below 2 MiB and unaligned from 2 MiB
    (a 5-byte header). New rows, then host hits, then after a push, equal numpy's."""
    client = make_client([shard_server()])
    dim = 16
    config = sgd_table("t", dim)
    client.create_table(config)
    keys = np.random.default_rng(5).choice(1 << 40, 40_000, replace=False).astype(np.int64)
    for few in (keys[:1000], keys):  # 64 KB of rows (header 4 bytes); 2.5 MB (header 5)
        data, (view,) = wire.lookup_reply([(few.size, dim)])
        start = view.ctypes.data - np.frombuffer(data, np.uint8).ctypes.data
        assert start == (4 if few.size == 1000 else 5)  # the rows' offset in the reply
        for _ in range(2):  # created, then found in the host tier
            np.testing.assert_array_equal(client.lookup("t", few), initial(config, few))
    grads = quarter_grads(np.random.default_rng(6), (keys.size, dim))
    client.push_gradients("t", keys, grads)
    expected = initial(config, keys) - np.float32(LR) * grads
    np.testing.assert_array_equal(client.lookup("t", keys, create=False), expected)


def test_a_shard_refusing_one_message_as_too_large_gets_the_stream(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """A shard whose message limit (256 KiB) is below the call: the lookup's reply is refused
    by the shard, the push's request by gRPC before the shard sees it; the client streams
    both instead, the push applied once, and streams that shard's calls of that size from
    then on."""
    server = shard_server(max_message_bytes=256 << 10, chunk_bytes=64 << 10)
    client = make_client([server], chunk_bytes=64 << 10)  # its stream chunks fit the shard's
    dim = 32
    config = sgd_table("t", dim)
    client.create_table(config)
    keys = np.arange(3000, dtype=np.int64) * 7  # 384 KB of rows back, 408 KB of push out
    np.testing.assert_array_equal(client.lookup("t", keys), initial(config, keys))
    assert calls(server, "LookupUnary", "RESOURCE_EXHAUSTED") == 1
    assert calls(server, "Lookup") == 1
    grads = quarter_grads(np.random.default_rng(3), (keys.size, dim))
    assert client.push_gradients("t", keys, grads) == keys.size
    assert client.push_gradients("t", keys, grads) == keys.size
    step = np.float32(LR) * grads
    expected = (initial(config, keys) - step) - step  # two pushes, each applied once
    np.testing.assert_array_equal(client.lookup("t", keys, create=False), expected)
    assert calls(server, "PushGradients") == 2
    assert calls(server, "PushGradientsUnary", "OK") == 0
    assert calls(server, "LookupUnary", "RESOURCE_EXHAUSTED") == 1  # not asked again
    assert client.lookup("t", keys[:10]).shape == (10, dim)  # small calls: one message
    assert calls(server, "LookupUnary") == 1


# -- a shard on more than one core -----------------------------------------------------------


def test_concurrent_clients_on_two_tables_equal_a_serial_oracle(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """Four clients at once, two per table, each pushing to keys it draws and reading keys
    nobody pushes: every read is the row as assigned, and the final rows are the serial
    numpy sum of every push (exact: gradients of quarters, lr 1/2)."""
    server = shard_server(max_workers=8)
    setup = make_client([server])
    tables = ("a", "b")
    pushed_keys, read_keys = np.arange(400), np.arange(400, 500)
    fixed = {t: quarter_grads(np.random.default_rng(i), (100, DIM)) for i, t in enumerate(tables)}
    for table in tables:
        setup.create_table(sgd_table(table))
        setup.assign(table, pushed_keys, np.zeros((400, DIM), np.float32))
        setup.assign(table, read_keys, fixed[table])
    rounds, workers = 6, [("a", 0), ("a", 1), ("b", 2), ("b", 3)]
    plans = {
        seed: [
            (rng.choice(pushed_keys, 150, replace=False), quarter_grads(rng, (150, DIM)))
            for _ in range(rounds)
        ]
        for _, seed in workers
        for rng in [np.random.default_rng(100 + seed)]
    }
    clients = {seed: make_client([server]) for _, seed in workers}
    failures: list[BaseException] = []
    start = threading.Barrier(len(workers))

    def work(table: str, seed: int) -> None:
        try:
            start.wait()
            for keys, grads in plans[seed]:
                clients[seed].push_gradients(table, keys, grads)
                got = clients[seed].lookup(table, read_keys, create=False)
                np.testing.assert_array_equal(got, fixed[table])
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            failures.append(error)

    threads = [threading.Thread(target=work, args=worker) for worker in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    for table in tables:
        oracle = np.zeros((400, DIM), np.float64)
        for _, seed in (w for w in workers if w[0] == table):
            for keys, grads in plans[seed]:
                np.add.at(oracle, keys, -LR * grads.astype(np.float64))
        got = setup.lookup(table, pushed_keys, create=False)
        np.testing.assert_array_equal(got, oracle.astype(np.float32))
