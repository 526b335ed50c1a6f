"""Acknowledged means kept, through the service, with real faults: `kill -9` of subprocess
shards (LocalCluster) and a data dir on a small tmpfs that fills.

Every table trains with SGD(lr=1) from zeros and every gradient is -1 in every column, so a
row's weight is exactly the number of pushes applied to it: the oracle is the count of
acknowledged pushes per key (a numpy replay of them), compared bit for bit."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from tests.fault_fs import fill, small_tmpfs
from tierps.client import EmbeddingClient
from tierps.client.admin import RetryPolicy, ShardError
from tierps.server.cluster import LocalCluster
from tierps.storage import TableConfig, init, optim

pytestmark = pytest.mark.slow  # kill -9 of subprocess shards and a tmpfs that fills

DIM = 8
KEYS = np.arange(600, dtype=np.int64)
FLUSH_INTERVAL_S = 0.5


def counting(name: str, **fields: object) -> TableConfig:
    return TableConfig(name, DIM, initializer=init.Zeros(), optimizer=optim.SGD(lr=1.0), **fields)  # type: ignore[arg-type]


BACK = counting("back")  # write_back, the default
THROUGH = counting("through", write_policy="write_through")


def push(client: EmbeddingClient, table: TableConfig, keys: np.ndarray) -> None:
    client.push_gradients(table.name, keys, -np.ones((keys.size, DIM), np.float32))


def applied(client: EmbeddingClient, table: TableConfig) -> np.ndarray:
    """Pushes applied per key, read back (create=False: reading stores nothing)."""
    rows = client.lookup(table.name, KEYS, create=False)
    assert np.all(rows == rows[:, :1]), "a row mixes two versions"
    return rows[:, 0].astype(np.int64)


def free_base_port(count: int) -> int:
    """A port p with p .. p+count-1 free now on 127.0.0.1 (a restarted shard must come back
    at the address its old clients know)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            held = []
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no run of free ports on 127.0.0.1")


@pytest.fixture
def cluster(tmp_path: Path):
    cluster = LocalCluster(
        2,
        tmp_path / "data",
        tmp_path / "snapshots",
        start_timeout_s=60,
        base_port=free_base_port(2),
        extra_args=("--flush-interval-s", str(FLUSH_INTERVAL_S)),
    )
    with cluster:
        yield cluster


def test_kill_9_keeps_write_through_and_flushed_write_back_and_tells_the_client(
    cluster: LocalCluster,
) -> None:
    acked = {BACK.name: np.zeros(KEYS.size, np.int64), THROUGH.name: np.zeros(KEYS.size, np.int64)}
    with EmbeddingClient(cluster.addresses) as client:
        for table in (BACK, THROUGH):
            client.create_table(table)
        for _ in range(20):
            for table in (BACK, THROUGH):
                push(client, table, KEYS)
                acked[table.name] += 1
        time.sleep(4 * FLUSH_INTERVAL_S)  # a background flush runs meanwhile
        flushed = {name: counts.copy() for name, counts in acked.items()}
        for _ in range(5):  # acknowledged after the last flush that could have run
            for table in (BACK, THROUGH):
                push(client, table, KEYS)
                acked[table.name] += 1
        assert cluster.stop_shard(1, sig=signal.SIGKILL) == -signal.SIGKILL
        cluster.start_shard(1)  # at the same address: the client's channel reconnects
        with pytest.raises(ShardError) as told:
            applied(client, BACK)
        assert told.value.code is grpc.StatusCode.DATA_LOSS
        assert told.value.shard_id == 1
        assert "unclean stop" in told.value.details and "may be lost" in told.value.details
        with pytest.raises(ShardError) as again:  # not silently: every call until it accepts
            push(client, BACK, KEYS)
        assert again.value.code is grpc.StatusCode.DATA_LOSS
        assert again.value.succeeded == [0]  # a push is per shard: shard 0 applied its keys
        acked[BACK.name][KEYS % 2 == 0] += 1
    with EmbeddingClient(cluster.addresses) as fresh:  # a new client goes on
        stats = fresh.stats()
        assert [s["previous_life_clean"] for s in stats] == [True, False]
        shard1 = KEYS % 2 == 1
        through = applied(fresh, THROUGH)
        assert np.array_equal(through, acked[THROUGH.name])  # write_through: 0 lost
        back = applied(fresh, BACK)
        assert np.array_equal(back[~shard1], acked[BACK.name][~shard1])  # not killed
        # write_back on the killed shard: everything up to the last background flush, at
        # most what was acknowledged in the last flush interval lost, never more than acked
        assert np.all(back[shard1] >= flushed[BACK.name][shard1])
        assert np.all(back[shard1] <= acked[BACK.name][shard1])
        lost = int((acked[BACK.name] - back)[shard1].sum())
        print(
            f"kill -9: write_through lost 0, write_back lost {lost} of "
            f"{int(acked[BACK.name][shard1].sum())} key-updates on the killed shard "
            f"(all after the last flush)"
        )


