"""Real subprocess clusters (LocalCluster: `tierps serve` daemons on 127.0.0.1): snapshot
round trips across shard counts, restarts, crashes, the `tierps admin` and `tierps cluster`
commands, and the consistency of a snapshot taken while trainers push.

Data goes through raw EmbeddingService stubs, routed here (key k to shard k % N); admin
through ClusterAdmin or the CLI. Oracles are numpy and TableConfig.initial_rows."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from tierps.client.admin import ClusterAdmin
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto import wire
from tierps.server.cluster import LocalCluster, wait_until_serving
from tierps.storage import TableConfig, init, optim

pytestmark = pytest.mark.slow  # subprocess clusters started, killed and restarted

RPC_TIMEOUT_S = 30.0
CLI_TIMEOUT_S = 60.0


# -- helpers ------------------------------------------------------------------------------------


@contextmanager
def running(cluster: LocalCluster) -> Iterator[LocalCluster]:
    """Start a cluster; at the end stop it gracefully (LocalCluster.stop, one SIGTERM per
    shard) and, unless the body failed, check that every shard exited 0."""
    cluster.start()
    try:
        yield cluster
    except BaseException:
        cluster.stop()
        raise
    codes = cluster.stop()
    assert codes == [0] * cluster.num_shards, f"exit codes of a graceful stop: {codes}"


class Data:
    """Raw data-path stubs of one cluster; key k goes to addresses[k % N]."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = list(addresses)
        self.channels = [
            grpc.insecure_channel(a, options=wire.channel_options()) for a in self.addresses
        ]
        self.stubs = [pb_grpc.EmbeddingServiceStub(c) for c in self.channels]

    def _route(self, keys: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        n = len(self.addresses)
        for shard in range(n):
            index = np.flatnonzero(keys % n == shard)
            if index.size:
                yield shard, index

    def lookup(self, table: TableConfig, keys: np.ndarray, *, create: bool = False) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.int64)
        out = np.empty((keys.size, table.dim), dtype=np.float32)
        for shard, index in self._route(keys):
            requests = wire.lookup_requests(
                table.name, table.dim, keys[index].astype("<i8").tobytes(), create=create
            )
            raw = wire.join_values(self.stubs[shard].Lookup(requests, timeout=RPC_TIMEOUT_S))
            out[index] = np.frombuffer(raw, dtype="<f4").reshape(index.size, table.dim)
        return out

    def push(self, table: TableConfig, step: int, keys: np.ndarray, grads: np.ndarray) -> None:
        keys = np.asarray(keys, dtype=np.int64)
        grads = np.asarray(grads, dtype=np.float32)
        for shard, index in self._route(keys):
            self.push_to(shard, table, step, keys[index], grads[index])

    def push_to(
        self, shard: int, table: TableConfig, step: int, keys: np.ndarray, grads: np.ndarray
    ) -> int:
        requests = wire.push_requests(
            table.name,
            table.dim,
            step,
            np.asarray(keys, dtype="<i8").tobytes(),
            np.asarray(grads, dtype="<f4").tobytes(),
        )
        return self.stubs[shard].PushGradients(requests, timeout=RPC_TIMEOUT_S).num_keys

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def __enter__(self) -> Data:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Bit-for-bit equality of float32 arrays (NaN-safe, -0.0 != 0.0)."""
    assert actual.shape == expected.shape, what
    np.testing.assert_array_equal(
        np.ascontiguousarray(actual, dtype=np.float32).view(np.uint32),
        np.ascontiguousarray(expected, dtype=np.float32).view(np.uint32),
        err_msg=what,
    )


def part_dir(snapshot: Path, part: str) -> Path:
    """A part's directory in a committed snapshot: under the id of the save that wrote it."""
    return snapshot / json.loads((snapshot / "MANIFEST.json").read_text())["save_id"] / part


def read_snapshot(path: Path, table: TableConfig) -> tuple[np.ndarray, np.ndarray]:
    """(keys, rows) of a table over every part of a snapshot, read from the raw files the
    manifest names, sorted by key."""
    manifest = json.loads((path / "MANIFEST.json").read_text())
    keys_parts, rows_parts = [], []
    for part in manifest["tables"][table.name]["parts"]:
        keys = np.fromfile(path / part["keys_file"]["path"], dtype="<i8")
        rows = np.fromfile(path / part["rows_file"]["path"], dtype="<f4")
        assert keys.size == part["rows"]
        assert rows.size == keys.size * table.row_width, f"{part['rows_file']['path']}: size"
        keys_parts.append(keys)
        rows_parts.append(rows.reshape(keys.size, table.row_width))
    keys = np.concatenate(keys_parts) if keys_parts else np.empty(0, np.int64)
    rows = np.concatenate(rows_parts) if rows_parts else np.empty((0, table.row_width), np.float32)
    order = np.argsort(keys, kind="stable")
    keys, rows = keys[order], rows[order]
    assert np.unique(keys).size == keys.size, f"{path.name}/{table.name}: a key in two parts"
    return keys, rows


