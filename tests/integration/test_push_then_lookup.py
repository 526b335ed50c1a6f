"""PushThenLookup: a push and a lookup that sees it, in one call per shard, against real
shards on port 0. Its bytes are protobuf's (encoded and decoded by hand in
tierps.proto.wire); a shard applies the push and then serves the lookup, or, refusing
either, changes nothing; a staleness-1 pipeline sends each step's push with the next
prefetch's lookup and trains bit for bit as with separate calls; calls too large for one
message, or to a shard that does not know the call, go as separate calls; a lookup that
fails after its push (a real full disk) leaves the push applied, and the client knows."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import given, settings

from tests.fault_fs import fill, small_tmpfs
from tests.integration.test_client import assert_same_state, state
from tests.integration.test_client_wire import (
    blobs,
    calls,
    initial,
    lookup_batches,
    push_batches,
    quarter_grads,
    sgd_table,
)
from tierps.client import EmbeddingClient, Feature, ShardError, TableConfig, init, optim
from tierps.client.push_then_lookup import PushNotApplied
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import wire
from tierps.server.daemon import ShardServer

torch = pytest.importorskip("torch")
tierps_torch = pytest.importorskip("tierps.client.torch")

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning"),
    pytest.mark.usefixtures("one_torch_thread"),
]

ServerFactory = Callable[..., ShardServer]
METHOD = "/tierps.v1.EmbeddingService/PushThenLookup"
DIM = 4
B, NNZ, STEPS, V = 4, 2, 6, 16  # bags per feature, keys per bag, steps, keys per table
LR = 0.5

# -- the codec -------------------------------------------------------------------------------


def _protobufs(pushes: list, lookups: list) -> pb.PushThenLookupRequest:
    return pb.PushThenLookupRequest(
        push=pb.PushGradientsBatches(
            batches=[
                pb.PushGradientsRequest(table=t, dim=d, step=s, keys=k, grads=g)
                for t, d, s, k, g in pushes
            ]
        ),
        lookup=pb.LookupBatches(
            batches=[pb.LookupRequest(table=t, dim=d, create=c, keys=k) for t, d, c, k in lookups]
        ),
    )


def _encoded(pushes: list, lookups: list) -> bytes:
    data, fields = wire.encode_push_then_lookup_in_place(
        [(t, d, s, (len(k), len(g))) for t, d, s, k, g in pushes],
        [(t, d, c, (k,)) for t, d, c, k in lookups],
    )
    for (*_, k, g), views in zip(pushes, fields, strict=True):
        for view, blob in zip(views, [blob for blob in (k, g) if blob], strict=True):
            view[...] = np.frombuffer(blob, np.uint8)
    return data


@settings(max_examples=40, deadline=None)
@given(push_batches, lookup_batches)
def test_a_request_built_in_place_is_protobufs_bytes(pushes: list, lookups: list) -> None:
    assert _encoded(pushes, lookups) == _protobufs(pushes, lookups).SerializeToString()


@settings(max_examples=40, deadline=None)
@given(push_batches, lookup_batches, push_batches, blobs)
def test_hand_decoding_reads_what_protobuf_reads(
    pushes: list, lookups: list, more: list, junk: bytes
) -> None:
    """Two requests' bytes one after the other (protobuf merges them: the batches of both)
    with an unknown field between, decoded by hand and by protobuf."""
    unknown = b"\x1a" + bytes([len(junk)]) + junk  # field 3, length-delimited
    data = (
        _protobufs(pushes, lookups).SerializeToString()
        + unknown
        + _protobufs(more, []).SerializeToString()
    )
    theirs, ours = pb.PushThenLookupRequest.FromString(data), wire.decode_push_then_lookup(data)
    assert [(b.table, b.dim, b.step, bytes(b.keys), bytes(b.grads)) for b in ours.push.batches] == [
        (b.table, b.dim, b.step, b.keys, b.grads) for b in theirs.push.batches
    ]
    assert [(b.table, b.dim, b.create, bytes(b.keys)) for b in ours.lookup.batches] == [
        (b.table, b.dim, b.create, b.keys) for b in theirs.lookup.batches
    ]
    with pytest.raises(wire.WireError, match="do not decode"):
        wire.decode_push_then_lookup(data + b"\x0a\x05ab").push.batches  # noqa: B018


@pytest.mark.parametrize(("shapes", "num_keys"), [([], 0), ([(3, 4)], 7), ([(2, 3), (0, 3)], 1)])
def test_a_reply_is_protobufs_bytes(shapes: list[tuple[int, int]], num_keys: int) -> None:
    rng = np.random.default_rng(len(shapes))
    rows = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
    values = b"".join(r.tobytes() for r in rows)
    expected = pb.PushThenLookupResponse(
        values=values, num_rows=sum(r.shape[0] for r in rows), num_keys=num_keys
    )
    encoded, views = wire.lookup_reply([r.shape for r in rows], num_keys)
    for view, r in zip(views, rows, strict=True):
        view[...] = r
    assert encoded == expected.SerializeToString()
    got, pushed = wire.push_then_lookup_reply(encoded)
    assert (bytes(got), pushed) == (values, num_keys)


# -- one shard -------------------------------------------------------------------------------


def _call(channel: grpc.Channel, pushes: list, lookups: list) -> tuple[np.ndarray, int]:
    """A raw PushThenLookup: pushes (table, dim, step, keys, grads), lookups (table, dim,
    create, keys); returns (the rows [n, dim] of every lookup batch, num_keys)."""
    request = _encoded(
        [
            (t, d, s, k.astype("<i8").tobytes(), g.astype("<f4").tobytes())
            for t, d, s, k, g in pushes
        ],
        [(t, d, c, k.astype("<i8").tobytes()) for t, d, c, k in lookups],
    )
    values, num_keys = wire.push_then_lookup_reply(channel.unary_unary(METHOD)(request, timeout=10))
    return np.frombuffer(values, "<f4").reshape(-1, lookups[0][1]), num_keys


def test_a_shard_applies_the_push_then_serves_the_lookup_or_refuses_both(
    shard_server: ServerFactory,
) -> None:
    """The lookup sees the push (numpy's SGD step on the initial rows, exact: quarter
    gradients); a push or a lookup the shard refuses refuses the call, and nothing changes:
    no row pushed, none created for the lookup's new keys, no optimizer state."""
    server = shard_server()
    config = sgd_table("t", DIM, LR)
    server.shard.admin.create_table(config)
    pushed, looked_up = np.arange(6, dtype=np.int64), np.arange(3, 9, dtype=np.int64)
    grads = quarter_grads(np.random.default_rng(1), (pushed.size, DIM))
    expected = initial(config, looked_up)
    expected[:3] -= np.float32(LR) * grads[3:]  # keys 3, 4, 5: pushed, then looked up
    with grpc.insecure_channel(server.address, options=wire.channel_options()) as channel:
        rows, num_keys = _call(
            channel, [("t", DIM, 1, pushed, grads)], [("t", DIM, True, looked_up)]
        )
        np.testing.assert_array_equal(rows, expected)
        assert num_keys == pushed.size

        before = state([server])
        new = np.arange(100, 104, dtype=np.int64)  # a lookup that would create their rows
        nan = grads.copy()
        nan[2, 1] = np.nan
        refused = {
            "a non-finite gradient": ([("t", DIM, 2, pushed, nan)], [("t", DIM, True, new)]),
            "a lookup of the wrong dim": (
                [("t", DIM, 2, pushed, grads)],
                [("t", DIM + 1, True, new)],
            ),
            "an unknown table in the push": (
                [("t", DIM, 2, pushed, grads), ("absent", DIM, 2, pushed, grads)],
                [("t", DIM, True, new)],
            ),
        }
        for why, (pushes, lookups) in refused.items():
            with pytest.raises(grpc.RpcError) as raised:
                _call(channel, pushes, lookups)
            assert raised.value.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.NOT_FOUND,
            ), why
            trailing = dict(raised.value.trailing_metadata() or ())
            assert wire.PUSHED_HEADER not in trailing, why  # the push is not in
            assert_same_state(before, state([server]))
    assert calls(server, "PushThenLookup") == 1


