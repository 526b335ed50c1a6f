"""The service benchmark's ceiling: an EmbeddingService that moves the same messages as a
shard, with the same chunking and limits, and does no storage work. Lookup answers each
batch with that many rows of zeros (a fresh array, encoded as a shard encodes rows);
PushGradients reads every message and acknowledges.

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

import grpc
import numpy as np

from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto.wire import CHUNK_BYTES, MAX_MESSAGE_BYTES, channel_options


class EchoServicer(pb_grpc.EmbeddingServiceServicer):
    def Lookup(self, requests, context):  # noqa: N802 - gRPC's method name
        first, key_bytes = None, 0
        for message in requests:
            first = first or message
            key_bytes += len(message.keys)
        rows = np.zeros((key_bytes // 8, first.dim), dtype=np.float32)
        per_chunk = CHUNK_BYTES // (4 * first.dim)
        for start in range(0, rows.shape[0], per_chunk):  # encoded as a shard encodes rows
            chunk = rows[start : start + per_chunk]
            yield pb.LookupResponse(values=chunk.tobytes(), num_rows=chunk.shape[0])

    def PushGradients(self, requests, context):  # noqa: N802
        key_bytes = sum(len(message.keys) for message in requests)
        return pb.PushGradientsResponse(num_keys=key_bytes // 8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", type=Path, required=True)
    args = parser.parse_args()
    server = grpc.server(
        ThreadPoolExecutor(16),
        options=[*channel_options(MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)],
    )
    pb_grpc.add_EmbeddingServiceServicer_to_server(EchoServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    args.port_file.write_text(json.dumps({"port": port, "pid": os.getpid()}))
    while not stop.wait(0.5):
        pass
    server.stop(1).wait()


if __name__ == "__main__":
    main()