def tierps_admin(addresses: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    """`tierps admin --addresses ... ARGS` as a subprocess (bounded)."""
    command = [sys.executable, "-m", "tierps.server.cli", "admin", "--addresses"]
    command += [",".join(addresses), "--timeout-s", "20", *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL
    )


def ok_json(addresses: list[str], *args: str) -> object:
    result = tierps_admin(addresses, "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def health_fails(address: str) -> bool:
    try:
        wait_until_serving(address, 1.0)
    except TimeoutError:
        return True
    return False


# -- numpy oracles of the optimizers (torch's formulas) ------------------------------------------


def oracle_adam(opt: optim.Adam, rows: np.ndarray, grads: np.ndarray, step: int, dim: int) -> None:
    """torch.optim.SparseAdam on rows [n, 3*dim] (float64 math), in place."""
    w, m, v = rows[:, :dim], rows[:, dim : 2 * dim], rows[:, 2 * dim :]
    m[...] = opt.beta1 * m + (1 - opt.beta1) * grads
    v[...] = opt.beta2 * v + (1 - opt.beta2) * grads * grads
    step_size = opt.lr * np.sqrt(1 - opt.beta2**step) / (1 - opt.beta1**step)
    w -= step_size * m / (np.sqrt(v) + opt.eps)


def oracle_adagrad(
    opt: optim.Adagrad, rows: np.ndarray, grads: np.ndarray, step: int, dim: int
) -> None:
    """torch.optim.Adagrad (no lr decay) on rows [n, 2*dim] (float64 math), in place."""
    w, s = rows[:, :dim], rows[:, dim:]
    s += grads * grads
    w -= opt.lr * grads / (np.sqrt(s) + opt.eps)


ORACLES = {"adam": oracle_adam, "adagrad": oracle_adagrad}


# -- 1. snapshot round trips across shard counts ------------------------------------------------

SOURCE_SHARDS = 2
ROUND_TRIP_TABLES = (
    # Host tier of 64 KiB per shard (~500 rows of 96 bytes): most rows live in RocksDB only.
    TableConfig(
        "adam8",
        8,
        initializer=init.Normal(std=0.1),
        optimizer=optim.Adam(lr=0.01),
        seed=7,
        host_cache_bytes=64 << 10,
    ),
    # Default host tier: every row fits, so at save time they are dirty in host memory.
    TableConfig(
        "adagrad16",
        16,
        initializer=init.Uniform(),
        seed=11,
        optimizer=optim.Adagrad(lr=0.05, initial_accumulator_value=0.1),
    ),
)
KEYS_PER_TABLE = 3000
STEPS = 3


@dataclass
class Source:
    cluster: LocalCluster
    admin: ClusterAdmin
    data: Data
    snapshots: Path
    keys: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]  # numpy oracle: full rows of keys (sorted), float64


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    """A 2-shard cluster with two trained tables, saved as snapshot 's'; alive for the
    whole module."""
    root = tmp_path_factory.mktemp("round-trip")
    rng = np.random.default_rng(2024)
    with (
        running(LocalCluster(SOURCE_SHARDS, root / "source", root / "snapshots")) as cluster,
        ClusterAdmin(cluster.addresses, timeout_s=RPC_TIMEOUT_S) as admin,
        Data(cluster.addresses) as data,
    ):
        keys: dict[str, np.ndarray] = {}
        expected: dict[str, np.ndarray] = {}
        for table in ROUND_TRIP_TABLES:
            assert admin.create_table(table) is True
            # Spread over the key space (and so over 1, 2 and 3 shards), sorted for the oracle.
            table_keys = np.sort(rng.choice(10**12, KEYS_PER_TABLE, replace=False))
            keys[table.name] = table_keys
            data.lookup(table, table_keys, create=True)  # every key gets a stored row
            rows = table.initial_rows(table_keys).astype(np.float64)
            for step in range(1, STEPS + 1):
                # Each step touches a random 70% of the keys, some of them twice (summed).
                chosen = rng.choice(KEYS_PER_TABLE, int(0.7 * KEYS_PER_TABLE), replace=False)
                pushed = np.concatenate([chosen, chosen[:50]])
                grads = rng.standard_normal((pushed.size, table.dim)).astype(np.float32)
                data.push(table, step, table_keys[pushed], grads)
                summed = np.zeros((KEYS_PER_TABLE, table.dim))
                np.add.at(summed, pushed, grads.astype(np.float64))
                touched = np.unique(chosen)
                block = rows[touched]
                ORACLES[table.optimizer.kind](
                    table.optimizer, block, summed[touched], step, table.dim
                )
                rows[touched] = block
            expected[table.name] = rows
        # The small table really spans both tiers on every shard.
        for shard in admin.describe("adam8"):
            tiers = {tier["name"]: tier["rows"] for tier in shard["tiers"]}
            owned = int(np.count_nonzero(keys["adam8"] % SOURCE_SHARDS == shard["shard_id"]))
            assert 0 < tiers["host"] < owned, (tiers, owned)
        saved = admin.save_snapshot("s")
        assert saved["rows"] == KEYS_PER_TABLE * len(ROUND_TRIP_TABLES)
        yield Source(cluster, admin, data, root / "snapshots", keys, expected)


def test_snapshot_s_holds_weights_and_optimizer_state(source: Source) -> None:
    """The saved rows (weights and optimizer state) are the numpy oracle's, every key once."""
    manifest = json.loads((source.snapshots / "s" / "MANIFEST.json").read_text())
    assert manifest["num_shards"] == SOURCE_SHARDS
    for table in ROUND_TRIP_TABLES:
        keys, rows = read_snapshot(source.snapshots / "s", table)
        np.testing.assert_array_equal(keys, source.keys[table.name])
        np.testing.assert_allclose(
            rows, source.expected[table.name], rtol=2e-5, atol=2e-6, err_msg=table.name
        )


@pytest.mark.parametrize("target_shards", [2, 3, 1])
def test_snapshot_round_trip_is_bit_exact(
    source: Source, target_shards: int, tmp_path: Path
) -> None:
    weights = {t.name: source.data.lookup(t, source.keys[t.name]) for t in ROUND_TRIP_TABLES}
    try:
        with (
            running(LocalCluster(target_shards, tmp_path / "target", source.snapshots)) as target,
            ClusterAdmin(target.addresses, timeout_s=RPC_TIMEOUT_S) as admin,
            Data(target.addresses) as data,
        ):
            loaded = admin.load_snapshot("s")
            assert loaded["rows"] == KEYS_PER_TABLE * len(ROUND_TRIP_TABLES)
            assert admin.list_tables() == sorted(ROUND_TRIP_TABLES, key=lambda t: t.name)
            for table in ROUND_TRIP_TABLES:
                got = data.lookup(table, source.keys[table.name])
                assert_bits_equal(got, weights[table.name], f"{table.name}: weights after load")

            # The target's own snapshot holds exactly the source's rows, state included.
            name = f"rt-{target_shards}"
            admin.save_snapshot(name)
            manifest = json.loads((source.snapshots / name / "MANIFEST.json").read_text())
            assert manifest["num_shards"] == target_shards
            for table in ROUND_TRIP_TABLES:
                keys_s, rows_s = read_snapshot(source.snapshots / "s", table)
                keys_t, rows_t = read_snapshot(source.snapshots / name, table)
                assert keys_t.tobytes() == keys_s.tobytes(), table.name
                assert rows_t.tobytes() == rows_s.tobytes(), table.name

            # The same further step on both: Adam and Adagrad outputs depend on the state.
            rng = np.random.default_rng(target_shards)
            for table in ROUND_TRIP_TABLES:
                keys = source.keys[table.name]
                grads = rng.standard_normal((keys.size, table.dim)).astype(np.float32)
                source.data.push(table, STEPS + 1, keys, grads)
                data.push(table, STEPS + 1, keys, grads)
                after_source = source.data.lookup(table, keys)
                assert not np.array_equal(after_source, weights[table.name])
                assert_bits_equal(
                    data.lookup(table, keys), after_source, f"{table.name}: after a further step"
                )
    finally:
        # Back to 's' for the next round trip (a 2 -> 2 load onto the source itself).
        source.admin.load_snapshot("s")
    for table in ROUND_TRIP_TABLES:
        got = source.data.lookup(table, source.keys[table.name])
        assert_bits_equal(got, weights[table.name], f"{table.name}: source reloaded")


def test_snapshot_of_three_shards_loads_into_one_bit_exact(source: Source, tmp_path: Path) -> None:
    """3 -> 1: a snapshot written by a 3-shard cluster (itself loaded from 's') loads into a
    single shard with every row, weights and optimizer state, unchanged."""
    with (
        running(LocalCluster(3, tmp_path / "three", source.snapshots)) as three,
        ClusterAdmin(three.addresses, timeout_s=RPC_TIMEOUT_S) as admin,
    ):
        admin.load_snapshot("s")
        admin.save_snapshot("from-three")
    manifest = json.loads((source.snapshots / "from-three" / "MANIFEST.json").read_text())
    assert manifest["num_shards"] == 3
    with (
        running(LocalCluster(1, tmp_path / "one", source.snapshots)) as one,
        ClusterAdmin(one.addresses, timeout_s=RPC_TIMEOUT_S) as admin,
        Data(one.addresses) as data,
    ):
        loaded = admin.load_snapshot("from-three")
        assert loaded["rows"] == KEYS_PER_TABLE * len(ROUND_TRIP_TABLES)
        admin.save_snapshot("one-from-three")
        for table in ROUND_TRIP_TABLES:
            expected = source.data.lookup(table, source.keys[table.name])
            got = data.lookup(table, source.keys[table.name])
            assert_bits_equal(got, expected, f"{table.name}: weights after 3 -> 1")
            keys_s, rows_s = read_snapshot(source.snapshots / "s", table)
            keys_1, rows_1 = read_snapshot(source.snapshots / "one-from-three", table)
            assert keys_1.tobytes() == keys_s.tobytes(), table.name
            assert rows_1.tobytes() == rows_s.tobytes(), f"{table.name}: rows with state"


# -- 2. restart keeps tables and rows ----------------------------------------------------------


def test_graceful_restart_keeps_tables_and_rows(tmp_path: Path) -> None:
    # Momentum on dyadic numbers is exact in float32, so the state has an exact oracle.
    momentum = TableConfig(
        "mom", 4, initializer=init.Constant(0.25), optimizer=optim.Momentum(lr=0.5, momentum=0.5)
    )
    spilling = TableConfig(
        "spill", 8, optimizer=optim.Adagrad(lr=0.1), seed=3, host_cache_bytes=16 << 10
    )
    through = TableConfig(
        "through", 4, optimizer=optim.SGD(lr=0.5), write_policy="write_through", seed=5
    )
    tables = (momentum, spilling, through)
    rng = np.random.default_rng(1)
    keys = np.sort(rng.choice(10**9, 1000, replace=False))
    grads = [(rng.integers(-8, 9, (keys.size, 4)) / 4).astype(np.float32) for _ in range(2)]
    cluster = LocalCluster(2, tmp_path / "data")
    try:
        cluster.start()
        with ClusterAdmin(cluster.addresses) as admin, Data(cluster.addresses) as data:
            for table in tables:
                admin.create_table(table)
                data.lookup(table, keys, create=True)
                for step in (1, 2):
                    table_grads = grads[step - 1]
                    if table.dim != 4:
                        table_grads = np.tile(table_grads, (1, table.dim // 4))
                    data.push(table, step, keys, table_grads)
            before = {t.name: data.lookup(t, keys) for t in tables}
            # The momentum table's rows are only dirty in the host tier: RocksDB has none.
            for shard in admin.describe("mom"):
                tiers = {tier["name"]: tier["rows"] for tier in shard["tiers"]}
                assert tiers == {
                    "host": int(np.count_nonzero(keys % 2 == shard["shard_id"])),
                    "rocksdb": 0,
                }
        # Graceful stop (SIGTERM): every shard flushes its dirty rows and exits 0.
        assert cluster.stop() == [0, 0]
    finally:
        cluster.stop()
    with (
        running(LocalCluster(2, tmp_path / "data")) as again,
        ClusterAdmin(again.addresses) as admin,
        Data(again.addresses) as data,
    ):
        assert admin.list_tables() == sorted(tables, key=lambda t: t.name)
        for table in tables:
            assert_bits_equal(data.lookup(table, keys), before[table.name], table.name)
        # Optimizer state survived too: one more momentum step against the exact oracle.
        w = np.full((keys.size, 4), 0.25)
        b = np.zeros((keys.size, 4))
        third = (rng.integers(-8, 9, (keys.size, 4)) / 4).astype(np.float32)
        for g in (*grads, third):
            b = 0.5 * b + g
            w = w - 0.5 * b
        data.push(momentum, 3, keys, third)
        assert_bits_equal(data.lookup(momentum, keys), w.astype(np.float32), "momentum state")


def test_restart_with_another_shard_count_is_refused(tmp_path: Path) -> None:
    with running(LocalCluster(2, tmp_path / "data")):
        pass
    cluster = LocalCluster(3, tmp_path / "data", start_timeout_s=30)
    with pytest.raises(RuntimeError, match="holds shard 0 of 2"):
        cluster.start()
    assert cluster.stop() == [None, None, None]


# -- 3. a crash (SIGKILL) ---------------------------------------------------------------------


def test_sigkill_loses_only_unflushed_rows(tmp_path: Path) -> None:
    back = TableConfig("back", 4, initializer=init.Zeros(), optimizer=optim.SGD(lr=1.0))
    through = TableConfig(
        "through",
        4,
        initializer=init.Zeros(),
        optimizer=optim.SGD(lr=1.0),
        write_policy="write_through",
    )
    keys = np.arange(400, dtype=np.int64)
    ones = np.ones((keys.size, 4), dtype=np.float32)
    with running(LocalCluster(2, tmp_path / "data", tmp_path / "snapshots")) as cluster:
        with ClusterAdmin(cluster.addresses) as admin, Data(cluster.addresses) as data:
            for table in (back, through):
                admin.create_table(table)
                data.push(table, 1, keys, ones)  # every value -1
            admin.save_snapshot("pre")  # the cut flushes: -1 is in RocksDB
            for table in (back, through):
                data.push(table, 2, keys, ones)  # every value -2; "back" only in host memory
        assert cluster.stop_shard(1, sig=signal.SIGKILL) == -signal.SIGKILL
        cluster.start_shard(1)
        with ClusterAdmin(cluster.addresses) as admin, Data(cluster.addresses) as data:
            assert [t.name for t in admin.list_tables()] == ["back", "through"]
            # write_through: acknowledged means durable.
            assert_bits_equal(data.lookup(through, keys), -2 * ones, "write_through rows")
            got = data.lookup(back, keys)
            survivor = keys % 2 == 0
            assert_bits_equal(got[survivor], -2 * ones[survivor], "shard 0 was not killed")
            # write_back rows of the killed shard: the flushed value or the newer one, whole.
            lost = got[~survivor]
            assert np.all((lost == -1) | (lost == -2)), np.unique(lost)
            assert np.all(lost == lost[:, :1]), "a row mixes two versions"
            # It serves again, and the snapshot saved before the crash loads back exactly.
            data.push(back, 3, keys, ones)
            assert admin.load_snapshot("pre")["rows"] == 2 * keys.size
            for table in (back, through):
                assert_bits_equal(data.lookup(table, keys), -1 * ones, f"{table.name}: 'pre'")


# -- stopping under signals --------------------------------------------------------------------


class CountingProcess:
    """A Popen that records the signals sent to it (and passes everything on)."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process
        self.signals: list[int] = []

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        self._process.send_signal(sig)

    def __getattr__(self, name: str) -> object:
        return getattr(self._process, name)


def test_local_cluster_stop_signals_each_shard_once(tmp_path: Path) -> None:
    """Regression: stop() used to signal every shard, then signal each one still running
    again in stop_shard(); the second SIGTERM could kill a shard at interpreter exit (-15)
    or deadlock its signal handler (then it was SIGKILLed after 30 s)."""
    cluster = LocalCluster(2, tmp_path / "data", stop_timeout_s=10)
    try:
        cluster.start()
        counting = [CountingProcess(p) for p in cluster._processes]  # type: ignore[arg-type]
        cluster._processes = list(counting)  # type: ignore[assignment]
        assert cluster.stop() == [0, 0]
        assert [p.signals for p in counting] == [[signal.SIGTERM], [signal.SIGTERM]]
    finally:
        cluster.stop()


def test_shard_stops_gracefully_under_repeated_sigterm(tmp_path: Path) -> None:
    """A storm of SIGTERMs (an impatient supervisor, Ctrl-C pressed twice): the shard still
    flushes its write-back rows and exits 0. Regression: the handler used to set a
    threading.Event while the main thread waited on it, which deadlocked when a signal was
    handled inside Event.wait/Event.set (most runs of this storm hung under CPU contention),
    and a late SIGTERM after Python restored SIG_DFL at exit killed the shard with -15."""
    table = TableConfig("t", 4, initializer=init.Zeros(), optimizer=optim.SGD(lr=1.0))
    keys = np.arange(100, dtype=np.int64)
    cluster = LocalCluster(1, tmp_path / "data", stop_timeout_s=5)
    try:
        cluster.start()
        with ClusterAdmin(cluster.addresses) as admin, Data(cluster.addresses) as data:
            admin.create_table(table)
            data.push(table, 1, keys, np.ones((keys.size, 4), np.float32))  # dirty in host
        pid = json.loads((tmp_path / "data" / "shard-0.port").read_text())["pid"]
        end = time.perf_counter() + 0.1
        while time.perf_counter() < end:
            os.kill(pid, signal.SIGTERM)  # our own child: a zombie at worst, never reused
        code = cluster.stop_shard(0)  # one more SIGTERM; waits up to 5 s, then kills
        assert code == 0, f"exit code {code}" + (" (killed after a hang)" if code == -9 else "")
    finally:
        cluster.stop()
    log = (tmp_path / "data" / "shard-0.log").read_text()
    assert log.count('"msg": "stopping"') == 1 and log.count('"msg": "stopped"') == 1
    with running(LocalCluster(1, tmp_path / "data")) as again, Data(again.addresses) as data:
        assert_bits_equal(data.lookup(table, keys), -np.ones((keys.size, 4), np.float32), "t")


# -- 4. `tierps admin` ------------------------------------------------------------------------

CLI_TABLE = TableConfig(
    "items", 8, optimizer=optim.Adagrad(lr=0.1), seed=5, host_cache_bytes=32 << 10
)
CLI_KEYS = np.arange(0, 3 * 1201, 3, dtype=np.int64)  # 1201 keys: 601 on shard 0, 600 on 1


@dataclass
class CliCluster:
    cluster: LocalCluster
    admin: ClusterAdmin
    data: Data
    snapshots: Path
    root: Path


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliCluster]:
    root = tmp_path_factory.mktemp("cli")
    with (
        running(LocalCluster(2, root / "data", root / "snapshots")) as cluster,
        ClusterAdmin(cluster.addresses) as admin,
        Data(cluster.addresses) as data,
    ):
        admin.create_table(CLI_TABLE)
        data.lookup(CLI_TABLE, CLI_KEYS, create=True)
        grads = np.random.default_rng(0).standard_normal((CLI_KEYS.size, 8)).astype(np.float32)
        data.push(CLI_TABLE, 1, CLI_KEYS, grads)
        yield CliCluster(cluster, admin, data, root / "snapshots", root)


def test_cli_tables_describe_stats(cli_cluster: CliCluster) -> None:
    addresses = cli_cluster.cluster.addresses
    n0 = int(np.count_nonzero(CLI_KEYS % 2 == 0))
    created = {0: n0, 1: CLI_KEYS.size - n0}

    plain = tierps_admin(addresses, "tables")
    assert plain.returncode == 0, plain.stderr
    assert "items" in plain.stdout and "adagrad(" in plain.stdout
    assert ok_json(addresses, "tables") == [CLI_TABLE.to_dict()]

    plain = tierps_admin(addresses, "describe", "items")
    assert plain.returncode == 0, plain.stderr
    assert "table 'items'" in plain.stdout and "rocksdb" in plain.stdout
    shards = ok_json(addresses, "describe", "items")
    assert [s["shard_id"] for s in shards] == [0, 1]
    assert all(s["num_shards"] == 2 and s["config"] == CLI_TABLE.to_dict() for s in shards)
    assert {s["shard_id"]: s["created"] for s in shards} == created
    assert sum(s["created"] for s in shards) == CLI_KEYS.size

    plain = tierps_admin(addresses, "stats")
    assert plain.returncode == 0, plain.stderr
    for address in addresses:
        assert address in plain.stdout
    stats = ok_json(addresses, "stats")
    assert [(s["shard_id"], s["num_shards"]) for s in stats] == [(0, 2), (1, 2)]
    assert {s["shard_id"]: s["tables"][0]["created"] for s in stats} == created
    assert all(s["rss_bytes"] > 0 and s["uptime_s"] > 0 for s in stats)


def test_cli_snapshot_save_list_load(cli_cluster: CliCluster) -> None:
    addresses = cli_cluster.cluster.addresses
    data = cli_cluster.data
    before = data.lookup(CLI_TABLE, CLI_KEYS)

    saved = ok_json(addresses, "snapshot", "save", "cli-a")
    assert saved["name"] == "cli-a" and saved["rows"] == CLI_KEYS.size
    assert saved["path"] == str(cli_cluster.snapshots / "cli-a")
    plain = tierps_admin(addresses, "snapshot", "save", "cli-b")
    assert plain.returncode == 0, plain.stderr
    assert f"saved snapshot 'cli-b': {CLI_KEYS.size:,} rows" in plain.stdout

    listed = {s["name"]: s for s in ok_json(addresses, "snapshot", "list")}
    for name in ("cli-a", "cli-b"):
        assert listed[name]["complete"] is True
        assert listed[name]["num_shards"] == 2
        assert listed[name]["table_rows"] == {"items": CLI_KEYS.size}
    plain = tierps_admin(addresses, "snapshot", "list")
    assert plain.returncode == 0, plain.stderr
    assert f"items ({CLI_KEYS.size:,})" in plain.stdout

    # Change the live rows, then load: they are the saved ones again.
    data.push(CLI_TABLE, 2, CLI_KEYS, np.ones((CLI_KEYS.size, 8), np.float32))
    assert not np.array_equal(data.lookup(CLI_TABLE, CLI_KEYS), before)
    plain = tierps_admin(addresses, "snapshot", "load", "cli-a")
    assert plain.returncode == 0, plain.stderr
    assert f"loaded snapshot 'cli-a': {CLI_KEYS.size:,} rows" in plain.stdout
    assert_bits_equal(data.lookup(CLI_TABLE, CLI_KEYS), before, "after CLI load")


@pytest.mark.parametrize("verb", ["save", "load"])
def test_cli_bad_snapshot_name_is_invalid_argument(cli_cluster: CliCluster, verb: str) -> None:
    result = tierps_admin(cli_cluster.cluster.addresses, "snapshot", verb, "../x")
    assert result.returncode == 1, result
    assert "INVALID_ARGUMENT" in result.stderr and "'../x'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (cli_cluster.snapshots.parent / "x").exists()


def test_cli_load_of_corrupted_snapshot_is_refused(cli_cluster: CliCluster) -> None:
    addresses = cli_cluster.cluster.addresses
    data = cli_cluster.data
    cli_cluster.admin.save_snapshot("corrupt")
    data.push(CLI_TABLE, 3, CLI_KEYS, np.ones((CLI_KEYS.size, 8), np.float32))
    live = data.lookup(CLI_TABLE, CLI_KEYS)
    rows_file = part_dir(cli_cluster.snapshots / "corrupt", "part-00001-of-00002") / "items.rows"
    raw = bytearray(rows_file.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    rows_file.write_bytes(bytes(raw))

    result = tierps_admin(addresses, "snapshot", "load", "corrupt")
    assert result.returncode == 1, result
    assert "FAILED_PRECONDITION" in result.stderr
    assert "part-00001-of-00002/items.rows" in result.stderr and "corrupt" in result.stderr
    for address in addresses:
        wait_until_serving(address, 10)
    assert_bits_equal(data.lookup(CLI_TABLE, CLI_KEYS), live, "live rows after a refused load")


@pytest.mark.parametrize("damage", ["part-deleted", "manifest-removed"])
def test_cli_load_of_partial_snapshot_is_refused(cli_cluster: CliCluster, damage: str) -> None:
    addresses = cli_cluster.cluster.addresses
    data = cli_cluster.data
    name = f"partial-{damage}"
    cli_cluster.admin.save_snapshot(name)
    data.push(CLI_TABLE, 4, CLI_KEYS, np.ones((CLI_KEYS.size, 8), np.float32))
    live = data.lookup(CLI_TABLE, CLI_KEYS)
    path = cli_cluster.snapshots / name
    if damage == "part-deleted":
        shutil.rmtree(part_dir(path, "part-00001-of-00002"))
        expected = "part-00001-of-00002/items."
    else:
        (path / "MANIFEST.json").unlink()
        expected = "incomplete"

    result = tierps_admin(addresses, "snapshot", "load", name)
    assert result.returncode == 1, result
    assert "FAILED_PRECONDITION" in result.stderr and expected in result.stderr, result.stderr
    assert repr(name) in result.stderr
    assert_bits_equal(data.lookup(CLI_TABLE, CLI_KEYS), live, "live rows after a refused load")
    if damage == "manifest-removed":
        listed = {s["name"]: s for s in ok_json(addresses, "snapshot", "list")}
        assert listed[name]["complete"] is False and listed[name]["num_shards"] == 0


def test_cli_two_clusters_share_a_snapshot_dir(cli_cluster: CliCluster) -> None:
    first = cli_cluster.cluster.addresses
    other_table = TableConfig("other", 4, optimizer=optim.SGD(lr=0.1))
    with (
        running(LocalCluster(1, cli_cluster.root / "other-data", cli_cluster.snapshots)) as other,
        ClusterAdmin(other.addresses) as admin,
        Data(other.addresses) as data,
    ):
        admin.create_table(other_table)
        data.lookup(other_table, np.arange(77), create=True)
        saved = tierps_admin(first, "snapshot", "save", "from-first")
        assert saved.returncode == 0, saved.stderr
        saved = tierps_admin(other.addresses, "snapshot", "save", "from-other")
        assert saved.returncode == 0, saved.stderr
        for addresses in (first, other.addresses):
            listed = {s["name"]: s for s in ok_json(addresses, "snapshot", "list")}
            assert listed["from-first"]["num_shards"] == 2
            assert listed["from-first"]["table_rows"] == {"items": CLI_KEYS.size}
            assert listed["from-other"]["num_shards"] == 1
            assert listed["from-other"]["table_rows"] == {"other": 77}
        # A name that exists is refused, from either cluster, and the snapshot is intact.
        manifest = (cli_cluster.snapshots / "from-first" / "MANIFEST.json").read_bytes()
        for addresses in (first, other.addresses):
            again = tierps_admin(addresses, "snapshot", "save", "from-first")
            assert again.returncode == 1, again
            assert "FAILED_PRECONDITION" in again.stderr and "already exists" in again.stderr
            assert "'from-first'" in again.stderr
        assert (cli_cluster.snapshots / "from-first" / "MANIFEST.json").read_bytes() == manifest
        listed = {s["name"]: s for s in ok_json(first, "snapshot", "list")}
        assert listed["from-first"]["table_rows"] == {"items": CLI_KEYS.size}


def test_cli_snapshot_list_reports_refusal_like_other_commands(tmp_path: Path) -> None:
    """Regression: ClusterAdmin.list_snapshots let a raw grpc.RpcError out, so `tierps admin
    snapshot list` died with a traceback instead of naming the shard and the status."""
    with running(LocalCluster(1, tmp_path / "data")) as cluster:  # no snapshot dir
        save = tierps_admin(cluster.addresses, "snapshot", "save", "x")
        assert save.returncode == 1
        assert save.stderr.strip().endswith("start it with --snapshot-dir")
        assert "tierps admin: shard 0 at " in save.stderr and "Traceback" not in save.stderr
        listed = tierps_admin(cluster.addresses, "snapshot", "list")
        assert listed.returncode == 1
        assert "FAILED_PRECONDITION" in listed.stderr
        assert "Traceback" not in listed.stderr, listed.stderr
        assert "tierps admin: shard 0 at " in listed.stderr


# -- 5. `tierps cluster` ------------------------------------------------------------------------


def test_cluster_command_serves_and_stops_on_sigint(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "tierps.server.cli",
        "cluster",
        "--shards",
        "2",
        "--data-dir",
        str(tmp_path / "data"),
        "--snapshot-dir",
        str(tmp_path / "snapshots"),
    ]
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    pids: list[int] = []
    try:
        output: list[str] = []
        addresses: list[str] = []
        deadline = time.monotonic() + 60
        while not addresses:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no 'addresses:' line within 60 s; output: {''.join(output)}")
            if line is None:
                pytest.fail(f"tierps cluster ended early: {''.join(output)}")
            output.append(line)
            if line.startswith("addresses: "):
                addresses = line.removeprefix("addresses: ").strip().split(",")
        assert len(addresses) == 2
        for shard_id in range(2):
            port_file = tmp_path / "data" / f"shard-{shard_id}.port"
            pids.append(json.loads(port_file.read_text())["pid"])
        for address in addresses:
            wait_until_serving(address, 10)
        with ClusterAdmin(addresses) as admin:
            admin.check_topology()

        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
        reader.join(10)
        rest = []
        while (line := lines.get_nowait() if not lines.empty() else None) is not None:
            rest.append(line)
        assert "stopping..." in "".join(rest)
        for pid in pids:  # reaped by the cluster command: gone
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        for address in addresses:
            assert health_fails(address), address
        for shard_id in range(2):  # graceful: each shard logged its stop
            log = (tmp_path / "data" / f"shard-{shard_id}.log").read_text()
            assert '"stopped"' in log or "stopped" in log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- 6. a snapshot while trainers push ----------------------------------------------------------


def test_save_while_pushing_is_consistent(tmp_path: Path) -> None:
    """Two trainer threads push -1 per call (SGD lr 1, gradient +1, zeros init) to one key
    on each shard; a save in the middle must hold, per key, at least the pushes acknowledged
    before the save began, and no more than were sent before it ended."""
    table = TableConfig("counter", 4, initializer=init.Zeros(), optimizer=optim.SGD(lr=1.0))
    keys = np.array([0, 1], dtype=np.int64)  # key s lives on shard s
    max_pushes = 300
    with (
        running(LocalCluster(2, tmp_path / "data", tmp_path / "snapshots")) as cluster,
        ClusterAdmin(cluster.addresses) as admin,
    ):
        admin.create_table(table)
        lock = threading.Lock()
        acked = [0, 0]
        sent = [0, 0]
        stop = threading.Event()
        errors: list[BaseException] = []

        def trainer() -> None:
            grad = np.ones((1, 4), dtype=np.float32)
            try:
                with Data(cluster.addresses) as data:
                    for step in range(1, max_pushes + 1):
                        if stop.is_set():
                            return
                        for shard in (0, 1):
                            with lock:
                                sent[shard] += 1
                            data.push_to(shard, table, step, keys[shard : shard + 1], grad)
                            with lock:
                                acked[shard] += 1
            except BaseException as error:  # noqa: BLE001 - reported by the test
                errors.append(error)

        threads = [threading.Thread(target=trainer, daemon=True) for _ in range(2)]
        for thread in threads:
            thread.start()
        try:
            deadline = time.monotonic() + 30
            while min(acked) < 40 and time.monotonic() < deadline and not errors:
                time.sleep(0.01)
            with lock:
                acked_before = list(acked)
            admin.save_snapshot("during")
            with lock:
                sent_after = list(sent)
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
        assert not errors, errors
        assert not any(thread.is_alive() for thread in threads)
        assert min(acked_before) >= 40, acked_before

        saved_keys, rows = read_snapshot(tmp_path / "snapshots" / "during", table)
        np.testing.assert_array_equal(saved_keys, keys)
        for shard in (0, 1):
            row = rows[shard]
            assert np.all(row == row[0]), row
            count = -float(row[0])
            assert count == int(count)
            assert acked_before[shard] <= count <= sent_after[shard], (
                shard,
                acked_before,
                count,
                sent_after,
            )
            assert count > 0
        # And no push was lost: the live value counts every acknowledged push.
        with Data(cluster.addresses) as data:
            live = data.lookup(table, keys)
        assert_bits_equal(
            live,
            -np.array(acked, np.float32)[:, None] * np.ones(4, np.float32),
            "every acknowledged push applied once",
        )
