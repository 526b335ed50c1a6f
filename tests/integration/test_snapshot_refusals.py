"""Crafted snapshots are refused before any live row changes.

Two in-process shards over real RocksDB and real snapshot files. Each case saves a good
snapshot, trains on (so the live rows differ from it), crafts the snapshot as an attacker or
a faulty disk would (checksums recomputed where that is the point), and loads it into both
shards: every shard must refuse it with FAILED_PRECONDITION naming the snapshot, table, part
and what it expected, and every stored value of every table - weights, optimizer state,
step stamps, step clocks - must be bit-identical afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tierps.client.admin import ClusterAdmin, ShardError
from tierps.core.errors import BackendError
from tierps.server.config import ServerConfig
from tierps.server.shard import LookupBatch, PushBatch, Shard
from tierps.storage import FailedPreconditionError, TableConfig, optim
from tierps.storage.snapshot_format import (
    CHECKSUM,
    MANIFEST,
    SnapshotRefusedError,
    manifest_checksum,
    part_name,
)
from tierps.storage.snapshot_reader import Snapshot
from tierps.storage.store import EmbeddingStore

SHARDS = 2
ADAM16 = TableConfig("adam16", 16, optimizer=optim.Adam(lr=0.01))
ADA = TableConfig("ada", 4, optimizer=optim.Adagrad(), steps_to_live=50)
# adaptive buckets and admission counts: their state files are crafted too
ADAPT = TableConfig("adapt", 4, optimizer=optim.Adagrad(), hash_bucket_size=5, promote_after=3)
ADMIT = TableConfig("admit", 4, optimizer=optim.Adagrad(), admit_after=3)
TABLES = (ADAM16, ADA, ADAPT, ADMIT)
KEYS = np.arange(0, 600, dtype=np.int64)


def make_cluster(root: Path, tag: str) -> list[Shard]:
    return [
        Shard(
            ServerConfig(
                shard_id=i,
                num_shards=SHARDS,
                data_dir=root / f"{tag}-{i}",
                snapshot_dir=root / "snapshots",
                tables=TABLES,
            )
        )
        for i in range(SHARDS)
    ]


def push(shards: list[Shard], seed: int, step: int) -> None:
    generator = np.random.default_rng(seed)
    for config in TABLES:
        # the counting tables see a part of the keys each step: some counted, not admitted
        keys = KEYS if not config.admit_after + config.promote_after else KEYS[seed::3]
        grads = generator.normal(size=(keys.size, config.dim)).astype(np.float32)
        for shard in shards:
            mine = keys % SHARDS == shard.shard_id
            shard.push_gradients(
                [PushBatch(config.name, config.dim, keys[mine], grads[mine], step)]
            )


def save(shards: list[Shard], name: str) -> None:
    for shard in shards:
        list(shard.admin.save_part(name, "sid"))
    list(shards[0].admin.commit_snapshot(name, "sid"))


def state(shards: list[Shard]) -> list[dict[str, Any]]:
    """Every stored value of every table on every shard, as raw bits (flushed first, so
    RocksDB holds every row at its newest; a flush moves rows down, it changes none)."""
    out = []
    for shard in shards:
        tables = {}
        for config in shard.admin.list_tables():
            table = shard.store.table(config.name)
            table.flush()
            chunks = list(table.durable.export(1000))
            keys = np.concatenate([k for k, _ in chunks]) if chunks else np.empty(0, np.int64)
            rows = (
                np.concatenate([r for _, r in chunks])
                if chunks
                else np.empty((0, config.stored_width), np.float32)
            )
            tables[config.name] = (
                config,
                table.current_step,
                table.first_step,
                keys,
                rows.view(np.uint32),
                soft_state(shard, config),
            )
        out.append(tables)
    return out


def soft_state(shard: Shard, config: TableConfig) -> bytes:
    """What a create=False lookup of every key reads, as bits, and the state held in
    memory only (admission and promotion counts, bucket rows), as bytes to compare."""
    table = shard.store.table(config.name)
    mine = KEYS[KEYS % SHARDS == shard.shard_id]
    parts = [shard.lookup([LookupBatch(config.name, config.dim, mine, False)])[0].tobytes()]
    for counter in (table.admission, table.buckets and table.buckets.counts):
        if counter:
            parts.append(counter.estimate(mine).tobytes())
    if table.buckets is not None:
        parts.append(table.buckets.rows.tobytes())
    return b"".join(parts)


def changed_rows(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> int:
    """Rows (over every table and shard) whose stored bits differ, or that appeared or went."""
    changed = 0
    for old, new in zip(before, after, strict=True):
        assert sorted(old) == sorted(new)
        for name, (_, _, _, keys, bits, soft) in old.items():
            if not np.array_equal(new[name][3], keys):
                changed += max(keys.size, new[name][3].size)
                continue
            changed += int(np.count_nonzero((new[name][4] != bits).any(axis=1)))
            changed += int(new[name][5] != soft)  # lookups, counts or bucket rows differ
    return changed


def clocks(tables: list[dict[str, Any]]) -> list[dict[str, tuple[Any, ...]]]:
    """Each table's config and step clock (current_step, first_step) on each shard."""
    return [{name: entry[:3] for name, entry in shard.items()} for shard in tables]


