"""The GPU tier through real shard servers (in-process on port 0, and `tierps serve`
subprocesses): every case runs the GPU tier's code on numpy arrays (gpu_arrays="numpy", in
CI) and on cupy where a GPU is usable, and compares with the same calls against shards
without a GPU tier (the CPU path) within 1e-6: training, snapshots taken while dirty rows
live on the GPU, restarts, and the per-tier figures of DescribeTable, admin stats and the
metrics."""

from __future__ import annotations

import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.commands import serve_command
from tierps.client import EmbeddingClient, TableConfig, init, optim
from tierps.core.xp import gpu_module
from tierps.server.daemon import ShardServer

ServerFactory = Callable[..., ShardServer]
DIM = 8
KEYS = 2000  # distinct keys of the trace: ~10x what the GPU tier holds
GPU_ROWS_BYTES = 24 << 10  # per table and shard: ~200 Adam rows of dim 8 with their index
TABLE = TableConfig(
    "items",
    DIM,
    initializer=init.Normal(0.0, 0.1),
    optimizer=optim.Adam(lr=0.01),
    seed=5,
    host_cache_bytes=64 << 10,  # a few hundred rows on the host: the rest in RocksDB
)


@pytest.fixture(params=["numpy", "cupy"])
def gpu_arrays(request: pytest.FixtureRequest) -> str:
    """The shards' gpu_arrays setting for a run on numpy or cupy arrays."""
    if request.param == "cupy":
        module, why = gpu_module()
        if module is None:
            pytest.skip(f"GPU tier on cupy: {why}")
        return "auto"
    return "numpy"


def zipf_batches(steps: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.unique(rng.zipf(1.05, 512) % KEYS).astype(np.int64) for _ in range(steps)]


def train(client: EmbeddingClient, batches: list[np.ndarray], first_step: int = 1) -> None:
    """Lookups and pushes of a Zipf trace; gradients a pure function of (step, key)."""
    for step, keys in enumerate(batches, start=first_step):
        rows = client.lookup(TABLE.name, keys)
        grads = np.sin(rows * 3.0 + keys[:, None] * 0.01 + step).astype(np.float32)
        client.push_gradients(TABLE.name, keys, grads, step=step)


def start(
    shard_server: ServerFactory, num_shards: int, gpu: str | None, **fields: object
) -> tuple[list[ShardServer], EmbeddingClient]:
    """Shards (with a GPU tier of GPU_ROWS_BYTES per table when gpu is a gpu_arrays value)
    and a client of them."""
    options = {} if gpu is None else {"gpu_cache_bytes": GPU_ROWS_BYTES, "gpu_arrays": gpu}
    servers = [
        shard_server(shard_id=i, num_shards=num_shards, **options, **fields)
        for i in range(num_shards)
    ]
    return servers, EmbeddingClient([s.address for s in servers], timeout_s=20.0)


def all_rows(client: EmbeddingClient) -> np.ndarray:
    return client.lookup(TABLE.name, np.arange(KEYS, dtype=np.int64), create=False)


def test_training_with_a_gpu_tier_matches_shards_without_one(
    shard_server: ServerFactory, gpu_arrays: str
) -> None:
    batches = zipf_batches(30)
    _, plain = start(shard_server, 2, None)
    gpu_servers, gpu = start(shard_server, 2, gpu_arrays)
    with plain, gpu:
        for client in (plain, gpu):
            client.create_table(TABLE)
            train(client, batches)
        np.testing.assert_allclose(all_rows(gpu), all_rows(plain), atol=1e-6)
        shards = gpu.describe(TABLE.name)
        for shard in shards:
            tiers = {t["name"]: t for t in shard["tiers"]}
            assert list(tiers) == ["gpu", "host", "rocksdb"]
            assert tiers["gpu"]["rows"] > 0
            assert 0 < tiers["gpu"]["bytes"] <= GPU_ROWS_BYTES
            assert tiers["gpu"]["hits"] > 0 and tiers["gpu"]["misses"] > 0
            assert tiers["gpu"]["hit_rate"] == pytest.approx(
                tiers["gpu"]["hits"] / (tiers["gpu"]["hits"] + tiers["gpu"]["misses"])
            )
        # the table's own config is unchanged: the budget is the shards' setting
        assert all(s["config"]["gpu_cache_bytes"] == 0 for s in shards)
        for server in gpu_servers:
            table = server.shard.store.table(TABLE.name)
            assert table.spilled > 0  # the small GPU tier evicted rows, dirty ones among them


