"""The snapshot format: the part each shard writes, and the manifest that completes them.

    <snapshot-dir>/<name>/
      <save-id>/part-00000-of-00002/<table>.keys  int64 little-endian keys, strictly ascending
      <save-id>/part-00000-of-00002/<table>.rows  float32 little-endian [n, row_width] rows:
                                                  weights and optimizer state side by side
      .../<table>.steps      (steps_to_live)      int64 [n]: each row's last-update step
      .../<table>.buckets    (promote_after)      float32 [B, row_width]: the shard's buckets
      .../<table>.promotion  (promote_after)      int64 [c, 3]: key, sightings, latest call
      .../<table>.admission  (admit_after)        counter: int64 [c, 3] as promotion;
                                                  bloom: the m counters (uint8..uint64, LE)
      <save-id>/part-00000-of-00002.json          the part's header: for each table its config,
                                                  layout (dim, optimizer, row_width, dtypes),
                                                  rows, and each file's size and SHA-256
      <save-id>/.part-00000-of-00002.writing      flock'ed while the part is written, then
                                                  removed (collect_abandoned_parts)
      MANIFEST.json                               written last and exclusively; a snapshot
                                                  without it is incomplete, never loaded

Format version 3: a part holds all training state (CARRIES says what, and how each piece
loads into another shard count): rows, step stamps, and in the header's "state" the step
clock (current_step, first_step) and the counters' call clocks. Version 2 snapshots (keys and
rows only) still load: step stamps and clocks then start at 0, bucket rows at their initial
values, and no key is counted. The manifest lists every part's files and header with their sizes and
SHA-256, and carries a SHA-256 of itself (`manifest_sha256`: of its canonical JSON - sorted
keys, no spaces - without that field), so an edited manifest is refused, and an edit that
recomputes that checksum still disagrees with the part headers the shards wrote.

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

Each save writes under its own save id, so two saves under one name (two clusters sharing a
snapshot directory) never touch each other's files, and only one of them can commit the
manifest. A save refuses (FailedPreconditionError) to write a row with a non-finite value or
keys out of order, rather than write a snapshot no load would accept.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
from tierps.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from tierps.core.validation import MAX_STEP, first_non_finite
from tierps.storage.admission import bloom_size, counter_dtype

log = logging.getLogger("tierps.storage")

FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)  # version 2 snapshots load too: rows only (see CARRIES)
MANIFEST = "MANIFEST.json"
CHECKSUM = "manifest_sha256"  # the manifest's field holding the SHA-256 of the rest of it
KEY_DTYPE = "<i8"
ROW_DTYPE = "<f4"
READ_CHUNK_ROWS = 65536
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
    """root/name, refused (FailedPreconditionError) where it is a symlink, or passes
    through one, that leads out of root: saves and loads never leave the snapshot dir."""
    path = Path(root) / check_name(name)
    check_inside(root, path, f"snapshot {name!r}")
    return path


def _inside(root: Path, path: Path) -> bool:
    real, top = path.resolve(), Path(root).resolve()
    return real == top or top in real.parents


def check_inside(root: Path, path: Path, what: str) -> None:
    """Refuse a path (existing, or a dangling link) that resolves outside root."""
    if (path.exists() or path.is_symlink()) and not _inside(root, path):
        raise FailedPreconditionError(
            f"{what}: {path} expected inside the snapshot directory {Path(root).resolve()}, "
            f"but it resolves to {path.resolve()} (a symlink out of it); remove the link"
        )


FULL = (errno.ENOSPC, errno.EDQUOT)


def full_error(error: OSError, what: str) -> ResourceExhaustedError:
    """A file system full (or over quota) while writing a snapshot, said as
    ResourceExhaustedError naming what was written and the file."""
    return ResourceExhaustedError(
        f"{what}: the snapshot directory's file system is full ({error.strerror} writing "
        f"{error.filename or 'a file there'}); what this save wrote there was removed; free "
        f"space, or delete snapshots (tierps admin snapshot delete NAME / snapshot gc)"
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
    exports: Iterable[tuple[Any, ...]],
    rows_estimate: int,
) -> Iterator[Progress]:
    """Write one shard's part from each table's export, yielding progress after every chunk;
    the last Progress has done=True. Each export is (config, chunks) or (config, chunks,
    state): chunks in key order, each (keys, rows [c, row_width]) or (keys, rows, steps:
    int64 last-update steps, or None), as EmbeddingTable.export_stored gives them; state as
    EmbeddingTable.export_state gives it (the step clock, bucket rows, admission and
    promotion counts; none: an empty table's). A non-finite value or keys out of order are
    refused (FailedPreconditionError) and the part is removed."""
    snapshot = snapshot_path(root, name)
    staging = snapshot / check_save_id(save_id)
    check_new(root, name)
    part = part_name(shard_id, num_shards)
    part_dir = staging / part
    where = f"snapshot {name!r}: shard {shard_id}'s part {part_dir}"
    check_inside(root, staging, where)
    try:
        with _writing(staging, part):  # the part is whole (header written) or removed
            try:
                # this save's part, written before by a call that failed: its header first,
                # so that no header describes files being rewritten
                (staging / f"{part}.json").unlink(missing_ok=True)
                if part_dir.exists():
                    shutil.rmtree(part_dir)
                part_dir.mkdir()
                yield from _write_part(staging, part, save_id, shard_id, num_shards, exports,
                                       rows_estimate, name)  # fmt: skip
            except OSError:
                shutil.rmtree(part_dir, ignore_errors=True)
                raise
    except OSError as error:
        if error.errno in FULL:
            raise full_error(error, where) from None
        raise


WRITING_SUFFIX = ".writing"  # <save-id>/.<part>.writing: held locked while the part is written


def _writing_marker(staging: Path, part: str) -> Path:
    return staging / f".{part}{WRITING_SUFFIX}"


@contextmanager
def _writing(staging: Path, part: str) -> Iterator[None]:
    """Hold the part's writing marker (see collect_abandoned_parts) while the body writes
    the part: a file beside it, created and flock'ed before the part's directory exists,
    removed only after the part is whole or removed. A process killed meanwhile leaves it
    behind, and the kernel releases its lock."""
    staging.mkdir(parents=True, exist_ok=True)
    marker = _writing_marker(staging, part)
    while True:
        fd = os.open(marker, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # a collector removes a marker it could lock: lock the file that is there now
            if _same_file(fd, marker):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        who = {"pid": os.getpid(), "host": socket.gethostname(), "started_unix": time.time()}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(who).encode())  # for people: who writes this part
        yield
    finally:
        marker.unlink(missing_ok=True)
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _tree_bytes(paths: Iterable[Path]) -> int:
    """Bytes of the files under these paths (links counted, never followed)."""
    total = 0
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            for folder, _, files in os.walk(path):
                total += sum(os.lstat(os.path.join(folder, f)).st_size for f in files)
        elif path.exists() or path.is_symlink():
            total += path.lstat().st_size
    return total


def collect_abandoned_parts(root: Path | None, shard_id: int, num_shards: int) -> dict[str, int]:
    """Remove this shard's snapshot parts whose writing was cut off (the process killed
    mid-save), logging each with its bytes; returns {part directory: bytes removed}. Run
    when a shard starts; a snapshot dir shared by several shards and clusters is safe.

    The rule. write_part creates <snapshot>/<save-id>/.<part>.writing and holds an
    exclusive flock on it from before the part's directory exists until the part is whole
    (its header <part>.json written last, atomically) or removed, and only then deletes it.
    So a marker that is still there but that no process holds locked belongs to a writer
    that died mid-part, and the kernel, not a guess, says no process holds it (flock locks
    die with their process, kill -9 included). For each marker of this shard's part name
    (part-<shard>-of-<num_shards>) this takes the lock without waiting, and:
    - the lock is held: a live writer (this part name of another cluster sharing the dir,
      mid-save): left alone;
    - the save's MANIFEST names this save, or the part's header exists: a whole part,
      perhaps committed: only the stale marker goes;
    - otherwise the part can never be committed (commit needs its header; a retry of the
      save rewrites it whole): its directory, its header's temporary files and the marker
      go.
    Whole parts of saves never committed, and directories left empty, are left to
    `snapshot gc` (delete_snapshot), which an admin runs when no save is in progress."""
    if root is None or not Path(root).is_dir():
        return {}
    part = part_name(shard_id, num_shards)
    removed: dict[str, int] = {}
    for marker in sorted(Path(root).glob(f"*/*/.{part}{WRITING_SUFFIX}")):
        staging, snapshot = marker.parent, marker.parent.parent
        if not (_NAME.fullmatch(snapshot.name) and _SAVE_ID.fullmatch(staging.name)):
            continue
        if not _inside(root, marker):  # through a symlink out of the snapshot dir
            continue
        try:
            size = _collect_part(marker, staging, snapshot, part)
        except OSError as error:  # garbage left behind, nothing lost: say so
            log.warning("shard %d: could not remove the abandoned snapshot part %s: %s",
                        shard_id, staging / part, error)  # fmt: skip
            continue
        if size is None:
            continue
        removed[str(staging / part)] = size
        log.warning(
            "shard %d of %d: removed %s, %d bytes: snapshot %r's save %s was killed while "
            "this shard wrote its part (never committed)", shard_id, num_shards,
            staging / part, size, snapshot.name, staging.name,
            extra={"shard_id": shard_id, "removed": str(staging / part), "bytes": size},
        )  # fmt: skip
    return removed


def _collect_part(marker: Path, staging: Path, snapshot: Path, part: str) -> int | None:
    """collect_abandoned_parts for one marker: the bytes removed, or None when the part
    is left as it is (a live writer, or a whole part)."""
    try:
        fd = os.open(marker, os.O_RDWR)  # never created here: gone means its writer is done
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a live writer holds it
        if not _same_file(fd, marker):
            return None  # replaced meanwhile: a new writer's
        committed = False
        if (snapshot / MANIFEST).exists():
            try:
                committed = _read_json(snapshot / MANIFEST, "").get("save_id") == staging.name
            except FailedPreconditionError:
                committed = True  # unreadable: take no chance with a snapshot's files
        if committed or (staging / f"{part}.json").exists():
            marker.unlink()
            return None
        leftovers = [staging / part, *staging.glob(f".{part}.json.*.tmp")]
        size = _tree_bytes([*leftovers, marker])
        for path in leftovers:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        marker.unlink()
        return size
    finally:
        os.close(fd)


def _write_part(
    staging: Path,
    part: str,
    save_id: str,
    shard_id: int,
    num_shards: int,
    exports: Iterable[tuple[Any, ...]],
    rows_estimate: int,
    name: str,
) -> Iterator[Progress]:
    part_dir = staging / part
    tables: dict[str, Any] = {}
    done = 0
    try:
        for config, chunks, *rest in exports:
            table_state = rest[0] if rest else {}
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
                            np.zeros(keys.size, STEP_DTYPE) if steps is None
                            else np.asarray(steps).astype(STEP_DTYPE, copy=False)
                        )  # fmt: skip
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
    check_inside(root, snapshot / check_save_id(save_id), f"snapshot {name!r}: save {save_id}")
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
                    "state": entry["state"],
                    **{key: value for key, value in entry.items() if key.endswith("_file")},
                }
            )
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "save_id": save_id,
        "num_shards": num_shards,
        "created_unix": time.time(),
        "carries": CARRIES,
        "tables": tables,
    }
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


def _read_json(path: Path, what: str, error: type[Exception] = FailedPreconditionError) -> Any:
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
    kinds = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
             (list, "a list"), (dict, "an object"))  # fmt: skip
    kind = next((name for type_, name in kinds if isinstance(value, type_)), "null")
    text = json.dumps(value, default=str) if value is not None else ""
    return f"{kind} {text[:60]}{'...' if len(text) > 60 else ''}".rstrip()


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _expect(where: str, field: str, value: Any, expected: str, ok: bool) -> None:
    if not ok:
        raise SnapshotRefusedError(
            f"{where}: field {field!r} expected {expected}, got {_json_kind(value)}"
        )


def _check_file_entry(where: str, field: str, file: Any) -> None:
    _expect(where, field, file, "an object (path, bytes, sha256)", isinstance(file, dict))
    _expect(where, f"{field}.path", file.get("path"), "a string", isinstance(file.get("path"), str))
    _expect(where, f"{field}.bytes", file.get("bytes"), "an integer >= 0",
            _is_count(file.get("bytes")))  # fmt: skip
    sha = file.get("sha256")
    _expect(where, f"{field}.sha256", sha, "a string (hex SHA-256)", isinstance(sha, str))


def check_manifest_fields(manifest: dict[str, Any], where: str) -> None:
    """Every field of a manifest that a reader uses, of the JSON type it must be: the one
    place that checks them, run before any of them is used, so that a crafted manifest (a
    list where an object belongs, a string for a count, NaN) is refused like every other
    crafted snapshot - SnapshotRefusedError, FAILED_PRECONDITION, naming the field, what was
    expected and what came - and never fails inside the code that reads it."""
    num_shards = manifest.get("num_shards")
    _expect(where, "num_shards", num_shards, "an integer >= 1",
            _is_count(num_shards) and num_shards >= 1)  # fmt: skip
    save_id = manifest.get("save_id")
    _expect(where, "save_id", save_id, f"a string matching {_SAVE_ID.pattern}",
            isinstance(save_id, str) and bool(_SAVE_ID.fullmatch(save_id)))  # fmt: skip
    created = manifest.get("created_unix")
    _expect(where, "created_unix", created, "a finite number (seconds since the epoch)",
            isinstance(created, int | float) and not isinstance(created, bool)
            and math.isfinite(created))  # fmt: skip
    tables = manifest.get("tables")
    _expect(where, "tables", tables, "an object (table name -> its entry)",
            isinstance(tables, dict))  # fmt: skip
    for name, entry in tables.items():
        at = f"tables.{name}"
        _expect(where, at, entry, "an object (config, layout, rows, parts)",
                isinstance(entry, dict))  # fmt: skip
        for key in ("config", "layout"):
            _expect(where, f"{at}.{key}", entry.get(key), "an object",
                    isinstance(entry.get(key), dict))  # fmt: skip
        config_name = entry["config"].get("name")
        _expect(where, f"{at}.config.name", config_name, f"{name!r} (the table's key)",
                config_name == name)  # fmt: skip
        _expect(where, f"{at}.rows", entry.get("rows"), "an integer >= 0",
                _is_count(entry.get("rows")))  # fmt: skip
        parts = entry.get("parts")
        _expect(where, f"{at}.parts", parts, "a list (one entry per part)",
                isinstance(parts, list))  # fmt: skip
        for index, part in enumerate(parts):
            here = f"{at}.parts[{index}]"
            _expect(where, here, part, "an object", isinstance(part, dict))
            for key in ("shard_id", "rows"):
                _expect(where, f"{here}.{key}", part.get(key), "an integer >= 0",
                        _is_count(part.get(key)))  # fmt: skip
            for key, file in part.items():
                if key.endswith("_file"):
                    _check_file_entry(where, f"{here}.{key}", file)


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
            raise NotFoundError(f"snapshot {name!r} not found in {root}")
        check_inside(root, self.path / MANIFEST, f"snapshot {name!r}")
        if not (self.path / MANIFEST).exists():
            parts = sorted(str(p.relative_to(self.path)) for p in self.path.glob("*/part-*.json"))
            raise FailedPreconditionError(
                f"snapshot {name!r} in {root} is incomplete: no {MANIFEST} (parts written: "
                f"{parts or 'none'}); it was never committed and cannot be loaded"
            )
        where = f"snapshot {name!r}: {MANIFEST}"
        self.manifest = _read_json(self.path / MANIFEST, where, SnapshotRefusedError)
        check_manifest_fields(self.manifest, where)
        self.version = int(self.manifest["format_version"])
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
        kinds = sorted(["header", "keys", "rows", *self.state_kinds(config)])
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
                    label = f"{where}: part header {file['path']}"
                    _expect(label, "(the header)", header, "an object", isinstance(header, dict))
                    tables = header.get("tables")
                    _expect(label, "tables", tables, "an object (table name -> its entry)",
                            isinstance(tables, dict))  # fmt: skip
                    headers[file["path"]] = header
                header = headers[file["path"]]
                written = header["tables"].get(table_name)
                if written is None:
                    raise SnapshotRefusedError(
                        f"{where}: the part header {file['path']} has no table {table_name!r}"
                    )
                _expect(f"{where}: part header {file['path']}", f"tables.{table_name}", written,
                        "an object", isinstance(written, dict))  # fmt: skip
                checks = [
                    ("shard_id", header.get("shard_id"), part["shard_id"]),
                    ("num_shards", header.get("num_shards"), self.num_shards),
                    ("config", written.get("config"), entry["config"]),
                    ("layout", written.get("layout"), layout(config)),
                    ("layout", written.get("layout"), entry.get("layout")),
                    ("rows", written.get("rows"), part["rows"]),
                    ("state", written.get("state"), part.get("state")),
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
                if not _is_count(value) or value > MAX_STEP:
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
            ("keys expected >= 0 and strictly ascending (distinct)",
             np.concatenate(([keys[0] < 0], keys[1:] <= keys[:-1]))),
            (f"counts expected in [1, {limit}) (a key counted {limit} times has its row)",
             (count < 1) | (count >= limit)),
            (f"latest calls expected in [1, {calls}] (the counter's call clock)",
             (seen < 1) | (seen > calls)),
        ]  # fmt: skip
        if config.placement is not Placement.TABLE:
            problems.append(
                (f"keys expected on shard {shard} (key % {self.num_shards} == {shard})",
                 key_shards(config, keys, self.num_shards) != shard)
            )  # fmt: skip
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
        config = self.configs[table_name]
        owner = single_shard(config, num_shards)
        for part in self.tables[table_name]["parts"]:
            for keys, rows, steps in self.read_part(table_name, part, chunk_rows):
                mine = (
                    slice(None) if owner == shard_id
                    else slice(0) if owner is not None
                    else np.flatnonzero(key_shards(config, keys, num_shards) == shard_id)
                )  # fmt: skip
                yield keys[mine], rows[mine], None if steps is None else steps[mine], keys.size
        self.check_disjoint(table_name)  # the parts read whole and verified: no repeats


def list_snapshots(root: Path) -> list[dict[str, Any]]:
    """Every snapshot directory under root, complete or not, in name order."""
    out: list[dict[str, Any]] = []
    if not Path(root).is_dir():
        return out
    for path in sorted(Path(root).iterdir()):
        if not path.is_dir() or not _NAME.fullmatch(path.name) or ".." in path.name:
            continue
        if not _inside(root, path):  # a symlink out of the snapshot dir: not a snapshot
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
                where = f"snapshot {path.name!r}: {MANIFEST}"
                manifest = _read_json(path / MANIFEST, where)
                check_manifest_fields(manifest, where)
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


def delete(root: Path, name: str, *, save_id: str = "", incomplete_only: bool = False) -> list[str]:
    """Remove snapshot `name` (a link to a directory inside root: the link only); with
    save_id, only that save's staging files, and the snapshot's directory if nothing else
    is left in it. incomplete_only: a complete snapshot is refused
    (FailedPreconditionError). Returns the paths removed."""
    path = snapshot_path(root, name)
    if not (path.is_dir() or path.is_symlink()):
        raise NotFoundError(f"snapshot {name!r} not found in {root}")
    complete = (path / MANIFEST).exists()
    if save_id:
        target = path / check_save_id(save_id)
        check_inside(root, target, f"snapshot {name!r}: save {save_id}")
        if complete and _read_json(path / MANIFEST, f"snapshot {name!r}").get("save_id") == save_id:
            raise FailedPreconditionError(
                f"snapshot {name!r}: save {save_id} is the committed snapshot; delete the "
                f"snapshot by name instead"
            )
        removed = []
        if target.exists():
            _remove(target)
            removed.append(str(target))
        if not complete and path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()
            removed.append(str(path))
        return removed
    if complete and incomplete_only:
        raise FailedPreconditionError(
            f"snapshot {name!r} in {root} is complete; incomplete_only deletes only snapshots "
            f"without a {MANIFEST}"
        )
    _remove(path)
    return [str(path)]


def gc(root: Path) -> list[str]:
    """Remove what failed saves left in root: every incomplete snapshot, and in a complete
    one every save directory its manifest does not name. Run it while no save runs (a
    save in progress is incomplete too). Returns the paths removed."""
    removed: list[str] = []
    for info in list_snapshots(root):
        path = Path(root) / info["name"]
        if not info["complete"]:
            removed += delete(root, info["name"])
            continue
        manifest = _read_json(path / MANIFEST, f"snapshot {info['name']!r}")
        for child in path.iterdir():
            if child.is_dir() and child.name != manifest.get("save_id"):
                removed += delete(root, info["name"], save_id=child.name)
    return removed


def _remove(path: Path) -> None:
    """A directory tree (links in it removed, never followed), or a link itself."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path)
