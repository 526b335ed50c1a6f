"""Chains of snapshots on their own (storage/snapshot_chain.py, the incremental parts of
storage/snapshot_writer.py and snapshot_reader.py), on real files without shards: a chain
resolves, in any shard count, to what a dict of rows with puts and deletes applied in
order says; the comparison finds exactly the rows that differ in any bit; a missing link, a
cycle and a replaced base are refused naming the snapshot and the link."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tierps.storage import TableConfig, optim
from tierps.storage.snapshot_chain import Comparison, ShardRows, open_chain
from tierps.storage.snapshot_format import (
    CHECKSUM,
    DIFF_JOURNAL,
    MANIFEST,
    SnapshotRefusedError,
    manifest_checksum,
)
from tierps.storage.snapshot_writer import BaseLink, TableCut, commit, write_part

T = TableConfig("t", 2, optimizer=optim.Adagrad())


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
) -> None:
    """Snapshot `name` of `shards` parts: keys' rows at `version`; with base, an incremental
    with gone's tombstones."""
    link = None
    if base:
        opened = open_chain(root, base)[0]
        link = BaseLink(base, opened.save_id, opened.manifest[CHECKSUM])
    gone = np.empty(0, np.int64) if gone is None else gone
    for shard in range(shards):
        mine, dead = keys[keys % shards == shard], gone[gone % shards == shard]
        cut = TableCut(
            T,
            iter([(mine, rows_of(mine, version))]),
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
            got = ShardRows.of_chain(chain, "t", shard, shards)
            mine = sorted(key for key in expected if key % shards == shard)
            np.testing.assert_array_equal(got.keys, mine)
            np.testing.assert_array_equal(got.rows, np.array([expected[k] for k in mine]))


def test_a_comparison_finds_every_row_that_differs_in_any_bit(tmp_path: Path) -> None:
    base_keys = np.array([1, 3, 5, 7, 9])
    base = ShardRows(base_keys, rows_of(base_keys, 0), None)
    live_keys = np.array([1, 3, 4, 7, 9])
    live = rows_of(live_keys, 0)
    live[1, 0] = np.nextafter(live[1, 0], np.float32(np.inf))  # key 3: one ulp more
    base.rows[0, 1], live[0, 1] = 0.0, -0.0  # key 1: equal as floats, not as bits
    comparison = Comparison(lambda: base)
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
