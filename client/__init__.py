"""tierps.client: what a trainer imports.

    from tierps.client import EmbeddingClient, TableConfig, optim, init

The table configuration, and Reason (what a ShardError's refusal is for), are re-exported
from tierps.core, which the client and the shards share; the PyTorch modules are in
tierps.client.torch (the `torch` extra).
"""

from tierps.client.admin import ClusterAdmin, RetryPolicy, ShardError
from tierps.client.embedding import EmbeddingClient
from tierps.client.formats import COO
from tierps.client.pooled_lookup import DevicePooledLookup, Feature, PooledLookup
from tierps.client.pooling import Combiner
from tierps.client.security import ChannelSecurity
from tierps.core import init, optim
from tierps.core.config import Admission, Eviction, Placement, TableConfig, WritePolicy
from tierps.core.errors import Reason

__all__ = [
    "Admission",
    "COO",
    "ChannelSecurity",
    "ClusterAdmin",
    "Combiner",
    "DevicePooledLookup",
    "EmbeddingClient",
    "Eviction",
    "Feature",
    "Placement",
    "PooledLookup",
    "Reason",
    "RetryPolicy",
    "ShardError",
    "TableConfig",
    "WritePolicy",
    "init",
    "optim",
]
