"""Reading a snapshot for a load: opening and verifying it whole, then giving each shard
of a cluster its rows and training state (storage/snapshot_format.py describes the layout).

A load into a cluster of M shards makes shard i read the keys with key % M == i from every
part, so a snapshot loads into any shard count; a table placed whole (placement="table") goes
whole to its owner among the M, owner_shard(config, M), and the other shards take none of it.

Before a load changes anything, every shard checks the whole snapshot, not only its own keys
(so every shard refuses the same snapshot): the manifest's checksum and its configs against
the part headers; every file path is the one the format names, inside the snapshot's own
directory (no '..', not absolute, no symlink out), and exactly the files the table's config
needs; every file's size and SHA-256; keys strictly ascending (so distinct in a part), >= 0,
each on the part's shard (key % N, so distinct across parts; a table placed whole: no key in
two parts), below capacity for a direct table; every weight, optimizer and bucket value
finite; step stamps and clocks in [0, MAX_STEP]; counts below the admit/promote threshold,
on distinct keys of their part's shard. A refusal is SnapshotRefusedError
(FAILED_PRECONDITION: the request is fine, the stored snapshot is not in a state that can be
loaded; the client does not retry it), naming the snapshot, table, part and file, with what
was expected and what was found.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from tierps.core.config import (
    Admission,
    Placement,
    TableConfig,
    key_shards,
    owner_shard,
    single_shard,
)
from tierps.core.errors import FailedPreconditionError, SnapshotNotFoundError
from tierps.core.validation import MAX_STEP, first_non_finite
from tierps.storage.admission import bloom_size, counter_dtype
from tierps.storage.snapshot_format import (
    CHECKSUM,
    COUNT_DTYPE,
    DIFF_ALL,
    KEY_DTYPE,
    MANIFEST,
    ROW_DTYPE,
    STEP_DTYPE,
    SnapshotRefusedError,
    check_inside,
    check_manifest_fields,
    check_name,
    check_save_id,
    expect_field,
    is_count,
    layout,
    manifest_checksum,
    part_name,
    read_versioned_json,
    snapshot_path,
)

READ_CHUNK_ROWS = 65536


def _config(where: str, table_name: str, data: dict[str, Any]) -> TableConfig:
    """A manifest's table config, or SnapshotRefusedError naming the table and why."""
    try:
        return TableConfig.from_dict(data)
    except (KeyError, TypeError, ValueError) as error:
        raise SnapshotRefusedError(
            f"{where}: field 'tables.{table_name}.config' expected a valid config of table "
            f"{table_name!r}, got one refused: {error}"
        ) from None


