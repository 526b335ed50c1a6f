"""Chains of snapshots on their own (storage/snapshot_chain.py, the incremental parts of
storage/snapshot_writer.py and snapshot_reader.py), on real files without shards: a chain
resolves, in any shard count, to what a dict of rows with puts and deletes applied in
order says; the comparison finds exactly the rows that differ in any bit; a missing link, a
cycle and a replaced base are refused naming the snapshot and the link."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierps.storage import TableConfig, optim
from tierps.storage.snapshot_chain import Comparison, open_chain, shard_rows
from tierps.storage.snapshot_format import (
    CHECKSUM,
    DIFF_JOURNAL,
    MANIFEST,
    SnapshotRefusedError,
    manifest_checksum,
)
from tierps.storage.snapshot_writer import BaseLink, TableCut, commit, write_part

T = TableConfig("t", 2, optimizer=optim.Adagrad())
STAMPED = TableConfig("t", 2, optimizer=optim.Adagrad(), steps_to_live=100)


def rows_of(keys: np.ndarray, version: int) -> np.ndarray:
    return (keys[:, None] * 10 + version + np.arange(T.row_width) / 8).astype(np.float32)


def save(
    root: Path,
    name: str,
    shards: int,
    keys: np.ndarray,
    version: int,
    base: str = "",
    gone: np.ndarray | None = None,
    config: TableConfig = T,
    step: int = 1,
) -> None:
    """Snapshot `name` of `shards` parts: keys' rows at `version` (stamped `step` where the
    config has steps_to_live); with base, an incremental with gone's tombstones."""
    link = None
    if base:
        opened = open_chain(root, base)[0]
        link = BaseLink(base, opened.save_id, opened.manifest[CHECKSUM])
    gone = np.empty(0, np.int64) if gone is None else gone
    for shard in range(shards):
        mine, dead = keys[keys % shards == shard], gone[gone % shards == shard]
        stamps = np.full(mine.size, step, np.int64) if config.steps_to_live else None
        cut = TableCut(
            config,
            iter([(mine, rows_of(mine, version), stamps)]),
            cursor="journal:1",
            diff=DIFF_JOURNAL if base else "",
            tombstones=lambda dead=dead: dead,
        )
        list(write_part(root, name, f"{name}-id", shard, shards, [cut], mine.size, link))
    commit(root, name, f"{name}-id")


def test_a_chain_resolves_like_puts_and_deletes_applied_in_order_in_any_shard_count(
    tmp_path: Path,
) -> None:
    expected: dict[int, np.ndarray] = {}
    steps = [  # (name, shards, keys put, version, base, keys deleted)
        ("full", 2, np.arange(0, 40), 0, "", None),  # each link its own shard count
        ("inc1", 3, np.arange(30, 50), 1, "full", np.array([2, 3, 5, 7])),
        ("inc2", 2, np.array([2, 9, 60]), 2, "inc1", np.array([0, 31, 49])),
    ]
    for name, shards, keys, version, base, gone in steps:
        save(tmp_path, name, shards, keys, version, base, gone)
        for key in [] if gone is None else gone:
            expected.pop(int(key), None)
        expected.update(zip(keys.tolist(), rows_of(keys, version), strict=True))
    chain = open_chain(tmp_path, "inc2")
    assert [link.name for link in chain] == ["inc2", "inc1", "full"]
    for shards in (1, 2, 4):
        for shard in range(shards):
            for chunk_rows in (2, 3, 1000):  # the merge walk's bounds fall everywhere
                chunks = list(shard_rows(chain, "t", shard, shards, chunk_rows))
                keys = np.concatenate([c[0] for c in chunks])
                mine = sorted(key for key in expected if key % shards == shard)
                np.testing.assert_array_equal(keys, mine)
                rows = np.concatenate([c[1] for c in chunks])
                np.testing.assert_array_equal(rows, np.array([expected[k] for k in mine]))
                assert all(c[2] is None for c in chunks)  # no steps_to_live: no steps


def test_a_comparison_finds_every_row_that_differs_in_any_bit(tmp_path: Path) -> None:
    base_keys = np.array([1, 3, 5, 7, 9])
    base_rows = rows_of(base_keys, 0)
    live_keys = np.array([1, 3, 4, 7, 9])
    live = rows_of(live_keys, 0)
    live[1, 0] = np.nextafter(live[1, 0], np.float32(np.inf))  # key 3: one ulp more
    base_rows[0, 1], live[0, 1] = 0.0, -0.0  # key 1: equal as floats, not as bits
    # the chain in chunks that do not line up with the export's
    comparison = Comparison(
        lambda: iter([(base_keys[:1], base_rows[:1], None), (base_keys[1:], base_rows[1:], None)])
    )
    chunks = [(live_keys[:2], live[:2], None), (live_keys[2:], live[2:], None)]
    changed = list(comparison.changed(chunks))
    np.testing.assert_array_equal(np.concatenate([c[0] for c in changed]), [1, 3, 4])
    np.testing.assert_array_equal(np.concatenate([c[1] for c in changed]), live[:3])
    np.testing.assert_array_equal(comparison.tombstones(), [5])  # 5: only in the base


