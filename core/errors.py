"""Errors tierps raises on purpose, and the reason each carries. The server sends the reason
with every refusal (google.rpc.ErrorInfo); the client decides on it, never on the message,
which is for people. The status code of each reason is the server's (server/status.py)."""

from __future__ import annotations

from enum import StrEnum

DOMAIN = "tierps"  # ErrorInfo.domain of every reason below


class Reason(StrEnum):
    """Why a call failed: the closed set a shard says and a client branches on. The
    RESOURCE_EXHAUSTED ones (limits) and INVALID_ARGUMENT ones changed nothing."""

    # The request is wrong (INVALID_ARGUMENT): sending it again fails again.
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # a field, shape, dtype, value or metadata is wrong
    UNDECODABLE_REQUEST = "UNDECODABLE_REQUEST"  # a message's bytes are not its protobuf type
    NOT_OWNER = "NOT_OWNER"  # a key, or a table placed whole, belongs to another shard
    # What the call names does not exist (NOT_FOUND).
    TABLE_NOT_FOUND = "TABLE_NOT_FOUND"  # no table of that name on the shard
    SNAPSHOT_NOT_FOUND = "SNAPSHOT_NOT_FOUND"  # no snapshot of that name in the snapshot dir
    # The call conflicts with what the shard holds.
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # e.g. a table exists with another config
    TABLE_REPLACED = "TABLE_REPLACED"  # a push against rows a load replaced: look up again
    TABLE_LOADING = "TABLE_LOADING"  # the table is being replaced by a load: send it after
    READ_ONLY = "READ_ONLY"  # a replica: writes go to the training cluster it follows
    SNAPSHOT_NEEDED = "SNAPSHOT_NEEDED"  # a kept incremental snapshot builds on this one
    # A limit of the shard (RESOURCE_EXHAUSTED).
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"  # over one message (either way): send as a stream
    CALL_TOO_LARGE = "CALL_TOO_LARGE"  # request or reply over the per-call bytes: split it
    BYTES_IN_FLIGHT = "BYTES_IN_FLIGHT"  # no room left in the in-flight byte budget: retry later
    TOO_MANY_CALLS = "TOO_MANY_CALLS"  # as many calls run as the shard takes: retry later
    TOO_MANY_STREAMS = "TOO_MANY_STREAMS"  # as many request streams wait as it takes: later
    OUT_OF_MEMORY = "OUT_OF_MEMORY"  # a table or a call needs more host or GPU memory than there is
    STORAGE_FULL = "STORAGE_FULL"  # the store's or the snapshot dir's file system is full
    # The storage behind the shard (UNAVAILABLE, DATA_LOSS).
    BACKEND_FAILED = "BACKEND_FAILED"  # the storage backend failed: the same call may pass later
    DATA_CORRUPT = "DATA_CORRUPT"  # the backend holds corrupt rows
    SHARD_RESTARTED = "SHARD_RESTARTED"  # an unclean restart since this client's last call
    DATA_DIR_CHANGED = "DATA_DIR_CHANGED"  # another data dir than the one this client knew
    # Credentials (UNAUTHENTICATED, PERMISSION_DENIED).
    UNKNOWN_TOKEN = "UNKNOWN_TOKEN"  # no bearer token, or one the shard does not know
    ROLE_NOT_ALLOWED = "ROLE_NOT_ALLOWED"  # the token's role may not make this call
    # Anything else.
    INTERNAL = "INTERNAL"  # an error not raised on purpose: a bug; the shard logs its traceback


class TierpsError(Exception):
    """Base of every error tierps raises on purpose. `reason`: the class's own, or the one
    given where a class covers several. `facts`: what the error knows that a program may
    read (table, shard, field, limit, ...): sent as ErrorInfo's metadata, as strings."""

    reason: Reason = Reason.INTERNAL

    def __init__(
        self, message: str = "", /, *, reason: Reason | None = None, **facts: str | int
    ) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        self.facts = {name: str(value) for name, value in facts.items()}


class InvalidArgumentError(TierpsError, ValueError):
    """Bad input (shape, dtype, size, non-finite values): nothing was changed. INVALID_ARGUMENT."""

    reason = Reason.INVALID_ARGUMENT


class NotFoundError(TierpsError, LookupError):
    """The named thing does not exist. NOT_FOUND; raised as one of the classes below."""


class TableNotFoundError(NotFoundError):
    """The named table does not exist. NOT_FOUND."""

    reason = Reason.TABLE_NOT_FOUND


class SnapshotNotFoundError(NotFoundError):
    """The named snapshot is not in the snapshot directory. NOT_FOUND."""

    reason = Reason.SNAPSHOT_NOT_FOUND


class FailedPreconditionError(TierpsError):
    """The call conflicts with the current state (a table exists with another config).
    FAILED_PRECONDITION."""

    reason = Reason.FAILED_PRECONDITION


class ResourceExhaustedError(TierpsError):
    """Over a limit of the shard: nothing was changed. RESOURCE_EXHAUSTED. The raise site
    names the limit (`reason`); where it names none, memory (OUT_OF_MEMORY)."""

    reason = Reason.OUT_OF_MEMORY


class BackendError(TierpsError, RuntimeError):
    """A storage backend failed; the message names the backend, table and shard. UNAVAILABLE:
    the shard is starting, stopping or recovering, and the same call may succeed later."""

    reason = Reason.BACKEND_FAILED


class StorageFullError(BackendError):
    """The store's file system is full (or over a space limit): the write did not happen and
    every row is still where it was. RESOURCE_EXHAUSTED: retrying will not help until space
    is freed; the shard reports NOT_SERVING and recovers on its own once it is."""

    reason = Reason.STORAGE_FULL


class DataLossError(BackendError):
    """Stored data is corrupt or rows may be gone (RocksDB reports corruption, or the shard
    restarted after an unclean stop, or holds another data dir: reason SHARD_RESTARTED,
    DATA_DIR_CHANGED). DATA_LOSS: a person or the trainer must decide."""

    reason = Reason.DATA_CORRUPT


class UnavailableError(TierpsError):
    """The call cannot run now but can soon (its table is being replaced by a snapshot
    load): nothing was changed. UNAVAILABLE: the same call may succeed later."""

    reason = Reason.TABLE_LOADING


class TableReplacedError(TierpsError):
    """A push made against a generation of a table's rows that a snapshot load has since
    replaced: nothing was applied. ABORTED: look the rows up again before pushing."""

    reason = Reason.TABLE_REPLACED


class UnauthenticatedError(TierpsError):
    """A call without a token the shard knows: nothing was done. UNAUTHENTICATED."""

    reason = Reason.UNKNOWN_TOKEN


class PermissionDeniedError(TierpsError):
    """A caller whose role may not make this call: nothing was done. PERMISSION_DENIED."""

    reason = Reason.ROLE_NOT_ALLOWED


QUOTED_CHARS = 64  # of a caller's string an error echoes: a table name has at most 64


def quoted(text: str, limit: int = QUOTED_CHARS) -> str:
    """`text` (a caller's name) as an error quotes it: repr'd whole up to `limit` characters,
    else its first `limit` and its length (`'aaaa…' (1048576 chars)`): an error echoing a
    1 MiB name whole would be over what a gRPC client accepts of a status message."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit] + '…'!r} ({len(text)} chars)"
