"""What a refusal tells the client, against real shard servers on port 0 (server/status.py):
a request message that does not decode (a string field not UTF-8) is INVALID_ARGUMENT naming
the method on every kind of rpc, not INTERNAL, with reason UNDECODABLE_REQUEST; and a
caller's huge string echoed in an error is shortened, so the client receives the error
itself instead of a transport failure about the size of its trailers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from tests.integration.conftest import Stubs
from tests.integration.test_reasons import error_info
from tierps.client import TableConfig, optim
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import wire
from tierps.proto.convert import table_config_to_proto
from tierps.server.daemon import ShardServer
from tierps.server.status import MAX_DETAILS_WIRE_BYTES

CODE = grpc.StatusCode
T = 10.0
DIM = 4
# A LookupRequest (or any message with a string field 1) whose `table` is the bytes ff fe:
# the protobuf encoding is well formed, the string is not UTF-8.
BAD_UTF8 = pb.LookupRequest(dim=DIM).SerializeToString() + b"\x0a\x02\xff\xfe"


def _identity(data: bytes) -> bytes:
    return data


def _call(channel: grpc.Channel, method: str, kind: str, messages: list[bytes]) -> Any:
    """A generic call sending `messages` as raw bytes; a response stream is drained."""
    make = {
        "uu": channel.unary_unary,
        "us": channel.unary_stream,
        "su": channel.stream_unary,
        "ss": channel.stream_stream,
    }[kind]
    call = make(method, request_serializer=_identity, response_deserializer=_identity)
    request = iter(messages) if kind[0] == "s" else messages[0]
    reply = call(request, timeout=T)
    return list(reply) if kind[1] == "s" else reply


DATA = "/tierps.v1.EmbeddingService/"
ADMIN = "/tierps.v1.AdminService/"
# One rpc of each request/response kind, ours and the ones the server adds.
METHODS = {
    "Lookup": (DATA + "Lookup", "ss"),
    "PushGradients": (DATA + "PushGradients", "su"),
    "DescribeTable": (ADMIN + "DescribeTable", "uu"),
    "SaveSnapshot": (ADMIN + "SaveSnapshot", "us"),
    "Health.Check": ("/grpc.health.v1.Health/Check", "uu"),
    "ServerReflectionInfo": (
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "ss",
    ),
}


def _create(stubs: Stubs) -> None:
    config = TableConfig("t", DIM, optimizer=optim.SGD(lr=0.5)).to_dict()
    stubs.admin.CreateTable(pb.CreateTableRequest(config=table_config_to_proto(config)), timeout=T)


def _rows(stubs: Stubs, keys: np.ndarray) -> np.ndarray:
    requests = wire.lookup_requests("t", DIM, keys.tobytes(), create=False)
    responses = list(stubs.embedding.Lookup(requests, timeout=T))
    return np.frombuffer(wire.join_values(responses), dtype="<f4").reshape(keys.size, DIM)


@pytest.mark.parametrize("name", list(METHODS))
def test_a_string_field_that_is_not_utf8_is_invalid_argument_naming_the_method(
    shard_server: Callable[..., ShardServer], connect: Callable[..., Stubs], name: str
) -> None:
    method, kind = METHODS[name]
    stubs = connect(shard_server())
    with pytest.raises(grpc.RpcError) as refused:
        _call(stubs.channel, method, kind, [BAD_UTF8])
    assert refused.value.code() is CODE.INVALID_ARGUMENT, refused.value.details()
    details = refused.value.details()
    assert details.startswith(f"{method}: request message 1 ({len(BAD_UTF8)} bytes)"), details
    assert "UTF-8" in details, details
    reason, facts = error_info(refused.value)  # on ours and on the ones the server adds
    assert reason == "UNDECODABLE_REQUEST" and facts["method"] == method, (reason, facts)
    # the shard goes on serving
    assert stubs.admin.ListTables(pb.ListTablesRequest(), timeout=T).tables == []


def test_a_push_stream_with_an_undecodable_second_message_changes_nothing(
    shard_server: Callable[..., ShardServer], connect: Callable[..., Stubs]
) -> None:
    stubs = connect(shard_server())
    _create(stubs)
    keys = np.arange(6, dtype="<i8")
    before = _rows(stubs, keys)
    good = pb.PushGradientsRequest(
        table="t",
        dim=DIM,
        step=1,
        keys=keys.tobytes(),
        grads=np.ones((keys.size, DIM), "<f4").tobytes(),
    ).SerializeToString()
    with pytest.raises(grpc.RpcError) as refused:
        _call(stubs.channel, DATA + "PushGradients", "su", [good, BAD_UTF8])
    assert refused.value.code() is CODE.INVALID_ARGUMENT, refused.value.details()
    assert "request message 2" in refused.value.details()
    np.testing.assert_array_equal(_rows(stubs, keys), before)


def test_a_lookup_naming_a_1mib_table_is_not_found_with_a_short_readable_message(
    shard_server: Callable[..., ShardServer], connect: Callable[..., Stubs]
) -> None:
    stubs = connect(shard_server())
    _create(stubs)
    huge = "a" * (1 << 20)
    keys = np.arange(3, dtype="<i8").tobytes()
    for call in (
        lambda: list(
            stubs.embedding.Lookup(wire.lookup_requests(huge, DIM, keys, create=True), timeout=T)
        ),
        lambda: stubs.admin.DescribeTable(pb.DescribeTableRequest(table=huge), timeout=T),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() is CODE.NOT_FOUND, refused.value.details()[:300]
        details = refused.value.details()
        assert len(details) < 400, details[:500]
        assert f"'{'a' * 64}…' ({1 << 20} chars)" in details, details
        assert "not found" in details and "['t']" in details, details
        # the name is no fact the status carries whole: left out, not cut
        assert error_info(refused.value) == ("TABLE_NOT_FOUND", {"shard": "0"})


def test_an_error_over_the_trailer_budget_keeps_its_start_and_end(
    shard_server: Callable[..., ShardServer], connect: Callable[..., Stubs]
) -> None:
    """A long message that is no long quoted run (a table name holding both quote characters,
    which repr escapes) is cut in the middle to MAX_DETAILS_WIRE_BYTES."""
    stubs = connect(shard_server())
    name = ("é" * 100 + "'\"") * 400  # é: 6 bytes on the wire, percent-encoded
    config = TableConfig("t", DIM).to_dict() | {"name": name}
    request = pb.CreateTableRequest(config=table_config_to_proto(config))
    with pytest.raises(grpc.RpcError) as refused:
        stubs.admin.CreateTable(request, timeout=T)
    assert refused.value.code() is CODE.INVALID_ARGUMENT, refused.value.details()[:300]
    details = refused.value.details()
    assert details.startswith("CreateTable: field 'config': TableConfig: field 'name'"), details
    assert details.endswith(repr(name)[-20:]), details[-200:]
    assert "chars cut]" in details
    encoded = details.encode()
    wire_bytes = len(encoded) + 2 * sum(1 for b in encoded if not 0x20 <= b < 0x7F or b == 0x25)
    assert MAX_DETAILS_WIRE_BYTES * 0.9 < wire_bytes <= MAX_DETAILS_WIRE_BYTES
