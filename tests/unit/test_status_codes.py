"""Errors become the gRPC codes a client can act on, with their reasons (server/status.py
owns the mapping)."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from tierps.core.errors import (
    QUOTED_CHARS,
    BackendError,
    InvalidArgumentError,
    Reason,
    ResourceExhaustedError,
    TableReplacedError,
    quoted,
)
from tierps.proto import wire
from tierps.server.status import (
    CODE_OF,
    MAX_DETAILS_WIRE_BYTES,
    MAX_FACT_CHARS,
    details,
    reason_of,
    status_for,
    status_of,
)
from tierps.storage import DataLossError, StorageFullError


class CupyLikeOutOfMemory(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError derives from MemoryError the same way."""


CODE = grpc.StatusCode


@pytest.mark.parametrize(
    ("error", "code", "reason"),
    [
        (InvalidArgumentError("x"), CODE.INVALID_ARGUMENT, Reason.INVALID_ARGUMENT),
        (StorageFullError("disk full"), CODE.RESOURCE_EXHAUSTED, Reason.STORAGE_FULL),
        (DataLossError("corrupt"), CODE.DATA_LOSS, Reason.DATA_CORRUPT),
        (
            DataLossError("restarted", reason=Reason.SHARD_RESTARTED),
            CODE.DATA_LOSS,
            Reason.SHARD_RESTARTED,
        ),
        (BackendError("rocksdb busy"), CODE.UNAVAILABLE, Reason.BACKEND_FAILED),
        (
            ResourceExhaustedError("over", reason=Reason.CALL_TOO_LARGE),
            CODE.RESOURCE_EXHAUSTED,
            Reason.CALL_TOO_LARGE,
        ),
        (TableReplacedError("replaced"), CODE.ABORTED, Reason.TABLE_REPLACED),
        (MemoryError(), CODE.RESOURCE_EXHAUSTED, Reason.OUT_OF_MEMORY),
        (
            CupyLikeOutOfMemory("out of memory allocating 1 GiB"),
            CODE.RESOURCE_EXHAUSTED,
            Reason.OUT_OF_MEMORY,
        ),
        (KeyError("bug"), CODE.INTERNAL, Reason.INTERNAL),
    ],
)
def test_each_error_has_its_code_and_reason(
    error: BaseException, code: grpc.StatusCode, reason: Reason
) -> None:
    assert (status_of(error), reason_of(error)) == (code, reason)


def test_every_reason_has_one_code() -> None:
    assert list(CODE_OF) == list(Reason)  # declared in the same order, none left out


def test_a_status_keeps_the_calls_trailers_and_carries_the_reason_and_facts() -> None:
    """What abort_with_status sends: the trailers the call set (a push applied in part) and
    grpc-status-details-bin, whose google.rpc.Status grpc_status reads back."""
    error = StorageFullError("table 'b': disk full", table="b", huge="x" * (MAX_FACT_CHARS + 1))
    applied = (wire.APPLIED_TABLES_HEADER, '["a"]')
    status = status_for(error, (applied,), shard=3)
    assert status.code is CODE.RESOURCE_EXHAUSTED and status.details == "table 'b': disk full"
    assert status.trailing_metadata[0] == applied
    ((key, value),) = status.trailing_metadata[1:]
    assert key == "grpc-status-details-bin"
    rich = status_pb2.Status.FromString(value)
    assert (rich.code, rich.message) == (CODE.RESOURCE_EXHAUSTED.value[0], status.details)
    info = error_details_pb2.ErrorInfo()
    assert rich.details[0].Unpack(info)
    assert (info.reason, info.domain) == ("STORAGE_FULL", "tierps")
    assert dict(info.metadata) == {"table": "b", "shard": "3"}  # the over-long fact left out
    assert rpc_status.to_status(rich).trailing_metadata == ((key, value),)


def test_details_that_fit_are_left_as_they_are() -> None:
    message = "snapshot 'snap': table 'ada', part 0: " + "x" * 300 + " in 'dir/ada.keys'"
    assert details(message) == message


def test_a_long_quoted_name_is_shortened_to_its_start_and_length() -> None:
    message = f"shard 0: table {'a' * (1 << 20)!r} not found; tables: ['t']"
    assert details(message) == (
        f"shard 0: table '{'a' * QUOTED_CHARS}…' ({1 << 20} chars) not found; tables: ['t']"
    )
    assert quoted("a" * (1 << 20)) == f"'{'a' * QUOTED_CHARS}…' ({1 << 20} chars)"
    assert quoted("item") == "'item'"


def test_a_long_message_keeps_its_start_and_end_within_the_budget() -> None:
    message = "start: " + "é x " * 50_000 + " :end"
    short = details(message)
    assert short.startswith("start: é x") and short.endswith("é x  :end")
    assert "chars cut]" in short
    raw = short.encode()
    wire = len(raw) + 2 * sum(1 for b in raw if not 0x20 <= b < 0x7F or b == ord("%"))
    assert MAX_DETAILS_WIRE_BYTES * 0.9 < wire <= MAX_DETAILS_WIRE_BYTES