def test_a_missing_link_a_cycle_and_a_replaced_base_are_refused(tmp_path: Path) -> None:
    save(tmp_path, "full", 1, np.arange(5), 0)
    save(tmp_path, "inc", 1, np.arange(2), 1, base="full")
    assert len(open_chain(tmp_path, "inc")) == 2

    shutil.move(tmp_path / "full", tmp_path / "aside")
    with pytest.raises(SnapshotRefusedError, match="link 'inc' builds on snapshot 'full', which"):
        open_chain(tmp_path, "inc")
    shutil.move(tmp_path / "aside", tmp_path / "full")

    manifest_path = tmp_path / "inc" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    looped = {**manifest, "base": "inc"}
    looped[CHECKSUM] = manifest_checksum(looped)
    manifest_path.write_text(json.dumps(looped))
    with pytest.raises(SnapshotRefusedError, match=r"names base 'inc', already in the chain"):
        open_chain(tmp_path, "inc")
    manifest_path.write_text(json.dumps(manifest))

    shutil.rmtree(tmp_path / "full")
    save(tmp_path, "full", 1, np.arange(5), 0)  # the same rows, another save
    with pytest.raises(SnapshotRefusedError, match="the base was replaced since"):
        open_chain(tmp_path, "inc")


def test_a_step_stamp_alone_differs_after_a_link_with_no_rows(tmp_path: Path) -> None:
    """full (stamps 1) -> inc (no rows changed: its parts are empty): the chain still
    carries the stamps, so a row whose weights and state are the same but whose stamp moved
    is changed, as the journal would have it."""
    keys = np.arange(10)
    save(tmp_path, "full", 2, keys, 0, config=STAMPED, step=1)
    save(tmp_path, "inc", 2, keys[:0], 0, base="full", config=STAMPED, step=1)
    chain = open_chain(tmp_path, "inc")
    resolved = list(shard_rows(chain, "t", 0, 1))
    np.testing.assert_array_equal(np.concatenate([c[2] for c in resolved]), np.ones(10))
    stamps = np.ones(10, np.int64)
    stamps[[2, 7]] = 5  # zero gradients at step 5: only the stamps moved
    comparison = Comparison(lambda: shard_rows(chain, "t", 0, 1))
    changed = list(comparison.changed([(keys, rows_of(keys, 0), stamps)]))
    np.testing.assert_array_equal(np.concatenate([c[0] for c in changed]), [2, 7])
    np.testing.assert_array_equal(np.concatenate([c[2] for c in changed]), [5, 5])


@pytest.mark.parametrize(
    "export_keys",
    [[], [5], [0, 1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 40, 41], [50, 60]],
    ids=["empty", "one", "below", "across", "above"],
)
def test_tombstones_are_the_chain_keys_the_export_lacks_wherever_they_fall(
    tmp_path: Path, export_keys: list[int]
) -> None:
    chain_keys = np.array([3, 5, 8, 9, 20, 21, 40, 45])
    save(tmp_path, "full", 2, chain_keys, 0)
    chain = open_chain(tmp_path, "full")
    keys = np.array(export_keys, np.int64)
    chunks = [(keys[i : i + 3], rows_of(keys[i : i + 3], 0), None) for i in range(0, keys.size, 3)]
    comparison = Comparison(lambda: shard_rows(chain, "t", 0, 1, chunk_rows=2))
    changed = list(comparison.changed(chunks))
    found = np.concatenate([c[0] for c in changed] or [np.empty(0, np.int64)])
    np.testing.assert_array_equal(found, np.setdiff1d(keys, chain_keys))
    np.testing.assert_array_equal(comparison.tombstones(), np.setdiff1d(chain_keys, keys))


def test_the_comparison_holds_chunks_not_the_chain(tmp_path: Path) -> None:
    """A merge walk: the memory a comparison allocates at its peak is a few chunks, not the
    chain's rows (which an in-memory resolution holds several times over); reading a
    part's tail to its end for its checksum takes 4 MiB more at most."""
    rows = 1_000_000
    keys = np.arange(rows, dtype=np.int64)
    save(tmp_path, "full", 2, keys, 0)
    save(tmp_path, "inc", 2, keys[::50], 1, base="full", gone=keys[7::1000])
    chain = open_chain(tmp_path, "inc")
    table_bytes = rows * (T.codec.row_bytes + 8)
    chunk = 4096

    def export() -> Iterator[tuple[np.ndarray, np.ndarray, None]]:
        for start in range(0, rows, chunk):
            part = keys[start : start + chunk]
            yield part, rows_of(part, 0), None

    tracemalloc.start()
    try:
        comparison = Comparison(lambda: shard_rows(chain, "t", 0, 1, chunk_rows=chunk))
        changed = sum(c[0].size for c in comparison.changed(export()))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the rows of inc (version 1) and the keys it removed differ from the export's
    assert changed == keys[::50].size + keys[7::1000].size
    assert comparison.tombstones().size == 0
    assert peak < table_bytes / 3, (peak, table_bytes)
