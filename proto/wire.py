"""What both ends of the wire share beyond the messages: size limits, channel options, the
split of a batch into a stream of chunks (tierps_service.proto, "Chunking"), and the
one-message data calls' bytes, encoded and decoded here by hand.

Why by hand: protobuf's Python parser copies a bytes field into its arena and again into a
Python bytes object on each read, and its serializer copies the field in and out again; at
16 MiB a copy costs ~2 ms. The hand-written codec below reads bulk fields as memoryviews of
the received bytes (no copy), and a lookup's reply is one bytes object the storage lookup
writes the rows into (lookup_reply). Its output is byte for byte
what protobuf's SerializeToString writes (tests/integration/test_client_wire.py checks)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from tierps.proto import tierps_service_pb2 as pb

CHUNK_BYTES = 4 << 20  # bulk bytes per stream message: "a few MiB"
# Bulk bytes a data call may carry as one message each way: a call of the client's default
# max_call_bytes (256 MiB) fits. Larger calls, or calls to a shard whose limit is lower,
# stream in chunks of CHUNK_BYTES.
ONE_MESSAGE_BYTES = 256 << 20
HEADER_ROOM = 64 << 10  # a message's non-bulk bytes (tags, lengths, table names), at most
# gRPC send/receive limit on both ends: one message of ONE_MESSAGE_BYTES plus its headers.
MAX_MESSAGE_BYTES = ONE_MESSAGE_BYTES + HEADER_ROOM
# gRPC metadata of a push call (server/ledger.py): "<client id>:<sequence>", the same on
# every retry of the call, so that a shard applies it once; and the generation of each of its
# batches' tables it was made against, comma-separated in the batches' order (0: not known).
PUSH_ID_HEADER = "tierps-push-id"
GENERATIONS_HEADER = "tierps-generations"
# gRPC metadata: a data call's request bytes (its serialized messages), declared by the client
# before it sends any, so a shard can refuse a call too large for it before reading a message
# (server/limits.py).
REQUEST_BYTES_HEADER = "tierps-request-bytes"
# gRPC trailing metadata of a failed PushThenLookup whose push was applied before its lookup
# failed: the push's num_keys (without it, the failed call changed nothing).
PUSHED_HEADER = "tierps-pushed"
# gRPC trailing metadata of a failed push call that a shard applied in part (a storage
# failure between two of its tables): the tables applied there, as a JSON list. The same call
# (the same push id) sent again applies only the others.
APPLIED_TABLES_HEADER = "tierps-applied-tables"


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


def declared(request_bytes: int) -> tuple[tuple[str, str]]:
    """The call metadata declaring a call's request bytes."""
    return ((REQUEST_BYTES_HEADER, str(request_bytes)),)


