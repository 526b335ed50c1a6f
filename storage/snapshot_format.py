"""The snapshot format: its layout on disk, names, checksums and the manifest's schema -
what the writer (snapshot_writer), the reader (snapshot_reader) and the catalog
(snapshot_catalog) all need.

    <snapshot-dir>/<name>/
      <save-id>/part-00000-of-00002/<table>.keys  int64 little-endian keys, strictly ascending
      <save-id>/part-00000-of-00002/<table>.rows  float32 little-endian [n, row_width] rows:
                                                  weights and optimizer state side by side
      .../<table>.steps      (steps_to_live)      int64 [n]: each row's last-update step
      .../<table>.buckets    (promote_after)      float32 [B, row_width]: the shard's buckets
      .../<table>.promotion  (promote_after)      int64 [c, 3]: key, sightings, latest call
      .../<table>.admission  (admit_after)        counter: int64 [c, 3] as promotion;
                                                  bloom: the m counters (uint8..uint64, LE)
      .../<table>.tombstones (incremental only)   int64 keys, strictly ascending: rows
                                                  removed since the base was cut
      <save-id>/part-00000-of-00002.json          the part's header: for each table its config,
                                                  layout (dim, optimizer, row_width, dtypes),
                                                  rows, and each file's size and SHA-256
      <save-id>/.part-00000-of-00002.writing      flock'ed while the part is written, then
                                                  removed (snapshot_writing_marker)
      MANIFEST.json                               written last and exclusively; a snapshot
                                                  without it is incomplete, never loaded

Format version 4 adds incremental snapshots and cursors. Every part header records, per table,
the cursor of the table's change journal at the cut (storage/changes.py), which a later
incremental save asks the journal about. An incremental snapshot's manifest names its `base`
(a complete snapshot, full or incremental) with the base's save id and manifest checksum, so a
base deleted and saved again under its name is not taken for the old one; each of its parts
holds, per table, only the rows changed since the base's cut (`diff`: "journal" or "compare",
how they were found) plus the tombstones of keys removed since, or every row of a table the
base lacks (`diff` "all"); the small state (clock, counts, bucket rows) is whole in every
link. Loading resolves the chain newest -> base -> ... -> full (storage/snapshot_chain.py).

Format version 3: a part holds all training state (CARRIES says what, and how each piece
loads into another shard count): rows, step stamps, and in the header's "state" the step
clock (current_step, first_step) and the counters' call clocks. Version 2 snapshots (keys and
rows only) still load: step stamps and clocks then start at 0, bucket rows at their initial
values, and no key is counted. The manifest lists every part's files and header with their sizes and
SHA-256, and carries a SHA-256 of itself (`manifest_sha256`: of its canonical JSON - sorted
keys, no spaces - without that field), so an edited manifest is refused, and an edit that
recomputes that checksum still disagrees with the part headers the shards wrote.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierps.core.config import TableConfig
from tierps.core.errors import FailedPreconditionError, InvalidArgumentError

FORMAT_VERSION = 4
# version 2 snapshots load too: rows only (see CARRIES); version 3: no cursors, never a base
READABLE_VERSIONS = (2, 3, 4)
INCREMENTAL_VERSION = 4  # the first version that may have a base and cursors
MANIFEST = "MANIFEST.json"
CHECKSUM = "manifest_sha256"  # the manifest's field holding the SHA-256 of the rest of it
KEY_DTYPE = "<i8"
ROW_DTYPE = "<f4"
COUNT_DTYPE = "<i8"  # admission and promotion counts: [n, 3] rows (key, count, latest call)
STEP_DTYPE = "<i8"  # a row's last-update step (steps_to_live)
# What a snapshot carries, and how each piece loads into another shard count (written into
# every manifest as "carries", so a reader of the snapshot can tell without the code).
CARRIES: dict[str, str] = {
    "rows": "weights and optimizer state of every stored key, exact; reshards by key",
    "step_stamps": "each row's last-update step (steps_to_live), exact; reshards by key",
    "step_clock": "each shard's current_step and first_step: a load into the same shard "
    "count gives shard i part i's clock; a reshard gives every shard the largest "
    "current_step and the smallest first_step of the parts",
    "admission_counts": "admission='counter': every key's sightings and recency, exact; "
    "reshards by key (more keys than max_elements on a shard are trimmed as a call trims)",
    "admission_bloom": "admission='bloom': each shard's counters, exact into the same shard "
    "count; a Bloom filter cannot be split by key, so a reshard gives every shard the "
    "element-wise max of the parts' counters: no key's estimate falls below its count, but "
    "more keys collide (keys may be admitted earlier than on the source cluster)",
    "promotion_counts": "adaptive embedding (promote_after): every key's sightings, exact; "
    "reshards by key",
    "bucket_rows": "adaptive embedding: each shard's bucket rows, exact into the same shard "
    "count; bucket rows are per shard and cannot be split by key, so a reshard gives every "
    "shard the mean of the parts' bucket rows (weights and optimizer state): keys not yet "
    "promoted then read a blend, not their old shard's bucket",
    "not_carried": "figures (sightings, keys_admitted, lookups and gradients to buckets, "
    "evictions) and the eviction guard's held-back leap step start over at a load",
}
# How an incremental part found a table's rows (its part entry's "diff"): the journal's
# changed keys since the base's cursor; a comparison of the table with the base chain's rows;
# or every row, where the base has no such table (or one of another config).
DIFF_JOURNAL = "journal"
DIFF_COMPARE = "compare"
DIFF_ALL = "all"
DIFFS = (DIFF_JOURNAL, DIFF_COMPARE, DIFF_ALL)
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
SAVE_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


class SnapshotRefusedError(FailedPreconditionError):
    """A snapshot that cannot be loaded as it is: altered, corrupted or inconsistent with
    itself. FAILED_PRECONDITION (the caller's request is well formed; the stored snapshot
    is not loadable, and retrying does not help)."""


@dataclass(frozen=True)
class Progress:
    """How far a save or load is: rows written (save) or read (load), of rows_total;
    rows_kept: rows a load stored on this shard; rows_evicted: rows a save removed before
    its cut (evict_before_snapshot); diffs: an incremental save's tables -> how their
    changed rows were found (DIFFS)."""

    rows_done: int
    rows_total: int
    path: str
    rows_kept: int = 0
    done: bool = False
    rows_evicted: int = 0
    diffs: dict[str, str] = field(default_factory=dict)


def check_name(name: Any) -> str:
    """A snapshot name is one directory name: no '/', no '..', not absolute."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name) or ".." in name:
        raise InvalidArgumentError(
            f"snapshot name expected to match {NAME_PATTERN.pattern} without '..' (one directory "
            f"name, not a path), got {name!r}"
        )
    return name


