"""The snapshot format: the part each shard writes, and the manifest that completes them.

    <snapshot-dir>/<name>/
      <save-id>/part-00000-of-00002/<table>.keys  int64 little-endian keys, ascending
      <save-id>/part-00000-of-00002/<table>.rows  float32 little-endian [n, row_width] rows:
                                                  weights and optimizer state side by side
      <save-id>/part-00000-of-00002.json          the part's summary: tables, rows, checksums
      MANIFEST.json                               written last and exclusively; a snapshot
                                                  without it is incomplete, never loaded

A load into a cluster of M shards makes shard i read the keys with key % M == i from every
part, so a snapshot loads into any shard count; a table placed whole (placement="table") goes
whole to its owner among the M, owner_shard(config, M), and the other shards take none of it.
Every file's size and SHA-256 are in the manifest and are checked before a load changes
anything. Each save writes under its own save id, so two saves under one name (two clusters
sharing a snapshot directory) never touch each other's files, and only one of them can commit
the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierps.storage.config import Placement, TableConfig, owner_shard
from tierps.storage.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_SAVE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
Chunk = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Progress:
    """How far a save or load is: rows written (save) or read (load), of rows_total;
    rows_kept: rows a load stored on this shard; rows_evicted: rows a save removed before
    its cut (evict_before_snapshot)."""

    rows_done: int
    rows_total: int
    path: str
    rows_kept: int = 0
    done: bool = False
    rows_evicted: int = 0


def check_name(name: Any) -> str:
    """A snapshot name is one directory name: no '/', no '..', not absolute."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidArgumentError(
            f"snapshot name expected to match {_NAME.pattern} without '..' (one directory "
            f"name, not a path), got {name!r}"
        )
    return name


def check_save_id(save_id: Any) -> str:
    if not isinstance(save_id, str) or not _SAVE_ID.fullmatch(save_id):
        raise InvalidArgumentError(
            f"snapshot save_id expected to match {_SAVE_ID.pattern}, got {save_id!r}"
        )
    return save_id


def part_name(shard_id: int, num_shards: int) -> str:
    return f"part-{shard_id:05d}-of-{num_shards:05d}"


def snapshot_path(root: Path, name: str) -> Path:
    return Path(root) / check_name(name)


