"""The checks a shard makes of a request before serving any of it: the table exists and has
the caller's dim, every key is this shard's (or the table is placed whole here), and a push
was made against the generation of rows the table holds."""

from __future__ import annotations

import numpy as np

from tierps.core.config import Placement, key_shards, owner_shard
from tierps.core.errors import Reason, TableReplacedError
from tierps.core.ownership import first_foreign_key
from tierps.storage import EmbeddingStore, InvalidArgumentError, TableConfig
from tierps.storage.table import EmbeddingTable


class RequestChecks:
    """Checks of the requests to shard `shard_id` of `num_shards`, over its store's tables;
    each refusal is an InvalidArgumentError (reason NOT_OWNER for a key or table of another
    shard; TableReplacedError for a stale generation) naming the table, the field and this
    shard (`where`)."""

    def __init__(self, store: EmbeddingStore, shard_id: int, num_shards: int, where: str) -> None:
        self.store = store
        self.shard_id = shard_id
        self.num_shards = num_shards
        self.where = where

    def table(self, name: str, dim: int) -> EmbeddingTable:
        """The table named, after checking that its dim is the caller's."""
        table = self.store.table(name)
        if dim != table.config.dim:
            raise InvalidArgumentError(
                f"table {name!r} on {self.where}: field 'dim' expected {table.config.dim} "
                f"(the table's), got {dim}",
                table=name,
                field="dim",
                expected=table.config.dim,
                got=dim,
            )
        return table

    def checked(self, name: str, dim: int, keys: np.ndarray) -> EmbeddingTable:
        """The table, after checking the caller's dim and that every key is this shard's:
        all of a call's batches are checked so before any is served. Keys in range (a
        direct-index table) are checked by the caller: the table's check_gradients and
        check_values do for pushes and assigns, a lookup checks them itself."""
        table = self.table(name, dim)
        self.check_keys(table.config, keys)
        return table

    def owner(self, config: TableConfig) -> int | None:
        """The shard holding a table placed whole, None for a row-placed one; a table_shard
        outside this cluster is refused (InvalidArgumentError naming table, field and shard)."""
        if config.placement is not Placement.TABLE:
            return None
        try:
            return owner_shard(config, self.num_shards)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{error} (refused by {self.where})") from None

    def check_keys(self, config: TableConfig, keys: np.ndarray) -> None:
        """Refuse keys >= 0 that belong to another shard, naming the first; a table placed
        whole on another shard is refused whatever the keys."""
        if self.num_shards == 1:
            return
        owner = self.owner(config)
        if owner is not None:
            if owner != self.shard_id:
                chosen = (
                    f"table_shard={config.table_shard}"
                    if config.table_shard >= 0
                    else "table_shard=-1: the shard chosen from its name"
                )
                raise InvalidArgumentError(
                    f"table {config.name!r} is placed whole on shard {owner} "
                    f"(placement='table', {chosen}), not on {self.where}; send its keys "
                    f"to shard {owner}",
                    reason=Reason.NOT_OWNER,
                    table=config.name,
                )
            return
        index = first_foreign_key(config, keys, self.num_shards, self.shard_id)
        if index >= 0:
            shard = int(key_shards(config, keys[index : index + 1], self.num_shards)[0])
            raise InvalidArgumentError(
                f"table {config.name!r}: key {int(keys[index])} at index {index} belongs to "
                f"shard {shard}, not to {self.where} (a key k lives on shard "
                f"k % {self.num_shards})",
                reason=Reason.NOT_OWNER,
                table=config.name,
            )

    def check_generation(self, table: EmbeddingTable, known: int) -> None:
        """Refuse a push made against generation `known` of a table's rows (0: not known)
        when a load has replaced them since."""
        generation = table.generation
        if known and generation is not None and known != generation.id:
            raise TableReplacedError(
                f"table {table.config.name!r} on {self.where}: this push was made against "
                f"generation {known} of its rows, but they were replaced since: the table "
                f"holds {generation.describe()}. Nothing was applied; look the rows up again "
                f"before pushing",
                table=table.config.name,
            )
