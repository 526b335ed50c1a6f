"""Refusals carry a reason the client decides on, against real shard servers on port 0: each
refusal a client branches on carries its google.rpc.ErrorInfo (domain "tierps", read here
with grpc_status, not with the client's own reader); the client decides the same when the
shard words its refusals otherwise; and a failure without ErrorInfo (gRPC's own, or a server
that sends none) is a ShardError with reason None."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tests.integration.conftest import Stubs
from tests.integration.test_client_wire import calls, initial, quarter_grads, sgd_table
from tests.integration.test_security import TOKENS, tokens_file
from tierps.client import ClusterAdmin, EmbeddingClient, ShardError, TableConfig, optim
from tierps.client.admin import LIFE_HEADER, refusal_of, too_large_for_one_message
from tierps.core.errors import Reason
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import wire
from tierps.server import cli, status
from tierps.server.daemon import ShardServer

CODE = grpc.StatusCode
T = 20.0
DIM = 8
LR = 0.5
DATA = "/tierps.v1.EmbeddingService/"
REWORDED = "the shard says this in other words"


def error_info(error: grpc.RpcError) -> tuple[str, dict[str, str]]:
    """The reason and metadata of a failed call's ErrorInfo, as grpc_status reads it."""
    rich = rpc_status.from_call(error)
    assert rich is not None, f"no rich status: {error.code()} {error.details()}"
    infos = []
    for detail in rich.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            infos.append(info)
    assert len(infos) == 1, rich
    assert infos[0].domain == "tierps"
    return infos[0].reason, dict(infos[0].metadata)


def _identity(data: bytes) -> bytes:
    return data


def _push_request(table: str, keys: np.ndarray, dim: int = DIM) -> bytes:
    grads = np.zeros((keys.size, dim), "<f4")
    return wire.encode_batches([(table, dim, 1, (keys.astype("<i8"), grads))])


def _push_one(stubs: Stubs, request: bytes, *metadata: tuple[str, str]) -> Any:
    call = stubs.channel.unary_unary(
        DATA + "PushGradientsUnary",
        request_serializer=_identity,
        response_deserializer=_identity,
    )
    return call(request, timeout=T, metadata=(*wire.declared(len(request)), *metadata))