def sha(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def reseal(snapshot: Path, *, headers: bool = True) -> None:
    """Recompute every checksum as an attacker would: each file's size and SHA-256 in the
    part headers (headers=True) and in the manifest, then the manifest's own checksum."""
    manifest = json.loads((snapshot / MANIFEST).read_text())
    if headers:
        for header_path in (snapshot / manifest["save_id"]).glob("part-*.json"):
            header = json.loads(header_path.read_text())
            for entry in header["tables"].values():
                for key, file in entry.items():
                    if key.endswith("_file") and (snapshot / file["path"]).exists():
                        file.update(sha(snapshot / file["path"]))
            header_path.write_text(json.dumps(header))
    for entry in manifest["tables"].values():
        for part in entry["parts"]:
            for key, file in part.items():
                target = snapshot / file["path"] if key.endswith("_file") else None
                if target is not None and target.exists() and target.is_relative_to(snapshot):
                    file.update(sha(target))
    manifest[CHECKSUM] = manifest_checksum(manifest)
    (snapshot / MANIFEST).write_text(json.dumps(manifest))


def part_file(snapshot: Path, shard: int, table: str, kind: str) -> Path:
    manifest = json.loads((snapshot / MANIFEST).read_text())
    return snapshot / manifest["save_id"] / part_name(shard, SHARDS) / f"{table}.{kind}"


def edit_manifest(snapshot: Path, change: Callable[[dict[str, Any]], None]) -> None:
    manifest = json.loads((snapshot / MANIFEST).read_text())
    change(manifest)
    (snapshot / MANIFEST).write_text(json.dumps(manifest))


def edit_array(path: Path, dtype: str, change: Callable[[np.ndarray], None]) -> None:
    values = np.fromfile(path, dtype=dtype)
    change(values)
    values.tofile(path)


# -- the crafted snapshots: (craft, what the refusal must say) ---------------------------------


def duplicate_key(snapshot: Path) -> None:
    edit_array(part_file(snapshot, 0, "adam16", "keys"), "<i8", lambda k: k.__setitem__(1, k[0]))
    reseal(snapshot)


def duplicate_across_parts(snapshot: Path) -> None:
    # part 1's first key becomes one that part 0 holds too (key 0), still ascending
    edit_array(part_file(snapshot, 1, "adam16", "keys"), "<i8", lambda k: k.__setitem__(0, 0))
    reseal(snapshot)


def inf_in_adam_state(snapshot: Path) -> None:
    """What one finite gradient of 1e20 makes of Adam's second moment in float32: g * g
    overflows (1e40 > 3.4e38), so v is inf."""
    row = ADAM16.initial_rows(np.array([7], dtype=np.int64))
    with np.errstate(over="ignore", invalid="ignore"):
        ADAM16.optimizer.apply(row, np.full((1, ADAM16.dim), 1e20, np.float32), 1)
    v = row[0, 2 * ADAM16.dim + 5]
    assert np.isinf(v)
    width = ADAM16.row_width
    path = part_file(snapshot, 1, "adam16", "rows")
    edit_array(path, "<f4", lambda r: r.__setitem__(3 * width + 2 * ADAM16.dim + 5, v))
    reseal(snapshot)


def nan_weight(snapshot: Path) -> None:
    edit_array(part_file(snapshot, 0, "ada", "rows"), "<f4", lambda r: r.__setitem__(9, np.nan))
    reseal(snapshot)


def traversal_path(snapshot: Path) -> None:
    outside = snapshot.parent.parent / "outside"
    outside.mkdir(exist_ok=True)
    secret = outside / "secret.bin"  # the same size, so only the path can give it away
    shutil.copy(part_file(snapshot, 0, "adam16", "rows"), secret)

    def point_out(manifest: dict[str, Any]) -> None:
        manifest["tables"]["adam16"]["parts"][0]["rows_file"]["path"] = "../../outside/secret.bin"
        manifest["tables"]["adam16"]["parts"][0]["rows_file"].update(sha(secret))

    edit_manifest(snapshot, point_out)
    reseal(snapshot, headers=False)


def absolute_path(snapshot: Path) -> None:
    secret = snapshot.parent.parent / "secret.bin"
    shutil.copy(part_file(snapshot, 0, "adam16", "rows"), secret)

    def point_out(manifest: dict[str, Any]) -> None:
        manifest["tables"]["adam16"]["parts"][0]["rows_file"]["path"] = str(secret)

    edit_manifest(snapshot, point_out)
    reseal(snapshot, headers=False)


def symlink_out(snapshot: Path) -> None:
    rows = part_file(snapshot, 0, "adam16", "rows")
    secret = snapshot.parent.parent / "linked-secret.bin"
    shutil.move(rows, secret)  # the very same bytes: every checksum still matches
    os.symlink(secret, rows)


def config_swap(snapshot: Path) -> None:
    """dim 16 -> 48 and adam -> sgd: the same row width (48), so the file sizes agree."""

    def swap(manifest: dict[str, Any]) -> None:
        entry = manifest["tables"]["adam16"]
        entry["config"].update(dim=48, optimizer={"kind": "sgd", "lr": 0.1})
        entry["layout"].update(dim=48, optimizer="sgd")
        assert TableConfig.from_dict(entry["config"]).row_width == ADAM16.row_width

    edit_manifest(snapshot, swap)
    reseal(snapshot, headers=False)  # the attacker recomputes the manifest's checksum


def manifest_edited(snapshot: Path) -> None:
    edit_manifest(snapshot, lambda m: m["tables"]["adam16"]["config"]["optimizer"].update(lr=1.0))


def truncated_part(snapshot: Path) -> None:
    path = part_file(snapshot, 1, "ada", "rows")
    path.write_bytes(path.read_bytes()[:-4])


def header_edited(snapshot: Path) -> None:
    header = next((snapshot / "sid").glob("part-00001-*.json"))
    data = json.loads(header.read_text())
    data["tables"]["ada"]["config"]["steps_to_live"] = 5
    header.write_text(json.dumps(data))


def inf_in_a_bucket_row(snapshot: Path) -> None:
    path = part_file(snapshot, 1, "adapt", "buckets")
    edit_array(path, "<f4", lambda r: r.__setitem__(ADAPT.row_width + 1, np.inf))
    reseal(snapshot)


def count_at_admit_after(snapshot: Path) -> None:
    """A count of admit_after: such a key would have been admitted (and have a row)."""
    path = part_file(snapshot, 1, "admit", "admission")
    edit_array(path, "<i8", lambda c: c.__setitem__(1, ADMIT.admit_after))
    reseal(snapshot)


def stamp_out_of_range(snapshot: Path) -> None:
    edit_array(part_file(snapshot, 0, "ada", "steps"), "<i8", lambda s: s.__setitem__(2, -5))
    reseal(snapshot)


def clock_edited(snapshot: Path) -> None:
    """A step clock of 2**60 written into the part header and the manifest alike."""
    header = next((snapshot / "sid").glob("part-00001-*.json"))
    data = json.loads(header.read_text())
    data["tables"]["ada"]["state"]["current_step"] = 2**60
    header.write_text(json.dumps(data))
    edit_manifest(
        snapshot,
        lambda m: m["tables"]["ada"]["parts"][1]["state"].__setitem__("current_step", 2**60),
    )
    reseal(snapshot)


def steps_file_dropped(snapshot: Path) -> None:
    """The manifest no longer lists part 0's step stamps (checksum recomputed)."""
    edit_manifest(snapshot, lambda m: m["tables"]["ada"]["parts"][0].pop("steps_file"))
    reseal(snapshot, headers=False)


CASES: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "duplicate key in a part": (
        duplicate_key,
        ["'adam16'", "part-00000-of-00002", "adam16.keys", "duplicate"],
    ),
    "duplicate key across parts": (
        duplicate_across_parts,
        ["'adam16'", "part-00001-of-00002", "belongs to part 0"],
    ),
    "inf in Adam state (from a 1e20 gradient)": (
        inf_in_adam_state,
        ["'adam16'", "part-00001-of-00002", "expected finite", "inf"],
    ),
    "NaN weight": (nan_weight, ["'ada'", "part-00000-of-00002", "expected finite", "nan"]),
    "traversal path ../../outside/secret.bin": (
        traversal_path,
        ["'adam16'", "../../outside/secret.bin", "leaves the snapshot"],
    ),
    "absolute path": (absolute_path, ["'adam16'", "secret.bin", "leaves the snapshot"]),
    "symlink out of the snapshot": (
        symlink_out,
        ["'adam16'", "adam16.rows", "inside the snapshot directory", "link"],
    ),
    "config swap dim 16 -> 48, adam -> sgd": (
        config_swap,
        ["'adam16'", "config disagrees with the part header", "'dim': 48"],
    ),
    "manifest edited, its checksum not recomputed": (
        manifest_edited,
        ["MANIFEST.json", "altered", CHECKSUM],
    ),
    "truncated part": (truncated_part, ["'ada'", "ada.rows", "expected", "bytes, got"]),
    "part header edited": (header_edited, ["part-00001-of-00002", "header file", "corrupted"]),
    "inf in a bucket row": (
        inf_in_a_bucket_row,
        ["'adapt'", "part-00001-of-00002", "adapt.buckets", "expected finite", "inf"],
    ),
    "admission count at admit_after": (
        count_at_admit_after,
        ["'admit'", "part-00001-of-00002", "admit.admission", "counts expected in [1, 3)"],
    ),
    "step stamp below 0": (stamp_out_of_range, ["'ada'", "ada.steps", "expected in [0", "-5"]),
    "step clock 2**60": (clock_edited, ["'ada'", "'current_step'", str(2**60)]),
    "steps file dropped from the manifest": (
        steps_file_dropped,
        ["'ada'", "part-00000-of-00002", "files expected", "'steps'"],
    ),
}