def check_save_id(save_id: Any) -> str:
    if not isinstance(save_id, str) or not SAVE_ID_PATTERN.fullmatch(save_id):
        raise InvalidArgumentError(
            f"snapshot save_id expected to match {SAVE_ID_PATTERN.pattern}, got {save_id!r}"
        )
    return save_id


def part_name(shard_id: int, num_shards: int) -> str:
    return f"part-{shard_id:05d}-of-{num_shards:05d}"


def snapshot_path(root: Path, name: str) -> Path:
    """root/name, refused (FailedPreconditionError) where it is a symlink, or passes
    through one, that leads out of root: saves and loads never leave the snapshot dir."""
    path = Path(root) / check_name(name)
    check_inside(root, path, f"snapshot {name!r}")
    return path


def is_inside(root: Path, path: Path) -> bool:
    real, top = path.resolve(), Path(root).resolve()
    return real == top or top in real.parents


def check_inside(root: Path, path: Path, what: str) -> None:
    """Refuse a path (existing, or a dangling link) that resolves outside root."""
    if (path.exists() or path.is_symlink()) and not is_inside(root, path):
        raise FailedPreconditionError(
            f"{what}: {path} expected inside the snapshot directory {Path(root).resolve()}, "
            f"but it resolves to {path.resolve()} (a symlink out of it); remove the link"
        )


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


def write_json_atomic(path: Path, data: dict[str, Any], *, exclusive: bool = False) -> None:
    """Write to a temporary file, fsync, then rename (or, exclusive, hard-link, which fails
    if `path` exists): readers see the whole file or none. The shard's own small records
    (SHARD.json, LIVES.json) are written so too."""
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


def read_versioned_json(
    path: Path, what: str, error: type[Exception] = FailedPreconditionError
) -> Any:
    try:
        with open(path) as source:
            data = json.load(source)
    except (OSError, ValueError) as problem:
        raise error(f"{what} is unreadable or corrupted: {problem}") from None
    if not isinstance(data, dict) or data.get("format_version") not in READABLE_VERSIONS:
        version = data.get("format_version") if isinstance(data, dict) else None
        raise error(f"{what}: format_version expected one of {READABLE_VERSIONS}, got {version!r}")
    return data