def test_old_client_goes_on_after_accepting_and_after_a_clean_restart(
    cluster: LocalCluster,
) -> None:
    with EmbeddingClient(cluster.addresses) as client:
        client.create_table(BACK)
        push(client, BACK, KEYS)
        assert cluster.stop_shard(0) == 0  # a clean stop: nothing to tell
        cluster.start_shard(0)
        assert np.array_equal(applied(client, BACK), np.ones(KEYS.size, np.int64))
        assert cluster.stop_shard(0, sig=signal.SIGKILL) == -signal.SIGKILL
        cluster.start_shard(0)
        with pytest.raises(ShardError, match="DATA_LOSS"):
            push(client, BACK, KEYS)
        client.accept_restart([0])
        push(client, BACK, KEYS)  # goes on with the rows as they are
        assert applied(client, BACK).min() >= 1


def test_full_disk_refuses_reports_not_serving_and_recovers_without_restart(
    tmp_path: Path, shard_server, connect
) -> None:
    with small_tmpfs(tmp_path / "fs", megabytes=30) as fs:
        server = shard_server(data_dir=fs / "shard", flush_interval_s=0.2)
        stubs = connect(server)
        table = counting("t", host_cache_bytes=64 << 10)  # small: pushes spill to RocksDB
        universe = np.arange(40_000, dtype=np.int64)
        acked = np.zeros(universe.size, np.int64)
        rng = np.random.default_rng(3)
        codes = []
        client = EmbeddingClient([f"127.0.0.1:{server.port}"], retry=RetryPolicy())
        with client:
            client.create_table(table)
            filler = fill(fs, leave_bytes=3 << 20)
            for _ in range(300):
                keys = rng.choice(universe, size=2048, replace=False)
                try:
                    client.push_gradients("t", keys, -np.ones((keys.size, DIM), np.float32))
                except ShardError as error:
                    codes.append(error.code)
                    if len(codes) >= 5:
                        break
                    continue
                acked[keys] += 1
            assert codes, "the disk never filled"
            assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            deadline = time.monotonic() + 10
            status = None
            while time.monotonic() < deadline:
                status = stubs.health.Check(health_pb2.HealthCheckRequest()).status
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                time.sleep(0.05)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            filler.unlink()  # space is back: the shard recovers by itself
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                status = stubs.health.Check(health_pb2.HealthCheckRequest()).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                time.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.SERVING
            assert client.stats()[0]["writable"]
            rows = client.lookup("t", universe, create=False)
            assert np.array_equal(rows[:, 0].astype(np.int64), acked)  # 0 lost, 0 extra
            keys = universe[:100]
            client.push_gradients("t", keys, -np.ones((keys.size, DIM), np.float32))
            acked[keys] += 1
        server.stop()
        reopened = shard_server(data_dir=fs / "shard")
        with EmbeddingClient([f"127.0.0.1:{reopened.port}"]) as after:
            rows = after.lookup("t", universe, create=False)
            assert np.array_equal(rows[:, 0].astype(np.int64), acked)
        reopened.stop()
        print(
            f"full disk through the service: {int(acked.sum())} acknowledged key-updates, "
            f"{len(codes)} pushes refused (RESOURCE_EXHAUSTED), lost 0"
        )
