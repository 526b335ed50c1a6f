"""Shard-service benchmark: lookup and push throughput over loopback against a raw gRPC echo
of the same messages (the ceiling) and Redis MGET/MSET of the same value bytes, all
measured in this run.

    python -m tests.bench.bench_service [--out bench-results/service.json] [--quick]

Shards and echo servers are subprocesses (as in production); the client is this process,
calling shards concurrently, one stream per shard, keys routed by key % num_shards. Redis is
Debian's redis-server, started here on a free port if it is installed (said if not). Not
part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

from tierps.client.admin import ClusterAdmin
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto import wire
from tierps.server import LocalCluster
from tierps.storage import TableConfig, optim

BATCHES = (4096, 16384, 65536, 262144)
DIMS = (64, 128)
SHARDS = (1, 2)
TABLE_KEYS = 1 << 19  # keys stored per table, all in the host tier
MIN_SECONDS = 1.0  # each measurement repeats until it has run this long (and >= 3 times)


class Router:
    """Raw-stub client: unique keys split by key % N, one concurrent stream per shard."""

    def __init__(self, addresses: list[str]) -> None:
        self.n = len(addresses)
        self.channels = [
            grpc.insecure_channel(a, options=wire.channel_options()) for a in addresses
        ]
        self.stubs = [pb_grpc.EmbeddingServiceStub(c) for c in self.channels]
        self.pool = ThreadPoolExecutor(self.n)

    def _split(self, keys: np.ndarray) -> list[np.ndarray]:
        if self.n == 1:
            return [np.arange(keys.size)]
        owner = keys % self.n
        return [np.flatnonzero(owner == shard) for shard in range(self.n)]

    def lookup(self, table: str, dim: int, keys: np.ndarray) -> np.ndarray:
        parts = self._split(keys)

        def call(shard: int) -> bytes:
            requests = wire.lookup_requests(table, dim, keys[parts[shard]].tobytes(), create=False)
            return wire.join_values(self.stubs[shard].Lookup(requests, timeout=120))

        replies = list(self.pool.map(call, range(self.n)))
        if self.n == 1:
            return np.frombuffer(replies[0], dtype="<f4").reshape(keys.size, dim)
        out = np.empty((keys.size, dim), dtype=np.float32)
        for shard, reply in enumerate(replies):
            out[parts[shard]] = np.frombuffer(reply, dtype="<f4").reshape(-1, dim)
        return out

    def push(self, table: str, dim: int, keys: np.ndarray, grads: np.ndarray) -> None:
        parts = self._split(keys)

        def call(shard: int) -> None:
            mine = parts[shard]
            requests = wire.push_requests(
                table, dim, 1, keys[mine].tobytes(), grads[mine].tobytes()
            )
            self.stubs[shard].PushGradients(requests, timeout=120)

        list(self.pool.map(call, range(self.n)))

    def close(self) -> None:
        self.pool.shutdown()
        for channel in self.channels:
            channel.close()


def _call(
    router: Router, op: str, table: str, dim: int, keys: np.ndarray, grads: np.ndarray
) -> Callable[[], object]:
    if op == "lookup":
        return lambda: router.lookup(table, dim, keys)
    return lambda: router.push(table, dim, keys, grads)


def measure(fn: Callable[[], object]) -> float:
    """Median seconds per call over >= 3 calls and >= MIN_SECONDS."""
    return measure_together({"fn": fn})["fn"]


def measure_together(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median seconds per call of each, their calls alternated (so drift on this shared
    machine hits all alike), >= 5 calls each and >= MIN_SECONDS each."""
    for fn in fns.values():
        fn()  # warm up
    times: dict[str, list[float]] = {name: [] for name in fns}
    while min(len(t) for t in times.values()) < 5 or min(map(sum, times.values())) < MIN_SECONDS:
        for name, fn in fns.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


class EchoServers:
    def __init__(self, count: int, root: Path) -> None:
        self.processes, self.addresses = [], []
        for i in range(count):
            port_file = root / f"echo-{count}-{i}.port"
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.bench.echo_server", "--port-file", str(port_file)]
                )
            )
            deadline = time.monotonic() + 30
            while not port_file.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("echo server did not start")
                time.sleep(0.05)
            self.addresses.append(f"127.0.0.1:{json.loads(port_file.read_text())['port']}")

    def close(self) -> None:
        for process in self.processes:
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            process.wait(10)


class Redis:
    """Debian's redis-server on a free port, persistence off."""

    def __init__(self, root: Path) -> None:
        import redis

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(root)],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        self.client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.version = self.client.info()["redis_version"]

    def close(self) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(10)


