"""tierps.client: what a trainer imports. The EmbeddingClient lands with the client issue;
the table configuration is re-exported from storage, which owns it."""

from tierps.storage import Eviction, TableConfig, WritePolicy, init, optim

__all__ = ["Eviction", "TableConfig", "WritePolicy", "init", "optim"]