# -- the pipeline ----------------------------------------------------------------------------


@pytest.fixture
def two_shards(shard_server: ServerFactory) -> list[ShardServer]:
    return [shard_server(shard_id=i, num_shards=2) for i in range(2)]


@pytest.fixture
def make_client() -> Iterator[Callable[..., EmbeddingClient]]:
    opened: list[EmbeddingClient] = []

    def make(servers: Sequence[Any], **options: Any) -> EmbeddingClient:
        addresses = [s if isinstance(s, str) else s.address for s in servers]
        opened.append(EmbeddingClient(addresses, timeout_s=20.0, **options))
        return opened[-1]

    yield make
    for client in opened:
        client.close()


def _tables(client: EmbeddingClient, suffix: str) -> list[Feature]:
    """Two Adam tables with the same rows (assigned), and a feature on each."""
    features = []
    start = 0.5 * np.random.default_rng(5).standard_normal((V, DIM)).astype(np.float32)
    for feature in ("a", "b"):
        name = f"{feature}-{suffix}"
        client.create_table(TableConfig(name, DIM, optimizer=optim.Adam(lr=0.05)))
        client.assign(name, np.arange(V), start)
        features.append(Feature(feature, name, "sum" if feature == "a" else "mean"))
    return features


def _batches(seed: int) -> list[dict[str, np.ndarray]]:
    """Per step, bags of each feature whose keys lie on both shards (even and odd keys)."""
    rng = np.random.default_rng(seed)
    parity = np.arange(NNZ) % 2
    return [
        {name: rng.integers(0, V // 2, (B, NNZ)) * 2 + parity for name in ("a", "b")}
        for _ in range(STEPS)
    ]


def _train(module: Any, batches: list[dict[str, np.ndarray]], fused: bool) -> list[np.ndarray]:
    """Each step's outputs and loss, through pipeline() (fused) or the same prefetches made
    by hand (each push its own call, as before PushThenLookup)."""
    got = []

    def step(batch: dict[str, np.ndarray]) -> None:
        out = module(batch)
        loss = (out["a"] ** 2).sum() + (out["b"] - 1).abs().sum()
        loss.backward()
        got.extend(
            [
                out["a"].detach().numpy().copy(),
                out["b"].detach().numpy().copy(),
                loss.detach().numpy().copy(),
            ]
        )

    if fused:
        for batch in module.pipeline(batches):
            step(batch)
    else:
        for index, batch in enumerate(batches):
            if index + 1 < len(batches):
                module.prefetch(batches[index + 1])
            step(batch)
        module.flush()
    return got


def _rows(client: EmbeddingClient, features: list[Feature]) -> list[np.ndarray]:
    return [client.lookup(f.table, np.arange(V), create=False) for f in features]


def test_a_pipeline_sends_one_call_per_shard_a_step_and_trains_bit_for_bit_as_before(
    two_shards: list[ShardServer], make_client: Callable[..., EmbeddingClient]
) -> None:
    """Staleness 1, two tables, two shards: the pipeline's outputs, losses and final rows
    equal those of the same schedule made of separate push and lookup calls, bit for bit;
    in steady state a step makes one call per shard (PushThenLookup) instead of two."""
    client = make_client(two_shards)
    runs = {}
    for fused in (False, True):
        features = _tables(client, "fused" if fused else "separate")
        before = [
            {m: calls(s, m) for m in ("PushThenLookup", "PushGradientsUnary", "LookupUnary")}
            for s in two_shards
        ]
        with tierps_torch.EmbeddingBagCollection(client, features, staleness=1) as module:
            got = _train(module, _batches(seed=6), fused)
        made = [
            {m: calls(s, m) - n for m, n in counts.items()}
            for s, counts in zip(two_shards, before, strict=True)
        ]
        runs[fused] = (got, _rows(client, features), made)
    (separate, separate_rows, separate_calls), (fused, fused_rows, fused_calls) = runs.values()
    for index, (have, want) in enumerate(zip(fused, separate, strict=True)):
        np.testing.assert_array_equal(have, want, err_msg=f"step {index // 3}")
    for have, want in zip(fused_rows, separate_rows, strict=True):
        np.testing.assert_array_equal(have, want)
    # per shard: the first two batches' lookups (no push before them) and the last two
    # pushes (no prefetch after them) go alone; every other push goes with a lookup
    alone = {"PushThenLookup": 0, "PushGradientsUnary": STEPS, "LookupUnary": STEPS}
    assert separate_calls == [alone, alone]
    together = {"PushThenLookup": STEPS - 2, "PushGradientsUnary": 2, "LookupUnary": 2}
    assert fused_calls == [together, together]


def test_a_refused_push_in_a_fused_call_changes_nothing_and_is_raised_once(
    two_shards: list[ShardServer], make_client: Callable[..., EmbeddingClient]
) -> None:
    """A step whose push is refused (one of its two tables was dropped meanwhile): its
    fused calls change nothing on either shard (the other table's push is not applied, the
    lookup not served), and the module's next call raises the push's error, once."""
    client = make_client(two_shards)
    module = tierps_torch.EmbeddingBagCollection(client, _tables(client, ""), staleness=1)
    steps = module.pipeline(_batches(seed=7))
    out = module(next(steps))
    (out["a"].sum() + out["b"].sum()).backward()  # held for the next prefetch
    out = module(next(steps))  # that prefetch sent it with its lookup
    module.flush()
    before = state(two_shards)
    with EmbeddingClient(client.addresses) as other:
        other.drop_table("b-")  # this step's push of "b" finds no table
    (out["a"].sum() + out["b"].sum()).backward()
    with pytest.raises(ShardError, match="NOT_FOUND") as raised:
        module(next(steps))  # the prefetch before it sent the push with its lookup
        module.flush()
    assert any("background" in note for note in raised.value.__notes__)
    assert [calls(s, "PushThenLookup", "NOT_FOUND") for s in two_shards] == [1, 1]
    after = state(two_shards)
    for shard in (*before, *after):
        shard.pop("b-", None)
    assert_same_state(before, after)  # "a-": its push refused with that of "b-"
    module.flush()  # raised once
    steps.close()
    module.close()


def _train_wide(client: EmbeddingClient) -> np.ndarray:
    """Four pipelined steps on a new table of dim WIDE; its final rows."""
    client.create_table(sgd_table("t", WIDE, LR))
    batches = [{"a": np.arange(8).reshape(4, 2) + step} for step in range(4)]
    with tierps_torch.EmbeddingBagCollection(client, [Feature("a", "t")], staleness=1) as module:
        for batch in module.pipeline(batches):
            (module(batch)["a"] ** 2).sum().backward()  # gradients of the rows seen
    return client.lookup("t", np.arange(12), create=False)


WIDE = 512  # a dim whose step's rows pass a 16 KiB message limit


def test_calls_too_large_for_one_message_go_separately(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """A client that streams every call (one_message_bytes=0), and a shard whose message
    limit is below the call (gRPC refuses the fused call as too large before the shard
    reads it): the pushes and lookups go as separate calls, and train as the fused ones."""
    server = shard_server()
    fused = _train_wide(make_client([server], chunk_bytes=4 << 10))
    assert calls(server, "PushThenLookup") == 2  # steps 0 and 1's pushes: the last two alone
    small_shard = {"max_message_bytes": 16 << 10, "chunk_bytes": 4 << 10}
    for options, limits in (({"one_message_bytes": 0}, {}), ({}, small_shard)):
        server = shard_server(**limits)
        separate = _train_wide(make_client([server], chunk_bytes=4 << 10, **options))
        assert calls(server, "PushThenLookup") == 0, (options, limits)
        assert calls(server, "PushGradients") > 0, (options, limits)  # streamed
        np.testing.assert_array_equal(separate, fused)


class OlderShard:
    """A real gRPC server in front of a shard, forwarding every call of the shard's services
    but PushThenLookup, which it does not know (UNIMPLEMENTED): a shard from before it."""

    KINDS = {  # (request streaming, response streaming) -> channel method, handler factory
        (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
        (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
        (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
        (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
    }

    def __init__(self, shard: ShardServer) -> None:
        self.channel = grpc.insecure_channel(shard.address, options=wire.channel_options())
        self.known = {
            f"/{service.full_name}/{method.name}": (
                method.client_streaming,
                method.server_streaming,
            )
            for service in pb.DESCRIPTOR.services_by_name.values()
            for method in service.methods
            if method.name != "PushThenLookup"
        }
        self.unknown = 0  # calls of a method it does not know
        self.server = grpc.server(ThreadPoolExecutor(8), options=wire.channel_options())
        self.server.add_generic_rpc_handlers((self,))  # type: ignore[arg-type]
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        kind = self.known.get(details.method)
        if kind is None:
            self.unknown += 1
            return None
        method, factory = self.KINDS[kind]
        forward = getattr(self.channel, method)(details.method)  # bytes as they are
        metadata = [(k, v) for k, v in details.invocation_metadata if k.startswith("tierps-")]

        def behave(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                reply = forward(request, metadata=metadata, timeout=20)
                return list(reply) if kind[1] else reply
            except grpc.RpcError as error:
                context.abort(error.code(), error.details() or "")

        if kind[1]:
            return factory(lambda request, context: iter(behave(request, context)))
        return factory(behave)

    def close(self) -> None:
        self.server.stop(None)
        self.channel.close()


def test_a_shard_that_does_not_know_the_call_gets_separate_calls(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """A shard answering UNIMPLEMENTED to PushThenLookup: the client pushes and looks up
    with separate calls, from then on, and trains as with the fused calls."""
    fused = _train_wide(make_client([shard_server()]))
    server = shard_server()
    older = OlderShard(server)
    try:
        separate = _train_wide(make_client([older.address]))
    finally:
        older.close()
    assert older.unknown == 1  # asked once
    assert calls(server, "PushThenLookup") == 0
    assert calls(server, "PushGradientsUnary") == 4  # each step's push, once
    np.testing.assert_array_equal(separate, fused)


def test_a_lookup_failing_after_its_push_keeps_the_push_and_says_so(
    tmp_path: Path, shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """A real full disk (a small tmpfs): the fused call's push of resident rows is applied,
    then its lookup of many new keys needs RocksDB to take the host tier's evictions, and
    fails. The shard says the push is in (trailing metadata): the client raises the
    lookup's error, not PushNotApplied, and the push stays applied, once (SGD lr 1 from
    zeros, gradients -1: a row's weight counts the pushes applied to it)."""
    dim = 64
    resident = np.arange(50, dtype=np.int64)
    minus_one = -np.ones((resident.size, dim), np.float32)
    new = np.arange(1_000, 21_000, dtype=np.int64)  # 5 MB of rows: one call
    with small_tmpfs(tmp_path / "fs", megabytes=30) as fs:
        server = shard_server(data_dir=fs / "shard", flush_interval_s=3600.0)
        try:
            client = make_client([server])
            client.create_table(
                TableConfig(
                    "t",
                    dim,
                    initializer=init.Zeros(),
                    optimizer=optim.SGD(lr=1.0),
                    host_cache_bytes=64 << 10,
                )
            )
            client.push_gradients("t", resident, minus_one)
            filler = fill(fs, leave_bytes=64 << 10)
            with pytest.raises(ShardError, match="No space left") as raised:
                client._fused.push_then_lookup(
                    {"t": (resident, minus_one)}, None, {"t": (dim, new)}, True
                )
            assert calls(server, "PushThenLookup", raised.value.code.name) == 1
            filler.unlink()
            rows = client.lookup("t", resident, create=False)
            np.testing.assert_array_equal(rows, np.full_like(rows, 2.0))  # 2 pushes, once each
        finally:
            (fs / "filler").unlink(missing_ok=True)
            server.stop()  # while its disk is mounted


# -- failures around the fused call --------------------------------------------------------


class Refused(grpc.RpcError):
    """A call's failure as gRPC raises it (code, details, trailing metadata), injected by
    wrapping one of the client's real stubs."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()) -> None:
        super().__init__(details)
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailing


def _fail_once(holder: Any, at: str | int, error: grpc.RpcError) -> list[int]:
    """Make holder's attribute or item `at` (a real stub's method) raise `error` on its
    first call; the returned list counts the calls."""
    real, made = holder[at] if isinstance(at, int) else getattr(holder, at), []

    def wrapped(*args: Any, **options: Any) -> Any:
        made.append(1)
        if len(made) == 1:
            raise error
        return real(*args, **options)

    if isinstance(at, int):
        holder[at] = wrapped
    else:
        setattr(holder, at, wrapped)
    return made


@pytest.mark.parametrize("failing", ["DescribeTable", "Stats"])
def test_a_push_failing_before_its_calls_ran_is_push_not_applied(
    two_shards: list[ShardServer], make_client: Callable[..., EmbeddingClient], failing: str
) -> None:
    """The first push of a fresh client learns the table's step (DescribeTable) and each
    shard's life (Stats) before any call: either failing raises PushNotApplied (the push is
    lost loudly, never silently), changes no row, and gives its step back."""
    make_client(two_shards).create_table(sgd_table("t", DIM, LR))
    client = make_client(two_shards)
    keys = np.arange(6, dtype=np.int64)
    before = client.lookup("t", keys, create=True) if failing == "DescribeTable" else None
    made = _fail_once(client._stubs[0], failing, Refused(grpc.StatusCode.UNAVAILABLE, "down"))
    grads = quarter_grads(np.random.default_rng(2), (keys.size, DIM))
    with pytest.raises(PushNotApplied) as raised:
        client._fused.push_then_lookup({"t": (keys, grads)}, None, {"t": (DIM, keys)}, True)
    assert made and raised.value.error.code is grpc.StatusCode.UNAVAILABLE
    assert raised.value.error.succeeded == []
    rows = client.lookup("t", keys, create=False)
    np.testing.assert_array_equal(
        rows, before if before is not None else initial(sgd_table("t", DIM, LR), keys)
    )
    client.push_gradients("t", keys, grads)  # the step given back: this push is step 1
    assert client.table_step("t") == 1


@pytest.mark.parametrize("client_limit", [1 << 20, None])
def test_a_push_and_lookup_over_the_shards_per_call_limit_together_go_separately(
    shard_server: ServerFactory,
    make_client: Callable[..., EmbeddingClient],
    client_limit: int | None,
) -> None:
    """A shard of max_batch_bytes 1 MiB; a push (960 KB) and a lookup (320 KB of keys) that
    each fit it but not together: the client (max_call_bytes as the shard's, or left at
    its default, when the shard's refusal of the fused call says so) pushes, then looks
    up, with separate calls; the rows are numpy's SGD step on the initial ones."""
    server = shard_server(max_batch_bytes=1 << 20)
    options = {} if client_limit is None else {"max_call_bytes": client_limit}
    client = make_client([server], **options)
    config = sgd_table("t", DIM, LR)
    client.create_table(config)
    pushed = looked_up = np.arange(40_000, dtype=np.int64)
    grads = quarter_grads(np.random.default_rng(3), (pushed.size, DIM))
    expected = initial(config, looked_up)
    expected[: pushed.size] -= np.float32(LR) * grads
    for _ in range(2):  # the second time, the client knows the shard's limit
        rows = client._fused.push_then_lookup(
            {"t": (pushed, grads)}, None, {"t": (DIM, looked_up)}, True
        )
        np.testing.assert_array_equal(rows["t"], expected)
        expected[: pushed.size] -= np.float32(LR) * grads
    assert calls(server, "PushThenLookup") == 0
    assert calls(server, "PushGradientsUnary") == 2


def _sgd_shard(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient], seed: int
) -> tuple[ShardServer, EmbeddingClient, TableConfig, np.ndarray, np.ndarray]:
    """A shard, a client of it, its SGD table "t" of dim DIM (sgd_table), and a push to
    it: six keys and their gradients."""
    server = shard_server()
    client = make_client([server])
    config = sgd_table("t", DIM, LR)
    client.create_table(config)
    keys = np.arange(6, dtype=np.int64)
    return server, client, config, keys, quarter_grads(np.random.default_rng(seed), (6, DIM))


def test_a_fused_reply_of_the_wrong_size_keeps_the_push_applied(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """The shard applied the push and served the lookup, but its reply (cut short here, on
    its way to the client) has a row too few: the client raises the reply's ShardError, not
    PushNotApplied, and keeps the push's step (the push is in, once)."""
    _, client, config, keys, grads = _sgd_shard(shard_server, make_client, seed=4)
    real = client._fused.fused_one[0]

    def one_row_short(request: bytes, **options: Any) -> bytes:
        values, num_keys = wire.push_then_lookup_reply(real(request, **options))
        rows = np.frombuffer(values, "<f4").reshape(-1, DIM)[:-1]
        encoded, (view,) = wire.lookup_reply([rows.shape], num_keys)
        view[...] = rows
        return encoded

    client._fused.fused_one[0] = one_row_short
    with pytest.raises(ShardError, match="expected 96 bytes, got 80"):
        client._fused.push_then_lookup({"t": (keys, grads)}, None, {"t": (DIM, keys)}, True)
    expected = initial(config, keys) - np.float32(LR) * grads
    np.testing.assert_array_equal(client.lookup("t", keys, create=False), expected)
    client.push_gradients("t", keys, grads)  # step 2: the fused push kept step 1
    assert client.table_step("t") == 2


def test_a_fused_call_whose_push_is_in_is_never_sent_again(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """A fused call failing with an error the client would otherwise answer with separate
    calls (too large for one message), after the shard applied its push and said so in
    trailing metadata: the client raises it as the lookup's failure and does not push
    again (the rows took one SGD step, and no PushGradients call came)."""
    server, client, config, keys, grads = _sgd_shard(shard_server, make_client, seed=5)
    real = client._fused.fused_one[0]

    def pushed_then_too_large(request: bytes, **options: Any) -> bytes:
        _, num_keys = wire.push_then_lookup_reply(real(request, **options))
        raise Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "reply too large for one message",
            ((wire.PUSHED_HEADER, str(num_keys)),),
        )

    client._fused.fused_one[0] = pushed_then_too_large
    with pytest.raises(ShardError, match="too large for one message"):
        client._fused.push_then_lookup({"t": (keys, grads)}, None, {"t": (DIM, keys)}, True)
    expected = initial(config, keys) - np.float32(LR) * grads
    np.testing.assert_array_equal(client.lookup("t", keys, create=False), expected)
    assert calls(server, "PushGradientsUnary") + calls(server, "PushGradients") == 0


def test_a_lookup_cut_into_pieces_sends_them_at_once_after_the_push(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """A lookup of 12 MiB of rows goes as three pieces (LOOKUP_PIECE_BYTES): with a push
    before it, the client pushes, then sends the pieces as a lookup alone does, two at
    once (a piece's call waits here, up to 10 s, for another to be in flight too); the
    rows are numpy's SGD step on the initial ones."""
    dim = 256
    server = shard_server()
    client = make_client([server])
    config = sgd_table("t", dim, LR)
    client.create_table(config)
    keys = np.arange(12 << 10, dtype=np.int64)  # 12 MiB of rows
    grads = quarter_grads(np.random.default_rng(6), (8, dim))
    real, in_flight, most = client._transport.lookup_one[0], [0], [0]
    both = threading.Condition()

    def wait_for_the_other(request: bytes, **options: Any) -> Any:
        with both:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            both.notify_all()
            both.wait_for(lambda: most[0] >= 2, timeout=10.0)
        try:
            return real(request, **options)
        finally:
            with both:
                in_flight[0] -= 1

    client._transport.lookup_one[0] = wait_for_the_other
    rows = client._fused.push_then_lookup({"t": (keys[:8], grads)}, None, {"t": (dim, keys)}, True)
    expected = initial(config, keys)
    expected[:8] -= np.float32(LR) * grads
    np.testing.assert_array_equal(rows["t"], expected)
    assert calls(server, "LookupUnary") == 3 and most[0] == 2


def test_a_fused_push_refused_on_one_shard_names_the_other_as_succeeded(
    two_shards: list[ShardServer], make_client: Callable[..., EmbeddingClient]
) -> None:
    """Two shards; shard 1 refuses its fused call (injected UNAVAILABLE, before its shard
    sees it), shard 0 applies its push: PushNotApplied, whose error says the push is in on
    shard 0 (succeeded == [0]) and not on shard 1; the rows say the same; the step stays
    taken (the next push is step 2)."""
    client = make_client(two_shards)
    config = sgd_table("t", DIM, LR)
    client.create_table(config)
    keys = np.arange(8, dtype=np.int64)  # even keys on shard 0, odd ones on shard 1
    grads = quarter_grads(np.random.default_rng(7), (keys.size, DIM))
    _fail_once(client._fused.fused_one, 1, Refused(grpc.StatusCode.UNAVAILABLE, "injected"))
    with pytest.raises(PushNotApplied) as raised:
        client._fused.push_then_lookup({"t": (keys, grads)}, None, {"t": (DIM, keys)}, True)
    error = raised.value.error
    assert (error.shard_id, error.code, error.succeeded) == (1, grpc.StatusCode.UNAVAILABLE, [0])
    assert "applied on shards [0]" in str(error)
    expected = initial(config, keys)
    expected[::2] -= np.float32(LR) * grads[::2]  # shard 0's part of the push only
    np.testing.assert_array_equal(client.lookup("t", keys, create=False), expected)
    client.push_gradients("t", keys, grads)
    assert client.table_step("t") == 2


def test_a_held_push_of_a_module_dropped_unclosed_is_sent(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """A pipeline suspended after a step's backward (its push held for the next prefetch),
    then dropped with its module, unclosed, the two collected in one cycle: the held push
    is still applied (acknowledged means kept): each key's row took one SGD step of the
    gradient of a sum, its count in the step's bags."""
    server = shard_server()
    client = make_client([server])
    config = sgd_table("t", DIM, LR)
    client.create_table(config)
    batches = [{"a": np.arange(8).reshape(4, 2) % 5 + step} for step in range(3)]
    module = tierps_torch.EmbeddingBagCollection(client, [Feature("a", "t")], staleness=1)
    steps = module.pipeline(batches)
    module(next(steps))["a"].sum().backward()  # held for the next prefetch
    assert module._held is not None
    module.steps = steps  # module and generator in one cycle
    del module, steps
    gc.collect()
    deadline = time.monotonic() + 10.0
    while any(t.name.startswith("tierps-pipeline") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the pipeline's thread did not end"
        time.sleep(0.01)
    keys = np.arange(5, dtype=np.int64)
    counts = np.bincount(batches[0]["a"].ravel(), minlength=keys.size).astype(np.float32)
    expected = initial(config, keys) - np.float32(LR) * counts[:, None]
    np.testing.assert_array_equal(client.lookup("t", keys, create=False), expected)


AT_EXIT = """
import sys
import numpy as np
from tierps.client import EmbeddingClient, Feature
from tierps.client.torch import EmbeddingBagCollection

client = EmbeddingClient([sys.argv[1]], timeout_s=20.0)
module = EmbeddingBagCollection(client, [Feature("a", "t")], staleness=1)
steps = module.pipeline([{"a": np.arange(8).reshape(4, 2) % 5 + step} for step in range(3)])
module(next(steps))["a"].sum().backward()  # held for the next prefetch
assert module._held is not None
sys.exit(0)  # the pipeline suspended, the module unclosed
"""


@pytest.mark.slow  # a subprocess
def test_a_held_push_is_sent_at_interpreter_exit(
    shard_server: ServerFactory, make_client: Callable[..., EmbeddingClient]
) -> None:
    """A trainer process that exits with its pipeline suspended after a step's backward
    (its push held, the module unclosed): the held push is applied before the process
    ends (each key's row took one SGD step of its count in the step's bags)."""
    server = shard_server()
    client = make_client([server])
    config = sgd_table("t", DIM, LR)
    client.create_table(config)
    done = subprocess.run(
        [sys.executable, "-c", AT_EXIT, server.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    keys = np.arange(5, dtype=np.int64)
    counts = np.bincount((np.arange(8) % 5), minlength=keys.size).astype(np.float32)
    expected = initial(config, keys) - np.float32(LR) * counts[:, None]
    np.testing.assert_array_equal(client.lookup("t", keys, create=False), expected)