def test_a_snapshot_taken_while_dirty_rows_live_on_the_gpu_holds_them(
    shard_server: ServerFactory, gpu_arrays: str
) -> None:
    """Save from 2 shards whose newest rows are dirty on the GPU (never flushed), load into
    1 shard without a GPU tier: the same rows, optimizer state included (training on from
    the snapshot gives what training on without it gives)."""
    batches = zipf_batches(24, seed=1)
    _, reference = start(shard_server, 1, None)
    gpu_servers, gpu = start(shard_server, 2, gpu_arrays)
    reference.create_table(TABLE)
    with gpu:
        gpu.create_table(TABLE)
        train(reference, batches[:16])
        train(gpu, batches[:16])
        dirty = sum(
            s.shard.store.table(TABLE.name).stats()["tiers"]["gpu"]["dirty_rows"]
            for s in gpu_servers
        )
        assert dirty > 0
        saved = gpu.save_snapshot("on-gpu")
        assert saved["rows"] == np.unique(np.concatenate(batches[:16])).size
    _, loaded = start(shard_server, 1, None)
    with loaded, reference:
        loaded.load_snapshot("on-gpu")
        np.testing.assert_allclose(all_rows(loaded), all_rows(reference), atol=1e-6)
        train(loaded, batches[16:], first_step=17)
        train(reference, batches[16:], first_step=17)
        np.testing.assert_allclose(all_rows(loaded), all_rows(reference), atol=1e-6)


def test_a_restart_keeps_the_rows_that_were_dirty_on_the_gpu(
    shard_server: ServerFactory, tmp_path: Path, gpu_arrays: str
) -> None:
    batches = zipf_batches(16, seed=2)
    options = {"gpu_cache_bytes": GPU_ROWS_BYTES, "gpu_arrays": gpu_arrays}
    server = shard_server(data_dir=tmp_path / "restart", **options)
    with EmbeddingClient([server.address], timeout_s=20.0) as client:
        client.create_table(TABLE)
        train(client, batches[:8])
    # stopped right after training: the newest rows are dirty on the GPU only
    assert server.shard.store.table(TABLE.name).stats()["tiers"]["gpu"]["dirty_rows"] > 0
    server.stop()
    again = shard_server(data_dir=tmp_path / "restart", **options)
    _, reference = start(shard_server, 1, None)
    with EmbeddingClient([again.address], timeout_s=20.0) as client, reference:
        reference.create_table(TABLE)
        train(reference, batches[:8])
        np.testing.assert_allclose(all_rows(client), all_rows(reference), atol=1e-6)
        train(reference, batches[8:], first_step=9)
        train(client, batches[8:], first_step=9)  # the optimizer state survived too
        np.testing.assert_allclose(all_rows(client), all_rows(reference), atol=1e-6)


