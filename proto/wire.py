"""What both ends of the wire share beyond the messages: size limits, channel options, and
the split of a batch into a stream of chunks (tierps_service.proto, "Chunking")."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from tierps.proto import tierps_service_pb2 as pb

CHUNK_BYTES = 4 << 20  # bulk bytes per stream message: "a few MiB"
MAX_MESSAGE_BYTES = 16 << 20  # gRPC send/receive limit on both ends: a chunk plus headroom


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Message size limits, set explicitly (gRPC's default receive limit is 4 MiB)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def _row_spans(n: int, bytes_per_row: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """[start, end) row ranges of at most chunk_bytes each; one empty range when n == 0."""
    step = max(1, chunk_bytes // bytes_per_row)
    yield from ((start, min(n, start + step)) for start in range(0, max(n, 1), step))


def lookup_requests(
    table: str, dim: int, keys: bytes, *, create: bool, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.LookupRequest]:
    for start, end in _row_spans(len(keys) // 8, 8, chunk_bytes):
        yield pb.LookupRequest(table=table, dim=dim, create=create, keys=keys[8 * start : 8 * end])


def _with_rows(
    make: Callable[[bytes, bytes], Any], dim: int, keys: bytes, rows: bytes, chunk_bytes: int
) -> Iterator[Any]:
    """make(keys, rows) for chunks of whole keys with their rows."""
    row = 4 * dim
    for start, end in _row_spans(len(keys) // 8, 8 + row, chunk_bytes):
        yield make(keys[8 * start : 8 * end], rows[row * start : row * end])


def push_requests(
    table: str, dim: int, step: int, keys: bytes, grads: bytes, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.PushGradientsRequest]:
    def make(keys: bytes, grads: bytes) -> pb.PushGradientsRequest:
        return pb.PushGradientsRequest(table=table, dim=dim, step=step, keys=keys, grads=grads)

    return _with_rows(make, dim, keys, grads, chunk_bytes)


def assign_requests(
    table: str, dim: int, keys: bytes, values: bytes, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.AssignRequest]:
    def make(keys: bytes, values: bytes) -> pb.AssignRequest:
        return pb.AssignRequest(table=table, dim=dim, keys=keys, values=values)

    return _with_rows(make, dim, keys, values, chunk_bytes)


def join_values(responses: Iterable[pb.LookupResponse]) -> bytes:
    """The values of a Lookup response stream, in key order."""
    return b"".join(response.values for response in responses)
