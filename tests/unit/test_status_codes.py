"""Errors become the gRPC codes a client can act on (server/status.py owns the mapping)."""

from __future__ import annotations

import grpc
import pytest

from tierps.server.status import status_of
from tierps.storage import DataLossError, StorageFullError
from tierps.storage.errors import BackendError, InvalidArgumentError


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
