"""A snapshot carries all training state: rows with their step stamps,
the step clock, admission counts (exact counter and Bloom filter), promotion counts and
adaptive bucket rows. In-process shards over real RocksDB and real snapshot files.

A 2-shard cluster trains five steps and saves; a new 2-shard cluster and a new 3-shard
cluster load the snapshot. Then all three take the same next step (training lookups and the
same gradients at step 6) and an evict. The reference is the cluster that never went through
a snapshot: every stored value (weights, optimizer state, step stamps, as raw bits), every
count, the clocks and the keys an evict removes must be the same, except where the manifest
says a piece of state cannot reshard (Bloom counters: element-wise max; bucket rows: mean),
which is checked against that rule computed here in numpy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierps.core.config import Admission
from tierps.server.config import ServerConfig
from tierps.server.shard import LookupBatch, PushBatch, Shard
from tierps.storage import TableConfig, optim
from tierps.storage.snapshot_format import CARRIES, CHECKSUM, MANIFEST, manifest_checksum
from tierps.storage.snapshot_reader import Snapshot

DIM = 4
TABLES = (
    TableConfig("plain", DIM, optimizer=optim.Adam(lr=0.01)),
    TableConfig("ttl", DIM, optimizer=optim.Adagrad(), steps_to_live=3),
    TableConfig("counter", DIM, optimizer=optim.Adagrad(), admit_after=3),
    TableConfig(
        "bloom",
        DIM,
        optimizer=optim.Adagrad(),
        admit_after=3,
        admission=Admission.BLOOM,
        max_elements=4096,
        false_positive_rate=0.01,
    ),
    TableConfig("adaptive", DIM, optimizer=optim.Adagrad(), hash_bucket_size=6, promote_after=3),
)
KEYS = np.arange(0, 240, dtype=np.int64)


def cluster(root: Path, tag: str, n: int) -> list[Shard]:
    return [
        Shard(
            ServerConfig(
                shard_id=i,
                num_shards=n,
                data_dir=root / f"{tag}-{i}",
                snapshot_dir=root / "snapshots",
                tables=TABLES,
            )
        )
        for i in range(n)
    ]


def train(shards: list[Shard], step: int) -> None:
    """A training step: a training lookup of a random subset of keys, then gradients for
    another subset (both sight keys without rows), on every table."""
    rng = np.random.default_rng(step)
    n = len(shards)
    looked = np.sort(rng.choice(KEYS, size=120, replace=False))
    pushed = np.sort(rng.choice(KEYS, size=120, replace=False))
    grads = rng.normal(size=(pushed.size, DIM)).astype(np.float32)
    for shard in shards:
        mine = looked % n == shard.shard_id
        shard.lookup([LookupBatch(t.name, DIM, looked[mine], True) for t in TABLES])
        mine = pushed % n == shard.shard_id
        shard.push_gradients(
            [PushBatch(t.name, DIM, pushed[mine], grads[mine], step) for t in TABLES]
        )


def stored(shards: list[Shard], name: str) -> tuple[np.ndarray, np.ndarray]:
    """Every stored row of a table over the cluster (weights, optimizer state, step stamps)
    as raw bits, by key."""
    keys, rows = [], []
    for shard in shards:
        table = shard.store.table(name)
        table.flush()
        for k, r in table.durable.export(1000):
            keys.append(k)
            rows.append(r.view(np.uint32))
    config = shards[0].store.table(name).config
    k = np.concatenate(keys) if keys else np.empty(0, np.int64)
    r = np.concatenate(rows) if rows else np.empty((0, config.stored_width), np.uint32)
    order = np.argsort(k)
    return k[order], r[order]


def looked_up(shards: list[Shard], name: str) -> np.ndarray:
    """Weights of every key by create=False lookups (stores and counts nothing), as bits."""
    n = len(shards)
    out = np.zeros((KEYS.size, DIM), np.float32)
    for shard in shards:
        mine = KEYS % n == shard.shard_id
        out[mine] = shard.lookup([LookupBatch(name, DIM, KEYS[mine], False)])[0]
    return out.view(np.uint32)


def counts(shards: list[Shard], name: str) -> np.ndarray:
    """Each key's count as its shard's admission filter or promotion counter holds it."""
    n = len(shards)
    out = np.zeros(KEYS.size, np.int64)
    for shard in shards:
        table = shard.store.table(name)
        counter = table.admission if table.admission is not None else table.buckets.counts
        mine = KEYS % n == shard.shard_id
        out[mine] = counter.estimate(KEYS[mine])
    return out


def clocks(shards: list[Shard], name: str) -> set[tuple[int, int]]:
    return {(s.store.table(name).current_step, s.store.table(name).first_step) for s in shards}


def same_rows(a: list[Shard], b: list[Shard], name: str, only: np.ndarray | None = None) -> None:
    ka, ra = stored(a, name)
    kb, rb = stored(b, name)
    if only is not None:
        ra, rb = ra[np.isin(ka, only)], rb[np.isin(kb, only)]
        ka, kb = ka[np.isin(ka, only)], kb[np.isin(kb, only)]
    assert np.array_equal(ka, kb), name
    assert np.array_equal(ra, rb), (name, int(np.count_nonzero((ra != rb).any(axis=1))))


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("state")
    source = cluster(root, "a", 2)
    for step in range(1, 6):
        train(source, step)
    for shard in source:
        list(shard.admin.save_part("s", "sid"))
    list(source[0].admin.commit_snapshot("s", "sid"))
    # the bucket rows of the source's shards, before anything more trains them
    buckets = [s.store.table("adaptive").buckets.rows.copy() for s in source]
    same = cluster(root, "b", 2)
    wider = cluster(root, "c", 3)
    one = cluster(root, "e", 1)
    for shard in same + wider + one:
        list(shard.admin.load_snapshot("s"))
    yield {"root": root, "a": source, "b": same, "c": wider, "e": one, "buckets": buckets}
    for shard in source + same + wider + one:
        shard.close()


def test_the_manifest_says_what_it_carries(clusters: dict[str, Any]) -> None:
    manifest = json.loads((clusters["root"] / "snapshots" / "s" / MANIFEST).read_text())
    assert manifest["format_version"] == 4
    assert manifest["carries"] == CARRIES
    for piece in ("step_clock", "admission_bloom", "bucket_rows", "not_carried"):
        assert piece in manifest["carries"]
    Snapshot(clusters["root"] / "snapshots", "s").verify()


@pytest.mark.parametrize("target", ["b", "c", "e"])  # 2 -> 2, 2 -> 3, 2 -> 1
def test_a_round_trip_keeps_rows_stamps_clocks_and_counts(
    clusters: dict[str, Any], target: str
) -> None:
    a, other = clusters["a"], clusters[target]
    assert clocks(a, "ttl") == {(5, 1)}  # every step reached both shards
    for config in TABLES:
        same_rows(a, other, config.name)  # stamps included: raw stored bits
        assert clocks(other, config.name) == clocks(a, config.name)
        if config.name == "adaptive" and target != "b":
            continue  # keys not promoted read a blend of buckets: the next test
        assert np.array_equal(looked_up(a, config.name), looked_up(other, config.name))
    for name in ("counter", "adaptive"):  # exact counts reshard by key
        assert counts(a, name).any()
        assert np.array_equal(counts(a, name), counts(other, name)), name
    if target == "b":
        assert np.array_equal(counts(a, "bloom"), counts(other, "bloom"))
        for i in range(2):
            assert np.array_equal(
                a[i].store.table("adaptive").buckets.rows,
                other[i].store.table("adaptive").buckets.rows,
            )
    else:
        # a Bloom filter cannot be split by key: every new shard holds the element-wise max
        # of the old counters, so no key's estimate falls below its count on the source
        assert (counts(other, "bloom") >= counts(a, "bloom")).all()
        merged = np.maximum(*(s.store.table("bloom").admission.counters for s in a))
        for shard in other:
            assert np.array_equal(shard.store.table("bloom").admission.counters, merged)


def test_a_reshard_gives_every_shard_the_mean_of_the_bucket_rows(
    clusters: dict[str, Any],
) -> None:
    old = clusters["buckets"]
    assert not np.array_equal(old[0], old[1])  # trained differently on the two shards
    mean = ((old[0].astype(np.float64) + old[1].astype(np.float64)) / 2).astype(np.float32)
    for shard in clusters["c"] + clusters["e"]:
        assert np.array_equal(shard.store.table("adaptive").buckets.rows, mean)


def test_the_next_step_and_an_evict_are_the_same_after_a_round_trip(
    clusters: dict[str, Any],
) -> None:
    a, b = clusters["a"], clusters["b"]
    promoted = stored(a, "adaptive")[0]  # keys with rows of their own before the step
    for shards in (a, b, clusters["c"], clusters["e"]):
        train(shards, 6)
    for config in TABLES:
        same_rows(a, b, config.name)
        assert np.array_equal(looked_up(a, config.name), looked_up(b, config.name))
    for c in (clusters["c"], clusters["e"]):
        check_resharded_step(a, c, promoted)
    removed = {}
    for tag in "abce":
        shards = clusters[tag]
        before = stored(shards, "ttl")[0]
        total = sum(shard.maintenance.evict("ttl")["removed"] for shard in shards)
        after = stored(shards, "ttl")[0]
        assert total == before.size - after.size > 0
        removed[tag] = np.setdiff1d(before, after)
    for tag in "bce":
        assert np.array_equal(removed["a"], removed[tag]), tag
    print(
        f"\nsnapshot state: {len(TABLES)} lifecycle tables identical after 2->2, 2->3 and "
        f"2->1; evict removed the same {removed['a'].size} keys on all four"
    )


def check_resharded_step(a: list[Shard], c: list[Shard], promoted: np.ndarray) -> None:
    """After the next step on the source `a` and a resharded copy `c`: every table the same,
    bit for bit; adaptive: the rows of keys promoted before the step (`promoted`) and which
    keys have rows (keys promoted at this step start from a blended bucket on `c`)."""
    for config in TABLES:
        if config.name == "adaptive":
            # own rows trained the same; which keys hold one is the same (counts are exact)
            same_rows(a, c, config.name, only=promoted)
            assert np.array_equal(stored(a, config.name)[0], stored(c, config.name)[0])
        elif config.name == "bloom":
            # no key was admitted early here: the max held no key of this test above its
            # count (m = 39k counters for 240 keys); the rule itself is checked above
            assert np.array_equal(counts(a, "bloom"), counts(c, "bloom"))
            same_rows(a, c, config.name)
        else:
            same_rows(a, c, config.name)
            assert np.array_equal(looked_up(a, config.name), looked_up(c, config.name))


def as_version_2(snapshot: Path) -> None:
    """Rewrite a format 3 snapshot as format 2 wrote it: keys and rows files only, no
    state, no "carries"; every checksum recomputed."""
    import hashlib

    def entry(path: Path) -> dict[str, Any]:
        data = path.read_bytes()
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    state_files = ("steps_file", "buckets_file", "promotion_file", "admission_file")
    manifest = json.loads((snapshot / MANIFEST).read_text())
    for header_path in (snapshot / manifest["save_id"]).glob("part-*.json"):
        header = json.loads(header_path.read_text())
        header["format_version"] = 2
        for table in header["tables"].values():
            table.pop("state")
            for field in state_files:
                if field in table:
                    (snapshot / table.pop(field)["path"]).unlink()
        header_path.write_text(json.dumps(header))
    manifest["format_version"] = 2
    manifest.pop("carries")
    for table in manifest["tables"].values():
        for part in table["parts"]:
            part.pop("state")
            for field in state_files:
                part.pop(field, None)
            part["header_file"].update(entry(snapshot / part["header_file"]["path"]))
    manifest[CHECKSUM] = manifest_checksum(manifest)
    (snapshot / MANIFEST).write_text(json.dumps(manifest))


def test_a_version_2_snapshot_still_loads_with_rows_only(clusters: dict[str, Any]) -> None:
    """Format 2 carried rows only: they load as they are; step stamps and clocks start at
    0, bucket rows at their initial values, and no key is counted."""
    import shutil

    from tierps.storage.adaptive import BucketRows

    root = clusters["root"] / "snapshots"
    shutil.copytree(root / "s", root / "old")
    as_version_2(root / "old")
    opened = Snapshot(root, "old")
    assert opened.version == 2
    opened.verify()
    shards = cluster(clusters["root"], "d", 2)
    try:
        for shard in shards:
            list(shard.admin.load_snapshot("old"))
        for config in TABLES:
            parts = [
                chunk
                for part in opened.tables[config.name]["parts"]
                for chunk in opened.read_part(config.name, part)
            ]
            keys = np.concatenate([k for k, _, _ in parts])
            rows = np.concatenate([r for _, r, _ in parts])[np.argsort(keys)]
            got_keys, got = stored(shards, config.name)
            assert np.array_equal(got_keys, np.sort(keys))
            assert np.array_equal(got[:, : config.row_width], rows.view(np.uint32))
            assert not got[:, config.row_width :].any()  # step stamps 0
            assert clocks(shards, config.name) == {(0, 0)}
        assert not counts(shards, "counter").any() and not counts(shards, "adaptive").any()
        initial = BucketRows(TABLES[-1]).rows
        for shard in shards:
            assert np.array_equal(shard.store.table("adaptive").buckets.rows, initial)
    finally:
        for shard in shards:
            shard.close()
