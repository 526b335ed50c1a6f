"""The snapshot format's checks on its own (storage/snapshot_writer.py,
storage/snapshot_reader.py): what a save refuses to write and what a load's verification
refuses, on real files, without shards."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierps.core.config import Placement
from tierps.storage import FailedPreconditionError, TableConfig, optim
from tierps.storage.snapshot_format import (
    CHECKSUM,
    FORMAT_VERSION,
    MANIFEST,
    SnapshotRefusedError,
    manifest_checksum,
    part_name,
)
from tierps.storage.snapshot_reader import Snapshot
from tierps.storage.snapshot_writer import commit, write_part

ROW = TableConfig("t", 4, optimizer=optim.Adagrad())
WHOLE = TableConfig("w", 4, optimizer=optim.SGD(), placement=Placement.TABLE, table_shard=0)
DIRECT = TableConfig("d", 2, optimizer=optim.SGD(), use_hashtable=False, capacity=100)


def rows_for(config: TableConfig, keys: np.ndarray) -> np.ndarray:
    return (keys[:, None] + np.arange(config.row_width) / 8).astype(np.float32)


def save(root: Path, config: TableConfig, parts: list[np.ndarray], name: str = "s") -> Path:
    for shard, keys in enumerate(parts):
        chunks = iter([(keys, rows_for(config, keys))])
        list(write_part(root, name, "sid", shard, len(parts), [(config, chunks)], keys.size))
    commit(root, name, "sid")
    return root / name


def reseal(snapshot: Path) -> None:
    """Recompute every file's size and SHA-256 in headers and manifest, and its checksum."""

    def entry(path: Path) -> dict[str, Any]:
        data = path.read_bytes()
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    for header_path in (snapshot / "sid").glob("part-*.json"):
        header = json.loads(header_path.read_text())
        for table in header["tables"].values():
            for key, file in table.items():
                if key.endswith("_file"):
                    file.update(entry(snapshot / file["path"]))
        header_path.write_text(json.dumps(header))
    manifest = json.loads((snapshot / MANIFEST).read_text())
    for table in manifest["tables"].values():
        for part in table["parts"]:
            for key, file in part.items():
                if key.endswith("_file"):
                    file.update(entry(snapshot / file["path"]))
    manifest[CHECKSUM] = manifest_checksum(manifest)
    (snapshot / MANIFEST).write_text(json.dumps(manifest))


def set_keys(snapshot: Path, table: str, shard: int, parts: int, keys: np.ndarray) -> None:
    path = snapshot / "sid" / part_name(shard, parts) / f"{table}.keys"
    keys.astype("<i8").tofile(path)
    reseal(snapshot)


def refused(snapshot: Path, *needles: str) -> None:
    opened = Snapshot(snapshot.parent, snapshot.name)
    with pytest.raises(SnapshotRefusedError) as raised:
        opened.verify()
    for needle in needles:
        assert needle in str(raised.value), (needle, str(raised.value))


def test_a_whole_table_key_in_two_parts_is_refused(tmp_path: Path) -> None:
    snapshot = save(tmp_path, WHOLE, [np.arange(0, 50), np.arange(60, 90)])
    Snapshot(tmp_path, "s").verify()  # rows in two parts are fine, while distinct
    set_keys(snapshot, "w", 1, 2, np.arange(49, 79))
    refused(snapshot, "'w'", "key 49 in parts part-00000-of-00002 and part-00001", "duplicate")


def test_keys_out_of_order_across_chunks_are_refused(tmp_path: Path) -> None:
    keys = np.arange(0, 400, 2)
    snapshot = save(tmp_path, ROW, [keys])
    swapped = keys.copy()
    swapped[[63, 64]] = swapped[[64, 63]]  # across the boundary of 64-row chunks
    set_keys(snapshot, "t", 0, 1, swapped)
    opened = Snapshot(tmp_path, "s")
    with pytest.raises(SnapshotRefusedError, match="key 126 after key 128 .out of order"):
        for part in opened.tables["t"]["parts"]:
            list(opened.read_part("t", part, chunk_rows=64))


def test_a_negative_key_and_a_key_beyond_a_direct_table_are_refused(tmp_path: Path) -> None:
    snapshot = save(tmp_path, ROW, [np.arange(10)], name="neg")
    set_keys(snapshot, "t", 0, 1, np.arange(-1, 9))
    refused(snapshot, "'neg'", "keys expected >= 0, got -1")
    snapshot = save(tmp_path, DIRECT, [np.arange(90, 100)], name="direct")
    set_keys(snapshot, "d", 0, 1, np.arange(91, 101))
    refused(snapshot, "'direct'", "below the direct table's capacity 100", "got key 100")


def test_a_save_refuses_non_finite_values_and_keys_out_of_order(tmp_path: Path) -> None:
    keys = np.arange(5)
    rows = rows_for(ROW, keys)
    rows[3, 6] = np.nan
    with pytest.raises(FailedPreconditionError, match=r"'t' on shard 0.*nan.*key 3 at column 6"):
        list(write_part(tmp_path, "s", "sid", 0, 1, [(ROW, iter([(keys, rows)]))], 5))
    assert not (tmp_path / "s" / "sid" / part_name(0, 1)).exists()  # no half part
    backwards = np.array([1, 0, 2])
    chunks = iter([(backwards, rows_for(ROW, backwards))])
    with pytest.raises(FailedPreconditionError, match="strictly ascending.*key 0 after key 1"):
        list(write_part(tmp_path, "s", "sid", 0, 1, [(ROW, chunks)], 3))


def test_the_manifest_records_layouts_headers_and_its_own_checksum(tmp_path: Path) -> None:
    snapshot = save(tmp_path, ROW, [np.arange(0, 20, 2), np.arange(1, 20, 2)])
    manifest = json.loads((snapshot / MANIFEST).read_text())
    assert manifest["format_version"] == FORMAT_VERSION == 4
    assert manifest[CHECKSUM] == manifest_checksum(manifest)
    layout = manifest["tables"]["t"]["layout"]
    assert layout == {
        "dim": 4,
        "optimizer": "adagrad",
        "row_width": 8,
        "key_dtype": "<i8",
        "row_dtype": "<f4",
    }
    for part in manifest["tables"]["t"]["parts"]:
        header = snapshot / part["header_file"]["path"]
        data = header.read_bytes()
        assert hashlib.sha256(data).hexdigest() == part["header_file"]["sha256"]
        assert json.loads(data)["tables"]["t"]["layout"] == layout