def _write_json_atomic(path: Path, data: dict[str, Any], *, exclusive: bool = False) -> None:
    """Write to a temporary file, fsync, then rename (or, exclusive, hard-link, which fails
    if `path` exists): readers see the whole file or none."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    with open(tmp, "w") as out:
        json.dump(data, out, indent=1, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    try:
        if exclusive:
            os.link(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_new(root: Path, name: str) -> None:
    """A save of `name` may start: the name is one directory name and no complete snapshot
    of it exists (FailedPreconditionError otherwise). Run before anything the save changes."""
    if (snapshot_path(root, name) / MANIFEST).exists():
        raise FailedPreconditionError(f"snapshot {name!r} already exists in {root}")


def write_part(
    root: Path,
    name: str,
    save_id: str,
    shard_id: int,
    num_shards: int,
    exports: Iterable[tuple[TableConfig, Iterator[Chunk]]],
    rows_estimate: int,
) -> Iterator[Progress]:
    """Write one shard's part from each table's export (chunks in key order), yielding
    progress after every chunk; the last Progress has done=True."""
    snapshot = snapshot_path(root, name)
    staging = snapshot / check_save_id(save_id)
    check_new(root, name)
    part = part_name(shard_id, num_shards)
    part_dir = staging / part
    if part_dir.exists():  # this save's part, written before by a call that failed
        shutil.rmtree(part_dir)
    part_dir.mkdir(parents=True)
    tables: dict[str, Any] = {}
    done = 0
    for config, chunks in exports:
        files: dict[str, Any] = {}
        rows_in_table = 0
        paths = {kind: part_dir / f"{config.name}.{kind}" for kind in ("keys", "rows")}
        digests = {kind: hashlib.sha256() for kind in paths}
        with open(paths["keys"], "wb") as keys_out, open(paths["rows"], "wb") as rows_out:
            for keys, rows in chunks:
                for kind, out, array in (
                    ("keys", keys_out, keys.astype("<i8", copy=False)),
                    ("rows", rows_out, rows.astype("<f4", copy=False)),
                ):
                    data = memoryview(np.ascontiguousarray(array)).cast("B")
                    out.write(data)
                    digests[kind].update(data)
                rows_in_table += keys.size
                done += keys.size
                yield Progress(done, max(done, rows_estimate), str(part_dir))
            for out in (keys_out, rows_out):
                out.flush()
                os.fsync(out.fileno())
        for kind, path in paths.items():
            files[f"{kind}_file"] = {
                "path": f"{save_id}/{part}/{path.name}",
                "bytes": path.stat().st_size,
                "sha256": digests[kind].hexdigest(),
            }
        tables[config.name] = {"config": config.to_dict(), "rows": rows_in_table, **files}
    summary = {
        "format_version": FORMAT_VERSION,
        "save_id": save_id,
        "shard_id": shard_id,
        "num_shards": num_shards,
        "tables": tables,
    }
    _write_json_atomic(staging / f"{part}.json", summary)
    yield Progress(done, done, str(part_dir), done=True)


def commit(root: Path, name: str, save_id: str) -> dict[str, Any]:
    """Check that every part of save `save_id` is there and agrees, then write the manifest
    (exclusively: an existing snapshot is never replaced). Returns the manifest."""
    snapshot = snapshot_path(root, name)
    if not snapshot.is_dir():
        raise NotFoundError(f"snapshot {name!r} not found in {root}")
    if (snapshot / MANIFEST).exists():
        raise FailedPreconditionError(f"snapshot {name!r} already exists in {root}")
    parts: dict[int, dict[str, Any]] = {}
    num_shards = None
    for path in sorted((snapshot / check_save_id(save_id)).glob("part-*-of-*.json")):
        summary = _read_json(path, f"snapshot {name!r}: part summary {path.name}")
        if summary.get("save_id") != save_id:
            raise FailedPreconditionError(
                f"snapshot {name!r}: part summary {path} names save {summary.get('save_id')!r}"
            )
        if num_shards is None:
            num_shards = summary["num_shards"]
        elif summary["num_shards"] != num_shards:
            raise FailedPreconditionError(
                f"snapshot {name!r}: parts of save {save_id} disagree on num_shards: "
                f"{num_shards} and {summary['num_shards']} ({path.name})"
            )
        parts[summary["shard_id"]] = summary
    missing = sorted(set(range(num_shards or 1)) - set(parts))
    if num_shards is None or missing:
        raise FailedPreconditionError(
            f"snapshot {name!r} is incomplete: save {save_id} has no part from shards "
            f"{missing} of {num_shards or '?'}"
        )
    tables: dict[str, Any] = {}
    for shard_id in range(num_shards):
        for table_name, entry in parts[shard_id]["tables"].items():
            table = tables.setdefault(
                table_name, {"config": entry["config"], "rows": 0, "parts": []}
            )
            if table["config"] != entry["config"]:
                raise FailedPreconditionError(
                    f"snapshot {name!r}: table {table_name!r} has another config on shard "
                    f"{shard_id}: {entry['config']} vs {table['config']}"
                )
            table["rows"] += entry["rows"]
            table["parts"].append(
                {
                    "shard_id": shard_id,
                    "rows": entry["rows"],
                    "keys_file": entry["keys_file"],
                    "rows_file": entry["rows_file"],
                }
            )
    manifest = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "save_id": save_id,
        "num_shards": num_shards,
        "created_unix": time.time(),
        "tables": tables,
    }
    try:
        _write_json_atomic(snapshot / MANIFEST, manifest, exclusive=True)
    except FileExistsError:
        raise FailedPreconditionError(f"snapshot {name!r} already exists in {root}") from None
    return manifest


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        with open(path) as source:
            data = json.load(source)
    except (OSError, ValueError) as error:
        raise FailedPreconditionError(f"{what} is unreadable or corrupted: {error}") from None
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        version = data.get("format_version") if isinstance(data, dict) else None
        raise FailedPreconditionError(
            f"{what}: format_version expected {FORMAT_VERSION}, got {version!r}"
        )
    return data


class Snapshot:
    """A complete snapshot, opened for loading. Opening checks the manifest; `verify` checks
    every file's size and checksum."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = check_name(name)
        self.path = snapshot_path(root, name)
        if not self.path.is_dir():
            raise NotFoundError(f"snapshot {name!r} not found in {root}")
        if not (self.path / MANIFEST).exists():
            parts = sorted(str(p.relative_to(self.path)) for p in self.path.glob("*/part-*.json"))
            raise FailedPreconditionError(
                f"snapshot {name!r} in {root} is incomplete: no {MANIFEST} (parts written: "
                f"{parts or 'none'}); it was never committed and cannot be loaded"
            )
        self.manifest = _read_json(self.path / MANIFEST, f"snapshot {name!r}: {MANIFEST}")
        try:
            self.num_shards = int(self.manifest["num_shards"])
            self.configs = {
                table_name: TableConfig.from_dict(entry["config"])
                for table_name, entry in self.manifest["tables"].items()
            }
            for table_name, entry in self.tables.items():
                self._check_sizes(table_name, entry)
        except (KeyError, TypeError, ValueError) as error:
            raise FailedPreconditionError(
                f"snapshot {name!r}: {MANIFEST} is corrupted: {error!r}"
            ) from None

    def _check_sizes(self, table_name: str, entry: dict[str, Any]) -> None:
        """The manifest's row counts and config must agree with its file sizes, or a load
        would read past the end or misread rows."""
        width = self.configs[table_name].row_width
        for part in entry["parts"]:
            rows = int(part["rows"])
            for file, expected in (
                (part["keys_file"], 8 * rows),
                (part["rows_file"], 4 * width * rows),
            ):
                if file["bytes"] != expected:
                    raise FailedPreconditionError(
                        f"snapshot {self.name!r}: {MANIFEST} is corrupted: table {table_name!r} "
                        f"lists {rows} rows of {width} floats in {file['path']}, which needs "
                        f"{expected} bytes, but the manifest gives {file['bytes']}"
                    )
        if sum(int(part["rows"]) for part in entry["parts"]) != int(entry["rows"]):
            raise FailedPreconditionError(
                f"snapshot {self.name!r}: {MANIFEST} is corrupted: table {table_name!r} has "
                f"{entry['rows']} rows in all but its parts sum to another count"
            )

    @property
    def tables(self) -> dict[str, Any]:
        return self.manifest["tables"]

    def files(self) -> Iterator[dict[str, Any]]:
        for entry in self.tables.values():
            for part in entry["parts"]:
                yield part["keys_file"]
                yield part["rows_file"]

    def verify(self) -> None:
        """Refuse (FailedPreconditionError naming the file) a missing, truncated or altered
        file."""
        for file in self.files():
            path = self.path / file["path"]
            where = f"snapshot {self.name!r}: file {file['path']}"
            try:
                size = path.stat().st_size
                if size != file["bytes"]:
                    raise FailedPreconditionError(
                        f"{where} is corrupted: expected {file['bytes']} bytes, got {size}"
                    )
                with open(path, "rb") as source:
                    digest = hashlib.file_digest(source, "sha256").hexdigest()
            except OSError as error:
                raise FailedPreconditionError(
                    f"{where} is missing or unreadable: {error}"
                ) from None
            if digest != file["sha256"]:
                raise FailedPreconditionError(
                    f"{where} is corrupted: expected sha256 {file['sha256']}, got {digest}"
                )

    def rows_for_shard(
        self, table_name: str, shard_id: int, num_shards: int, chunk_rows: int = 65536
    ) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        """(keys, rows, rows scanned) chunks of the keys with key % num_shards == shard_id,
        read from every part; memory stays bounded by chunk_rows. A table placed whole gives
        every row to owner_shard(config, num_shards) and none to the others (they read
        nothing, but count its rows as scanned). InvalidArgumentError if the table's
        table_shard is not below num_shards."""
        config = self.configs[table_name]
        whole = config.placement is Placement.TABLE
        owner = owner_shard(config, num_shards) if whole else -1
        for part in self.tables[table_name]["parts"]:
            n = part["rows"]
            if n == 0:
                continue
            if whole and owner != shard_id:
                yield np.empty(0, np.int64), np.empty((0, config.row_width), np.float32), n
                continue
            keys = np.memmap(self.path / part["keys_file"]["path"], dtype="<i8", mode="r")
            rows = np.memmap(
                self.path / part["rows_file"]["path"],
                dtype="<f4",
                mode="r",
                shape=(n, config.row_width),
            )
            for start in range(0, n, chunk_rows):
                window = np.asarray(keys[start : start + chunk_rows])
                mine = slice(None) if whole else np.flatnonzero(window % num_shards == shard_id)
                yield (
                    window[mine].astype(np.int64),
                    np.asarray(rows[start : start + chunk_rows][mine], dtype=np.float32),
                    window.size,
                )
            del keys, rows


def list_snapshots(root: Path) -> list[dict[str, Any]]:
    """Every snapshot directory under root, complete or not, in name order."""
    out: list[dict[str, Any]] = []
    if not Path(root).is_dir():
        return out
    for path in sorted(Path(root).iterdir()):
        if not path.is_dir() or not _NAME.fullmatch(path.name) or ".." in path.name:
            continue
        info: dict[str, Any] = {
            "name": path.name,
            "complete": False,
            "num_shards": 0,
            "created_unix": 0.0,
            "table_rows": {},
        }
        if (path / MANIFEST).exists():
            try:
                manifest = _read_json(path / MANIFEST, f"snapshot {path.name!r}: {MANIFEST}")
            except FailedPreconditionError:
                pass  # listed as incomplete; a load says what is wrong
            else:
                info.update(
                    complete=True,
                    num_shards=manifest["num_shards"],
                    created_unix=manifest["created_unix"],
                    table_rows={t: e["rows"] for t, e in manifest["tables"].items()},
                )
        out.append(info)
    return out
