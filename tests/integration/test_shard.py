"""Shard (server/shard.py) and the daemon around it, in-process: a shard's data dir keeps its
tables, rows and optimizer state across restarts, and belongs to one shard of one shard
count. Real shard servers on port 0 over real RocksDB in tmp_path; expected values from
numpy oracles."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_service_inprocess import (
    DIM,
    Connect,
    ServerFactory,
    assert_same_state,
    assign,
    create_table,
    list_tables,
    lookup,
    normal,
    push,
    rng,
    shard_state,
)
from tierps.server.config import ServerConfig
from tierps.server.daemon import create_server
from tierps.server.shard import Shard
from tierps.storage import BackendError, FailedPreconditionError, TableConfig, optim

# -- restart ------------------------------------------------------------------------------------


def test_restart_on_the_same_data_dir_keeps_tables_rows_and_optimizer_state(
    shard_server: ServerFactory, connect: Connect, tmp_path: Path
) -> None:
    data_dir = tmp_path / "shard"
    adagrad = TableConfig("ada", DIM, optimizer=optim.Adagrad(lr=0.1, eps=1e-8), seed=1)
    adam = TableConfig(
        "adam",
        4,
        optimizer=optim.Adam(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8),
        host_cache_bytes=8192,  # most rows only in RocksDB
    )
    server = shard_server(data_dir=data_dir)
    stubs = connect(server)
    for config in (adagrad, adam):
        create_table(stubs, config)
    generator = rng(14)
    keys = np.arange(500)
    push(stubs, "ada", keys, normal(generator, (500, DIM)), step=1)
    push(stubs, "adam", keys, normal(generator, (500, 4)), step=1)
    assign(stubs, "ada", keys[:50], normal(generator, (50, DIM)))
    before = shard_state(server)
    tables = list_tables(stubs)
    server.stop()
    server.stop()  # idempotent

    again = shard_server(data_dir=data_dir)
    stubs = connect(again)

    assert list_tables(stubs) == tables == [adagrad, adam]
    assert_same_state(before, shard_state(again))
    _, ada_keys, ada_rows = before["ada"]
    np.testing.assert_array_equal(lookup(stubs, "ada", ada_keys), ada_rows[:, :DIM])
    # The optimizer state survived: one more step matches an oracle run from the saved rows.
    grads = normal(generator, (500, DIM)).astype(np.float64)
    weights, accum = ada_rows[:, :DIM].astype(np.float64), ada_rows[:, DIM:].astype(np.float64)
    accum = accum + grads * grads
    oracle = weights - 0.1 * grads / (np.sqrt(accum) + 1e-8)
    push(stubs, "ada", keys, grads.astype(np.float32), step=2)
    np.testing.assert_allclose(lookup(stubs, "ada", keys), oracle, rtol=1e-5, atol=1e-6)

    _, _, adam_rows = before["adam"]
    g = normal(generator, (500, 4)).astype(np.float64)
    w, m, v = (adam_rows[:, i * 4 : (i + 1) * 4].astype(np.float64) for i in range(3))
    m = m + 0.1 * (g - m)
    v = v + 0.01 * (g * g - v)
    oracle = w - 0.01 * np.sqrt(1 - 0.99**2) / (1 - 0.9**2) * m / (np.sqrt(v) + 1e-8)
    push(stubs, "adam", keys, g.astype(np.float32), step=2)
    np.testing.assert_allclose(lookup(stubs, "adam", keys, 4), oracle, rtol=1e-5, atol=1e-6)


def test_tables_of_the_config_are_created_at_start_and_kept_on_restart(
    shard_server: ServerFactory, connect: Connect, tmp_path: Path
) -> None:
    config = TableConfig("cfg", DIM, optimizer=optim.SGD(lr=0.5))
    server = shard_server(data_dir=tmp_path / "d", tables=(config,))
    stubs = connect(server)
    assert list_tables(stubs) == [config]
    push(stubs, "cfg", [1, 2], np.ones((2, DIM), np.float32), step=1)
    before = shard_state(server)
    server.stop()
    again = shard_server(data_dir=tmp_path / "d", tables=(config,))
    assert_same_state(before, shard_state(again))


@pytest.mark.parametrize(("shard_id", "num_shards"), [(1, 2), (0, 3), (0, 1)])
def test_a_data_dir_is_refused_as_another_shard_or_shard_count(
    shard_server: ServerFactory, connect: Connect, tmp_path: Path, shard_id: int, num_shards: int
) -> None:
    data_dir = tmp_path / "shard-0-of-2"
    server = shard_server(0, 2, data_dir=data_dir)
    create_table(connect(server), TableConfig("t", DIM))
    push(connect(server), "t", [0, 2], np.ones((2, DIM), np.float32), step=1)
    before = shard_state(server)
    server.stop()
    wrong = ServerConfig(shard_id=shard_id, num_shards=num_shards, data_dir=data_dir)

    with pytest.raises(FailedPreconditionError) as from_shard:
        Shard(wrong)
    with pytest.raises(FailedPreconditionError) as from_server:
        create_server(wrong)

    for raised in (from_shard, from_server):
        message = str(raised.value)
        assert "holds shard 0 of 2" in message, message
        assert f"shard {shard_id} of {num_shards}" in message, message
    identity = json.loads((data_dir / "SHARD.json").read_text())
    assert {key: identity[key] for key in ("shard_id", "num_shards")} == {
        "shard_id": 0,
        "num_shards": 2,
    }
    assert_same_state(before, shard_state(shard_server(0, 2, data_dir=data_dir)))


def test_a_port_in_use_is_refused_and_the_data_dir_is_released(
    shard_server: ServerFactory, tmp_path: Path
) -> None:
    running = shard_server()
    config = ServerConfig(shard_id=0, num_shards=1, data_dir=tmp_path / "b", port=running.port)
    with pytest.raises((OSError, RuntimeError)):
        create_server(config)
    shard_server(data_dir=tmp_path / "b")  # RocksDB was closed: the data dir opens again


def test_a_second_daemon_on_a_data_dir_in_use_is_refused(
    shard_server: ServerFactory, tmp_path: Path
) -> None:
    shard_server(data_dir=tmp_path / "d")
    with pytest.raises(BackendError, match="rocksdb") as raised:
        create_server(ServerConfig(shard_id=0, num_shards=1, data_dir=tmp_path / "d"))
    assert str(tmp_path / "d") in str(raised.value)


def test_a_start_refused_for_a_conflicting_table_releases_the_data_dir(
    shard_server: ServerFactory, tmp_path: Path
) -> None:
    data_dir = tmp_path / "d"
    shard_server(data_dir=data_dir, tables=(TableConfig("t", 4),)).stop()
    conflicting = ServerConfig(
        shard_id=0, num_shards=1, data_dir=data_dir, tables=(TableConfig("t", 8),)
    )
    with pytest.raises(FailedPreconditionError, match="another config") as raised:
        create_server(conflicting)
    assert raised.value is not None  # the traceback is alive, as in any caller that keeps it
    shard_server(data_dir=data_dir)


def test_a_snapshot_of_cold_rows_holds_them_rounded_and_loads_them_bit_for_bit(
    tmp_path: Path,
) -> None:
    """A bfloat16 table's snapshot holds the rows as RocksDB has them (every one rounded:
    the snapshot's float32 values are bfloat16 values, checked with torch), step stamps
    exact, and a load gives a new shard the same stored bits."""
    torch = pytest.importorskip("torch")
    config = TableConfig(
        "cold", DIM, optimizer=optim.Adam(lr=0.01), steps_to_live=100, cold_dtype="bfloat16"
    )
    keys = np.arange(300, dtype=np.int64)

    def shard(tag: str) -> Shard:
        return Shard(
            ServerConfig(
                shard_id=0,
                num_shards=1,
                data_dir=tmp_path / tag,
                snapshot_dir=tmp_path / "snapshots",
                tables=(config,),
            )
        )

    def stored(source: Shard) -> tuple[np.ndarray, np.ndarray]:
        table = source.store.table("cold")
        table.flush()
        chunks = list(table.durable.export(1000))
        return np.concatenate([k for k, _ in chunks]), np.concatenate([r for _, r in chunks])

    source = shard("a")
    table = source.store.table("cold")
    generator = rng(3)
    for step in range(1, 4):
        table.apply_gradients(keys, normal(generator, (keys.size, DIM)), step)
    list(source.admin.save_part("s", "sid"))
    list(source.admin.commit_snapshot("s", "sid"))
    saved_keys, saved_rows = stored(source)
    part = tmp_path / "snapshots" / "s" / "sid" / "part-00000-of-00001"
    on_file = np.fromfile(part / "cold.rows", dtype="<f4").reshape(-1, config.row_width)
    as_bfloat16 = torch.from_numpy(on_file.copy()).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(on_file, as_bfloat16)  # every value a bfloat16 one
    np.testing.assert_array_equal(on_file, saved_rows[:, : config.row_width])
    np.testing.assert_array_equal(np.fromfile(part / "cold.steps", dtype="<i8"), 3)
    target = shard("b")
    list(target.admin.load_snapshot("s"))
    loaded_keys, loaded_rows = stored(target)
    np.testing.assert_array_equal(loaded_keys, saved_keys)
    np.testing.assert_array_equal(loaded_rows.view(np.uint32), saved_rows.view(np.uint32))
    source.close()
    target.close()
