"""Writing a snapshot: each shard's part of a consistent cut of its tables (files,
checksums, the part header), then the commit that checks every part and writes the
manifest exclusively (storage/snapshot_format.py describes the layout).

Each save writes under its own save id, so two saves under one name (two clusters sharing a
snapshot directory) never touch each other's files, and only one of them can commit the
manifest. A save refuses (FailedPreconditionError) to write a row with a non-finite value or
keys out of order, rather than write a snapshot no load would accept.

An incremental save writes the same part, from cuts that hold only the changed rows and the
tombstones of removed keys (TableCut.diff, TableCut.tombstones), and names its base in every
part header; the commit checks the parts agree on it and records it in the manifest.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

import numpy as np

from tierps.core.config import Admission, TableConfig
from tierps.core.errors import (
    FailedPreconditionError,
    Reason,
    ResourceExhaustedError,
    SnapshotNotFoundError,
)
from tierps.core.validation import first_non_finite
from tierps.storage.admission import bloom_size, counter_dtype
from tierps.storage.snapshot_format import (
    CARRIES,
    CHECKSUM,
    COUNT_DTYPE,
    DIFFS,
    FORMAT_VERSION,
    KEY_DTYPE,
    MANIFEST,
    ROW_DTYPE,
    STEP_DTYPE,
    Progress,
    check_inside,
    check_save_id,
    layout,
    manifest_checksum,
    part_name,
    read_versioned_json,
    snapshot_path,
    write_json_atomic,
)
from tierps.storage.snapshot_writing_marker import writing_marker_held

FULL = (errno.ENOSPC, errno.EDQUOT)


def full_error(error: OSError, what: str) -> ResourceExhaustedError:
    """A file system full (or over quota) while writing a snapshot, said as
    ResourceExhaustedError naming what was written and the file."""
    return ResourceExhaustedError(
        f"{what}: the snapshot directory's file system is full ({error.strerror} writing "
        f"{error.filename or 'a file there'}); what this save wrote there was removed; free "
        f"space, or delete snapshots (tierps admin snapshot delete NAME / snapshot gc)",
        reason=Reason.STORAGE_FULL,
    )


@dataclass(frozen=True)
class BaseLink:
    """The complete snapshot an incremental one builds on, pinned: its name, save id and
    manifest checksum (a snapshot deleted and saved again under the name is another)."""

    name: str
    save_id: str
    manifest_sha256: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "save_id": self.save_id, "manifest_sha256": self.manifest_sha256}


@dataclass
class TableCut:
    """One table's share of a part, as of the cut. chunks: in key order, each (keys, rows
    [c, row_width]) or (keys, rows, steps: int64 last-update steps, or None), as
    EmbeddingTable.export_stored gives them; state: as EmbeddingTable.export_state gives it
    (the step clock, bucket rows, admission and promotion counts; empty: an empty table's);
    cursor: the table's journal cursor at the cut (Cursor.encoded()). In an incremental
    part: diff (snapshot_format.DIFFS) says how the rows were found, and tombstones, asked
    once the chunks are written, gives the keys removed since the base (int64, ascending)."""

    config: TableConfig
    chunks: Iterable[tuple[Any, ...]]
    state: dict[str, Any] = dataclass_field(default_factory=dict)
    cursor: str = ""
    diff: str = ""
    tombstones: Callable[[], np.ndarray] | None = None

    @classmethod
    def of(cls, export: TableCut | tuple[Any, ...]) -> TableCut:
        """A TableCut as it is, or from a (config, chunks) or (config, chunks, state) tuple."""
        if isinstance(export, TableCut):
            return export
        config, chunks, *rest = export
        return cls(config, chunks, rest[0] if rest else {})


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
    bad = first_non_finite(rows)
    if bad is not None:
        row, column = bad
        raise FailedPreconditionError(
            f"{where}: every weight and optimizer value expected finite, got "
            f"{rows[row, column]} in the row of key {int(keys[row])} at column {column}; "
            f"the snapshot is not written (a load would refuse it)"
        )


def write_part(
    root: Path,
    name: str,
    save_id: str,
    shard_id: int,
    num_shards: int,
    exports: Iterable[TableCut | tuple[Any, ...]],
    rows_estimate: int,
    base: BaseLink | None = None,
) -> Iterator[Progress]:
    """Write one shard's part from each table's cut (a TableCut, or a (config, chunks[,
    state]) tuple: see TableCut.of), yielding progress after every chunk; the last Progress
    has done=True. base: the snapshot an incremental part builds on (None: a full one); each
    of its tables then writes its tombstones and its diff. A non-finite value or keys out of
    order are refused (FailedPreconditionError) and the part is removed."""
    snapshot = snapshot_path(root, name)
    staging = snapshot / check_save_id(save_id)
    check_new(root, name)
    part = part_name(shard_id, num_shards)
    part_dir = staging / part
    where = f"snapshot {name!r}: shard {shard_id}'s part {part_dir}"
    check_inside(root, staging, where)
    try:
        with writing_marker_held(staging, part):  # the part is whole (header written) or removed
            try:
                # this save's part, written before by a call that failed: its header first,
                # so that no header describes files being rewritten
                (staging / f"{part}.json").unlink(missing_ok=True)
                if part_dir.exists():
                    shutil.rmtree(part_dir)
                part_dir.mkdir()
                yield from _write_part(
                    staging, part, save_id, shard_id, num_shards, exports, rows_estimate, name, base
                )
            except OSError:
                shutil.rmtree(part_dir, ignore_errors=True)
                raise
    except OSError as error:
        if error.errno in FULL:
            raise full_error(error, where) from None
        raise


def _write_part(
    staging: Path,
    part: str,
    save_id: str,
    shard_id: int,
    num_shards: int,
    exports: Iterable[TableCut | tuple[Any, ...]],
    rows_estimate: int,
    name: str,
    base: BaseLink | None,
) -> Iterator[Progress]:
    part_dir = staging / part
    tables: dict[str, Any] = {}
    done = 0
    try:
        for export in exports:
            cut = TableCut.of(export)
            config, chunks, table_state = cut.config, cut.chunks, cut.state
            where = f"snapshot {name!r}: table {config.name!r} on shard {shard_id}"
            rows_in_table = 0
            kinds = ("keys", "rows", "steps") if config.steps_to_live else ("keys", "rows")
            paths = {kind: part_dir / f"{config.name}.{kind}" for kind in kinds}
            digests = {kind: hashlib.sha256() for kind in paths}
            outs = {kind: open(path, "wb") for kind, path in paths.items()}  # noqa: SIM115
            previous = -1
            try:
                for keys, rows, *more in chunks:
                    steps = more[0] if more else None
                    _check_chunk(where, keys, rows, previous)
                    if keys.size:
                        previous = int(keys[-1])
                    arrays = {
                        "keys": keys.astype(KEY_DTYPE, copy=False),
                        "rows": rows.astype(ROW_DTYPE, copy=False),
                    }
                    if "steps" in outs:  # no steps (an old export): 0, as a new row's
                        arrays["steps"] = (
                            np.zeros(keys.size, STEP_DTYPE)
                            if steps is None
                            else np.asarray(steps).astype(STEP_DTYPE, copy=False)
                        )
                    for kind, array in arrays.items():
                        data = _raw(array)
                        outs[kind].write(data)
                        digests[kind].update(data)
                    rows_in_table += keys.size
                    done += keys.size
                    yield Progress(done, max(done, rows_estimate), str(part_dir))
                for out in outs.values():
                    out.flush()
                    os.fsync(out.fileno())
            finally:
                for out in outs.values():
                    out.close()
            entry: dict[str, Any] = {
                "config": config.to_dict(),
                "layout": layout(config),
                "rows": rows_in_table,
                "state": _write_state(where, part_dir, config, table_state, paths, digests),
                "cursor": cut.cursor,
            }
            if base is not None:
                entry["diff"] = cut.diff
                entry["tombstones"] = _write_tombstones(where, part_dir, cut, paths, digests)
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
        "base": None if base is None else base.to_dict(),
        "tables": tables,
    }
    write_json_atomic(staging / f"{part}.json", header)
    yield Progress(done, done, str(part_dir), done=True)


def _raw(array: np.ndarray) -> memoryview:
    """An array's bytes, without a copy where it is contiguous (empty arrays too)."""
    array = np.ascontiguousarray(array)
    return memoryview(array).cast("B") if array.size else memoryview(b"")


def _state_arrays(config: TableConfig, state: dict[str, Any]) -> dict[str, np.ndarray]:
    """The state files a table's part holds, as the arrays to write: bucket rows and
    promotion counts (promote_after), admission counts or Bloom counters (admit_after);
    an absent piece is written empty or initial (a table without state of that kind)."""
    arrays: dict[str, np.ndarray] = {}
    if config.promote_after:
        buckets = state.get("buckets")
        if buckets is None:
            from tierps.storage.adaptive import BucketRows  # initial bucket rows

            buckets = BucketRows(config).rows
        arrays["buckets"] = np.asarray(buckets).astype(ROW_DTYPE, copy=False)
        arrays["promotion"] = _counts(state.get("promotion"))
    if config.admit_after:
        if config.admission is Admission.BLOOM:
            size, _ = bloom_size(config.max_elements, config.false_positive_rate)
            counters = state.get("admission")
            dtype = counter_dtype(config.admit_after).newbyteorder("<")
            arrays["admission"] = (
                np.zeros(size, dtype) if counters is None else counters.astype(dtype, copy=False)
            )
        else:
            arrays["admission"] = _counts(state.get("admission"))
    return arrays


def _counts(counts: np.ndarray | None) -> np.ndarray:
    return np.zeros((0, 3), COUNT_DTYPE) if counts is None else counts.astype(COUNT_DTYPE)


def _write_state(
    where: str,
    part_dir: Path,
    config: TableConfig,
    state: dict[str, Any],
    paths: dict[str, Path],
    digests: dict[str, Any],
) -> dict[str, int]:
    """Write a table's state files into its part (adding them to paths and digests) and
    return the header's "state": the step clock and the counters' call clocks. A bucket
    row holding a non-finite value is refused (FailedPreconditionError)."""
    for kind, array in _state_arrays(config, state).items():
        bad = first_non_finite(array) if kind == "buckets" else None
        if bad is not None:
            row, column = bad
            raise FailedPreconditionError(
                f"{where}: every bucket row value expected finite, got {array[row, column]} "
                f"in bucket {row} at column {column}; the snapshot is not written"
            )
        paths[kind] = part_dir / f"{config.name}.{kind}"
        data = _raw(array)
        with open(paths[kind], "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        digests[kind] = hashlib.sha256(data)
    out = {
        "current_step": int(state.get("current_step", 0)),
        "first_step": int(state.get("first_step", 0)),
    }
    for field in ("admission_calls", "promotion_calls"):
        if (field == "promotion_calls" and config.promote_after) or (
            field == "admission_calls"
            and config.admit_after
            and config.admission is not Admission.BLOOM
        ):
            out[field] = int(state.get(field, 0))
    return out


def _write_tombstones(
    where: str, part_dir: Path, cut: TableCut, paths: dict[str, Path], digests: dict[str, Any]
) -> int:
    """Write a table's tombstones file into an incremental part (adding it to paths and
    digests); returns how many keys. Keys must be distinct, ascending and >= 0
    (FailedPreconditionError otherwise), and diff one of DIFFS."""
    if cut.diff not in DIFFS:
        raise ValueError(f"{where}: diff expected one of {DIFFS}, got {cut.diff!r}")
    keys = np.empty(0, np.int64) if cut.tombstones is None else np.asarray(cut.tombstones())
    keys = keys.astype(KEY_DTYPE, copy=False)
    if keys.size and (keys[0] < 0 or bool(np.any(keys[1:] <= keys[:-1]))):
        raise FailedPreconditionError(
            f"{where}: tombstones expected distinct, ascending and >= 0, got {keys[:8]}...; "
            f"nothing was committed"
        )
    paths["tombstones"] = part_dir / f"{cut.config.name}.tombstones"
    data = _raw(keys)
    with open(paths["tombstones"], "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    digests["tombstones"] = hashlib.sha256(data)
    return int(keys.size)


def _file_entry(path: Path, relative: str) -> dict[str, Any]:
    data = path.read_bytes()
    return {"path": relative, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _check_base(root: Path, name: str, base: dict[str, str]) -> None:
    """The base the parts were written on is still the snapshot they pinned (not deleted,
    nor replaced by another save of its name, while they were written): a manifest naming
    a base that is gone would commit a snapshot no load can read."""
    manifest_path = snapshot_path(root, base["name"]) / MANIFEST
    where = f"snapshot {name!r}: its base {base['name']!r}"
    try:
        found = read_versioned_json(manifest_path, where)
    except FailedPreconditionError as error:  # missing, unreadable
        raise FailedPreconditionError(
            f"{where} expected complete (save {base['save_id']}), got none readable "
            f"({error}); it was deleted while the parts were written; nothing was committed"
        ) from None
    pinned = (base["save_id"], base["manifest_sha256"])
    now = (found.get("save_id"), found.get(CHECKSUM))
    if now != pinned:
        raise FailedPreconditionError(
            f"{where} expected save {pinned[0]} (manifest sha256 {pinned[1]}), got save "
            f"{now[0]} (manifest sha256 {now[1]}): it was replaced while the parts were "
            f"written; nothing was committed"
        )


def commit(root: Path, name: str, save_id: str) -> dict[str, Any]:
    """Check that every part of save `save_id` is there and agrees, then write the manifest
    (exclusively: an existing snapshot is never replaced). Returns the manifest."""
    snapshot = snapshot_path(root, name)
    if not snapshot.is_dir():
        raise SnapshotNotFoundError(f"snapshot {name!r} not found in {root}", snapshot=name)
    if (snapshot / MANIFEST).exists():
        raise FailedPreconditionError(f"snapshot {name!r} already exists in {root}")
    check_inside(root, snapshot / check_save_id(save_id), f"snapshot {name!r}: save {save_id}")
    parts: dict[int, dict[str, Any]] = {}
    headers: dict[int, dict[str, Any]] = {}
    num_shards = None
    bases: set[str] = set()
    for path in sorted((snapshot / check_save_id(save_id)).glob("part-*-of-*.json")):
        summary = read_versioned_json(path, f"snapshot {name!r}: part header {path.name}")
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
        bases.add(json.dumps(summary.get("base"), sort_keys=True))
    missing = sorted(set(range(num_shards or 1)) - set(parts))
    if num_shards is None or missing:
        raise FailedPreconditionError(
            f"snapshot {name!r} is incomplete: save {save_id} has no part from shards "
            f"{missing} of {num_shards or '?'}"
        )
    if len(bases) != 1:
        raise FailedPreconditionError(
            f"snapshot {name!r}: parts of save {save_id} disagree on their base: {sorted(bases)}"
        )
    base = json.loads(bases.pop()) or {}
    if base:
        _check_base(root, name, base)
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
                    "state": entry["state"],
                    **{
                        key: value
                        for key, value in entry.items()
                        if key.endswith("_file") or key in ("cursor", "diff", "tombstones")
                    },
                }
            )
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "save_id": save_id,
        "num_shards": num_shards,
        "created_unix": time.time(),
        "base": base.get("name", ""),
        "carries": CARRIES,
        "tables": tables,
    }
    if base:
        manifest["base_save_id"] = base["save_id"]
        manifest["base_manifest_sha256"] = base["manifest_sha256"]
    manifest[CHECKSUM] = manifest_checksum(manifest)
    try:
        write_json_atomic(snapshot / MANIFEST, manifest, exclusive=True)
    except FileExistsError:
        raise FailedPreconditionError(f"snapshot {name!r} already exists in {root}") from None
    except OSError as error:
        if error.errno in FULL:
            raise full_error(error, f"snapshot {name!r}: its {MANIFEST}") from None
        raise
    return manifest
