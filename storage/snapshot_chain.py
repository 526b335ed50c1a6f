"""Chains of snapshots: an incremental snapshot, its base, the base's base, ... down to a full
snapshot (storage/snapshot_format.py describes the fields that link them).

`open_chain` opens every link and checks that each is the very snapshot its successor was
saved on (save id and manifest checksum), so a base deleted and saved again under its name,
a missing link or a cycle is refused (SnapshotRefusedError naming the snapshot and the link).
`table_links` picks the links a table's rows come from: newest first back to the first link
that holds all of the table's rows (a full snapshot, or an incremental whose base lacked the
table). A load applies them oldest first: the oldest's rows, then each newer link's rows put
and its tombstones deleted. `ShardRows` is the same result in memory for one shard and one
table, which an incremental save compares the live table with when the table's journal
cannot say what changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierps.core.errors import FailedPreconditionError, SnapshotNotFoundError
from tierps.storage.snapshot_format import CHECKSUM, SnapshotRefusedError
from tierps.storage.snapshot_reader import Snapshot


def open_chain(root: Path, name: str) -> list[Snapshot]:
    """Snapshot `name` and every link of its chain, newest first, ending at a full snapshot.
    Each link's manifest is opened and checked (Snapshot); each base must be the snapshot its
    successor pinned (save_id and manifest_sha256). SnapshotNotFoundError if `name` itself
    is missing; SnapshotRefusedError for a missing, incomplete, altered or replaced link, or a
    cycle."""
    chain = [Snapshot(root, name)]
    while chain[-1].base:
        link = chain[-1]
        names = [s.name for s in chain]
        where = f"snapshot {name!r} (chain {' -> '.join(names)})"
        if link.base in names:
            raise SnapshotRefusedError(
                f"{where}: link {link.name!r} names base {link.base!r}, already in the chain "
                f"(a cycle); a chain expected to end at a full snapshot"
            )
        try:
            base = Snapshot(root, link.base)
        except (FailedPreconditionError, SnapshotNotFoundError) as error:  # refused, gone
            raise SnapshotRefusedError(
                f"{where}: link {link.name!r} builds on snapshot {link.base!r}, which cannot be "
                f"read: {error}"
            ) from None
        found = (base.save_id, base.manifest.get(CHECKSUM))
        expected = (link.base_save_id, link.base_manifest_sha256)
        if found != expected:
            raise SnapshotRefusedError(
                f"{where}: link {link.name!r} builds on snapshot {link.base!r} of save "
                f"{expected[0]} (manifest sha256 {expected[1]}), but {link.base!r} is now save "
                f"{found[0]} (manifest sha256 {found[1]}): the base was replaced since"
            )
        chain.append(base)
    return chain


def table_links(chain: list[Snapshot], table_name: str) -> list[Snapshot]:
    """The links of chain (newest first, as open_chain gives it) that a table's rows come
    from, oldest first: back from the newest to the first that holds all its rows. Every
    one must hold the table with the newest's config (SnapshotRefusedError otherwise)."""
    config = chain[0].configs[table_name]
    links: list[Snapshot] = []
    for link in chain:
        found = link.configs.get(table_name)
        if found != config:
            what = "no such table" if found is None else f"another config: {found.to_dict()}"
            raise SnapshotRefusedError(
                f"snapshot {chain[0].name!r}: table {table_name!r} builds on link {link.name!r}, "
                f"which has {what}; expected the config {config.to_dict()}"
            )
        links.append(link)
        if not link.builds_on_base(table_name):
            return links[::-1]
    raise SnapshotRefusedError(  # open_chain ends at a full snapshot: not reached
        f"snapshot {chain[0].name!r}: table {table_name!r} has no link holding all its rows"
    )


@dataclass
class ShardRows:
    """One table's rows of one shard as a chain resolves them, in memory, keys ascending:
    rows float32 [n, row_width], steps int64 [n] (None: the table has none)."""

    keys: np.ndarray
    rows: np.ndarray
    steps: np.ndarray | None

    @classmethod
    def of_chain(
        cls, chain: list[Snapshot], table_name: str, shard_id: int, num_shards: int
    ) -> ShardRows:
        """Read (and check, every part of every link as a load does) the table's links
        and apply them oldest first: rows put, tombstones deleted."""
        out: ShardRows | None = None
        for link in table_links(chain, table_name):
            pieces = list(link.rows_and_steps_for_shard(table_name, shard_id, num_shards))
            width = link.configs[table_name].row_width
            keys = np.concatenate([p[0] for p in pieces] or [np.empty(0, np.int64)])
            rows = np.concatenate([p[1] for p in pieces] or [np.empty((0, width), np.float32)])
            steps = None
            if pieces and pieces[0][2] is not None:
                steps = np.concatenate([p[2] for p in pieces])
            order = np.argsort(keys, kind="stable")
            put = cls(keys[order], rows[order], None if steps is None else steps[order])
            gone = link.tombstones_for_shard(table_name, shard_id, num_shards)
            out = put if out is None else out._updated(put, gone)
        assert out is not None  # table_links gives at least one link
        return out

    def _updated(self, put: ShardRows, gone: np.ndarray) -> ShardRows:
        """These rows with put's rows replacing or adding theirs and gone's keys removed."""
        kept = ~np.isin(self.keys, np.concatenate([put.keys, gone]))
        keys = np.concatenate([self.keys[kept], put.keys])
        order = np.argsort(keys, kind="stable")
        rows = np.concatenate([self.rows[kept], put.rows])[order]
        steps = None
        if self.steps is not None and put.steps is not None:
            steps = np.concatenate([self.steps[kept], put.steps])[order]
        return ShardRows(keys[order], rows, steps)


class Comparison:
    """The rows of a table's export (chunks in key order, as export_stored gives them) that
    differ from a chain's rows of the same shard: keys the chain lacks, and rows whose
    weights, optimizer state or step stamp differ in any bit; then (tombstones) the chain's
    keys the export lacks. `base` is called once, when the first chunk is asked for: a save
    reads the chain after its cut, while the shard serves again."""

    def __init__(self, base: Callable[[], ShardRows]) -> None:
        self._base = base
        self._tombstones: np.ndarray | None = None

    def changed(
        self, chunks: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray | None]]
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        base = self._base()
        seen = np.zeros(base.keys.size, dtype=bool)
        for keys, rows, steps in chunks:
            same = np.zeros(keys.size, dtype=bool)
            if base.keys.size:
                at = np.minimum(np.searchsorted(base.keys, keys), base.keys.size - 1)
                found = base.keys[at] == keys
                seen[at[found]] = True
                ours, theirs = rows[found], base.rows[at[found]]
                equal = np.all(_bits(ours) == _bits(theirs), axis=1)
                if steps is not None and base.steps is not None:
                    equal &= steps[found] == base.steps[at[found]]
                same[found] = equal
            changed = ~same
            yield keys[changed], rows[changed], None if steps is None else steps[changed]
        self._tombstones = base.keys[~seen]

    def tombstones(self) -> np.ndarray:
        """The chain's keys that the export did not hold (after `changed` is exhausted)."""
        if self._tombstones is None:
            raise RuntimeError("Comparison.tombstones asked before every chunk was compared")
        return self._tombstones


def _bits(rows: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32)