def test_a_table_can_ask_for_its_own_gpu_cache_and_metrics_show_the_gpu_tier(
    shard_server: ServerFactory, gpu_arrays: str
) -> None:
    server = shard_server(gpu_arrays=gpu_arrays, metrics_port=0)
    own = TableConfig("own", DIM, optimizer=optim.SGD(lr=0.1), gpu_cache_bytes=1 << 20)
    none = TableConfig("none", DIM, optimizer=optim.SGD(lr=0.1))
    with EmbeddingClient([server.address], timeout_s=20.0) as client:
        client.create_table(own)
        client.create_table(none)
        keys = np.arange(100, dtype=np.int64)
        for table in ("own", "none"):
            client.lookup(table, keys)
            client.lookup(table, keys)
        assert [t["name"] for t in client.describe("own")[0]["tiers"]] == ["gpu", "host", "rocksdb"]
        assert [t["name"] for t in client.describe("none")[0]["tiers"]] == ["host", "rocksdb"]
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'tierps_table_rows{shard="0",table="own",tier="gpu"} 100.0' in text
        assert 'tierps_table_hits_total{shard="0",table="own",tier="gpu"} 100.0' in text
        assert 'tier="gpu"' not in "".join(line for line in text.splitlines() if '"none"' in line)


def _serve(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    command = serve_command(str(tmp_path / "data"), *flags)
    return subprocess.run(
        command, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


def test_require_gpu_without_a_gpu_exits_with_a_clear_error(tmp_path: Path) -> None:
    if gpu_module()[0] is not None:
        pytest.skip("a GPU is usable here: --require-gpu serves")
    done = _serve(tmp_path, "--require-gpu", "--gpu-cache-mb", "64")
    assert done.returncode == 1
    assert "require_gpu is set, but" in done.stderr and "cupy" in done.stderr


def test_a_gpu_cache_without_a_gpu_warns_once_and_serves_from_the_host(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if gpu_module()[0] is not None:
        pytest.skip("a GPU is usable here: the GPU tier is made")
    from tierps.storage import EmbeddingStore

    with caplog.at_level("WARNING", logger="tierps.storage"):
        with EmbeddingStore(tmp_path / "db", gpu_cache_bytes=8 << 20) as store:
            for name in ("a", "b"):
                table = store.create_table(TableConfig(name, DIM, gpu_cache_bytes=1 << 20))
                assert list(table.stats()["tiers"]) == ["host", "rocksdb"]
                np.testing.assert_array_equal(
                    table.lookup(np.arange(5)), table.config.initial_rows(np.arange(5))[:, :DIM]
                )
    warnings = [r for r in caplog.records if "no GPU is usable" in r.getMessage()]
    assert len(warnings) == 1
    assert "8388608 bytes per table" in warnings[0].getMessage()


def test_gpu_tier_flags_reach_the_shard_config(tmp_path: Path) -> None:
    done = _serve(tmp_path, "--gpu-cache-mb", "-1")
    assert done.returncode == 1 and "gpu_cache_bytes" in done.stderr
    done = _serve(tmp_path, "--gpu-arrays", "cuda")
    assert done.returncode == 2 and "--gpu-arrays" in done.stderr


def test_serve_gpu_cache_mb_gives_every_table_a_gpu_tier(tmp_path: Path) -> None:
    """`tierps serve --gpu-cache-mb 1 --gpu-arrays numpy` (subprocesses): a table that leaves
    gpu_cache_bytes 0 gets the shard's 1 MiB GPU tier, listed and counted by describe."""
    from tierps.server.cluster import LocalCluster

    flags = ("--gpu-cache-mb", "1", "--gpu-arrays", "numpy")
    with (
        LocalCluster(2, tmp_path / "cluster", extra_args=flags) as cluster,
        EmbeddingClient(cluster.addresses, timeout_s=20.0) as client,
    ):
        client.create_table(TableConfig("t", DIM, optimizer=optim.SGD(lr=0.1)))
        keys = np.arange(50, dtype=np.int64)
        client.lookup("t", keys)
        client.lookup("t", keys)
        shards = client.describe("t")
    for shard in shards:
        tiers = {t["name"]: t for t in shard["tiers"]}
        assert list(tiers) == ["gpu", "host", "rocksdb"]
        assert tiers["gpu"]["rows"] == 25 and tiers["gpu"]["hits"] == 25
        assert 0 < tiers["gpu"]["bytes"] <= 1 << 20
