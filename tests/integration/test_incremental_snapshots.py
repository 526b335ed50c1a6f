"""Incremental snapshots against real shard servers on port 0, real RocksDB and real
snapshot files.

The reference is the training cluster itself: right after each save returns (no call runs
in between), every shard's stored rows of every table - weights, optimizer state and step
stamps, as raw bits, through the storage export - are what the snapshot must give back. A
chain saved by 2 shards loads into 3, link by link, and must give exactly those rows; the
journal path and the compare path (forced by restarting the shards on their data dirs) must
load the same rows; pushes running during a save are wholly in or out of it; a base a kept
incremental needs cannot be deleted; a corrupted incremental is refused whole.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tierps.client import EmbeddingClient, ShardError
from tierps.core.errors import Reason
from tierps.server import cli
from tierps.server.daemon import ShardServer
from tierps.storage import TableConfig, init, optim
from tierps.storage.snapshot_format import MANIFEST

ServerFactory = Callable[..., ShardServer]
KEYS = np.arange(0, 1200, dtype=np.int64)
ADA = TableConfig("ada", 8, optimizer=optim.Adagrad(lr=0.1), steps_to_live=4, seed=3)
ADAM = TableConfig("adam", 4, optimizer=optim.Adam(lr=0.02), seed=4, host_cache_bytes=4096)
GONE = TableConfig("gone", 4, optimizer=optim.SGD(lr=0.5), seed=5)  # dropped after the base
LATE = TableConfig("late", 4, optimizer=optim.Adagrad(), seed=6)  # created after the base


def start(
    shard_server: ServerFactory, shards: int, data_root: Path | None = None
) -> list[ShardServer]:
    """A cluster of in-process shard servers (data dirs under data_root: the same dirs
    again for a restart; None: new ones), sharing the test's snapshot dir."""
    return [
        shard_server(
            shard_id=i,
            num_shards=shards,
            data_dir=None if data_root is None else data_root / f"shard-{i}",
        )
        for i in range(shards)
    ]


def client_of(servers: list[ShardServer]) -> EmbeddingClient:
    return EmbeddingClient([s.address for s in servers], timeout_s=30)


def stored(servers: list[ShardServer], table: str) -> tuple[np.ndarray, np.ndarray, Any]:
    """Every shard's stored (keys, rows: weights and optimizer state, step stamps or None) of
    a table, through the storage export, merged in key order."""
    keys, rows, steps = [], [], []
    for server in servers:
        for k, r, s in server.shard.store.table(table).export_stored(chunk_rows=500):
            keys.append(k)
            rows.append(r)
            steps.append(s)
    merged = np.concatenate(keys)
    order = np.argsort(merged)
    return (
        merged[order],
        np.concatenate(rows)[order],
        None if steps[0] is None else np.concatenate(steps)[order],
    )


def state(servers: list[ShardServer]) -> dict[str, Any]:
    tables = {config.name for config in servers[0].shard.admin.list_tables()}
    return {name: stored(servers, name) for name in sorted(tables)}


