"""Storage errors. The server maps each class to one gRPC status code, in one place."""

from __future__ import annotations


class TierpsError(Exception):
    """Base of every error tierps raises on purpose."""


class InvalidArgumentError(TierpsError, ValueError):
    """Bad input (shape, dtype, size, non-finite values): nothing was changed. INVALID_ARGUMENT."""


class NotFoundError(TierpsError, LookupError):
    """The named thing (table, snapshot) does not exist. NOT_FOUND."""


class TableNotFoundError(NotFoundError):
    """The named table does not exist. NOT_FOUND."""


class FailedPreconditionError(TierpsError):
    """The call conflicts with the current state (a table exists with another config).
    FAILED_PRECONDITION."""


class ResourceExhaustedError(TierpsError):
    """A request over a size limit. RESOURCE_EXHAUSTED."""


class BackendError(TierpsError, RuntimeError):
    """A storage backend failed; the message names the backend, table and shard. UNAVAILABLE:
    the shard is starting, stopping or recovering, and the same call may succeed later."""


class StorageFullError(BackendError):
    """The store's file system is full (or over a space limit): the write did not happen and
    every row is still where it was. RESOURCE_EXHAUSTED: retrying will not help until space
    is freed; the shard reports NOT_SERVING and recovers on its own once it is."""


class DataLossError(BackendError):
    """Stored data is corrupt or rows may be gone (RocksDB reports corruption, or the shard
    restarted after an unclean stop). DATA_LOSS: a person or the trainer must decide."""


class UnavailableError(TierpsError):
    """The call cannot run now but can soon (its table is being replaced by a snapshot
    load): nothing was changed. UNAVAILABLE: the same call may succeed later."""


class TableReplacedError(TierpsError):
    """A push made against a generation of a table's rows that a snapshot load has since
    replaced: nothing was applied. ABORTED: look the rows up again before pushing."""


QUOTED_CHARS = 64  # of a caller's string an error echoes: a table name has at most 64


def quoted(text: str, limit: int = QUOTED_CHARS) -> str:
    """`text` (a caller's name) as an error quotes it: repr'd whole up to `limit` characters,
    else its first `limit` and its length (`'aaaa…' (1048576 chars)`): an error echoing a
    1 MiB name whole would be over what a gRPC client accepts of a status message."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit] + '…'!r} ({len(text)} chars)"
