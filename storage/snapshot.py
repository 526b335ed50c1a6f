"""The snapshot format: the part each shard writes, and the manifest that completes them.

    <snapshot-dir>/<name>/
      <save-id>/part-00000-of-00002/<table>.keys  int64 little-endian keys, strictly ascending
      <save-id>/part-00000-of-00002/<table>.rows  float32 little-endian [n, row_width] rows:
                                                  weights and optimizer state side by side
      <save-id>/part-00000-of-00002.json          the part's header: for each table its config,
                                                  layout (dim, optimizer, row_width, dtypes),
                                                  rows, and each file's size and SHA-256
      MANIFEST.json                               written last and exclusively; a snapshot
                                                  without it is incomplete, never loaded

Format version 2. The manifest lists every part's files and header with their sizes and
SHA-256, and carries a SHA-256 of itself (`manifest_sha256`: of its canonical JSON - sorted
keys, no spaces - without that field), so an edited manifest is refused, and an edit that
recomputes that checksum still disagrees with the part headers the shards wrote.

A load into a cluster of M shards makes shard i read the keys with key % M == i from every
part, so a snapshot loads into any shard count; a table placed whole (placement="table") goes
whole to its owner among the M, owner_shard(config, M), and the other shards take none of it.

Before a load changes anything, every shard checks the whole snapshot, not only its own keys
(so every shard refuses the same snapshot): the manifest's checksum and its configs against
the part headers; every file path is the one the format names, inside the snapshot's own
directory (no '..', not absolute, no symlink out); every file's size and SHA-256; keys
strictly ascending (so distinct in a part), >= 0, each on the part's shard (key % N, so
distinct across parts; a table placed whole: no key in two parts), below capacity for a
direct table; every weight and optimizer value finite. A refusal is SnapshotRefusedError
(FAILED_PRECONDITION: the request is fine, the stored snapshot is not in a state that can be
loaded; the client does not retry it), naming the snapshot, table, part and file, with what
was expected and what was found.

Each save writes under its own save id, so two saves under one name (two clusters sharing a
snapshot directory) never touch each other's files, and only one of them can commit the
manifest. A save refuses (FailedPreconditionError) to write a row with a non-finite value or
keys out of order, rather than write a snapshot no load would accept.
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
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from tierps.storage.config import Placement, TableConfig, owner_shard
from tierps.storage.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError

FORMAT_VERSION = 2
MANIFEST = "MANIFEST.json"
CHECKSUM = "manifest_sha256"  # the manifest's field holding the SHA-256 of the rest of it
KEY_DTYPE = "<i8"
ROW_DTYPE = "<f4"
READ_CHUNK_ROWS = 65536
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_SAVE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
Chunk = tuple[np.ndarray, np.ndarray]


class SnapshotRefusedError(FailedPreconditionError):
    """A snapshot that cannot be loaded as it is: altered, corrupted or inconsistent with
    itself. FAILED_PRECONDITION (the caller's request is well formed; the stored snapshot
    is not loadable, and retrying does not help)."""


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


def layout(config: TableConfig) -> dict[str, Any]:
    """What a table's files hold, recorded in each part header and checked against the
    manifest's config at load: a config edited to another dim or optimizer of the same
    row width is refused."""
    return {
        "dim": config.dim,
        "optimizer": config.optimizer.kind,
        "row_width": config.row_width,
        "key_dtype": KEY_DTYPE,
        "row_dtype": ROW_DTYPE,
    }


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """SHA-256 (hex) of the manifest's canonical JSON without its CHECKSUM field."""
    body = {key: value for key, value in manifest.items() if key != CHECKSUM}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


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


