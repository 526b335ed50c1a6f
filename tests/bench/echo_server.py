"""The service benchmark's baselines, two raw gRPC services in one server process, no
protobuf on either end (identity serializers), one message each way, limits raised on both
ends to the shards' (tierps.proto.wire.MAX_MESSAGE_BYTES):

- the **echo** (the ceiling): does nothing but move a data call's bytes. The request is read
  as the bytes it is, and the reply is a bytes object of the length the caller asks for
  (metadata "reply-bytes"), made once per length and reused, so that a call costs only what
  gRPC costs to carry the bytes;
- the **raw numpy server** (the same work, done the raw way): holds one table as a dense
  float32 arena [table_rows, dim], a row per key (the benchmark's keys are distinct ids in
  [0, table_rows)). A lookup's request is the keys (int64), its reply the rows gathered with
  np.take; a push's request is the keys then their float32 gradients, applied as numpy SGD
  (`arena[keys] -= lr * grads`, written as a gather, update and scatter), its reply 8
  bytes. `fill` makes the arena (`initial_rows`, the rows the benchmark assigns to tierps).
  Keys are trusted: no checks.

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
import numpy as np

from tierps.proto.wire import MAX_MESSAGE_BYTES, channel_options

METHOD = "/tierps.bench.Echo/Unary"
REPLY_BYTES = "reply-bytes"  # metadata: the length of the reply to send
RAW_SERVICE = "tierps.bench.RawNumpy"
RAW_METHODS = ("fill", "lookup", "push")
PUSH_REPLY = bytes(8)


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


def initial_rows(table_rows: int, dim: int, seed: int = 0) -> np.ndarray:
    """The rows of key 0..table_rows-1 that the benchmark assigns to tierps and the raw
    numpy server fills its arena with: seeded normals, the same in every process."""
    return np.random.default_rng(seed).standard_normal((table_rows, dim), dtype=np.float32)


class RawNumpy:
    """One table in a numpy arena, looked up and trained the raw way (module docstring)."""

    def __init__(self) -> None:
        self.arena = np.zeros((0, 0), np.float32)
        self.lr = 0.0
        # the gather's buffer, one a thread, reused: np.take into it, then one copy into the
        # reply's bytes (gRPC sends bytes only). Faster than np.take(...).tobytes(), whose
        # fresh array costs page faults at every call (docs/perf/profile-lookup.md, "A raw server")
        self._gathers = threading.local()

    def fill(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """request: JSON {"table_rows", "dim", "lr", "seed"}: the arena of initial_rows."""
        shape = json.loads(request)
        self.arena = initial_rows(shape["table_rows"], shape["dim"], shape["seed"])
        self.lr = float(shape["lr"])
        self._gathers = threading.local()
        return PUSH_REPLY

    def lookup(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return self._gather(np.frombuffer(request, np.int64)).tobytes()

    def push(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        count = len(request) // (8 + 4 * self.arena.shape[1])
        keys = np.frombuffer(request, np.int64, count)
        grads = np.frombuffer(request, np.float32, offset=8 * count).reshape(count, -1)
        # arena[keys] -= lr * grads, the same bits, in half the time (docs/perf/
        # profile-lookup.md, "A raw server"): numpy's in-place fancy update makes more temporaries
        rows = self._gather(keys)
        rows -= self.lr * grads
        self.arena[keys] = rows
        return PUSH_REPLY

    def _gather(self, keys: np.ndarray) -> np.ndarray:
        """The keys' rows, copied into this thread's reused buffer."""
        dim = self.arena.shape[1]
        buffer = getattr(self._gathers, "buffer", None)
        if buffer is None or buffer.size < keys.size * dim:
            buffer = self._gathers.buffer = np.empty(keys.size * dim, np.float32)
        rows = buffer[: keys.size * dim].reshape(keys.size, dim)
        # mode="clip": np.take writes straight into `out` (mode="raise" buffers it first)
        return np.take(self.arena, keys, axis=0, out=rows, mode="clip")


def echo_call(channel: grpc.Channel) -> Any:
    """The echo's unary callable on a channel: call(request_bytes, reply_bytes=n)."""
    unary = channel.unary_unary(METHOD)
    return lambda request, reply_bytes, timeout=120.0: unary(
        request, metadata=((REPLY_BYTES, str(reply_bytes)),), timeout=timeout
    )


def raw_calls(channel: grpc.Channel) -> dict[str, Any]:
    """The raw numpy server's unary callables on a channel, by method: fill, lookup, push;
    each takes the request bytes and returns the reply bytes."""
    return {name: channel.unary_unary(f"/{RAW_SERVICE}/{name}") for name in RAW_METHODS}


def start_server(address: str = "127.0.0.1:0") -> tuple[grpc.Server, int]:
    """A started server of both services (the echo and a raw numpy server), and its port."""
    server = grpc.server(
        ThreadPoolExecutor(16),
        options=[*channel_options(MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)],
    )
    service, name = METHOD.strip("/").split("/")
    raw = RawNumpy()
    raw_handlers = {  # no (de)serializers: requests and replies are the bytes they are
        method: grpc.unary_unary_rpc_method_handler(getattr(raw, method)) for method in RAW_METHODS
    }
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                service, {name: grpc.unary_unary_rpc_method_handler(Echo().unary)}
            ),
            grpc.method_handlers_generic_handler(RAW_SERVICE, raw_handlers),
        )
    )
    port = server.add_insecure_port(address)
    server.start()
    return server, port


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--port-file", type=Path, required=True)
    args = parser.parse_args()
    server, port = start_server()
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
