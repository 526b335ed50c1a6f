"""The writing marker: how a snapshot part still being written is told from one whose
writer was killed, and the collector that removes the latter when a shard starts."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tierps.core.errors import FailedPreconditionError
from tierps.storage.snapshot_format import (
    MANIFEST,
    NAME_PATTERN,
    SAVE_ID_PATTERN,
    is_inside,
    part_name,
    read_versioned_json,
)

log = logging.getLogger("tierps.storage")

WRITING_SUFFIX = ".writing"  # <save-id>/.<part>.writing: held locked while the part is written


def _writing_marker(staging: Path, part: str) -> Path:
    return staging / f".{part}{WRITING_SUFFIX}"


@contextmanager
def writing_marker_held(staging: Path, part: str) -> Iterator[None]:
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
        if not (NAME_PATTERN.fullmatch(snapshot.name) and SAVE_ID_PATTERN.fullmatch(staging.name)):
            continue
        if not is_inside(root, marker):  # through a symlink out of the snapshot dir
            continue
        try:
            size = _collect_part(marker, staging, snapshot, part)
        except OSError as error:  # garbage left behind, nothing lost: say so
            log.warning(
                "shard %d: could not remove the abandoned snapshot part %s: %s",
                shard_id,
                staging / part,
                error,
            )
            continue
        if size is None:
            continue
        removed[str(staging / part)] = size
        log.warning(
            "shard %d of %d: removed %s, %d bytes: snapshot %r's save %s was killed while "
            "this shard wrote its part (never committed)",
            shard_id,
            num_shards,
            staging / part,
            size,
            snapshot.name,
            staging.name,
            extra={"shard_id": shard_id, "removed": str(staging / part), "bytes": size},
        )
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
                manifest = read_versioned_json(snapshot / MANIFEST, "")
                committed = manifest.get("save_id") == staging.name
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