def populate(router: Router, admin: ClusterAdmin, dim: int) -> str:
    table = f"bench{dim}"
    # SGD keeps rows at dim floats; the budget holds every row in the host tier.
    admin.create_table(
        TableConfig(table, dim, optimizer=optim.SGD(lr=0.01), host_cache_bytes=TABLE_KEYS * dim * 8)
    )
    keys = np.arange(TABLE_KEYS, dtype=np.int64)
    for start in range(0, TABLE_KEYS, 65536):
        chunk = keys[start : start + 65536]
        router.push(table, dim, chunk, np.zeros((chunk.size, dim), dtype=np.float32))
    return table


def run(quick: bool) -> dict:
    batches = (4096, 65536) if quick else BATCHES
    dims = (64,) if quick else DIMS
    rng = np.random.default_rng(0)
    results: dict = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "grpcio": grpc.__version__},
        "chunk_bytes": wire.CHUNK_BYTES,
        "table_keys": TABLE_KEYS,
        "rows": [],
    }  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="tierps-bench-"))
    redis_server = None
    if shutil.which("redis-server"):
        redis_server = Redis(root)
        results["redis"] = redis_server.version
        print(f"redis-server {redis_server.version} started on port {redis_server.port}")
    else:
        results["redis"] = None
        print("redis-server is not installed (apt-get install redis-server): no Redis baseline")
    redis_figures: dict[tuple[int, int], dict[str, float]] = {}
    try:
        if redis_server is not None:
            for dim in dims:
                for batch in batches:
                    keys = [int(k).to_bytes(8, "little") for k in range(batch)]
                    value = bytes(4 * dim)
                    mset = dict.fromkeys(keys, value)
                    redis_figures[(dim, batch)] = {
                        "push_s": measure(lambda m=mset: redis_server.client.mset(m)),
                        "lookup_s": measure(lambda k=keys: redis_server.client.mget(k)),
                    }
        for shards in SHARDS:
            with LocalCluster(shards, root / f"data-{shards}") as cluster:
                echo = EchoServers(shards, root)
                routers = {"tierps": Router(cluster.addresses), "echo": Router(echo.addresses)}
                admin = ClusterAdmin(cluster.addresses)
                try:
                    for dim in dims:
                        table = populate(routers["tierps"], admin, dim)
                        for batch in batches:
                            keys = rng.choice(TABLE_KEYS, batch, replace=False).astype(np.int64)
                            grads = rng.standard_normal((batch, dim), dtype=np.float32) * 1e-3
                            row = {"shards": shards, "dim": dim, "batch": batch}
                            payload_mb = {
                                "lookup": batch * (8 + 4 * dim) / 1e6,
                                "push": batch * (8 + 4 * dim) / 1e6,
                            }
                            for op in ("lookup", "push"):
                                seconds_of = measure_together(
                                    {
                                        name: _call(router, op, table, dim, keys, grads)
                                        for name, router in routers.items()
                                    }
                                )
                                for name, seconds in seconds_of.items():
                                    row[f"{op}_{name}_keys_per_s"] = batch / seconds
                                    row[f"{op}_{name}_mb_per_s"] = payload_mb[op] / seconds
                                row[f"{op}_vs_echo"] = (
                                    row[f"{op}_tierps_keys_per_s"] / row[f"{op}_echo_keys_per_s"]
                                )
                                if (dim, batch) in redis_figures:
                                    redis_s = redis_figures[(dim, batch)][f"{op}_s"]
                                    row[f"{op}_redis_keys_per_s"] = batch / redis_s
                                    row[f"{op}_vs_redis"] = (
                                        row[f"{op}_tierps_keys_per_s"] * redis_s / batch
                                    )
                            results["rows"].append(row)
                            print(_line(row), flush=True)
                finally:
                    admin.close()
                    for router in routers.values():
                        router.close()
                    echo.close()
    finally:
        if redis_server is not None:
            redis_server.close()
        shutil.rmtree(root, ignore_errors=True)
    return results


def _line(row: dict) -> str:
    parts = [f"shards={row['shards']} dim={row['dim']:>3} batch={row['batch']:>6}"]
    for op in ("lookup", "push"):
        part = (
            f"{op} {row[f'{op}_tierps_keys_per_s'] / 1e6:5.2f}M keys/s "
            f"({row[f'{op}_tierps_mb_per_s']:6.0f} MB/s) {row[f'{op}_vs_echo']:.2f}x echo"
        )
        if f"{op}_vs_redis" in row:
            part += f" {row[f'{op}_vs_redis']:.1f}x redis"
        parts.append(part)
    return " | ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench-results/service.json"))
    parser.add_argument("--quick", action="store_true", help="fewer shapes, for a smoke run")
    args = parser.parse_args()
    results = run(args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
