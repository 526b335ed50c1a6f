"""The service benchmark's ceiling: a raw gRPC unary echo that moves a data call's bytes as
one message each way and does nothing else. No protobuf on either end (identity
serializers): the request is read as the bytes it is, and the reply is a bytes object of
the length the caller asks for (metadata "reply-bytes"), made once per length and reused,
so that a call costs only what gRPC costs to carry the bytes. Its limits are the shards'
(tierps.proto.wire.MAX_MESSAGE_BYTES), raised on both ends.

    python -m tests.bench.echo_server --port-file F
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from tierps.proto.wire import MAX_MESSAGE_BYTES, channel_options

METHOD = "/tierps.bench.Echo/Unary"
REPLY_BYTES = "reply-bytes"  # metadata: the length of the reply to send


class Echo:
    """Answers each request with a reply of the asked length (zeros, built once a length)."""

    def __init__(self) -> None:
        self._replies: dict[int, bytes] = {}

    def unary(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        size = int(dict(context.invocation_metadata()).get(REPLY_BYTES, "0"))
        reply = self._replies.get(size)
        if reply is None:
            reply = self._replies.setdefault(size, bytes(size))
        return reply


def echo_call(channel: grpc.Channel) -> Any:
    """The echo's unary callable on a channel: call(request_bytes, reply_bytes=n)."""
    unary = channel.unary_unary(METHOD)
    return lambda request, reply_bytes, timeout=120.0: unary(
        request, metadata=((REPLY_BYTES, str(reply_bytes)),), timeout=timeout
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", type=Path, required=True)
    args = parser.parse_args()
    server = grpc.server(
        ThreadPoolExecutor(16),
        options=[*channel_options(MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)],
    )
    service, name = METHOD.strip("/").split("/")
    handler = grpc.unary_unary_rpc_method_handler(Echo().unary)  # no (de)serializers
    generic = grpc.method_handlers_generic_handler(service, {name: handler})
    server.add_generic_rpc_handlers((generic,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    written = args.port_file.with_suffix(".tmp")  # renamed: the reader never sees half of it
    written.write_text(json.dumps({"port": port, "pid": os.getpid()}))
    written.replace(args.port_file)
    while not stop.wait(0.5):
        pass
    server.stop(1).wait()


if __name__ == "__main__":
    main()
