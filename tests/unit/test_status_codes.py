"""Errors become the gRPC codes a client can act on (server/status.py owns the mapping)."""

from __future__ import annotations

import grpc
import pytest

from tierps.core.errors import QUOTED_CHARS, BackendError, InvalidArgumentError, quoted
from tierps.server.status import MAX_DETAILS_WIRE_BYTES, details, status_of
from tierps.storage import DataLossError, StorageFullError


class CupyLikeOutOfMemory(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError derives from MemoryError the same way."""


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgumentError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (StorageFullError("disk full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (DataLossError("corrupt"), grpc.StatusCode.DATA_LOSS),
        (BackendError("rocksdb busy"), grpc.StatusCode.UNAVAILABLE),
        (MemoryError(), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (CupyLikeOutOfMemory("out of memory allocating 1 GiB"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (KeyError("bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_each_error_has_its_code(error: BaseException, code: grpc.StatusCode) -> None:
    assert status_of(error) is code


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
