"""A shard's lives (server/lives.py) and the durability settings of ServerConfig."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tierps.server.config import ServerConfig
from tierps.server.lives import Lives
from tierps.server.shard import Shard
from tierps.storage import DataLossError, InvalidArgumentError, StorageFullError, TableConfig, optim


def start(data_dir: Path, at_risk: bool = True) -> Lives:
    lives = Lives(data_dir, "shard 0 of 1")
    lives.begin(at_risk)
    return lives


def test_clean_stops_keep_every_client_going(tmp_path: Path) -> None:
    first = start(tmp_path)
    assert (first.life, first.ended_cleanly) == (1, True)
    first.end_cleanly()
    second = start(tmp_path)
    assert (second.life, second.ended_cleanly) == (2, True)
    for known in (None, "1", "2"):
        second.check(known)  # nothing acknowledged can be missing


def test_an_unclean_stop_is_told_to_clients_of_that_life_only(tmp_path: Path) -> None:
    first = start(tmp_path)
    first.flushed(1_700_000_000.0)  # then killed: no end_cleanly
    second = start(tmp_path)
    assert (second.life, second.ended_cleanly) == (2, False)
    second.check(None)  # a new client
    second.check("2")  # a client that learned the new life (accepted the restart)
    with pytest.raises(DataLossError, match=r"life 1 ended.*2023-11-14T22:13:20Z.*may be lost"):
        second.check("1")
    second.end_cleanly()
    third = start(tmp_path)  # a clean restart later: the loss of life 1 is still told
    with pytest.raises(DataLossError, match="life 1 ended"):
        third.check("1")
    third.check("2")


def test_write_through_only_stores_lose_nothing_on_an_unclean_stop(tmp_path: Path) -> None:
    start(tmp_path, at_risk=False)  # killed
    again = start(tmp_path, at_risk=False)
    assert not again.ended_cleanly
    again.check("1")  # every acknowledged update was in RocksDB's log


@pytest.mark.parametrize("known", ["7", "0"])
def test_a_life_this_shard_never_had_is_refused(tmp_path: Path, known: str) -> None:
    lives = start(tmp_path)
    with pytest.raises(DataLossError):
        lives.check(known)


@pytest.mark.parametrize("known", ["banana", "abc/", "x/-1", "1/2/x", "9" * 30])
def test_a_header_that_is_no_life_is_the_callers_error(tmp_path: Path, known: str) -> None:
    lives = start(tmp_path)
    with pytest.raises(InvalidArgumentError, match="tierps-life"):
        lives.check(known)


def test_a_client_that_knew_another_data_dir_is_told(tmp_path: Path) -> None:
    """A wiped volume starts again at life 1: the life alone cannot tell, the dir's id does."""
    lives = Lives(tmp_path, "shard 0 of 1", data_id="new")
    lives.begin(at_risk=False)
    lives.check("new/1")
    lives.check("1")  # a client of the life alone: as before
    with pytest.raises(DataLossError, match="another data dir"):
        lives.check("old/1")


def test_durability_settings_are_checked(tmp_path: Path) -> None:
    config = ServerConfig(0, 1, tmp_path, flush_interval_s=0, sync_writes=True)
    assert (config.flush_interval_s, config.sync_writes) == (0, True)
    assert ServerConfig(0, 1, tmp_path).flush_interval_s == 30.0
    for bad in (-1, float("nan"), float("inf"), "30"):
        with pytest.raises(ValueError, match="flush_interval_s"):
            ServerConfig(0, 1, tmp_path, flush_interval_s=bad)
    with pytest.raises(ValueError, match="sync_writes"):
        ServerConfig(0, 1, tmp_path, sync_writes="yes")
    toml = tmp_path / "shard.toml"
    toml.write_text(
        f'shard_id = 0\nnum_shards = 1\ndata_dir = "{tmp_path}"\nflush_interval_s = 5\n'
    )
    assert ServerConfig.from_file(toml).flush_interval_s == 5


def test_a_background_flush_yields_to_a_waiting_snapshot(tmp_path: Path) -> None:
    """A background flush lets go of the shard's gate as soon as an exclusive section (a
    snapshot cut, a load, a drop) waits for it, after at most one chunk: data calls queue
    behind that waiter, so they must not wait for the whole flush. The rows it did not
    reach stay dirty, and its start is not recorded as a whole flush."""
    config = ServerConfig(0, 1, tmp_path / "data", flush_interval_s=0)
    shard = Shard(config)
    try:
        shard.admin.create_table(
            TableConfig("t", 16, optimizer=optim.SGD(lr=0.1), host_cache_bytes=64 << 20)
        )
        keys = np.arange(50_000, dtype=np.int64)
        shard.store.table("t").apply_gradients(keys, np.ones((keys.size, 16), np.float32), 1)
        result: list[bool] = []
        flushing = threading.Thread(
            target=lambda: result.append(shard.maintenance.flush(16 << 10, 0.005, background=True))
        )
        flushing.start()
        host = shard.store.table("t").tiers[0]
        deadline = time.monotonic() + 30
        while host.stats()["dirty_rows"] == keys.size and time.monotonic() < deadline:
            time.sleep(0.002)  # until some chunks are in
        with shard._gate.exclusive():
            still_dirty = host.dirty_keys().size
        flushing.join()
        assert result == [False]
        assert 0 < still_dirty < keys.size
        assert shard.maintenance.last_flush is None
        assert shard.maintenance.flush() is True  # a flush not in the background goes to the end
        assert host.dirty_keys().size == 0 and shard.maintenance.last_flush is not None
    finally:
        shard.close()


def test_a_starting_server_publishes_the_store_as_it_is_now(tmp_path: Path) -> None:
    """Health at start reflects whether the store can write at that moment (a write that
    failed before the first maintenance tick is NOT_SERVING), not a cached SERVING."""
    shard = Shard(ServerConfig(0, 1, tmp_path / "data", flush_interval_s=0))
    told: list[bool] = []
    shard.health.on_serving_change = told.append
    try:
        shard.health.publish_serving()
        shard.store.write_state.failed(StorageFullError("injected: No space left on device"))
        shard.health.publish_serving()
        assert told == [True, False]
    finally:
        shard.store.write_state.failure = None
        shard.close()