def stream_bytes(
    table: str, dim: int, third: int, keys: int, row_bytes: int, chunk_bytes: int = CHUNK_BYTES
) -> int:
    """The serialized bytes of the messages lookup_requests (row_bytes 0, third = create),
    push_requests (third = step) or assign_requests (third 0) make for `keys` keys with
    row_bytes of rows each: what a client declares before streaming them. Closed form over
    _row_spans: every span but the last holds `step` keys."""
    header = _request_pieces(table, dim, third, ())[1]

    def message(rows: int) -> int:
        return header + sum(
            len(_length_field(4, size)) + size for size in (8 * rows, row_bytes * rows) if size
        )

    step = max(1, chunk_bytes // (8 + row_bytes))
    full, rest = divmod(keys, step)
    return full * message(step) + (message(rest) if rest or not keys else 0)


def join_values(responses: Iterable[pb.LookupResponse]) -> bytes:
    """The values of a Lookup response stream, in key order."""
    return b"".join(response.values for response in responses)


# -- the one-message data calls, by hand --------------------------------------------------------
# Protobuf's wire format: each field is a tag (field_number << 3 | wire_type, a varint), then a
# varint (wire type 0), 8 bytes (1), a varint length and that many bytes (2), or 4 bytes (5).
# Serializers write fields in field-number order and leave out proto3 defaults (0, "", b"").

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


_ONE_BYTE = [bytes((value,)) for value in range(0x80)]  # a varint below 128 is its byte


def _varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _ONE_BYTE[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@functools.cache
def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _length_field(field: int, size: int) -> bytes:
    """The tag and length of a length-delimited field of `size` bytes (its bytes follow)."""
    return _tag(field, _LENGTH) + _varint(size)


def _scalar_field(field: int, value: int) -> bytes:
    return _tag(field, _VARINT) + _varint(value) if value else b""


Buffer = bytes | memoryview | np.ndarray  # a C-contiguous array goes as its raw bytes


Unfilled = int  # a bulk field given by its size in bytes, for the caller to fill in place


def _size(piece: Buffer | Unfilled) -> int:
    if type(piece) is bytes:  # the most of a request's pieces: tags, lengths, names
        return len(piece)
    if isinstance(piece, int):
        return piece
    return piece.nbytes if isinstance(piece, np.ndarray | memoryview) else len(piece)


def _bytes_field(field: int, value: Buffer | Unfilled) -> list[Buffer | Unfilled]:
    size = _size(value)
    return [_length_field(field, size), value] if size else []


def _nbytes(pieces: list[Buffer | Unfilled]) -> int:
    return sum(_size(p) for p in pieces)


def _request_pieces(
    table: str, dim: int, third: int, bulk: tuple[Buffer | Unfilled, ...]
) -> tuple[list[Buffer | Unfilled], int]:
    """The pieces of one LookupRequest (third = create, bulk = keys) or PushGradientsRequest
    (third = step, bulk = keys, grads), and their bytes: fields 1 table, 2 dim, 3
    create/step, 4.. bulk."""
    name = table.encode()
    header = (_length_field(1, len(name)) + name if name else b"") + (
        _scalar_field(2, dim) + _scalar_field(3, third)
    )
    pieces: list[Buffer | Unfilled] = [header]
    size = len(header)
    for number, value in enumerate(bulk, start=4):
        field = _bytes_field(number, value)
        pieces += field
        size += sum(_size(piece) for piece in field)
    return pieces, size


def encode_batches(batches: list[tuple[str, int, int, tuple[Buffer, ...]]]) -> bytes:
    """A LookupBatches or PushGradientsBatches message, serialized: its batches are
    (table, dim, create or step, (keys,) or (keys, grads)). Bulk buffers (C-contiguous,
    little-endian) are copied once, into the result."""
    return b"".join(
        memoryview(p).cast("B") if isinstance(p, np.ndarray) else p
        for p in _batches_pieces(batches)[0]
    )


def _batches_pieces(
    batches: list[tuple[str, int, int, tuple[Buffer | Unfilled, ...]]],
) -> tuple[list[Buffer | Unfilled], int]:
    """The pieces of a LookupBatches or PushGradientsBatches message, and their bytes."""
    pieces: list[Buffer | Unfilled] = []
    total = 0
    for table, dim, third, bulk in batches:
        inner, size = _request_pieces(table, dim, third, bulk)
        head = _length_field(1, size)
        pieces += [head, *inner]
        total += len(head) + size
    return pieces, total


def encode_batches_in_place(
    batches: list[tuple[str, int, int, tuple[Unfilled, ...]]],
) -> tuple[bytes, list[list[np.ndarray]]]:
    """encode_batches with the bulk fields given by their sizes in bytes and left for the
    caller to fill: (the message's bytes, per batch a writable uint8 view of each bulk
    field of positive size). Once the caller has written the views (before it sends the
    bytes; see _new_bytes for why writing into new bytes is safe), the bytes are
    encode_batches' for those buffers, byte for byte. A push gathers its gradients
    straight into them: one copy, no join."""
    data, views = _in_place(_batches_pieces(batches)[0])
    return data, _per_batch(batches, views)


def encode_push_then_lookup_in_place(
    push: list[tuple[str, int, int, tuple[Unfilled, ...]]],
    lookup: list[tuple[str, int, int, tuple[Buffer, ...]]],
) -> tuple[bytes, list[list[np.ndarray]]]:
    """A PushThenLookupRequest (field 1: the push's PushGradientsBatches, field 2: the
    lookup's LookupBatches), its push's bulk fields left for the caller to fill, as
    encode_batches_in_place leaves them: (the message's bytes, per push batch a writable
    uint8 view of each bulk field of positive size). The lookup's keys are copied in here.
    Both fields are written even when empty, as protobuf writes a submessage that is set."""
    (push_pieces, push_bytes), (lookup_pieces, lookup_bytes) = (
        _batches_pieces(push),
        _batches_pieces(lookup),
    )
    data, views = _in_place(
        [
            _length_field(1, push_bytes),
            *push_pieces,
            _length_field(2, lookup_bytes),
            *lookup_pieces,
        ]
    )
    return data, _per_batch(push, views)


def _per_batch(
    batches: list[tuple[str, int, int, tuple[Buffer | Unfilled, ...]]], views: list[np.ndarray]
) -> list[list[np.ndarray]]:
    """The views of _in_place's unfilled pieces, grouped by the batch they belong to."""
    fields, start = [], 0
    for _, _, _, bulk in batches:
        count = sum(1 for piece in bulk if isinstance(piece, int) and piece)
        fields.append(views[start : start + count])
        start += count
    return fields


def _in_place(pieces: list[Buffer | Unfilled]) -> tuple[bytes, list[np.ndarray]]:
    """The bytes of these pieces joined, with each Unfilled piece left for the caller to
    fill: (the bytes, a writable uint8 view of each Unfilled piece, in order)."""
    pieces = _runs_joined(pieces)
    total = _nbytes(pieces)
    if total < 2:  # nothing to fill (and b"" is a shared object: never filled)
        return b"".join(p for p in pieces if not isinstance(p, int)), [
            np.empty(0, np.uint8) for p in pieces if isinstance(p, int)
        ]
    data = _new_bytes(None, total)
    memory = np.asarray(_Unfilled(data))  # writable uint8 [total]; keeps `data` alive
    views, at = [], 0
    for piece in pieces:
        size = _size(piece)
        if isinstance(piece, int):
            views.append(memory[at : at + size])
        else:
            memory[at : at + size] = np.frombuffer(piece, np.uint8)
        at += size
    return data, views


def _runs_joined(pieces: list[Buffer | Unfilled]) -> list[Buffer | Unfilled]:
    """The pieces with each run of bytes pieces (tags, lengths, names, scalars) joined into
    one: a request of 8 tables has some 70 of them, and a copy each into numpy costs more
    than the join."""
    joined: list[Buffer | Unfilled] = []
    run: list[bytes] = []
    for piece in pieces:
        if isinstance(piece, bytes):
            run.append(piece)
            continue
        if run:
            joined.append(b"".join(run))
            run = []
        joined.append(piece)
    if run:
        joined.append(b"".join(run))
    return joined


def lookup_reply(
    shapes: list[tuple[int, int]], num_keys: int = 0
) -> tuple[bytes, list[np.ndarray]]:
    """A serialized LookupResponse of rows of these shapes ([n, dim] each, one per batch),
    built in place: (its bytes, a writable float32 view [n, dim] of each batch's part of
    `values`). Its header and num_rows are written here; the rows are left for the caller
    to write into the views (the storage lookup does, with out=) before it sends the bytes.
    Once written, the bytes are protobuf's LookupResponse(values=the rows joined,
    num_rows=their count), byte for byte; with num_keys, a PushThenLookupResponse's (its
    num_keys field 3 after LookupResponse's two).

    A view of a reply of 2**21 bytes or more is not 4-byte aligned (values' tag and
    length take 5 bytes there): numpy and the compiled host kernels read and write such
    arrays correctly, as x86-64 and AArch64 allow unaligned float loads and stores."""
    size = sum(4 * n * dim for n, dim in shapes)
    tail = _scalar_field(2, sum(n for n, _ in shapes)) + _scalar_field(3, num_keys)
    data, values = _in_place([*_bytes_field(1, size), tail])
    memory = values[0] if values else np.empty(0, np.uint8)
    views, at = [], 0
    for n, dim in shapes:
        views.append(memory[at : at + 4 * n * dim].view("<f4").reshape(n, dim))
        at += 4 * n * dim
    return data, views


# gRPC's Python API takes a message only as a `bytes` object (it copies it into its own
# buffer), and numpy cannot write into bytes. So a message is built the way C code builds
# bytes: PyBytes_FromStringAndSize(NULL, n) makes a new object of n bytes, left
# uninitialized for its maker to fill, and PyBytes_AsString gives their address. Safe
# because that object is this module's alone until it is handed to gRPC (a reply the
# servicer returns, a request the client sends): no other reference exists while it is
# written (n >= 2: the interpreter shares only its empty and 1-byte objects), its hash is
# not computed yet (bytes cache it on first use), and nothing writes to it once it is
# handed over (the lookup or gather that fills it has ended by then, and a failed one's
# message is dropped). The views keep the object alive while they exist.
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.restype = ctypes.c_void_p
_bytes_address.argtypes = (ctypes.py_object,)


class _Unfilled:
    """A new bytes object's memory as numpy sees it: writable, of its length, and holding
    the object (numpy keeps this as the base of every view)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.__array_interface__ = {
            "data": (_bytes_address(data), False),  # False: writable
            "shape": (len(data),),
            "typestr": "|u1",
            "version": 3,
        }


class WireError(ValueError):
    """Bytes that are not the message they were sent as."""


def _read_varint(data: memoryview, at: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= end or shift > 63:
            raise WireError(f"a varint at byte {at} runs past its message (ends at {end})")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, at
        shift += 7


def _field(data: memoryview, at: int, end: int) -> tuple[int, int, Any, int]:
    """The field at byte `at` of a message ending at `end`: (field number, wire type,
    value, the byte after it); the value an int for a varint, a memoryview of the bytes for
    a length-delimited field, None for fixed-size ones. One-byte varints (tags, dims, most
    lengths) are read inline: a call's batches are most of its decoding."""
    key = data[at]
    if key < 0x80:
        at += 1
    else:
        key, at = _read_varint(data, at, end)
    number, wire_type = key >> 3, key & 7
    if wire_type == _VARINT or wire_type == _LENGTH:
        if at < end and data[at] < 0x80:
            value, at = data[at], at + 1
        else:
            value, at = _read_varint(data, at, end)
        if wire_type == _LENGTH:
            if at + value > end:
                raise WireError(f"field {number}: {value} bytes at byte {at} run past {end}")
            value, at = data[at : at + value], at + value
    elif wire_type == _FIXED64 or wire_type == _FIXED32:
        value, at = None, at + (8 if wire_type == _FIXED64 else 4)
    else:
        raise WireError(f"field {number}: wire type {wire_type} is not protobuf's")
    if number == 0 or at > end:
        raise WireError(f"field {number} at byte {at}: not a valid field")
    return number, wire_type, value, at


def _fields(data: memoryview, at: int, end: int) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a message's fields, as _field reads each."""
    while at < end:
        number, wire_type, value, at = _field(data, at, end)
        yield number, wire_type, value


class WireBatch:
    """One table's message of a one-message data call, decoded by hand: the fields of a
    LookupRequest or PushGradientsRequest (unset ones at their defaults), bulk fields as
    memoryviews of the received bytes."""

    __slots__ = ("table", "dim", "create", "step", "keys", "grads")

    def __init__(self) -> None:
        self.table, self.dim, self.create, self.step = "", 0, False, 0
        self.keys: bytes | memoryview = b""
        self.grads: bytes | memoryview = b""


def _read_batch(data: memoryview, push: bool) -> WireBatch:
    """One LookupRequest (push: PushGradientsRequest) message's fields, read by _field in
    a loop (no generator, no setter a field). Fields other than the batch's are skipped, as
    protobuf skips unknown ones."""
    batch = WireBatch()
    at, end = 0, len(data)
    while at < end:
        number, wire_type, value, at = _field(data, at, end)
        if wire_type == _LENGTH:
            if number == 4:
                batch.keys = value
            elif number == 5 and push:
                batch.grads = value
            elif number == 1:
                batch.table = str(value, "utf-8")
        elif wire_type == _VARINT:
            if number == 2:
                batch.dim = value & 0xFFFFFFFF  # uint32: truncated
            elif number == 3:
                if push:
                    batch.step = value
                else:
                    batch.create = value != 0
    return batch


class WireBatches:
    """A LookupBatches or PushGradientsBatches (push) message decoded by hand. Decoding
    never raises inside gRPC (which would answer INTERNAL): bytes that are not the message
    are raised, as InvalidArgumentError-worthy WireError, when `batches` is read."""

    def __init__(self, data: bytes, push: bool) -> None:
        self.data = data  # kept: the batches' bulk fields are views of it
        try:
            self._batches: list[WireBatch] | WireError = self._decode(memoryview(data), push)
        except (WireError, UnicodeDecodeError) as error:
            self._batches = WireError(f"a one-message call's bytes do not decode: {error}")

    @staticmethod
    def _decode(data: memoryview, push: bool) -> list[WireBatch]:
        return [
            _read_batch(value, push)
            for number, wire_type, value in _fields(data, 0, len(data))
            if number == 1 and wire_type == _LENGTH
        ]

    @property
    def batches(self) -> list[WireBatch]:
        if isinstance(self._batches, WireError):
            raise self._batches
        return self._batches


def decode_lookup_batches(data: bytes) -> WireBatches:
    """A LookupBatches message's batches (a gRPC request deserializer)."""
    return WireBatches(data, push=False)


def decode_push_batches(data: bytes) -> WireBatches:
    """A PushGradientsBatches message's batches (a gRPC request deserializer)."""
    return WireBatches(data, push=True)


class WirePushThenLookup:
    """A PushThenLookupRequest decoded by hand: `push` and `lookup` are the WireBatches of
    its two fields (a field given more than once is merged, as protobuf merges a repeated
    submessage: its batches joined). Bytes that are not the message are raised when either
    one's batches are read."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        parts: dict[int, list[memoryview]] = {1: [], 2: []}
        error: WireError | None = None
        try:
            view = memoryview(data)
            for number, wire_type, value in _fields(view, 0, len(view)):
                if number in parts and wire_type == _LENGTH:
                    parts[number].append(value)
        except WireError as failed:
            error = WireError(f"a one-message call's bytes do not decode: {failed}")
        self.push = _joined_batches(parts[1], True, error)
        self.lookup = _joined_batches(parts[2], False, error)


def _joined_batches(views: list[memoryview], push: bool, error: WireError | None) -> WireBatches:
    joined = WireBatches(b"", push)
    batches = [WireBatches(view, push) for view in views]
    failed = error or next((b._batches for b in batches if isinstance(b._batches, WireError)), None)
    joined._batches = failed or [batch for part in batches for batch in part.batches]
    return joined


def decode_push_then_lookup(data: bytes) -> WirePushThenLookup:
    """A PushThenLookupRequest's push and lookup batches (a gRPC request deserializer)."""
    return WirePushThenLookup(data)


def lookup_reply_values(data: bytes) -> memoryview:
    """The values of a serialized LookupResponse: a view of `data`, not a copy."""
    return push_then_lookup_reply(data)[0]


def push_then_lookup_reply(data: bytes) -> tuple[memoryview, int]:
    """(values, num_keys) of a serialized PushThenLookupResponse (or LookupResponse, whose
    num_keys reads 0): values a view of `data`, not a copy."""
    view = memoryview(data)
    values, num_keys = view[:0], 0
    for number, wire_type, value in _fields(view, 0, len(view)):
        # a repeated singular field: the last one counts, as in protobuf
        if (number, wire_type) == (1, _LENGTH):
            values = value
        elif (number, wire_type) == (3, _VARINT):
            num_keys = value
    return values, num_keys
