"""The figures a shard reports (DescribeTable, Stats, /metrics, admin top): per table its
tiers, lifecycle counts and keys served, and this process's memory."""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from tierps.core.config import TableConfig
from tierps.storage.table import EmbeddingTable

LOOKED_UP, PUSHED = 0, 1  # the kinds of keys KeyCounts counts


class KeyedBatch(Protocol):
    """One table's keys of a data call (a LookupBatch or a PushBatch)."""

    @property
    def table(self) -> str: ...

    @property
    def keys(self) -> np.ndarray: ...


class KeyCounts:
    """Per table: [keys looked up, keys pushed] since the start."""

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        self._lock = threading.Lock()

    def count(self, batches: Sequence[KeyedBatch], kind: int) -> None:
        """Count the batches' keys per table (kind LOOKED_UP or PUSHED), once a call
        that succeeded."""
        with self._lock:
            for batch in batches:
                self._counts[batch.table][kind] += int(batch.keys.size)

    def forget(self, table: str) -> None:
        """Drop a dropped table's counts."""
        with self._lock:
            self._counts.pop(table, None)

    def of(self, table: str) -> tuple[int, int]:
        """(keys looked up, keys pushed) of a table; zeros for one not served yet."""
        looked_up, pushed = self._counts.get(table, (0, 0))
        return looked_up, pushed


def describe_table(
    table: EmbeddingTable, shard_id: int, num_shards: int, key_counts: KeyCounts
) -> dict[str, Any]:
    """A table's description on this shard, as DescribeTable tells it."""
    stats = table.stats()
    looked_up, pushed = key_counts.of(table.config.name)
    return {
        "config": table.config,
        "shard_id": shard_id,
        "num_shards": num_shards,
        "tiers": [
            {
                "name": tier,
                "rows": figures["rows"],
                "bytes": figures["bytes"],
                "hits": figures["hits"],
                "misses": figures["misses"],
                "hit_rate": _hit_rate(figures["hits"], figures["misses"]),
                "scratch_bytes": figures.get("scratch_bytes", 0),  # a tier that trains in place
            }
            for tier, figures in stats["tiers"].items()
        ],
        "initialized": stats["initialized"],
        "created": stats["created"],
        "lifecycle": _lifecycle(stats),
        "current_step": table.current_step,
        "keys_looked_up": looked_up,
        "keys_pushed": pushed,
        "generation": table.generation.id,
        "generation_snapshot": table.generation.snapshot or "",
    }


def skipped_table(config: TableConfig, shard_id: int, num_shards: int) -> dict[str, Any]:
    """A table a replica does not follow (server/replica.py: adaptive, or placed whole on a
    shard its cluster lacks), as Stats tells it: the training table's config, no rows,
    lifecycle "replica.skipped" = 1."""
    return {
        "config": config,
        "shard_id": shard_id,
        "num_shards": num_shards,
        "tiers": [],
        "initialized": 0,
        "created": 0,
        "lifecycle": {"replica.skipped": 1.0},
        "current_step": 0,
        "keys_looked_up": 0,
        "keys_pushed": 0,
        "generation": 0,
        "generation_snapshot": "",
    }


def proc_status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (0 where there is none)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _hit_rate(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else 0.0


def _lifecycle(stats: dict[str, Any]) -> dict[str, float]:
    """A table's feature-lifecycle figures as TableDescription.lifecycle names them
    ("admission.keys_counted", "eviction.removed_total", "adaptive.keys_promoted", ...);
    empty when no such feature is on."""
    return {
        f"{feature}.{name}": float(value)
        for feature in ("admission", "eviction", "adaptive")
        for name, value in (stats.get(feature) or {}).items()
    }
