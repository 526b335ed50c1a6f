"""The snapshots in a snapshot directory: listing them (with each incremental's chain of
bases), deleting one (or one save's files of it; never a snapshot a kept incremental's chain
needs), and collecting what failed saves left behind (never a complete snapshot)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tierps.core.errors import FailedPreconditionError, Reason, SnapshotNotFoundError
from tierps.storage.snapshot_format import (
    MANIFEST,
    NAME_PATTERN,
    check_inside,
    check_manifest_fields,
    check_save_id,
    is_inside,
    read_versioned_json,
    snapshot_path,
)


def list_snapshots(root: Path) -> list[dict[str, Any]]:
    """Every snapshot directory under root, complete or not, in name order; an incremental
    one with its base and chain (its bases, newest first, down to a full snapshot, as far as
    they are there)."""
    out: list[dict[str, Any]] = []
    if not Path(root).is_dir():
        return out
    for path in sorted(Path(root).iterdir()):
        if not path.is_dir() or not NAME_PATTERN.fullmatch(path.name) or ".." in path.name:
            continue
        if not is_inside(root, path):  # a symlink out of the snapshot dir: not a snapshot
            continue
        info: dict[str, Any] = {
            "name": path.name,
            "complete": False,
            "num_shards": 0,
            "created_unix": 0.0,
            "table_rows": {},
            "base": "",
            "chain": [],
        }
        if (path / MANIFEST).exists():
            try:
                where = f"snapshot {path.name!r}: {MANIFEST}"
                manifest = read_versioned_json(path / MANIFEST, where)
                check_manifest_fields(manifest, where)
            except FailedPreconditionError:
                pass  # listed as incomplete; a load says what is wrong
            else:
                info.update(
                    complete=True,
                    num_shards=manifest["num_shards"],
                    created_unix=manifest["created_unix"],
                    table_rows={t: e["rows"] for t, e in manifest["tables"].items()},
                    base=manifest.get("base", ""),
                )
        out.append(info)
    bases = {info["name"]: info["base"] for info in out if info["complete"]}
    for info in out:
        link = info["base"]
        while link and link not in info["chain"] and link != info["name"]:
            info["chain"].append(link)
            link = bases.get(link, "")
    return out


def dependents(root: Path, name: str) -> list[str]:
    """The complete snapshots whose chain needs snapshot `name` (its incrementals, theirs,
    ...), in name order."""
    bases = {info["name"]: info["chain"] for info in list_snapshots(root) if info["complete"]}
    return sorted(other for other, chain in bases.items() if name in chain)


def delete(root: Path, name: str, *, save_id: str = "", incomplete_only: bool = False) -> list[str]:
    """Remove snapshot `name` (a link to a directory inside root: the link only); with
    save_id, only that save's staging files, and the snapshot's directory if nothing else
    is left in it. incomplete_only: a complete snapshot is refused
    (FailedPreconditionError). Returns the paths removed."""
    path = snapshot_path(root, name)
    if not (path.is_dir() or path.is_symlink()):
        raise SnapshotNotFoundError(f"snapshot {name!r} not found in {root}", snapshot=name)
    complete = (path / MANIFEST).exists()
    if save_id:
        target = path / check_save_id(save_id)
        check_inside(root, target, f"snapshot {name!r}: save {save_id}")
        where = f"snapshot {name!r}"
        if complete and read_versioned_json(path / MANIFEST, where).get("save_id") == save_id:
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
    needed_by = dependents(root, name) if complete else []
    if needed_by:
        raise FailedPreconditionError(
            f"snapshot {name!r} in {root} is needed by the incremental snapshots "
            f"{', '.join(needed_by)}, which build on it; delete those first (newest first), "
            f"or keep it",
            reason=Reason.SNAPSHOT_NEEDED,
            snapshot=name,
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
        manifest = read_versioned_json(path / MANIFEST, f"snapshot {info['name']!r}")
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