def _json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words, with the value when short: "a list [1, 2]"."""
    kinds = (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (list, "a list"),
        (dict, "an object"),
    )
    kind = next((name for type_, name in kinds if isinstance(value, type_)), "null")
    text = json.dumps(value, default=str) if value is not None else ""
    return f"{kind} {text[:60]}{'...' if len(text) > 60 else ''}".rstrip()


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def expect_field(where: str, field: str, value: Any, expected: str, ok: bool) -> None:
    if not ok:
        raise SnapshotRefusedError(
            f"{where}: field {field!r} expected {expected}, got {_json_kind(value)}"
        )


def _check_file_entry(where: str, field: str, file: Any) -> None:
    expect_field(where, field, file, "an object (path, bytes, sha256)", isinstance(file, dict))
    path = file.get("path")
    expect_field(where, f"{field}.path", path, "a string", isinstance(path, str))
    expect_field(
        where, f"{field}.bytes", file.get("bytes"), "an integer >= 0", is_count(file.get("bytes"))
    )
    sha = file.get("sha256")
    expect_field(where, f"{field}.sha256", sha, "a string (hex SHA-256)", isinstance(sha, str))


def check_manifest_fields(manifest: dict[str, Any], where: str) -> None:
    """Every field of a manifest that a reader uses, of the JSON type it must be: the one
    place that checks them, run before any of them is used, so that a crafted manifest (a
    list where an object belongs, a string for a count, NaN) is refused like every other
    crafted snapshot - SnapshotRefusedError, FAILED_PRECONDITION, naming the field, what was
    expected and what came - and never fails inside the code that reads it."""
    num_shards = manifest.get("num_shards")
    expect_field(
        where, "num_shards", num_shards, "an integer >= 1", is_count(num_shards) and num_shards >= 1
    )
    save_id = manifest.get("save_id")
    expect_field(
        where,
        "save_id",
        save_id,
        f"a string matching {SAVE_ID_PATTERN.pattern}",
        isinstance(save_id, str) and bool(SAVE_ID_PATTERN.fullmatch(save_id)),
    )
    created = manifest.get("created_unix")
    expect_field(
        where,
        "created_unix",
        created,
        "a finite number (seconds since the epoch)",
        isinstance(created, int | float)
        and not isinstance(created, bool)
        and math.isfinite(created),
    )
    incremental = _check_base_fields(manifest, where)
    tables = manifest.get("tables")
    expect_field(
        where, "tables", tables, "an object (table name -> its entry)", isinstance(tables, dict)
    )
    for name, entry in tables.items():
        at = f"tables.{name}"
        expect_field(
            where, at, entry, "an object (config, layout, rows, parts)", isinstance(entry, dict)
        )
        for key in ("config", "layout"):
            expect_field(
                where, f"{at}.{key}", entry.get(key), "an object", isinstance(entry.get(key), dict)
            )
        config_name = entry["config"].get("name")
        expect_field(
            where,
            f"{at}.config.name",
            config_name,
            f"{name!r} (the table's key)",
            config_name == name,
        )
        expect_field(
            where, f"{at}.rows", entry.get("rows"), "an integer >= 0", is_count(entry.get("rows"))
        )
        parts = entry.get("parts")
        expect_field(
            where, f"{at}.parts", parts, "a list (one entry per part)", isinstance(parts, list)
        )
        for index, part in enumerate(parts):
            here = f"{at}.parts[{index}]"
            expect_field(where, here, part, "an object", isinstance(part, dict))
            for key in ("shard_id", "rows"):
                expect_field(
                    where,
                    f"{here}.{key}",
                    part.get(key),
                    "an integer >= 0",
                    is_count(part.get(key)),
                )
            for key, file in part.items():
                if key.endswith("_file"):
                    _check_file_entry(where, f"{here}.{key}", file)
            if manifest.get("format_version", 0) >= INCREMENTAL_VERSION:
                cursor = part.get("cursor")
                expect_field(
                    where,
                    f"{here}.cursor",
                    cursor,
                    "a string (JOURNAL:POSITION, the table's journal at the cut)",
                    isinstance(cursor, str),
                )
            if incremental:
                diff = part.get("diff")
                expect_field(where, f"{here}.diff", diff, f"one of {DIFFS}", diff in DIFFS)
                tombstones = part.get("tombstones")
                expect_field(
                    where, f"{here}.tombstones", tombstones, "an integer >= 0", is_count(tombstones)
                )


def _check_base_fields(manifest: dict[str, Any], where: str) -> bool:
    """A version 4 manifest's base: "" (a full snapshot) or a snapshot name, then its
    save_id and manifest checksum. True for an incremental snapshot."""
    if manifest.get("format_version", 0) < INCREMENTAL_VERSION:
        return False
    base = manifest.get("base")
    expect_field(
        where,
        "base",
        base,
        "a string: empty (a full snapshot) or the name of the snapshot it builds on",
        isinstance(base, str) and (not base or bool(NAME_PATTERN.fullmatch(base))),
    )
    if not base:
        return False
    save_id = manifest.get("base_save_id")
    expect_field(
        where,
        "base_save_id",
        save_id,
        f"a string matching {SAVE_ID_PATTERN.pattern}",
        isinstance(save_id, str) and bool(SAVE_ID_PATTERN.fullmatch(save_id)),
    )
    checksum = manifest.get("base_manifest_sha256")
    expect_field(
        where, "base_manifest_sha256", checksum, "a string (hex SHA-256)", isinstance(checksum, str)
    )
    return True
