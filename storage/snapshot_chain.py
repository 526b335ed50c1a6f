"""Chains of snapshots: an incremental snapshot, its base, the base's base, ... down to a full
snapshot (storage/snapshot_format.py describes the fields that link them).

`open_chain` opens every link and checks that each is the very snapshot its successor was
saved on (save id and manifest checksum), so a base deleted and saved again under its name,
a missing link or a cycle is refused (SnapshotRefusedError naming the snapshot and the link).
`table_links` picks the links a table's rows come from: newest first back to the first link
that holds all of the table's rows (a full snapshot, or an incremental whose base lacked the
table). A load applies them oldest first: the oldest's rows, then each newer link's rows put
and its tombstones deleted. `shard_rows` is the same result for one shard and one table, as
a stream in key order, which an incremental save compares the live table with (`Comparison`,
a merge walk) when the table's journal cannot say what changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

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


Chunk = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # keys ascending, rows, steps
LAST_KEY = np.iinfo(np.int64).max
# rows read at a time from each part of each link: a chain of L links of P parts buffers
# L * P chunks (2 links of 2 parts, dim 16 Adagrad: about 40 MiB at the peak, whatever the
# table's size)
CHAIN_CHUNK_ROWS = 16384


def shard_rows(
    chain: list[Snapshot],
    table_name: str,
    shard_id: int,
    num_shards: int,
    chunk_rows: int = CHAIN_CHUNK_ROWS,
) -> Iterator[Chunk]:
    """One table's rows of one shard as the chain resolves them: (keys, rows float32 [c,
    row_width], steps int64 [c] or None without steps_to_live) chunks, keys ascending
    across chunks, each key's row from the newest link that holds it, none where a newer
    link's tombstone removed it. A merge walk over every part of every link the table needs
    (table_links), each read in chunks and checked as a load checks it (its SHA-256 once
    read to the end, then each link's check_disjoint): memory stays bounded by the parts'
    count times chunk_rows, whatever the table's size. Steps a part lacks (format 2) are
    0, as a load stores them."""
    links = table_links(chain, table_name)
    config = chain[0].configs[table_name]
    sources: list[_Source] = []
    for rank, link in enumerate(links):  # oldest first: a higher rank is newer
        for part in link.tables[table_name]["parts"]:
            chunks = link.part_rows_for_shard(table_name, part, shard_id, num_shards, chunk_rows)
            sources.append(_Source(rank, ((k, r, s) for k, r, s, _ in chunks)))
        gone = link.tombstones_for_shard(table_name, shard_id, num_shards)
        sources.append(_Source(rank, iter([(gone, None, None)])))
    with_steps = bool(config.steps_to_live)
    while True:
        live = [source for source in sources if source.fill()]
        if not live:
            break
        bound = min(int(source.keys[-1]) for source in live)  # every key <= it is buffered
        pieces = [source.take_through(bound) for source in live]
        yield _newest(pieces, config.row_width, with_steps)
    for link in links:  # every part read whole: a key in two parts of a link is refused
        link.check_disjoint(table_name)


class _Source:
    """One part's (or one link's tombstones') chunks for a merge walk, with what is buffered
    of them: rows None for tombstones."""

    def __init__(self, rank: int, chunks: Iterator[tuple[Any, ...]]) -> None:
        self.rank = rank
        self._chunks = chunks
        self.keys = np.empty(0, np.int64)
        self.rows: np.ndarray | None = None
        self.steps: np.ndarray | None = None

    def fill(self) -> bool:
        """Buffer the next non-empty chunk if none is buffered; False once all are read."""
        while not self.keys.size:
            chunk = next(self._chunks, None)
            if chunk is None:
                return False
            self.keys, self.rows, self.steps = chunk
        return True

    def take_through(self, bound: int) -> tuple[int, np.ndarray, Any, Any]:
        """(rank, keys, rows, steps) of the buffered keys <= bound, removed from the buffer."""
        end = int(np.searchsorted(self.keys, bound, side="right"))
        taken = (
            self.rank,
            self.keys[:end],
            None if self.rows is None else self.rows[:end],
            None if self.steps is None else self.steps[:end],
        )
        self.keys = self.keys[end:]
        self.rows = None if self.rows is None else self.rows[end:]
        self.steps = None if self.steps is None else self.steps[end:]
        return taken


def _newest(pieces: list[tuple[int, np.ndarray, Any, Any]], width: int, with_steps: bool) -> Chunk:
    """The pieces' keys (each piece ascending) in order, each with the row of its newest
    piece (highest rank), dropped where that newest is a tombstone (rows None)."""
    keys = np.concatenate([piece[1] for piece in pieces])
    ranks = np.concatenate([np.full(piece[1].size, piece[0]) for piece in pieces])
    held: list[Chunk] = []  # the pieces with rows, in order
    at = []  # each key's index into held's concatenation; -1: a tombstone
    for _, piece_keys, rows, steps in pieces:
        if rows is None:
            at.append(np.full(piece_keys.size, -1))
            continue
        start = sum(piece[0].size for piece in held)
        at.append(np.arange(start, start + piece_keys.size))
        if with_steps and steps is None:  # a format 2 part: a load stamps step 0
            steps = np.zeros(piece_keys.size, np.int64)
        held.append((piece_keys, rows, steps))
    order = np.lexsort((-ranks, keys))  # by key, then newest first
    first = np.ones(order.size, dtype=bool)
    first[1:] = keys[order][1:] != keys[order][:-1]
    winners = np.concatenate(at)[order[first]]
    winners = winners[winners >= 0]  # where the newest is a tombstone, the key is gone
    if not held:
        empty_steps = np.empty(0, np.int64) if with_steps else None
        return keys[:0], np.empty((0, width), np.float32), empty_steps
    held_keys = np.concatenate([piece[0] for piece in held])
    rows = np.concatenate([piece[1] for piece in held])
    steps = np.concatenate([piece[2] for piece in held]) if with_steps else None
    return held_keys[winners], rows[winners], None if steps is None else steps[winners]


class Comparison:
    """The rows of a table's export (chunks in key order, as export_stored gives them) that
    differ from a chain's rows of the same shard (shard_rows' chunks, in key order): keys the
    chain lacks, and rows whose weights, optimizer state or step stamp differ in any bit;
    then (tombstones) the chain's keys the export lacks. A merge walk: one export chunk and
    one chain chunk in memory at a time, and the tombstones. `base` is called once, when the
    first chunk is asked for: a save reads the chain after its cut, while the shard serves
    again."""

    def __init__(self, base: Callable[[], Iterable[Chunk]]) -> None:
        self._base = base
        self._tombstones: np.ndarray | None = None

    def changed(self, chunks: Iterable[Chunk]) -> Iterator[Chunk]:
        chain = _Source(0, iter(self._base()))
        gone: list[np.ndarray] = []
        exported = iter(chunks)
        chunk = next(exported, None)
        while chunk is not None:
            keys, rows, steps = chunk
            following = next(exported, None)  # the last chunk takes every chain key left
            bound = LAST_KEY if following is None else int(keys[-1]) if keys.size else None
            same = np.zeros(keys.size, dtype=bool)
            while bound is not None and chain.fill() and int(chain.keys[0]) <= bound:
                _, base_keys, base_rows, base_steps = chain.take_through(bound)
                at = np.minimum(np.searchsorted(keys, base_keys), max(keys.size - 1, 0))
                found = keys[at] == base_keys if keys.size else np.zeros(0, dtype=bool)
                gone.append(base_keys[~found])
                mine = at[found]
                equal = np.all(_bits(rows[mine]) == _bits(base_rows[found]), axis=1)
                if steps is not None and base_steps is not None:
                    equal &= steps[mine] == base_steps[found]
                same[mine] = equal
            changed = ~same
            yield keys[changed], rows[changed], None if steps is None else steps[changed]
            chunk = following
        while chain.fill():  # no export chunk at all: every chain key is gone
            gone.append(chain.take_through(LAST_KEY)[1])
        self._tombstones = np.concatenate(gone) if gone else np.empty(0, np.int64)

    def tombstones(self) -> np.ndarray:
        """The chain's keys that the export did not hold (after `changed` is exhausted)."""
        if self._tombstones is None:
            raise RuntimeError("Comparison.tombstones asked before every chunk was compared")
        return self._tombstones


def _bits(rows: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32)