def assert_same(found: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    for name, (keys, rows, steps) in expected.items():
        got_keys, got_rows, got_steps = found[name]
        np.testing.assert_array_equal(got_keys, keys, err_msg=f"{what}: {name} keys")
        # raw bits: weights and optimizer state exactly
        np.testing.assert_array_equal(
            got_rows.view(np.uint32), rows.view(np.uint32), err_msg=f"{what}: {name} rows"
        )
        if steps is not None:
            np.testing.assert_array_equal(got_steps, steps, err_msg=f"{what}: {name} steps")


def train(client: EmbeddingClient, tables: list[TableConfig], keys: np.ndarray, step: int) -> None:
    rng = np.random.default_rng(step)
    for config in tables:
        grads = rng.normal(size=(keys.size, config.dim)).astype(np.float32)
        client.push_gradients(config.name, keys, grads, step=step)


def test_a_chain_of_three_incrementals_saved_by_2_shards_loads_into_3_row_for_row(
    shard_server: ServerFactory,
) -> None:
    source = start(shard_server, 2)
    cuts: dict[str, dict[str, Any]] = {}
    with client_of(source) as client:
        for config in (ADA, ADAM, GONE):
            client.create_table(config)
        for step in (1, 2):
            train(client, [ADA, ADAM, GONE], KEYS, step)
        assert client.save_snapshot("full")["diffs"] == [{}, {}]
        cuts["full"] = state(source)

        # inc1: a few rows changed, a table dropped, a table created
        train(client, [ADA, ADAM], KEYS[:100], 3)
        client.drop_table("gone")
        client.create_table(LATE)
        train(client, [LATE], KEYS[::7], 3)
        saved = client.save_snapshot("inc1", base="full")
        assert saved["diffs"] == [{"ada": "journal", "adam": "journal", "late": "all"}] * 2
        assert saved["rows"] < KEYS.size  # the changed rows only (and 'late''s)
        cuts["inc1"] = state(source)

        # inc2: ada's rows not pushed since step 1..2 go stale and are evicted: tombstones
        train(client, [ADA, ADAM, LATE], KEYS[:300], 6)
        evicted = client.evict("ada")["removed"]
        assert evicted == KEYS.size - 300
        client.save_snapshot("inc2", base="inc1")
        cuts["inc2"] = state(source)
        assert 900 not in cuts["inc2"]["ada"][0] and 900 in cuts["inc1"]["ada"][0]

        # inc3: keys come back (a removed key reads its initial row again) and others change
        train(client, [ADA, ADAM, LATE], KEYS[850:950], 7)
        client.save_snapshot("inc3", base="inc2")
        cuts["inc3"] = state(source)

        listed = {s["name"]: s for s in client.list_snapshots()}
        assert listed["inc3"]["base"] == "inc2"
        assert listed["inc3"]["chain"] == ["inc2", "inc1", "full"]
        assert listed["full"]["base"] == "" and listed["full"]["chain"] == []

    target = start(shard_server, 3)
    with client_of(target) as client:
        for name in ("full", "inc1", "inc2", "inc3"):
            client.load_snapshot(name)
            assert_same(state(target), cuts[name], f"snapshot {name!r} into 3 shards")
            ada_keys = stored(target, "ada")[0]
            # a tombstoned (evicted) row is absent after the load, and back once re-pushed
            assert (1100 in ada_keys) == (name in ("full", "inc1")), name
            assert (900 in ada_keys) == (name != "inc2"), name


def test_the_compare_path_loads_the_same_rows_as_the_journal_path(
    shard_server: ServerFactory, tmp_path: Path
) -> None:
    source = start(shard_server, 2, tmp_path / "source")
    with client_of(source) as client:
        for config in (ADA, ADAM):
            client.create_table(config)
        for step in (1, 2):
            train(client, [ADA, ADAM], KEYS, step)
        client.save_snapshot("base")
        for step in (5, 6):  # rows not pushed since step 2 go stale at step 6: tombstones
            train(client, [ADA, ADAM], KEYS[:200], step)
        assert client.evict("ada")["removed"] == KEYS.size - 200
        journal = client.save_snapshot("by-journal", base="base")
    assert journal["diffs"] == [{"ada": "journal", "adam": "journal"}] * 2
    cut = state(source)
    for server in source:
        server.stop(grace_s=0.5)
    # the same data dirs: a new life, a new journal, so the base's cursors are not answerable
    source = start(shard_server, 2, tmp_path / "source")
    assert_same(state(source), cut, "after the restart")
    with client_of(source) as client:
        compared = client.save_snapshot("by-compare", base="base")
    assert compared["diffs"] == [{"ada": "compare", "adam": "compare"}] * 2
    assert compared["rows"] <= journal["rows"]

    target = start(shard_server, 3)
    with client_of(target) as client:
        for name in ("by-journal", "by-compare"):
            client.load_snapshot(name)
            assert_same(state(target), cut, f"snapshot {name!r}")


def test_pushes_acknowledged_before_an_incremental_save_are_in_it_and_none_after(
    shard_server: ServerFactory,
) -> None:
    config = TableConfig("t", 4, initializer=init.Zeros(), optimizer=optim.SGD(lr=1.0))
    source = start(shard_server, 2)
    block = 16  # each push: the next block of keys, set to -1 from 0
    with client_of(source) as client:
        client.create_table(config)
        client.push_gradients("t", np.arange(block), np.ones((block, 4), np.float32), step=1)
        client.save_snapshot("base")
        acked = [1]  # blocks pushed and acknowledged
        stop = threading.Event()

        def pusher() -> None:
            with client_of(source) as other:
                while not stop.is_set():
                    keys = np.arange(acked[0] * block, (acked[0] + 1) * block)
                    other.push_gradients("t", keys, np.ones((block, 4), np.float32), step=1)
                    acked[0] += 1

        thread = threading.Thread(target=pusher)
        thread.start()
        try:
            time.sleep(0.1)
            before = acked[0]
            client.save_snapshot("during", base="base")
            after = acked[0]
        finally:
            stop.set()
            thread.join(timeout=30)
    target = start(shard_server, 1)
    with client_of(target) as client:
        client.load_snapshot("during")
    keys, rows, _ = stored(target, "t")
    # every push acknowledged before the save began is in it, none begun after it ended;
    # each shard cuts on its own, so a push in flight may be in one shard's part only
    assert set(range(before * block)) <= set(keys.tolist()), before
    assert keys.max() < (after + 1) * block, (keys.max(), after)
    for shard in range(2):  # each shard's part holds its pushes in order: a prefix
        mine = keys[keys % 2 == shard]
        np.testing.assert_array_equal(mine, np.arange(shard, 2 * mine.size, 2))
    np.testing.assert_array_equal(rows, -np.ones_like(rows))  # each push applied once


def test_a_needed_base_cannot_be_deleted_and_gc_keeps_it(shard_server: ServerFactory) -> None:
    source = start(shard_server, 2)
    with client_of(source) as client:
        client.create_table(ADAM)
        train(client, [ADAM], KEYS, 1)
        client.save_snapshot("full")
        train(client, [ADAM], KEYS[:10], 2)
        client.save_snapshot("inc1", base="full")
        train(client, [ADAM], KEYS[:10], 3)
        client.save_snapshot("inc2", base="inc1")
        for name, needed_by in (("full", "inc1, inc2"), ("inc1", "inc2")):
            with pytest.raises(ShardError) as refused:
                client.delete_snapshot(name)
            assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
            assert refused.value.reason == Reason.SNAPSHOT_NEEDED.value
            assert f"needed by the incremental snapshots {needed_by}" in refused.value.details
        assert client.gc_snapshots() == []
        assert [s["name"] for s in client.list_snapshots()] == ["full", "inc1", "inc2"]
        client.delete_snapshot("inc2")  # newest first: each is free once nothing needs it
        client.delete_snapshot("inc1")
        client.delete_snapshot("full")
        assert client.list_snapshots() == []


def test_a_corrupted_incremental_or_a_replaced_base_is_refused_whole(
    shard_server: ServerFactory, tmp_path: Path
) -> None:
    source = start(shard_server, 2)
    with client_of(source) as client:
        for config in (ADA, ADAM):
            client.create_table(config)
        train(client, [ADA, ADAM], KEYS, 1)
        client.save_snapshot("full")
        train(client, [ADA, ADAM], KEYS[:50], 2)
        client.save_snapshot("inc", base="full")
        train(client, [ADA, ADAM], KEYS[:70], 3)  # the live rows differ from the snapshots
        live = state(source)
        snapshots = tmp_path / "snapshots"
        rows_file = next((snapshots / "inc").glob("*/part-00001-of-00002/adam.rows"))
        data = bytearray(rows_file.read_bytes())
        data[5] ^= 0x40
        rows_file.write_bytes(bytes(data))
        with pytest.raises(ShardError) as refused:
            client.load_snapshot("inc")
        assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "snapshot 'inc'" in refused.value.details
        assert "adam.rows is corrupted" in refused.value.details
        assert_same(state(source), live, "after a refused load")

        data[5] ^= 0x40  # mended: the link is fine, but its base is replaced by another save
        rows_file.write_bytes(bytes(data))
        client.delete_snapshot("inc")
        client.save_snapshot("inc", base="full")  # a new save of the incremental, then a new
        manifest = (snapshots / "inc" / MANIFEST).read_text()  # base under the old name
        (snapshots / "inc" / MANIFEST).rename(tmp_path / "inc-manifest")
        client.delete_snapshot("full")
        client.save_snapshot("full")
        (tmp_path / "inc-manifest").rename(snapshots / "inc" / MANIFEST)
        assert (snapshots / "inc" / MANIFEST).read_text() == manifest
        with pytest.raises(ShardError) as refused:
            client.load_snapshot("inc")
        assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "link 'inc' builds on snapshot 'full' of save" in refused.value.details
        assert "the base was replaced since" in refused.value.details
        assert_same(state(source), live, "after a refused load")

        client.delete_snapshot("inc")
        client.delete_snapshot("full")
        with pytest.raises(ShardError) as refused:  # a missing base: refused, not loaded
            client.save_snapshot("again", base="full")
        assert refused.value.code is grpc.StatusCode.NOT_FOUND


def test_the_cli_saves_an_incremental_and_lists_its_chain(
    shard_server: ServerFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    source = start(shard_server, 2)
    addresses = ",".join(s.address for s in source)
    with client_of(source) as client:
        client.create_table(ADAM)
        train(client, [ADAM], KEYS, 1)
        client.save_snapshot("full")
        train(client, [ADAM], KEYS[:30], 2)

    def admin(*args: str) -> str:
        code = cli.main(["admin", *args, "--addresses", addresses])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        return captured.out

    out = admin("snapshot", "save", "inc", "--base", "full")
    assert "saved snapshot 'inc': 30 rows" in out  # the 30 rows pushed since, no more
    assert "incremental over 'full': changes found by adam: journal (shards 0, 1)" in out
    listed = {line.split()[0]: line.split() for line in admin("snapshot", "list").splitlines()}
    assert listed["inc"][:4] == ["inc", "yes", "2", "full"]
    assert listed["full"][:4] == ["full", "yes", "2", "full"]
