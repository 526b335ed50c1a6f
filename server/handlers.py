"""Rewriting a gRPC method handler inside a server interceptor: the same kind of call, the
same (de)serializers, another behavior. One place for it, as grpc's API spreads a handler
over four factory functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def behavior_of(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    kind = {
        (False, False): handler.unary_unary,
        (False, True): handler.unary_stream,
        (True, False): handler.stream_unary,
        (True, True): handler.stream_stream,
    }
    return kind[(handler.request_streaming, handler.response_streaming)]


def with_behavior(
    handler: grpc.RpcMethodHandler,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """The handler with behavior wrap(its behavior) and, where given, another request
    deserializer."""
    factory = _FACTORIES[(handler.request_streaming, handler.response_streaming)]
    return factory(
        wrap(behavior_of(handler)),
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def as_request_stream(
    handler: grpc.RpcMethodHandler,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """The handler as one that takes its request as a stream (the same response kind and
    serializers), with behavior wrap(its behavior): for a one-message call, the new behavior
    gets an iterator and decides whether and when the message is read. On the wire a
    one-message request is a stream of one message: clients see no difference."""
    factory = _FACTORIES[(True, handler.response_streaming)]
    return factory(
        wrap(behavior_of(handler)),
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
