"""Incremental snapshots at the edges between operations, against real shard servers on
port 0, real RocksDB and real snapshot files: links saved by different shard counts, tables
dropped, re-created or created between links, a load between a base and its incremental, a
change of a row's step stamp only, cold rows rounded in RocksDB, a corrupted middle link, a
base deleted while an incremental is saved on it, a shard killed -9 while it saves one.

The oracle is the training cluster itself, as in test_incremental_snapshots.py: every
shard's stored rows of every table (weights, optimizer state and step stamps, as raw bits,
through the storage export) right after each save returns.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tests.integration.test_crash_safety import free_base_port
from tests.integration.test_incremental_snapshots import (
    ADA,
    ADAM,
    KEYS,
    ServerFactory,
    assert_same,
    client_of,
    start,
    state,
    train,
)
from tierps.client import EmbeddingClient, ShardError
from tierps.server.cluster import LocalCluster
from tierps.storage import TableConfig, init, optim

SGD = TableConfig("sgd", 4, optimizer=optim.SGD(lr=0.5), seed=7)


def test_each_link_saved_by_another_shard_count_loads_into_yet_another(
    shard_server: ServerFactory,
) -> None:
    """full by 2 shards, inc1 by 3 (after loading full), inc2 by 1 (after loading inc1):
    every link takes the compare path, and the chain loads into 2 shards row for row."""
    cuts: dict[str, dict[str, Any]] = {}
    first = start(shard_server, 2)
    with client_of(first) as client:
        for config in (ADA, ADAM):
            client.create_table(config)
        for step in (1, 2):
            train(client, [ADA, ADAM], KEYS, step)
        client.save_snapshot("full")
        cuts["full"] = state(first)

    second = start(shard_server, 3)
    with client_of(second) as client:
        client.load_snapshot("full")
        train(client, [ADA, ADAM], KEYS[:150], 3)
        saved = client.save_snapshot("inc1", base="full")
        assert saved["diffs"] == [{"ada": "compare", "adam": "compare"}] * 3
        assert saved["rows"] == 2 * 150  # exactly the rows pushed since
        cuts["inc1"] = state(second)

    third = start(shard_server, 1)
    with client_of(third) as client:
        client.load_snapshot("inc1")
        # ada's rows last pushed at step 1..2 go stale at 6 (those of step 3 do not)
        train(client, [ADA, ADAM], KEYS[100:400], 6)
        assert client.evict("ada")["removed"] == KEYS.size - 400
        saved = client.save_snapshot("inc2", base="inc1")
        assert saved["diffs"] == [{"ada": "compare", "adam": "compare"}]
        cuts["inc2"] = state(third)

    target = start(shard_server, 2)
    with client_of(target) as client:
        for name in ("inc1", "inc2"):
            client.load_snapshot(name)
            assert_same(state(target), cuts[name], f"snapshot {name!r} into 2 shards")


def test_tables_recreated_created_or_dropped_between_base_and_incremental(
    shard_server: ServerFactory,
) -> None:
    """ada re-created with another dim and optimizer (written whole), adam re-created with
    the same config (a new journal: compared), sgd dropped (absent after a load into a
    fresh cluster), late created (written whole)."""
    source = start(shard_server, 2)
    with client_of(source) as client:
        for config in (ADA, ADAM, SGD):
            client.create_table(config)
        train(client, [ADA, ADAM, SGD], KEYS, 1)
        client.save_snapshot("base")
        client.drop_table("ada")
        wider = TableConfig("ada", 16, optimizer=optim.Adam(lr=0.01), seed=9)
        client.create_table(wider)
        train(client, [wider], KEYS[::3], 2)
        client.drop_table("adam")
        client.create_table(ADAM)
        train(client, [ADAM], KEYS[:40], 2)  # the other keys are gone: tombstones
        client.drop_table("sgd")
        late = TableConfig("late", 4, optimizer=optim.Adagrad(), seed=8)
        client.create_table(late)
        train(client, [late], KEYS[::5], 2)
        saved = client.save_snapshot("inc", base="base")
        assert saved["diffs"] == [{"ada": "all", "adam": "compare", "late": "all"}] * 2
        cut = state(source)

    target = start(shard_server, 3)
    with client_of(target) as client:
        client.load_snapshot("inc")
        assert sorted(c.name for c in target[0].shard.admin.list_tables()) == [
            "ada",
            "adam",
            "late",
        ]
        assert target[0].shard.store.table("ada").config.dim == 16
        assert_same(state(target), cut, "the incremental into 3 shards")


def test_a_load_between_base_and_incremental_takes_the_compare_path(
    shard_server: ServerFactory,
) -> None:
    """A load restarts the tables' journals: the base's cursors are of the old ones, so the
    incremental compares, and loads as the live tables were at its cut."""
    source = start(shard_server, 2)
    with client_of(source) as client:
        for config in (ADA, ADAM):
            client.create_table(config)
        train(client, [ADA, ADAM], KEYS, 1)
        client.save_snapshot("base")
        train(client, [ADA, ADAM], KEYS[:500], 2)
        client.save_snapshot("other")  # a full snapshot of another state
        train(client, [ADA, ADAM], KEYS[300:700], 3)
        client.load_snapshot("other")  # back to step 2's rows, on new journals
        train(client, [ADA, ADAM], KEYS[600:650], 4)
        saved = client.save_snapshot("inc", base="base")
        assert saved["diffs"] == [{"ada": "compare", "adam": "compare"}] * 2
        cut = state(source)
        # and a load of the base itself, then an incremental on it: nothing changed since
        client.load_snapshot("base")
        again = client.save_snapshot("inc-after-load", base="base")
        assert again["rows"] == 0, again
        base_cut = state(source)

    target = start(shard_server, 3)
    with client_of(target) as client:
        client.load_snapshot("inc")
        assert_same(state(target), cut, "the incremental over a load")
        client.load_snapshot("inc-after-load")
        assert_same(state(target), base_cut, "the incremental right after loading its base")


@pytest.mark.parametrize("cold", ["float32", "bfloat16"])
def test_journal_and_compare_give_bit_identical_tables_after_a_link_with_no_changes(
    shard_server: ServerFactory, tmp_path: Path, cold: str
) -> None:
    """full -> inc1 (nothing changed: no rows), then pushes of zero gradients (the step stamp
    moves, weights and state do not) and of others; then the incremental over inc1 saved by
    the journal, and again by the compare path after a restart. Both must load the rows the
    cluster held, step stamps included; with bfloat16 cold rows, as RocksDB rounds them (as
    a full save holds them)."""
    config = TableConfig(
        "t", 8, optimizer=optim.Adagrad(lr=0.1), steps_to_live=50, seed=3, cold_dtype=cold
    )
    data = tmp_path / "source"
    source = start(shard_server, 2, data)
    with client_of(source) as client:
        client.create_table(config)
        train(client, [config], KEYS, 1)
        client.save_snapshot("full")
        assert client.save_snapshot("inc1", base="full")["rows"] == 0
        zeros = np.zeros((200, config.dim), np.float32)
        client.push_gradients("t", KEYS[:200], zeros, step=5)  # only the stamps move
        train(client, [config], KEYS[200:260], 5)
        journal = client.save_snapshot("by-journal", base="inc1")
        assert journal["diffs"] == [{"t": "journal"}] * 2
        assert journal["rows"] == 260
    cut = state(source)
    assert np.all(cut["t"][2][:260] == 5)  # the zero pushes did move the stamps
    for server in source:
        server.stop(grace_s=0.5)
    source = start(shard_server, 2, data)
    assert_same(state(source), cut, "after the restart")
    with client_of(source) as client:
        compared = client.save_snapshot("by-compare", base="inc1")
        assert compared["diffs"] == [{"t": "compare"}] * 2
        assert compared["rows"] == 260
        # the journal's link holds the rows as RocksDB rounds them, so comparing with it
        # finds nothing changed since
        assert client.save_snapshot("nothing-new", base="by-journal")["rows"] == 0

    target = start(shard_server, 3)
    with client_of(target) as client:
        for name in ("by-journal", "by-compare"):
            client.load_snapshot(name)
            assert_same(state(target), cut, f"snapshot {name!r}")


def test_a_corrupted_middle_link_refuses_the_load_naming_it(
    shard_server: ServerFactory, tmp_path: Path
) -> None:
    data = tmp_path / "source"
    source = start(shard_server, 2, data)
    with client_of(source) as client:
        for config in (ADA, ADAM):
            client.create_table(config)
        train(client, [ADA, ADAM], KEYS, 1)
        client.save_snapshot("full")
        train(client, [ADA, ADAM], KEYS[:50], 2)
        client.save_snapshot("inc1", base="full")
        train(client, [ADA, ADAM], KEYS[:70], 3)
        client.save_snapshot("inc2", base="inc1")
        train(client, [ADA, ADAM], KEYS[:90], 4)
        live = state(source)
        rows_file = next((tmp_path / "snapshots" / "inc1").glob("*/part-00000-of-00002/ada.rows"))
        flipped = bytearray(rows_file.read_bytes())
        flipped[9] ^= 0x01
        rows_file.write_bytes(bytes(flipped))
        with pytest.raises(ShardError) as refused:
            client.load_snapshot("inc2")
        assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "snapshot 'inc1'" in refused.value.details, refused.value.details
        assert "ada.rows is corrupted" in refused.value.details
        assert_same(state(source), live, "after a refused load")
    # after a restart (new journals) an incremental on that chain must compare with it:
    # refused too, rather than saved over rows it could not read
    for server in source:
        server.stop(grace_s=0.5)
    source = start(shard_server, 2, data)
    with client_of(source) as client:
        with pytest.raises(ShardError) as refused:
            client.save_snapshot("inc3", base="inc2")
        assert "snapshot 'inc1'" in refused.value.details, refused.value.details
        assert "ada.rows is corrupted" in refused.value.details
        assert "inc3" not in {s["name"] for s in client.list_snapshots()}


def test_a_base_deleted_while_an_incremental_is_saved_on_it_fails_the_commit(
    shard_server: ServerFactory,
) -> None:
    """The parts are written on the base; before the commit, the base is deleted (it has no
    complete dependent yet). The commit must refuse, not leave a snapshot no load can read."""
    source = start(shard_server, 2)
    with client_of(source) as client:
        client.create_table(ADAM)
        train(client, [ADAM], KEYS, 1)
        client.save_snapshot("base")
        train(client, [ADAM], KEYS[:20], 2)
        for server in source:  # the write phase, as save_snapshot sends it
            list(server.shard.admin.save_part("inc", "a" * 32, base="base"))
        client.delete_snapshot("base")
        with pytest.raises(Exception, match="base") as refused:
            list(source[0].shard.admin.commit_snapshot("inc", "a" * 32))
        assert "'base'" in str(refused.value)
        assert not any(s["name"] == "inc" and s["complete"] for s in client.list_snapshots())


@pytest.mark.slow  # subprocess shards, one killed -9
def test_a_shard_killed_during_an_incremental_save_leaves_nothing_and_the_next_one_works(
    shard_server: ServerFactory, tmp_path: Path
) -> None:
    """Shard 1 of a LocalCluster is killed -9 while it writes its part of an incremental.
    The save fails; the restarted shard removes its abandoned part and gc the rest, as for
    a full save; a new incremental on the same base then compares on shard 1 (its journal
    restarted) and reads its journal on shard 0, and loads as the live cluster is."""
    counting = TableConfig("c", 32, initializer=init.Zeros(), optimizer=optim.SGD(lr=1.0))
    keys = np.arange(150_000, dtype=np.int64)
    snapshots = tmp_path / "snapshots"

    def push(client: EmbeddingClient, some: np.ndarray) -> None:
        client.push_gradients("c", some, -np.ones((some.size, 32), np.float32))

    cluster = LocalCluster(
        2, tmp_path / "data", snapshots, start_timeout_s=60, base_port=free_base_port(2)
    )
    with cluster:
        with EmbeddingClient(cluster.addresses, timeout_s=60) as client:
            client.create_table(counting)
            push(client, keys)
            client.save_snapshot("base")
            push(client, keys)  # every row changed: the incremental writes them all
            failed: list[BaseException] = []

            def save() -> None:
                try:
                    client.save_snapshot("inc", base="base")
                except Exception as error:  # noqa: BLE001 - the test reads it below
                    failed.append(error)

            saver = threading.Thread(target=save)
            saver.start()
            deadline = time.monotonic() + 30
            marker = None
            while marker is None and time.monotonic() < deadline:
                marker = next(snapshots.glob("inc/*/.part-00001-of-00002.writing"), None)
            assert marker is not None, "shard 1 never began its part"
            assert cluster.stop_shard(1, sig=signal.SIGKILL) == -signal.SIGKILL
            header_written = (marker.parent / "part-00001-of-00002.json").exists()
            print(f"shard 1 killed {'after' if header_written else 'while'} writing its part")
            saver.join(timeout=120)
            assert not saver.is_alive()
            assert failed and isinstance(failed[0], ShardError), failed
        cluster.start_shard(1)  # its start collects its own abandoned part
        assert not (marker.parent / "part-00001-of-00002").exists() or header_written
        with EmbeddingClient(cluster.addresses, timeout_s=60) as client:
            client.gc_snapshots()
            assert [s["name"] for s in client.list_snapshots()] == ["base"]
            assert not (snapshots / "inc").exists()
            push(client, keys[::3])
            saved = client.save_snapshot("inc", base="base")
            assert saved["diffs"] == [{"c": "journal"}, {"c": "compare"}]
            live = client.lookup("c", keys, create=False)
    target = shard_server(0, 1)
    with client_of([target]) as client:
        client.load_snapshot("inc")
        loaded = client.lookup("c", keys, create=False)
    np.testing.assert_array_equal(loaded.view(np.uint32), live.view(np.uint32))