# -- manifests with a field of the wrong JSON type, checksum recomputed: (change, needles) ---


def retyped(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """A craft that edits the manifest and recomputes its checksum, as an attacker would."""

    def craft(snapshot: Path) -> None:
        manifest = json.loads((snapshot / MANIFEST).read_text())
        change(manifest)
        try:
            manifest[CHECKSUM] = manifest_checksum(manifest)
        except ValueError:  # NaN or Infinity: canonical JSON has none, so neither a checksum
            pass
        (snapshot / MANIFEST).write_text(json.dumps(manifest))

    return craft


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set manifest[a][b]... (path "a/b/0/c") to value."""

    def change(manifest: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        target: Any = manifest
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[int(last) if isinstance(target, list) else last] = value

    return change


def _tables_as_list(manifest: dict[str, Any]) -> None:
    manifest["tables"] = [dict(entry, name=name) for name, entry in manifest["tables"].items()]


WRONG_TYPES: dict[str, tuple[Callable[[dict[str, Any]], None], list[str]]] = {
    "tables a list": (_tables_as_list, ["'tables'", "expected an object", "got a list"]),
    "num_shards a string": (
        _set("num_shards", "2"),
        ["'num_shards'", "an integer >= 1", 'got a string "2"'],
    ),
    "save_id a number": (_set("save_id", 7), ["'save_id'", "a string", "got an integer 7"]),
    "created_unix a string": (
        _set("created_unix", "now"),
        ["'created_unix'", 'got a string "now"'],
    ),
    "a table entry a list": (_set("tables/ada", []), ["'tables.ada'", "got a list"]),
    "parts an object": (
        _set("tables/ada/parts", {}),
        ["'tables.ada.parts'", "a list", "got an object"],
    ),
    "rows a string": (_set("tables/ada/rows", "1"), ["'tables.ada.rows'", "an integer >= 0"]),
    "a part's shard_id a float": (
        _set("tables/ada/parts/1/shard_id", 1.0),
        ["'tables.ada.parts[1].shard_id'", "got a number 1.0"],
    ),
    "a part a string": (
        _set("tables/ada/parts/0", "part"),
        ["'tables.ada.parts[0]'", "an object", "got a string"],
    ),
    "a file's bytes a boolean": (
        _set("tables/ada/parts/0/keys_file/bytes", True),
        ["'tables.ada.parts[0].keys_file.bytes'", "got a boolean"],
    ),
    "a file entry a string": (
        _set("tables/adam16/parts/1/rows_file", "x.rows"),
        ["'tables.adam16.parts[1].rows_file'", "an object"],
    ),
    "config a list": (_set("tables/ada/config", []), ["'tables.ada.config'", "an object"]),
    "config named another table": (
        _set("tables/ada/config/name", "adam16"),
        ["'tables.ada.config.name'", "'ada'", "adam16"],
    ),
    "created_unix NaN": (
        _set("created_unix", float("nan")),
        ["'created_unix'", "a finite number", "got a number NaN"],
    ),
    "a config's lr Infinity": (
        _set("tables/ada/config/optimizer/lr", float("inf")),
        ["'ada'", "'lr'", "inf"],
    ),
}


@pytest.fixture
def clusters(tmp_path: Path) -> Iterator[tuple[list[Shard], Path]]:
    shards = make_cluster(tmp_path, "live")
    push(shards, seed=1, step=1)
    push(shards, seed=2, step=2)
    save(shards, "good")
    push(shards, seed=3, step=3)  # live rows now differ from the snapshot
    yield shards, tmp_path / "snapshots"
    for shard in shards:
        shard.close()


@pytest.mark.parametrize("case", list(CASES))
def test_a_crafted_snapshot_is_refused_and_changes_no_live_row(
    clusters: tuple[list[Shard], Path], case: str
) -> None:
    shards, root = clusters
    craft, needles = CASES[case]
    shutil.copytree(root / "good", root / "bad", symlinks=True)
    craft(root / "bad")
    before = state(shards)
    families_before = sorted(families(shards))

    for shard in shards:  # every shard it reaches refuses it
        with pytest.raises(FailedPreconditionError) as raised:
            list(shard.admin.load_snapshot("bad"))
        message = str(raised.value)
        for needle in ["'bad'", *needles]:
            assert needle in message, (needle, message)

    after = state(shards)
    assert changed_rows(before, after) == 0
    assert clocks(after) == clocks(before)  # configs and step clocks too
    assert sorted(families(shards)) == families_before  # staging dropped
    # the good snapshot still loads, so the refusal was about the crafting
    for shard in shards:
        list(shard.admin.load_snapshot("good"))
    assert changed_rows(before, state(shards)) > 0


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_a_manifest_field_of_the_wrong_type_is_refused_naming_it(
    clusters: tuple[list[Shard], Path], case: str
) -> None:
    """Not an internal error: FAILED_PRECONDITION, as every crafted snapshot, naming the
    field, what it expected and what came; no live row changes and nothing stays staged;
    listing the snapshots shows a mistyped one as incomplete instead of failing."""
    shards, root = clusters
    change, needles = WRONG_TYPES[case]
    shutil.copytree(root / "good", root / "bad", symlinks=True)
    retyped(change)(root / "bad")
    before = state(shards)
    families_before = sorted(families(shards))
    for shard in shards:
        with pytest.raises(SnapshotRefusedError) as raised:
            list(shard.admin.load_snapshot("bad"))
        for needle in ["'bad'", "MANIFEST.json", *needles]:
            assert needle in str(raised.value), (needle, str(raised.value))
    assert changed_rows(before, state(shards)) == 0
    assert sorted(families(shards)) == families_before
    listed = {info["name"]: info["complete"] for info in shards[0].admin.list_snapshots()}
    assert sorted(listed) == ["bad", "good"] and listed["good"]
    if case != "a config's lr Infinity":  # well typed: listed as complete, refused at a load
        assert not listed["bad"]


def families(shards: list[Shard]) -> list[str]:
    """Column families of every shard's RocksDB (a refused load leaves none staged)."""
    from rocksdict import Rdict

    out = []
    for shard in shards:
        path = str(shard.store.path)
        out += [f"{shard.shard_id}:{cf}" for cf in Rdict.list_cf(path)]
    return out


def test_the_good_snapshot_round_trips_bit_exactly(clusters: tuple[list[Shard], Path]) -> None:
    shards, root = clusters
    Snapshot(root, "good").verify()
    # a second cluster loads it, and saves it again: the same bits
    for shard in shards:
        list(shard.admin.load_snapshot("good"))
    loaded = state(shards)
    save(shards, "again")
    for name in ("good", "again"):
        manifest = json.loads((root / name / MANIFEST).read_text())
        assert manifest["format_version"] == 4
        assert manifest[CHECKSUM] == manifest_checksum(manifest)
    for config in TABLES:
        for shard in range(SHARDS):
            for kind in ("keys", "rows"):
                a = part_file(root / "good", shard, config.name, kind).read_bytes()
                b = part_file(root / "again", shard, config.name, kind).read_bytes()
                assert a == b, (config.name, shard, kind)
    assert changed_rows(loaded, state(shards)) == 0


def test_a_storage_failure_while_staging_changes_no_live_row(
    clusters: tuple[list[Shard], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A RocksDB write that fails half-way through a load (injected: the staged tier's
    second write raises as a full disk would) leaves the live tables as they were."""
    shards, _ = clusters
    before = state(shards)
    families_before = sorted(families(shards))
    stage_table = EmbeddingStore.stage_table
    writes = {"n": 0}

    def failing_stage(self: EmbeddingStore, config: TableConfig, source: str = "") -> Any:
        staged = stage_table(self, config, source)
        write = staged.rows.write

        def write_then_fail(keys: np.ndarray, rows: np.ndarray) -> None:
            writes["n"] += 1
            if writes["n"] == 2:
                raise BackendError("injected: rocksdb backend failed to write rows: No space")
            write(keys, rows)

        staged.rows.write = write_then_fail  # type: ignore[method-assign]
        return staged

    monkeypatch.setattr(EmbeddingStore, "stage_table", failing_stage)
    with pytest.raises(BackendError, match="injected"):
        list(shards[0].admin.load_snapshot("good"))
    assert writes["n"] == 2  # one table's rows were staged before the failure
    assert changed_rows(before, state(shards)) == 0
    assert sorted(families(shards)) == families_before


def test_save_refuses_a_non_finite_row(tmp_path: Path) -> None:
    """A row that reached storage with an inf (a fault injected below the table's checks)
    fails the save with a clear error instead of writing a snapshot no load accepts."""
    shards = make_cluster(tmp_path, "s")
    try:
        push(shards, seed=1, step=1)
        table = shards[1].store.table("adam16")
        table.flush()
        keys, rows = next(table.durable.export(1))
        rows = rows.copy()
        rows[0, ADAM16.dim * 2 + 3] = np.inf
        table.durable.write(keys, rows)
        with pytest.raises(FailedPreconditionError) as raised:
            for shard in shards:
                list(shard.admin.save_part("x", "sid"))
        message = str(raised.value)
        for needle in ("'x'", "'adam16'", "shard 1", "expected finite", "inf", f"key {keys[0]}"):
            assert needle in message, (needle, message)
        with pytest.raises(FailedPreconditionError, match="incomplete"):
            list(shards[0].admin.commit_snapshot("x", "sid"))
        assert not (tmp_path / "snapshots" / "x" / MANIFEST).exists()
    finally:
        for shard in shards:
            shard.close()


def test_every_crafted_snapshot_is_refused_by_every_shard_with_no_live_row_changed(
    clusters: tuple[list[Shard], Path],
) -> None:
    """The figure for the closing note: every crafted case, loaded into both shards one
    after the other (the bad part is on one shard only in most cases: the other must
    refuse too, since each shard checks every part before it stages anything)."""
    shards, root = clusters
    before = state(shards)
    refused = changed = 0
    for index, (craft, _) in enumerate(CASES.values()):
        name = f"bad{index}"
        shutil.copytree(root / "good", root / name, symlinks=True)
        craft(root / name)
        for shard in shards:
            with pytest.raises(FailedPreconditionError):
                list(shard.admin.load_snapshot(name))
        refused += 1
        changed += changed_rows(before, state(shards))
    print(
        f"\n{refused} crafted snapshots refused by each of {SHARDS} shards, "
        f"{changed} live rows changed"
    )
    assert refused == len(CASES) >= 16
    assert changed == 0


def test_a_bad_part_on_shard_1_is_refused_through_the_cluster_admin(
    shard_server: Callable[..., Any], tmp_path: Path
) -> None:
    """Through gRPC and ClusterAdmin's fan-out (both shards load at once): an inf in part
    1 only is refused by shard 0 as well, and neither shard's rows change."""
    servers = [shard_server(shard_id=i, num_shards=SHARDS, tables=TABLES) for i in range(SHARDS)]
    shards = [server.shard for server in servers]
    push(shards, seed=1, step=1)
    save(shards, "good")
    push(shards, seed=2, step=2)
    root = tmp_path / "snapshots"
    shutil.copytree(root / "good", root / "bad", symlinks=True)
    inf_in_adam_state(root / "bad")
    shutil.copytree(root / "good", root / "listed", symlinks=True)
    retyped(_tables_as_list)(root / "listed")
    before = state(shards)
    with ClusterAdmin([s.address for s in servers], timeout_s=10.0) as admin:
        with pytest.raises(ShardError) as raised:
            admin.load_snapshot("bad")
        assert raised.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "part-00001-of-00002" in raised.value.details  # the bad part: shard 1's
        with pytest.raises(ShardError) as raised:  # "tables" a list: refused, not INTERNAL
            admin.load_snapshot("listed")
        assert raised.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "field 'tables' expected an object" in raised.value.details
        assert changed_rows(before, state(shards)) == 0
        admin.load_snapshot("good")  # the good one loads through the same path
    assert changed_rows(before, state(shards)) > 0