class Snapshot:
    """A complete snapshot, opened for loading. Opening checks the manifest: its structure,
    sizes, file paths and its own checksum. `check_files` checks that every file is where
    the manifest says with its size, `check_headers` the part headers against the manifest,
    and `read_part` (so `rows_for_shard` and `verify`) each file's content and SHA-256."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = check_name(name)
        self.path = snapshot_path(root, name)
        if not self.path.is_dir():
            raise SnapshotNotFoundError(f"snapshot {name!r} not found in {root}", snapshot=name)
        check_inside(root, self.path / MANIFEST, f"snapshot {name!r}")
        if not (self.path / MANIFEST).exists():
            parts = sorted(str(p.relative_to(self.path)) for p in self.path.glob("*/part-*.json"))
            raise FailedPreconditionError(
                f"snapshot {name!r} in {root} is incomplete: no {MANIFEST} (parts written: "
                f"{parts or 'none'}); it was never committed and cannot be loaded"
            )
        where = f"snapshot {name!r}: {MANIFEST}"
        self.manifest = read_versioned_json(self.path / MANIFEST, where, SnapshotRefusedError)
        check_manifest_fields(self.manifest, where)
        self.version = int(self.manifest["format_version"])
        # an incremental snapshot's base, pinned by save id and manifest checksum ("": full)
        self.base: str = self.manifest.get("base", "")
        self.base_save_id: str = self.manifest.get("base_save_id", "")
        self.base_manifest_sha256: str = self.manifest.get("base_manifest_sha256", "")
        try:
            self.num_shards = int(self.manifest["num_shards"])
            self.save_id = check_save_id(self.manifest["save_id"])
            self.configs = {
                table_name: _config(where, table_name, entry["config"])
                for table_name, entry in self.manifest["tables"].items()
            }
            for table_name, entry in self.tables.items():
                self._check_parts(table_name, entry)  # the files first: sizes read them
                self._check_sizes(table_name, entry)
        except (KeyError, TypeError, ValueError) as error:
            raise SnapshotRefusedError(f"{where} is corrupted: {error!r}") from None
        try:
            found = manifest_checksum(self.manifest)
        except ValueError as error:  # NaN or infinity, which json.load reads
            raise SnapshotRefusedError(
                f"{where}: every number expected finite (JSON has no NaN or Infinity), got "
                f"one: {error}"
            ) from None
        expected = self.manifest.get(CHECKSUM)
        if found != expected:
            raise SnapshotRefusedError(
                f"{where} was altered after it was written: its {CHECKSUM} is {expected!r}, "
                f"but its content hashes to {found!r}"
            )

    def state_kinds(self, config: TableConfig) -> dict[str, int | None]:
        """The files besides keys and rows that each part of a table holds in this
        snapshot's format version, with their size in bytes (None: per row, as `steps`, or
        a multiple of one count row, as exact counts); version 2 has none."""
        if self.version < 3:
            return {}
        kinds: dict[str, int | None] = {}
        if config.steps_to_live:
            kinds["steps"] = None
        if config.promote_after:
            kinds["buckets"] = config.bucket_codec.row_bytes * config.hash_bucket_size
            kinds["promotion"] = None
        if config.admit_after:
            if config.admission is Admission.BLOOM:
                size, _ = bloom_size(config.max_elements, config.false_positive_rate)
                kinds["admission"] = size * counter_dtype(config.admit_after).itemsize
            else:
                kinds["admission"] = None
        return kinds

    def _check_sizes(self, table_name: str, entry: dict[str, Any]) -> None:
        """The manifest's row counts and config must agree with its file sizes, or a load
        would read past the end or misread rows."""
        config = self.configs[table_name]
        row_bytes = config.codec.row_bytes  # a row of a .rows file: float32 [row_width]
        for part in entry["parts"]:
            rows = int(part["rows"])
            sizes = [(part["keys_file"], 8 * rows), (part["rows_file"], row_bytes * rows)]
            for kind, size in self.state_kinds(config).items():
                file = part[f"{kind}_file"]
                if kind == "steps":
                    sizes.append((file, 8 * rows))
                elif size is None:  # exact counts: whole [n, 3] int64 rows
                    sizes.append((file, file["bytes"] - file["bytes"] % 24))
                else:
                    sizes.append((file, size))
            if self.base:
                sizes.append((part["tombstones_file"], 8 * int(part["tombstones"])))
            for file, expected in sizes:
                if file["bytes"] != expected:
                    raise SnapshotRefusedError(
                        f"snapshot {self.name!r}: {MANIFEST} is corrupted: table {table_name!r} "
                        f"(dim {config.dim}, {config.optimizer.kind}: rows of "
                        f"{config.row_width} floats, {rows} rows in this part) needs "
                        f"{expected} bytes in {file['path']}, "
                        f"but the manifest gives {file['bytes']}"
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
        config = self.configs[table_name]
        tombstones = ["tombstones"] if self.base else []
        kinds = sorted(["header", "keys", "rows", *self.state_kinds(config), *tombstones])
        for part in entry["parts"]:
            name = part_name(part["shard_id"], self.num_shards)
            found = sorted(kind for kind, _ in self._part_files(part))
            if found != kinds:
                raise SnapshotRefusedError(
                    f"{self._part_where(table_name, part)}: files expected {kinds} (format "
                    f"version {self.version}, {config.name!r}'s config), got {found}"
                )
            if self.version >= 3 and not isinstance(part.get("state"), dict):
                raise SnapshotRefusedError(
                    f"{self._part_where(table_name, part)}: field 'state' expected (the "
                    f"table's step clock and counter clocks), got {part.get('state')!r}"
                )
            for kind, file in self._part_files(part):
                expected = (
                    f"{self.save_id}/{name}.json"
                    if kind == "header"
                    else f"{self.save_id}/{name}/{table_name}.{kind}"
                )
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
                    label = f"{where}: part header {file['path']}"
                    expect_field(
                        label, "(the header)", header, "an object", isinstance(header, dict)
                    )
                    tables = header.get("tables")
                    expect_field(
                        label,
                        "tables",
                        tables,
                        "an object (table name -> its entry)",
                        isinstance(tables, dict),
                    )
                    base = header.get("base") or {}
                    pinned = {
                        "name": self.base,
                        "save_id": self.base_save_id,
                        "manifest_sha256": self.base_manifest_sha256,
                    }
                    expected = pinned if self.base else {}
                    if base != expected:
                        raise SnapshotRefusedError(
                            f"{where}: the manifest's base disagrees with the part header the "
                            f"shard wrote ({file['path']}): manifest {expected or None}, header "
                            f"{base or None}"
                        )
                    headers[file["path"]] = header
                header = headers[file["path"]]
                written = header["tables"].get(table_name)
                if written is None:
                    raise SnapshotRefusedError(
                        f"{where}: the part header {file['path']} has no table {table_name!r}"
                    )
                expect_field(
                    f"{where}: part header {file['path']}",
                    f"tables.{table_name}",
                    written,
                    "an object",
                    isinstance(written, dict),
                )
                checks = [
                    ("shard_id", header.get("shard_id"), part["shard_id"]),
                    ("num_shards", header.get("num_shards"), self.num_shards),
                    ("config", written.get("config"), entry["config"]),
                    ("layout", written.get("layout"), layout(config)),
                    ("layout", written.get("layout"), entry.get("layout")),
                    ("rows", written.get("rows"), part["rows"]),
                    ("state", written.get("state"), part.get("state")),
                    ("cursor", written.get("cursor"), part.get("cursor")),
                    ("diff", written.get("diff"), part.get("diff")),
                    ("tombstones", written.get("tombstones"), part.get("tombstones")),
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
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """Every (keys, rows, steps) chunk of one part - steps: each row's last-update step
        (int64), None where the part has none (no steps_to_live, or format version 2) -
        each checked as it is read (keys strictly ascending, >= 0, on the part's shard for a
        row-placed table, below a direct table's capacity; every value finite; steps in
        [0, MAX_STEP]) and every file's SHA-256 compared after its last byte:
        SnapshotRefusedError naming the part, file, key and what was expected otherwise. A
        caller must not make anything it did with the chunks live before the generator
        ends."""
        config = self.configs[table_name]
        where = self._part_where(table_name, part)
        shard, rows_total, width = int(part["shard_id"]), int(part["rows"]), config.row_width
        kinds = ("keys", "rows", "steps") if "steps_file" in part else ("keys", "rows")
        per_row = {"keys": 8, "rows": config.codec.row_bytes, "steps": 8}
        files = {kind: part[f"{kind}_file"] for kind in kinds}
        paths = {kind: self._resolve(where, kind, file) for kind, file in files.items()}
        digests = {kind: hashlib.sha256() for kind in files}
        previous = -1
        problem: SnapshotRefusedError | None = None
        sources = {kind: open(path, "rb") for kind, path in paths.items()}  # noqa: SIM115
        try:
            try:
                for start in range(0, rows_total, chunk_rows):
                    n = min(chunk_rows, rows_total - start)
                    raw = {kind: sources[kind].read(per_row[kind] * n) for kind in kinds}
                    for kind, data in raw.items():
                        digests[kind].update(data)
                        if len(data) != per_row[kind] * n:
                            raise SnapshotRefusedError(
                                f"{where}: {kind} file {files[kind]['path']} is corrupted: it "
                                f"ended early (changed while it was read)"
                            )
                    keys = np.frombuffer(raw["keys"], dtype=KEY_DTYPE).astype(np.int64)
                    rows = np.frombuffer(raw["rows"], dtype=ROW_DTYPE).reshape(n, width)
                    self._check_keys(where, files["keys"]["path"], config, shard, keys, previous)
                    previous = int(keys[-1])
                    self._check_rows(where, files["rows"]["path"], config, keys, rows)
                    steps = None
                    if "steps" in raw:
                        steps = np.frombuffer(raw["steps"], dtype=STEP_DTYPE).astype(np.int64)
                        bad = np.flatnonzero((steps < 0) | (steps > MAX_STEP))
                        if bad.size:
                            raise SnapshotRefusedError(
                                f"{where}: steps file {files['steps']['path']}: last-update "
                                f"steps expected in [0, {MAX_STEP}], got {int(steps[bad[0]])} "
                                f"for key {int(keys[bad[0]])}"
                            )
                    yield keys, rows.astype(np.float32), steps
            except SnapshotRefusedError as error:
                problem = error  # a checksum mismatch, if any, is the better explanation
            for kind, source in sources.items():
                while data := source.read(1 << 22):  # to the end: bytes past the rows too
                    digests[kind].update(data)
        finally:
            for source in sources.values():
                source.close()
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
        bad = first_non_finite(rows)
        if bad is not None:
            row, column = bad
            raise SnapshotRefusedError(
                f"{where}: rows file {path}: every weight and optimizer value expected "
                f"finite, got {rows[row, column]} in the row of key {int(keys[row])} at "
                f"column {column} (of row_width {config.row_width}: dim {config.dim} "
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
            shards = key_shards(config, keys, self.num_shards)
            wrong = np.flatnonzero(shards != shard)
            if wrong.size:
                raise SnapshotRefusedError(
                    f"{label}: keys expected on shard {shard} (key % {self.num_shards} == "
                    f"{shard}), got key {int(keys[wrong[0]])}, which belongs to part "
                    f"{int(shards[wrong[0]])} (a key in two parts, or a part of another snapshot)"
                )
        if keys.size and not config.use_hashtable and int(keys[-1]) >= config.capacity:
            raise SnapshotRefusedError(
                f"{label}: keys expected below the direct table's capacity {config.capacity}, "
                f"got key {int(keys[-1])}"
            )

    def builds_on_base(self, table_name: str) -> bool:
        """Whether this snapshot's rows of a table are changes over its base's (an
        incremental part whose diff is not "all"); False for a full snapshot. Parts that
        disagree (some "all", some not) are refused: a save decides "all" for every shard."""
        if not self.base:
            return False
        diffs = {part["diff"] == DIFF_ALL for part in self.tables[table_name]["parts"]}
        if len(diffs) > 1:
            raise SnapshotRefusedError(
                f"snapshot {self.name!r}: table {table_name!r}: parts expected to agree on "
                f"whether they hold every row (diff 'all'), got some that do and some that "
                f"do not"
            )
        return not diffs.pop()

    def read_tombstones(self, table_name: str, part: dict[str, Any]) -> np.ndarray:
        """One incremental part's tombstones (int64, ascending): the keys removed since the
        base, read whole, the SHA-256 compared and the keys checked as a part's keys are
        (distinct, ascending, >= 0, on the part's shard). Empty for a full snapshot."""
        if not self.base:
            return np.empty(0, np.int64)
        config = self.configs[table_name]
        where = self._part_where(table_name, part)
        file = part["tombstones_file"]
        data = self._resolve(where, "tombstones", file).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != file["sha256"] or len(data) != file["bytes"]:
            raise SnapshotRefusedError(
                f"{where}: tombstones file {file['path']} is corrupted: expected sha256 "
                f"{file['sha256']} of {file['bytes']} bytes, got {digest} of {len(data)}"
            )
        keys = np.frombuffer(data, KEY_DTYPE).astype(np.int64)
        self._check_keys(where, file["path"], config, int(part["shard_id"]), keys, -1)
        return keys

    def tombstones_for_shard(self, table_name: str, shard_id: int, num_shards: int) -> np.ndarray:
        """The tombstones of shard `shard_id` of `num_shards` (key % num_shards == shard_id,
        or all of a table placed whole on its owner), from every part, every part's read
        and checked (read_tombstones)."""
        config = self.configs[table_name]
        owner = single_shard(config, num_shards)
        mine = []
        for part in self.tables[table_name]["parts"]:
            keys = self.read_tombstones(table_name, part)
            if owner is not None:
                mine.append(keys if owner == shard_id else keys[:0])
            else:
                mine.append(keys[key_shards(config, keys, num_shards) == shard_id])
        return np.sort(np.concatenate(mine)) if mine else np.empty(0, np.int64)

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

    def read_state(self, table_name: str, part: dict[str, Any]) -> dict[str, Any]:
        """One part's training state besides its rows, as EmbeddingTable.export_state gave
        it (the step clock; bucket rows and promotion counts; admission counts or Bloom
        counters), every state file read whole, its SHA-256 compared and its content
        checked: bucket rows finite; counts on distinct ascending keys of the part's shard,
        each in [1, admit_after or promote_after), its latest call in [1, the counter's call
        clock]; clocks in [0, MAX_STEP]. SnapshotRefusedError otherwise. Version 2 parts
        carry none: {}."""
        if self.version < 3:
            return {}
        config = self.configs[table_name]
        where = self._part_where(table_name, part)
        header = part["state"]
        state: dict[str, Any] = {}
        for field in ("current_step", "first_step", "admission_calls", "promotion_calls"):
            if field in header:
                value = header[field]
                if not is_count(value) or value > MAX_STEP:
                    raise SnapshotRefusedError(
                        f"{where}: state field {field!r} expected an int in [0, {MAX_STEP}], "
                        f"got {value!r}"
                    )
                state[field] = value
        for kind in self.state_kinds(config):
            if kind == "steps":
                continue  # per row: read_part reads it with the rows
            file = part[f"{kind}_file"]
            data = self._resolve(where, kind, file).read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            if digest != file["sha256"] or len(data) != file["bytes"]:
                raise SnapshotRefusedError(
                    f"{where}: {kind} file {file['path']} is corrupted: expected sha256 "
                    f"{file['sha256']} of {file['bytes']} bytes, got {digest} of {len(data)}"
                )
            label = f"{where}: {kind} file {file['path']}"
            if kind == "buckets":
                rows = np.frombuffer(data, ROW_DTYPE).reshape(-1, config.row_width)
                bad = first_non_finite(rows)
                if bad is not None:
                    row, column = bad
                    raise SnapshotRefusedError(
                        f"{label}: every bucket row value expected finite, got "
                        f"{rows[row, column]} in bucket {row} at column {column}"
                    )
                state[kind] = rows.astype(np.float32)
            elif kind == "admission" and config.admission is Admission.BLOOM:
                dtype = counter_dtype(config.admit_after).newbyteorder("<")
                state[kind] = np.frombuffer(data, dtype).astype(counter_dtype(config.admit_after))
            else:
                limit = config.admit_after if kind == "admission" else config.promote_after
                calls = state.get(f"{kind}_calls", 0)
                counts = np.frombuffer(data, COUNT_DTYPE).reshape(-1, 3).astype(np.int64)
                self._check_counts(label, config, int(part["shard_id"]), counts, limit, calls)
                state[kind] = counts
        return state

    def _check_counts(
        self,
        label: str,
        config: TableConfig,
        shard: int,
        counts: np.ndarray,
        limit: int,
        calls: int,
    ) -> None:
        if counts.shape[0] == 0:
            return
        keys, count, seen = counts[:, 0], counts[:, 1], counts[:, 2]
        problems = [
            (
                "keys expected >= 0 and strictly ascending (distinct)",
                np.concatenate(([keys[0] < 0], keys[1:] <= keys[:-1])),
            ),
            (
                f"counts expected in [1, {limit}) (a key counted {limit} times has its row)",
                (count < 1) | (count >= limit),
            ),
            (
                f"latest calls expected in [1, {calls}] (the counter's call clock)",
                (seen < 1) | (seen > calls),
            ),
        ]
        if config.placement is not Placement.TABLE:
            problems.append(
                (
                    f"keys expected on shard {shard} (key % {self.num_shards} == {shard})",
                    key_shards(config, keys, self.num_shards) != shard,
                )
            )
        for what, bad in problems:
            if bad.any():
                at = int(np.argmax(bad))
                raise SnapshotRefusedError(
                    f"{label}: {what}, got key {int(keys[at])} with count {int(count[at])}, "
                    f"latest call {int(seen[at])}"
                )

    def state_for_shard(self, table_name: str, shard_id: int, num_shards: int) -> dict[str, Any]:
        """The training state shard `shard_id` of `num_shards` takes from this snapshot (as
        EmbeddingTable.restore_state takes it, bucket rows included), every part's state
        read and checked (read_state). Into the same shard count, shard i takes part i's
        state as it is. Into another (see CARRIES): exact and Bloom counts of its own keys
        go by key; the step clock is the largest current_step and the smallest first_step
        of the parts; Bloom counters are the element-wise max of the parts'; bucket rows the
        mean of the parts'. A table placed whole takes its old owner's part's state, on its
        new owner only. Version 2 snapshots carry none: {}."""
        config = self.configs[table_name]
        parts = sorted(self.tables[table_name]["parts"], key=lambda p: int(p["shard_id"]))
        if config.placement is Placement.TABLE:
            source = owner_shard(config, self.num_shards)
            take = source if shard_id == owner_shard(config, num_shards) else -1
        else:
            take = shard_id if num_shards == self.num_shards else None  # None: merge all
        # every part is read and checked, but only one part's state (or the running merge)
        # is held at a time: a Bloom filter's counters can be large
        out: dict[str, Any] = {}
        kept: dict[str, Any] = {}
        counts: dict[str, list[np.ndarray]] = {"admission": [], "promotion": []}
        buckets: np.ndarray | None = None
        for part in parts:
            state = self.read_state(table_name, part)
            if not state:
                continue  # format version 2: nothing but rows
            if take is not None:
                if int(part["shard_id"]) == take:
                    kept = state
                continue
            out["current_step"] = max(out.get("current_step", 0), state["current_step"])
            if state["first_step"]:
                out["first_step"] = min(out.get("first_step") or MAX_STEP, state["first_step"])
            out.setdefault("first_step", 0)
            for kind in ("admission", "promotion"):
                if kind not in state:
                    continue
                if kind == "admission" and config.admission is Admission.BLOOM:
                    held = out.get(kind)
                    out[kind] = state[kind] if held is None else np.maximum(held, state[kind])
                    continue
                mine = state[kind][key_shards(config, state[kind][:, 0], num_shards) == shard_id]
                counts[kind].append(mine)
                out[f"{kind}_calls"] = max(out.get(f"{kind}_calls", 0), state[f"{kind}_calls"])
            if "buckets" in state:
                rows = state["buckets"].astype(np.float64)
                buckets = rows if buckets is None else buckets + rows
        if take is not None or self.version < 3:
            return kept
        for kind, pieces in counts.items():
            if pieces:
                merged = np.concatenate(pieces)
                out[kind] = merged[np.argsort(merged[:, 0], kind="stable")]
        if buckets is not None:
            out["buckets"] = (buckets / len(parts)).astype(np.float32)
        return out

    def verify(self) -> None:
        """The whole snapshot, checked as a load checks it before anything changes: the
        files, the part headers, and every part's content and state (SnapshotRefusedError
        naming the snapshot, table, part and file)."""
        self.check_files()
        self.check_headers()
        for table_name, entry in self.tables.items():
            for part in entry["parts"]:
                for _ in self.read_part(table_name, part):
                    pass
                self.read_state(table_name, part)
                self.read_tombstones(table_name, part)
            self.check_disjoint(table_name)

    def rows_for_shard(
        self, table_name: str, shard_id: int, num_shards: int, chunk_rows: int = READ_CHUNK_ROWS
    ) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
        """rows_and_steps_for_shard without the steps: (keys, rows, rows scanned)."""
        for keys, rows, _, scanned in self.rows_and_steps_for_shard(
            table_name, shard_id, num_shards, chunk_rows
        ):
            yield keys, rows, scanned

    def rows_and_steps_for_shard(
        self, table_name: str, shard_id: int, num_shards: int, chunk_rows: int = READ_CHUNK_ROWS
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None, int]]:
        """(keys, rows, steps, rows scanned) chunks of the keys with key % num_shards ==
        shard_id (steps: their last-update steps, None where the snapshot has none),
        read from every part, every part checked whole as `read_part` checks it (the parts
        of other shards' keys too, so every shard refuses the same snapshot); memory stays
        bounded by chunk_rows. A table placed whole gives every row to
        owner_shard(config, num_shards) and none to the others. InvalidArgumentError if the
        table's table_shard is not below num_shards."""
        for part in self.tables[table_name]["parts"]:
            yield from self.part_rows_for_shard(table_name, part, shard_id, num_shards, chunk_rows)
        self.check_disjoint(table_name)  # the parts read whole and verified: no repeats

    def part_rows_for_shard(
        self,
        table_name: str,
        part: dict[str, Any],
        shard_id: int,
        num_shards: int,
        chunk_rows: int = READ_CHUNK_ROWS,
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None, int]]:
        """rows_and_steps_for_shard of one part: its chunks (keys ascending) cut to shard
        `shard_id`'s keys, the part read whole and checked as `read_part` checks it. Whoever
        reads a table's parts one by one calls check_disjoint once they are all read."""
        config = self.configs[table_name]
        owner = single_shard(config, num_shards)
        for keys, rows, steps in self.read_part(table_name, part, chunk_rows):
            mine = (
                slice(None)
                if owner == shard_id
                else slice(0)
                if owner is not None
                else np.flatnonzero(key_shards(config, keys, num_shards) == shard_id)
            )
            yield keys[mine], rows[mine], None if steps is None else steps[mine], keys.size