def _refused(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def refused_calls(server: ShardServer, method: str) -> int:
    """Calls of `method` the shard refused with RESOURCE_EXHAUSTED: by its limits, before
    the servicer ran (tierps_refusals), or in the servicer (tierps_rpc_seconds)."""
    by_limits = sum(
        sample.value
        for metric in server.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "tierps_refusals_total"
        and (sample.labels["method"], sample.labels["code"])
        == (DATA + method, "RESOURCE_EXHAUSTED")
    )
    return int(by_limits) + calls(server, method, "RESOURCE_EXHAUSTED")


def _create(server: ShardServer, name: str = "t", dim: int = DIM) -> None:
    server.shard.admin.create_table(TableConfig(name, dim, optimizer=optim.SGD(lr=1.0)))


# -- each refusal the client decides on carries its reason ---------------------------------------


def test_a_one_message_call_over_the_message_limit_is_message_too_large(
    shard_server: Callable[..., ShardServer], connect: Callable[..., Stubs]
) -> None:
    server = shard_server(max_message_bytes=6 << 20)
    _create(server)
    request = _push_request("t", np.arange(200_000))  # 8 MB
    refused = _refused(lambda: _push_one(connect(server), request))
    assert refused.code() is CODE.RESOURCE_EXHAUSTED
    reason, facts = error_info(refused)
    assert reason == "MESSAGE_TOO_LARGE"
    assert facts["limit"] == str(6 << 20) and facts["bytes"] == str(len(request))
    assert too_large_for_one_message(refused)


def test_a_lookup_whose_reply_is_over_the_message_limit_is_message_too_large(
    shard_server: Callable[..., ShardServer], connect: Callable[..., Stubs]
) -> None:
    """The shard's own check of the reply (LookupUnary), not the request's size."""
    server = shard_server(max_message_bytes=6 << 20)
    dim = 512
    _create(server, dim=dim)
    keys = np.arange(4_000, dtype="<i8")  # 8 MB of rows, 32 KB of keys
    request = wire.encode_batches([("t", dim, True, (keys,))])
    call = connect(server).channel.unary_unary(
        DATA + "LookupUnary", request_serializer=_identity, response_deserializer=_identity
    )
    refused = _refused(lambda: call(request, timeout=T, metadata=wire.declared(len(request))))
    assert refused.code() is CODE.RESOURCE_EXHAUSTED
    reason, facts = error_info(refused)
    assert reason == "MESSAGE_TOO_LARGE" and facts["bytes"] == str(4 * dim * keys.size)
    assert facts["shard"] == "0"


def test_a_call_over_the_per_call_limit_is_call_too_large(
    shard_server: Callable[..., ShardServer], connect: Callable[..., Stubs]
) -> None:
    server = shard_server(max_batch_bytes=1 << 20)
    _create(server)
    stubs = connect(server)
    declared = 64 << 20
    messages = wire.push_requests(
        "t", DIM, 1, np.arange(10, dtype="<i8").tobytes(), np.zeros((10, DIM), "<f4").tobytes()
    )
    refused = _refused(
        lambda: stubs.embedding.PushGradients(messages, timeout=T, metadata=wire.declared(declared))
    )
    assert refused.code() is CODE.RESOURCE_EXHAUSTED
    reason, facts = error_info(refused)
    assert reason == "CALL_TOO_LARGE"
    assert facts["limit"] == str(server.limits.max_call_bytes) and facts["bytes"] == str(declared)
    assert not too_large_for_one_message(refused)  # a stream would be refused as well


def test_an_unknown_table_and_an_unknown_snapshot_are_told_apart(
    shard_server: Callable[..., ShardServer], connect: Callable[..., Stubs]
) -> None:
    stubs = connect(shard_server())
    refused = _refused(
        lambda: stubs.admin.DescribeTable(pb.DescribeTableRequest(table="nope"), timeout=T)
    )
    assert refused.code() is CODE.NOT_FOUND
    assert error_info(refused) == ("TABLE_NOT_FOUND", {"table": "nope", "shard": "0"})
    refused = _refused(
        lambda: list(stubs.admin.LoadSnapshot(pb.LoadSnapshotRequest(name="gone"), timeout=T))
    )
    assert refused.code() is CODE.NOT_FOUND
    assert error_info(refused) == ("SNAPSHOT_NOT_FOUND", {"snapshot": "gone", "shard": "0"})


def test_a_push_against_replaced_rows_is_table_replaced(
    shard_server: Callable[..., ShardServer], connect: Callable[..., Stubs]
) -> None:
    server = shard_server()
    _create(server)
    generation = server.shard.store.table("t").generation.id
    request = _push_request("t", np.arange(4))
    refused = _refused(
        lambda: _push_one(connect(server), request, (wire.GENERATIONS_HEADER, str(generation + 1)))
    )
    assert refused.code() is CODE.ABORTED
    assert error_info(refused) == ("TABLE_REPLACED", {"table": "t", "shard": "0"})


def test_a_key_of_another_shard_is_not_owner(
    shard_server: Callable[..., ShardServer], connect: Callable[..., Stubs]
) -> None:
    server = shard_server(0, 2)
    _create(server)
    refused = _refused(lambda: _push_one(connect(server), _push_request("t", np.array([2, 3]))))
    assert refused.code() is CODE.INVALID_ARGUMENT
    assert error_info(refused) == ("NOT_OWNER", {"table": "t", "shard": "0"})


def test_a_client_of_another_data_dir_or_an_earlier_life_is_told_which(
    shard_server: Callable[..., ShardServer], connect: Callable[..., Stubs]
) -> None:
    server = shard_server()
    _create(server)
    stubs = connect(server)
    lives = server.shard.lives
    request = _push_request("t", np.arange(4))
    for header, expected in (
        (f"another-dir/{lives.life}", "DATA_DIR_CHANGED"),
        (f"{lives.data_id}/{lives.life + 5}", "SHARD_RESTARTED"),
    ):
        refused = _refused(lambda: _push_one(stubs, request, (LIFE_HEADER, header)))  # noqa: B023
        assert refused.code() is CODE.DATA_LOSS
        reason, facts = error_info(refused)
        assert reason == expected and facts["shard"] == "0", (reason, facts)


def test_an_unknown_token_and_a_role_that_may_not_are_told_apart(
    tmp_path: Path, shard_server: Callable[..., ShardServer], connect: Callable[..., Stubs]
) -> None:
    server = shard_server(tokens_file=tokens_file(tmp_path))
    _create(server)
    stubs = connect(server)
    request = _push_request("t", np.arange(4))
    refused = _refused(lambda: _push_one(stubs, request))
    assert refused.code() is CODE.UNAUTHENTICATED
    reason, facts = error_info(refused)
    assert reason == "UNKNOWN_TOKEN" and facts["method"] == DATA + "PushGradientsUnary"
    reader = ("authorization", f"Bearer {TOKENS['reader']}")
    refused = _refused(lambda: _push_one(stubs, request, reader))
    assert refused.code() is CODE.PERMISSION_DENIED
    reason, facts = error_info(refused)
    assert reason == "ROLE_NOT_ALLOWED" and facts["role"] == "reader"


# -- the client decides on the reason, whatever the shard's words --------------------------------


@pytest.fixture
def reworded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every refusal of the in-process shards says REWORDED instead of its message."""
    monkeypatch.setattr(status, "details", lambda message: REWORDED)


@pytest.fixture
def make_client() -> Iterator[Callable[..., EmbeddingClient]]:
    opened: list[EmbeddingClient] = []

    def make(servers: Sequence[ShardServer], **options: Any) -> EmbeddingClient:
        client = EmbeddingClient([s.address for s in servers], timeout_s=T, **options)
        opened.append(client)
        return client

    yield make
    for client in opened:
        client.close()


def test_reworded_a_push_too_large_for_one_message_goes_as_a_stream(
    reworded: None, shard_server: Callable[..., ShardServer], make_client: Callable[..., Any]
) -> None:
    server = shard_server(max_message_bytes=6 << 20)
    config = sgd_table("t", 64, LR)
    client = make_client([server])
    client.create_table(config)
    keys = np.arange(40_000)  # 10.6 MB of keys and gradients
    grads = quarter_grads(np.random.default_rng(1), (keys.size, 64))
    assert client.push_gradients("t", keys, grads) == keys.size
    expected = initial(config, keys) - np.float32(LR) * grads
    np.testing.assert_array_equal(client.lookup("t", keys, create=False), expected)
    assert refused_calls(server, "PushGradientsUnary") == 1
    assert calls(server, "PushGradients") == 1  # the same push, once, as a stream


def test_reworded_a_lookup_whose_reply_is_too_large_for_one_message_goes_as_a_stream(
    reworded: None, shard_server: Callable[..., ShardServer], make_client: Callable[..., Any]
) -> None:
    server = shard_server(max_message_bytes=6 << 20)
    config = sgd_table("t", 512, LR)
    client = make_client([server])
    client.create_table(config)
    keys = np.arange(4_000)  # 8 MB of rows
    np.testing.assert_array_equal(client.lookup("t", keys), initial(config, keys))
    assert refused_calls(server, "LookupUnary") == 1
    assert calls(server, "Lookup") == 1


def test_reworded_a_push_and_lookup_over_the_per_call_limit_go_separately(
    reworded: None, shard_server: Callable[..., ShardServer], make_client: Callable[..., Any]
) -> None:
    """As test_push_then_lookup's test of the same: the fused call is refused
    (CALL_TOO_LARGE, nothing applied), the push and the lookup go as separate calls."""
    server = shard_server(max_batch_bytes=1 << 20)
    client = make_client([server])  # its max_call_bytes left at its default: told by the shard
    config = sgd_table("t", 4, LR)
    client.create_table(config)
    keys = np.arange(40_000, dtype=np.int64)  # a 960 KB push and 320 KB of lookup keys
    grads = quarter_grads(np.random.default_rng(3), (keys.size, 4))
    rows = client._fused.push_then_lookup({"t": (keys, grads)}, None, {"t": (4, keys)}, True)
    np.testing.assert_array_equal(rows["t"], initial(config, keys) - np.float32(LR) * grads)
    assert refused_calls(server, "PushThenLookup") == 1
    assert calls(server, "PushThenLookup") == 0
    assert calls(server, "PushGradientsUnary") == 1


def test_reworded_a_push_against_replaced_rows_learns_the_new_generation(
    reworded: None, shard_server: Callable[..., ShardServer], make_client: Callable[..., Any]
) -> None:
    """A trainer pushed; an admin saved and loaded a snapshot since: the trainer's next push
    is refused (TABLE_REPLACED, nothing applied, its step given back), and the one after goes
    on the loaded rows."""
    server = shard_server()
    trainer, admin = make_client([server]), make_client([server])
    config = sgd_table("t", DIM, LR)
    trainer.create_table(config)
    keys = np.arange(6)
    grads = quarter_grads(np.random.default_rng(4), (keys.size, DIM))
    trainer.push_gradients("t", keys, grads)
    admin.save_snapshot("base")
    admin.load_snapshot("base")
    with pytest.raises(ShardError) as raised:
        trainer.push_gradients("t", keys, grads)
    error = raised.value
    assert (error.code, error.reason, error.details) == (
        CODE.ABORTED,
        Reason.TABLE_REPLACED,
        REWORDED,
    )
    assert error.facts == {"table": "t", "shard": "0"}
    trainer.push_gradients("t", keys, grads)  # against the loaded generation: applied
    step = np.float32(LR) * grads
    expected = (initial(config, keys) - step) - step  # two SGD steps, in float32 as the shard
    np.testing.assert_array_equal(admin.lookup("t", keys, create=False), expected)


def test_reworded_loading_a_snapshot_that_is_not_there_lists_the_ones_that_are(
    reworded: None,
    shard_server: Callable[..., ShardServer],
    make_client: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = shard_server()
    admin = make_client([server])
    admin.create_table(sgd_table("t"))
    admin.save_snapshot("base")
    code = cli.main(["admin", "snapshot", "load", "gone", "--addresses", server.address])
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().endswith(f"NOT_FOUND: {REWORDED}; snapshots there: base"), err


# -- failures without ErrorInfo ---------------------------------------------------------------


def _serve(handler: grpc.GenericRpcHandler, **options: int) -> tuple[grpc.Server, str]:
    server = grpc.server(ThreadPoolExecutor(2), options=list(options.items()))
    server.add_generic_rpc_handlers((handler,))
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    return server, address


class _Plain(grpc.GenericRpcHandler):
    """Answers every unary call with `code` and `words`, as a server without rich status."""

    def __init__(self, code: grpc.StatusCode, words: str) -> None:
        self.code, self.words = code, words

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(self.code, self.words)

        return grpc.unary_unary_rpc_method_handler(refuse)


def test_a_refusal_without_error_info_is_a_shard_error_without_a_reason() -> None:
    server, address = _serve(_Plain(CODE.NOT_FOUND, "words of an older server"))
    try:
        with ClusterAdmin([address], timeout_s=T) as admin, pytest.raises(ShardError) as raised:
            admin.list_tables()
    finally:
        server.stop(None)
    error = raised.value
    assert (error.code, error.details, error.reason, error.facts) == (
        CODE.NOT_FOUND,
        "words of an older server",
        None,
        {},
    )
    assert str(error) == f"shard 0 at {address}: NOT_FOUND: words of an older server"


def test_grpcs_own_message_limit_is_too_large_for_one_message_without_a_reason() -> None:
    """gRPC itself refuses a message over the server's receive limit: RESOURCE_EXHAUSTED,
    no ErrorInfo, nothing ran; told apart by code and the missing ErrorInfo."""
    ran = []

    class Echo(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> Any:
            return grpc.unary_unary_rpc_method_handler(lambda request, context: ran.append(1))

    server, address = _serve(Echo(), **{"grpc.max_receive_message_length": 1 << 20})
    try:
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(
                "/any/Method", request_serializer=_identity, response_deserializer=_identity
            )
            refused = _refused(lambda: call(b"x" * (2 << 20), timeout=T))
    finally:
        server.stop(None)
    assert refused.code() is CODE.RESOURCE_EXHAUSTED and ran == []
    assert refusal_of(refused) == (None, {})
    assert too_large_for_one_message(refused)
