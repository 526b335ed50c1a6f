"""tierps.storage: table configs, the tiers, the cascade and the store of one shard."""

from tierps.storage import init, optim
from tierps.storage.config import Admission, Eviction, Placement, TableConfig, WritePolicy
from tierps.storage.errors import (
    BackendError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    TableNotFoundError,
    TierpsError,
)
from tierps.storage.hash_table import HashTable
from tierps.storage.store import EmbeddingStore
from tierps.storage.table import EmbeddingTable

__all__ = [
    "Admission",
    "BackendError",
    "EmbeddingStore",
    "EmbeddingTable",
    "Eviction",
    "FailedPreconditionError",
    "HashTable",
    "InvalidArgumentError",
    "NotFoundError",
    "Placement",
    "ResourceExhaustedError",
    "TableConfig",
    "TableNotFoundError",
    "TierpsError",
    "WritePolicy",
    "init",
    "optim",
]
