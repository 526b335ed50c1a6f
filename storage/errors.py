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
    """A storage backend failed; the message names the backend, table and shard. UNAVAILABLE."""
