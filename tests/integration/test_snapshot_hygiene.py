"""The snapshot directory kept to itself and clean, against real shard servers: a name
that is a symlink out of it is refused, a full file system (a real small tmpfs) answers
RESOURCE_EXHAUSTED naming the path and the shard and leaves no partial save, and what a
failed save left is listed and removed by `tierps admin snapshot delete` / `snapshot gc`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests.fault_fs import fill, small_tmpfs
from tierps.client import EmbeddingClient, ShardError, TableConfig
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.server import cli
from tierps.server.daemon import ShardServer

CODE = grpc.StatusCode
DIM = 16


def cluster(
    shard_server: Callable[..., ShardServer], snapshot_dir: Path, shards: int = 2
) -> tuple[list[ShardServer], EmbeddingClient]:
    servers = [
        shard_server(shard_id=i, num_shards=shards, snapshot_dir=snapshot_dir)
        for i in range(shards)
    ]
    client = EmbeddingClient([s.address for s in servers], timeout_s=30)
    client.create_table(TableConfig(name="t", dim=DIM))
    keys = np.arange(2000)
    client.assign("t", keys, np.ones((keys.size, DIM), np.float32))
    return servers, client


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_snapshot_name_that_is_a_symlink_out_of_the_dir_is_refused(
    shard_server: Callable[..., ShardServer], tmp_path: Path
) -> None:
    root, outside = tmp_path / "snapshots", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    servers, client = cluster(shard_server, root)
    with client:
        (root / "escape").symlink_to(outside, target_is_directory=True)
        (root / "dangling").symlink_to(tmp_path / "not-yet")
        for name in ("escape", "dangling"):
            for action in (client.save_snapshot, client.load_snapshot):
                with pytest.raises(ShardError) as refused:
                    action(name)
                assert refused.value.code is CODE.FAILED_PRECONDITION
                assert "a symlink out of it" in refused.value.details
        assert tree(outside) == [] and not (tmp_path / "not-yet").exists()
        assert [s["name"] for s in client.list_snapshots()] == []  # links out: not listed
        client.save_snapshot("fine")  # a plain name still saves
        assert [s["name"] for s in client.list_snapshots()] == ["fine"]


def test_a_full_snapshot_dir_answers_resource_exhausted_and_leaves_no_partial_save(
    shard_server: Callable[..., ShardServer], tmp_path: Path
) -> None:
    with small_tmpfs(tmp_path / "fs", megabytes=4) as fs:
        root = fs / "snapshots"
        root.mkdir()
        servers, client = cluster(shard_server, root)
        with client:
            fill(fs, leave_bytes=64 << 10)  # the parts need ~130 KiB of rows
            with pytest.raises(ShardError) as refused:
                client.save_snapshot("s")
            assert refused.value.code is CODE.RESOURCE_EXHAUSTED
            details = refused.value.details
            assert "file system is full" in details
            assert f"shard {refused.value.shard_id}'s part" in details
            assert str(root / "s") in details  # the path written
            assert tree(root) == []  # the failed save's parts removed, both shards'
            (fs / "filler").unlink()
            assert client.save_snapshot("s")["rows"] == 2000  # with space, it saves


def test_failed_saves_are_listed_and_removed_by_snapshot_gc_and_delete(
    shard_server: Callable[..., ShardServer], tmp_path: Path
) -> None:
    root = tmp_path / "snapshots"
    servers, client = cluster(shard_server, root)
    with client:
        client.save_snapshot("kept")
        # a save whose client went away after the parts: incomplete, never committed
        for server in servers:
            with grpc.insecure_channel(server.address) as channel:
                request = pb.SaveSnapshotRequest(
                    name="orphan", phase=pb.SAVE_PHASE_WRITE_PART, save_id="lost"
                )
                list(pb_grpc.AdminServiceStub(channel).SaveSnapshot(request, timeout=30))
        (root / "kept" / "old-save").mkdir()  # a failed earlier save under a kept name
        listed = {s["name"]: s["complete"] for s in client.list_snapshots()}
        assert listed == {"kept": True, "orphan": False}
        addresses = ",".join(s.address for s in servers)
        gc = ["admin", "--addresses", addresses, "--json", "snapshot", "gc"]
        assert cli.main(gc) == 0
        assert not (root / "orphan").exists() and not (root / "kept" / "old-save").exists()
        assert [s["name"] for s in client.list_snapshots()] == ["kept"]
        assert client.load_snapshot("kept")["rows"] == 2000  # gc left the complete one whole
        assert cli.main(["admin", "--addresses", addresses, "snapshot", "delete", "kept"]) == 0
        assert client.list_snapshots() == []
        with pytest.raises(ShardError) as missing:
            client.delete_snapshot("kept")
        assert missing.value.code is CODE.NOT_FOUND
    assert json.dumps(tree(root)) == "[]"
