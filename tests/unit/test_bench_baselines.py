"""The service benchmark's raw numpy server (tests/bench/echo_server.py), a real gRPC server
on port 0: a lookup answers np.take's rows of the filled arena for the given keys, and a
push applies numpy's SGD to those rows and no others; the echo answers the asked length."""

from __future__ import annotations

import json

import grpc
import numpy as np

from tests.bench.echo_server import echo_call, initial_rows, raw_calls, start_server
from tierps.proto import wire


def test_raw_numpy_server_looks_up_and_trains_like_numpy() -> None:
    rows, dim, lr = 1000, 8, 0.05
    server, port = start_server()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=wire.channel_options())
    try:
        raw = raw_calls(channel)
        raw["fill"](json.dumps({"table_rows": rows, "dim": dim, "lr": lr, "seed": 3}).encode())
        arena = initial_rows(rows, dim, 3)
        rng = np.random.default_rng(4)
        keys = rng.choice(rows, 300, replace=False).astype(np.int64)
        got = np.frombuffer(raw["lookup"](keys.tobytes()), np.float32).reshape(-1, dim)
        assert np.array_equal(got, np.take(arena, keys, axis=0))

        grads = rng.standard_normal((keys.size, dim), dtype=np.float32)
        assert raw["push"](keys.tobytes() + grads.tobytes()) == bytes(8)
        arena[keys] -= lr * grads  # the same numpy expression: the same bits
        every_key = np.arange(rows, dtype=np.int64)
        after = np.frombuffer(raw["lookup"](every_key.tobytes()), np.float32).reshape(-1, dim)
        assert np.array_equal(after, arena)
        assert not np.array_equal(after, initial_rows(rows, dim, 3))

        assert echo_call(channel)(b"\x01" * 5, reply_bytes=12) == bytes(12)
    finally:
        channel.close()
        server.stop(None)
