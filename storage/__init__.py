"""tierps.storage: the tiers, the cascade and the store of one shard. The table configs,
optimizers, initializers and errors are tierps.core's, re-exported here for code that
builds a store."""

from tierps.core import init, optim
from tierps.core.config import Admission, Eviction, Placement, TableConfig, WritePolicy
from tierps.core.errors import (
    BackendError,
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    SnapshotNotFoundError,
    StorageFullError,
    TableNotFoundError,
    TierpsError,
)
from tierps.storage.hash_table import HashTable
from tierps.storage.store import EmbeddingStore
from tierps.storage.table import EmbeddingTable

__all__ = [
    "Admission",
    "BackendError",
    "DataLossError",
    "EmbeddingStore",
    "EmbeddingTable",
    "Eviction",
    "FailedPreconditionError",
    "HashTable",
    "InvalidArgumentError",
    "NotFoundError",
    "Placement",
    "ResourceExhaustedError",
    "SnapshotNotFoundError",
    "StorageFullError",
    "TableConfig",
    "TableNotFoundError",
    "TierpsError",
    "WritePolicy",
    "init",
    "optim",
]