def _check_chunk(where: str, keys: np.ndarray, rows: np.ndarray, previous: int) -> None:
    """Refuse (FailedPreconditionError) to save keys not strictly ascending after `previous`
    or a row holding a non-finite value: a load would refuse the snapshot."""
    if keys.size and (keys[0] <= previous or bool(np.any(keys[1:] <= keys[:-1]))):
        at = 0 if keys[0] <= previous else int(np.argmax(keys[1:] <= keys[:-1])) + 1
        raise FailedPreconditionError(
            f"{where}: keys expected strictly ascending (distinct), got key {int(keys[at])} "
            f"after key {previous if at == 0 else int(keys[at - 1])}; nothing was committed"
        )
    finite = np.isfinite(rows)
    if not finite.all():
        row, column = np.argwhere(~finite)[0]
        raise FailedPreconditionError(
            f"{where}: every weight and optimizer value expected finite, got "
            f"{rows[row, column]} in the row of key {int(keys[row])} at column {int(column)}; "
            f"the snapshot is not written (a load would refuse it)"
        )


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
    progress after every chunk; the last Progress has done=True. A non-finite value or keys
    out of order are refused (FailedPreconditionError) and the part is removed."""
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
    try:
        for config, chunks in exports:
            where = f"snapshot {name!r}: table {config.name!r} on shard {shard_id}"
            rows_in_table = 0
            paths = {kind: part_dir / f"{config.name}.{kind}" for kind in ("keys", "rows")}
            digests = {kind: hashlib.sha256() for kind in paths}
            previous = -1
            with open(paths["keys"], "wb") as keys_out, open(paths["rows"], "wb") as rows_out:
                for keys, rows in chunks:
                    _check_chunk(where, keys, rows, previous)
                    if keys.size:
                        previous = int(keys[-1])
                    for kind, out, array in (
                        ("keys", keys_out, keys.astype(KEY_DTYPE, copy=False)),
                        ("rows", rows_out, rows.astype(ROW_DTYPE, copy=False)),
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
            entry: dict[str, Any] = {
                "config": config.to_dict(),
                "layout": layout(config),
                "rows": rows_in_table,
            }
            for kind, path in paths.items():
                entry[f"{kind}_file"] = {
                    "path": f"{save_id}/{part}/{path.name}",
                    "bytes": path.stat().st_size,
                    "sha256": digests[kind].hexdigest(),
                }
            tables[config.name] = entry
    except BaseException:
        shutil.rmtree(part_dir, ignore_errors=True)  # never leave half a part behind
        raise
    header = {
        "format_version": FORMAT_VERSION,
        "save_id": save_id,
        "shard_id": shard_id,
        "num_shards": num_shards,
        "tables": tables,
    }
    _write_json_atomic(staging / f"{part}.json", header)
    yield Progress(done, done, str(part_dir), done=True)


def _file_entry(path: Path, relative: str) -> dict[str, Any]:
    data = path.read_bytes()
    return {"path": relative, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def commit(root: Path, name: str, save_id: str) -> dict[str, Any]:
    """Check that every part of save `save_id` is there and agrees, then write the manifest
    (exclusively: an existing snapshot is never replaced). Returns the manifest."""
    snapshot = snapshot_path(root, name)
    if not snapshot.is_dir():
        raise NotFoundError(f"snapshot {name!r} not found in {root}")
    if (snapshot / MANIFEST).exists():
        raise FailedPreconditionError(f"snapshot {name!r} already exists in {root}")
    parts: dict[int, dict[str, Any]] = {}
    headers: dict[int, dict[str, Any]] = {}
    num_shards = None
    for path in sorted((snapshot / check_save_id(save_id)).glob("part-*-of-*.json")):
        summary = _read_json(path, f"snapshot {name!r}: part header {path.name}")
        if summary.get("save_id") != save_id:
            raise FailedPreconditionError(
                f"snapshot {name!r}: part header {path} names save {summary.get('save_id')!r}"
            )
        if num_shards is None:
            num_shards = summary["num_shards"]
        elif summary["num_shards"] != num_shards:
            raise FailedPreconditionError(
                f"snapshot {name!r}: parts of save {save_id} disagree on num_shards: "
                f"{num_shards} and {summary['num_shards']} ({path.name})"
            )
        parts[summary["shard_id"]] = summary
        headers[summary["shard_id"]] = _file_entry(path, f"{save_id}/{path.name}")
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
                table_name,
                {"config": entry["config"], "layout": entry["layout"], "rows": 0, "parts": []},
            )
            if table["config"] != entry["config"] or table["layout"] != entry["layout"]:
                raise FailedPreconditionError(
                    f"snapshot {name!r}: table {table_name!r} has another config on shard "
                    f"{shard_id}: {entry['config']} vs {table['config']}"
                )
            table["rows"] += entry["rows"]
            table["parts"].append(
                {
                    "shard_id": shard_id,
                    "rows": entry["rows"],
                    "header_file": headers[shard_id],
                    **{key: value for key, value in entry.items() if key.endswith("_file")},
                }
            )
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "save_id": save_id,
        "num_shards": num_shards,
        "created_unix": time.time(),
        "tables": tables,
    }
    manifest[CHECKSUM] = manifest_checksum(manifest)
    try:
        _write_json_atomic(snapshot / MANIFEST, manifest, exclusive=True)
    except FileExistsError:
        raise FailedPreconditionError(f"snapshot {name!r} already exists in {root}") from None
    return manifest


def _read_json(path: Path, what: str, error: type[Exception] = FailedPreconditionError) -> Any:
    try:
        with open(path) as source:
            data = json.load(source)
    except (OSError, ValueError) as problem:
        raise error(f"{what} is unreadable or corrupted: {problem}") from None
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        version = data.get("format_version") if isinstance(data, dict) else None
        raise error(f"{what}: format_version expected {FORMAT_VERSION}, got {version!r}")
    return data


class Snapshot:
    """A complete snapshot, opened for loading. Opening checks the manifest: its structure,
    sizes, file paths and its own checksum. `check_files` checks that every file is where
    the manifest says with its size, `check_headers` the part headers against the manifest,
    and `read_part` (so `rows_for_shard` and `verify`) each file's content and SHA-256."""

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
        where = f"snapshot {name!r}: {MANIFEST}"
        self.manifest = _read_json(self.path / MANIFEST, where, SnapshotRefusedError)
        try:
            self.num_shards = int(self.manifest["num_shards"])
            self.save_id = check_save_id(self.manifest["save_id"])
            self.configs = {
                table_name: TableConfig.from_dict(entry["config"])
                for table_name, entry in self.manifest["tables"].items()
            }
            for table_name, entry in self.tables.items():
                self._check_sizes(table_name, entry)
                self._check_parts(table_name, entry)
        except (KeyError, TypeError, ValueError) as error:
            raise SnapshotRefusedError(f"{where} is corrupted: {error!r}") from None
        found = manifest_checksum(self.manifest)
        expected = self.manifest.get(CHECKSUM)
        if found != expected:
            raise SnapshotRefusedError(
                f"{where} was altered after it was written: its {CHECKSUM} is {expected!r}, "
                f"but its content hashes to {found!r}"
            )

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
                    raise SnapshotRefusedError(
                        f"snapshot {self.name!r}: {MANIFEST} is corrupted: table {table_name!r} "
                        f"lists {rows} rows of {width} floats in {file['path']}, which needs "
                        f"{expected} bytes, but the manifest gives {file['bytes']}"
                    )
        if sum(int(part["rows"]) for part in entry["parts"]) != int(entry["rows"]):
            raise SnapshotRefusedError(
                f"snapshot {self.name!r}: {MANIFEST} is corrupted: table {table_name!r} has "
                f"{entry['rows']} rows in all but its parts sum to another count"
            )

    def _part_where(self, table_name: str, part: dict[str, Any]) -> str:
        shard = part["shard_id"]
        return (
            f"snapshot {self.name!r}: table {table_name!r}, part "
            f"{part_name(shard, self.num_shards)} (shard {shard} of {self.num_shards})"
        )

    def _check_parts(self, table_name: str, entry: dict[str, Any]) -> None:
        """One part per source shard, and every file path exactly the one the format names
        for it: relative, inside the snapshot, no '..' (a manifest cannot point a load at
        another file)."""
        shards = sorted(int(part["shard_id"]) for part in entry["parts"])
        if shards != list(range(self.num_shards)):
            raise SnapshotRefusedError(
                f"snapshot {self.name!r}: {MANIFEST} is corrupted: table {table_name!r} "
                f"expected one part per shard 0..{self.num_shards - 1}, got shards {shards}"
            )
        for part in entry["parts"]:
            name = part_name(part["shard_id"], self.num_shards)
            for kind, file in self._part_files(part):
                expected = (
                    f"{self.save_id}/{name}.json" if kind == "header"
                    else f"{self.save_id}/{name}/{table_name}.{kind}"
                )  # fmt: skip
                path = file["path"]
                pure = PurePosixPath(path) if isinstance(path, str) else None
                if pure is None or pure.is_absolute() or ".." in pure.parts or "\\" in path:
                    raise SnapshotRefusedError(
                        f"{self._part_where(table_name, part)}: {kind} file path expected "
                        f"inside the snapshot directory ({expected!r}), got {path!r}: it "
                        f"leaves the snapshot directory"
                    )
                if path != expected:
                    raise SnapshotRefusedError(
                        f"{self._part_where(table_name, part)}: {kind} file path expected "
                        f"{expected!r}, got {path!r}"
                    )

    @staticmethod
    def _part_files(part: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        return [
            (key.removesuffix("_file"), file) for key, file in part.items() if key.endswith("_file")
        ]

    @property
    def tables(self) -> dict[str, Any]:
        return self.manifest["tables"]

    @property
    def rows_total(self) -> int:
        return sum(int(entry["rows"]) for entry in self.tables.values())

    def files(self) -> Iterator[dict[str, Any]]:
        for entry in self.tables.values():
            for part in entry["parts"]:
                for _, file in self._part_files(part):
                    yield file

    def _resolve(self, where: str, kind: str, file: dict[str, Any]) -> Path:
        """The file's real path, refused (SnapshotRefusedError) where it is missing, not a
        regular file, resolves outside the snapshot directory (a symlink out) or has another
        size than the manifest says."""
        path = self.path / file["path"]
        label = f"{where}: {kind} file {file['path']}"
        try:
            real = path.resolve(strict=True)
            size = real.stat().st_size
        except (OSError, RuntimeError) as error:
            raise SnapshotRefusedError(f"{label} is missing or unreadable: {error}") from None
        inside = self.path.resolve()
        if not real.is_relative_to(inside):
            raise SnapshotRefusedError(
                f"{label} expected inside the snapshot directory {inside}, got a link to {real}"
            )
        if not real.is_file():
            raise SnapshotRefusedError(f"{label} expected a regular file, got {real}")
        if size != file["bytes"]:
            raise SnapshotRefusedError(
                f"{label} is corrupted: expected {file['bytes']} bytes, got {size}"
            )
        return real

    def check_files(self) -> None:
        """Every file the manifest names is a regular file inside the snapshot directory
        with the size the manifest gives (SnapshotRefusedError naming it otherwise)."""
        for table_name, entry in self.tables.items():
            for part in entry["parts"]:
                for kind, file in self._part_files(part):
                    self._resolve(self._part_where(table_name, part), kind, file)

    def check_headers(self) -> None:
        """Each part header (written by the shard that saved the part, its SHA-256 in the
        manifest) agrees with the manifest: the table's config and layout, its row count
        and its files. A manifest edited to another config, even one with its checksum
        recomputed, is refused here."""
        headers: dict[str, dict[str, Any]] = {}
        for table_name, entry in self.tables.items():
            config = self.configs[table_name]
            for part in entry["parts"]:
                where = self._part_where(table_name, part)
                file = part["header_file"]
                if file["path"] not in headers:
                    path = self._resolve(where, "header", file)
                    data = path.read_bytes()
                    digest = hashlib.sha256(data).hexdigest()
                    if digest != file["sha256"]:
                        raise SnapshotRefusedError(
                            f"{where}: header file {file['path']} is corrupted: expected "
                            f"sha256 {file['sha256']}, got {digest}"
                        )
                    try:
                        header = json.loads(data)
                    except ValueError as error:
                        raise SnapshotRefusedError(
                            f"{where}: header file {file['path']} is corrupted: {error}"
                        ) from None
                    headers[file["path"]] = header
                header = headers[file["path"]]
                written = header.get("tables", {}).get(table_name)
                if written is None:
                    raise SnapshotRefusedError(
                        f"{where}: the part header {file['path']} has no table {table_name!r}"
                    )
                checks = [
                    ("shard_id", header.get("shard_id"), part["shard_id"]),
                    ("num_shards", header.get("num_shards"), self.num_shards),
                    ("config", written.get("config"), entry["config"]),
                    ("layout", written.get("layout"), layout(config)),
                    ("layout", written.get("layout"), entry.get("layout")),
                    ("rows", written.get("rows"), part["rows"]),
                ]
                for kind, manifest_file in self._part_files(part):
                    if kind != "header":
                        checks.append((f"{kind}_file", written.get(f"{kind}_file"), manifest_file))
                for field, in_header, in_manifest in checks:
                    if in_header != in_manifest:
                        raise SnapshotRefusedError(
                            f"{where}: the manifest's {field} disagrees with the part header "
                            f"the shard wrote ({file['path']}): manifest {in_manifest!r}, "
                            f"header {in_header!r}"
                        )

    def read_part(
        self, table_name: str, part: dict[str, Any], chunk_rows: int = READ_CHUNK_ROWS
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every (keys, rows) chunk of one part, each checked as it is read (keys strictly
        ascending, >= 0, on the part's shard for a row-placed table, below a direct table's
        capacity; every value finite) and every file's SHA-256 compared after its last
        byte: SnapshotRefusedError naming the part, file, key and what was expected
        otherwise. A caller must not make anything it did with the chunks live before the
        generator ends."""
        config = self.configs[table_name]
        where = self._part_where(table_name, part)
        shard, rows_total, width = int(part["shard_id"]), int(part["rows"]), config.row_width
        files = {kind: part[f"{kind}_file"] for kind in ("keys", "rows")}
        paths = {kind: self._resolve(where, kind, file) for kind, file in files.items()}
        digests = {kind: hashlib.sha256() for kind in files}
        previous = -1
        problem: SnapshotRefusedError | None = None
        with open(paths["keys"], "rb") as keys_in, open(paths["rows"], "rb") as rows_in:
            try:
                for start in range(0, rows_total, chunk_rows):
                    n = min(chunk_rows, rows_total - start)
                    raw = {"keys": keys_in.read(8 * n), "rows": rows_in.read(4 * width * n)}
                    for kind, data in raw.items():
                        digests[kind].update(data)
                        if len(data) != (8 if kind == "keys" else 4 * width) * n:
                            raise SnapshotRefusedError(
                                f"{where}: {kind} file {files[kind]['path']} is corrupted: it "
                                f"ended early (changed while it was read)"
                            )
                    keys = np.frombuffer(raw["keys"], dtype=KEY_DTYPE).astype(np.int64)
                    rows = np.frombuffer(raw["rows"], dtype=ROW_DTYPE).reshape(n, width)
                    self._check_keys(where, files["keys"]["path"], config, shard, keys, previous)
                    previous = int(keys[-1])
                    self._check_rows(where, files["rows"]["path"], config, keys, rows)
                    yield keys, rows.astype(np.float32)
            except SnapshotRefusedError as error:
                problem = error  # a checksum mismatch, if any, is the better explanation
            for kind, source in (("keys", keys_in), ("rows", rows_in)):
                while data := source.read(1 << 22):  # to the end: bytes past the rows too
                    digests[kind].update(data)
        for kind, file in files.items():
            digest = digests[kind].hexdigest()
            if digest != file["sha256"]:
                found = f"; reading it found: {problem}" if problem is not None else ""
                raise SnapshotRefusedError(
                    f"{where}: {kind} file {file['path']} is corrupted: expected sha256 "
                    f"{file['sha256']}, got {digest}{found}"
                )
        if problem is not None:
            raise problem

    @staticmethod
    def _check_rows(
        where: str, path: str, config: TableConfig, keys: np.ndarray, rows: np.ndarray
    ) -> None:
        finite = np.isfinite(rows)
        if not finite.all():
            row, column = np.argwhere(~finite)[0]
            raise SnapshotRefusedError(
                f"{where}: rows file {path}: every weight and optimizer value expected "
                f"finite, got {rows[row, column]} in the row of key {int(keys[row])} at "
                f"column {int(column)} (of row_width {config.row_width}: dim {config.dim} "
                f"with {config.optimizer.kind}'s state)"
            )

    def _check_keys(
        self,
        where: str,
        path: str,
        config: TableConfig,
        shard: int,
        keys: np.ndarray,
        previous: int,
    ) -> None:
        label = f"{where}: keys file {path}"
        order = np.concatenate(([previous], keys))
        repeat = np.flatnonzero(order[1:] <= order[:-1])
        if repeat.size:
            at = int(repeat[0])
            what = "duplicate" if order[at + 1] == order[at] else "out of order"
            raise SnapshotRefusedError(
                f"{label}: keys expected distinct and strictly ascending, got key "
                f"{int(order[at + 1])} after key {int(order[at])} ({what})"
                if previous >= 0 or at > 0
                else f"{label}: keys expected >= 0, got {int(order[at + 1])}"
            )
        if config.placement is not Placement.TABLE:
            wrong = np.flatnonzero(keys % self.num_shards != shard)
            if wrong.size:
                key = int(keys[wrong[0]])
                raise SnapshotRefusedError(
                    f"{label}: keys expected on shard {shard} (key % {self.num_shards} == "
                    f"{shard}), got key {key}, which belongs to part {key % self.num_shards} "
                    f"(a key in two parts, or a part of another snapshot)"
                )
        if not config.use_hashtable and int(keys[-1]) >= config.capacity:
            raise SnapshotRefusedError(
                f"{label}: keys expected below the direct table's capacity {config.capacity}, "
                f"got key {int(keys[-1])}"
            )

    def check_disjoint(self, table_name: str) -> None:
        """A table placed whole may have rows in several parts (a loader takes them from
        wherever they were written), so its parts' keys, each strictly ascending, must not
        overlap: every key of each part is searched in every later part (memory-mapped,
        chunked). Row-placed tables need no search: each part's keys are on its own shard."""
        config = self.configs[table_name]
        parts = [p for p in self.tables[table_name]["parts"] if int(p["rows"])]
        if config.placement is not Placement.TABLE or len(parts) < 2:
            return
        maps = [
            np.memmap(self.path / p["keys_file"]["path"], dtype=KEY_DTYPE, mode="r") for p in parts
        ]
        for i, part in enumerate(parts):
            for j in range(i + 1, len(parts)):
                for start in range(0, maps[i].size, READ_CHUNK_ROWS):
                    chunk = np.asarray(maps[i][start : start + READ_CHUNK_ROWS])
                    at = np.minimum(np.searchsorted(maps[j], chunk), maps[j].size - 1)
                    same = np.flatnonzero(np.asarray(maps[j][at]) == chunk)
                    if same.size:
                        raise SnapshotRefusedError(
                            f"{self._part_where(table_name, part)}: keys expected in one part "
                            f"only, got key {int(chunk[same[0]])} in parts "
                            f"{part_name(part['shard_id'], self.num_shards)} and "
                            f"{part_name(parts[j]['shard_id'], self.num_shards)} (duplicate)"
                        )
        del maps

    def verify(self) -> None:
        """The whole snapshot, checked as a load checks it before anything changes: the
        files, the part headers, and every part's content (SnapshotRefusedError naming the
        snapshot, table, part and file)."""
        self.check_files()
        self.check_headers()
        for table_name, entry in self.tables.items():
            for part in entry["parts"]:
                for _ in self.read_part(table_name, part):
                    pass
            self.check_disjoint(table_name)

    def rows_for_shard(
        self, table_name: str, shard_id: int, num_shards: int, chunk_rows: int = READ_CHUNK_ROWS
    ) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        """(keys, rows, rows scanned) chunks of the keys with key % num_shards == shard_id,
        read from every part, every part checked whole as `read_part` checks it (the parts
        of other shards' keys too, so every shard refuses the same snapshot); memory stays
        bounded by chunk_rows. A table placed whole gives every row to
        owner_shard(config, num_shards) and none to the others. InvalidArgumentError if the
        table's table_shard is not below num_shards."""
        config = self.configs[table_name]
        whole = config.placement is Placement.TABLE
        owner = owner_shard(config, num_shards) if whole else -1
        for part in self.tables[table_name]["parts"]:
            for keys, rows in self.read_part(table_name, part, chunk_rows):
                mine = (
                    slice(None) if owner == shard_id
                    else slice(0) if whole
                    else np.flatnonzero(keys % num_shards == shard_id)
                )  # fmt: skip
                yield keys[mine], rows[mine], keys.size
        self.check_disjoint(table_name)  # the parts read whole and verified: no repeats


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
