"""Shard-service benchmark: EmbeddingClient lookups and pushes over loopback against the best
raw transport of the same bytes, a gRPC unary echo carrying each shard's request and reply
as one message each (tests/bench/echo_server.py: no protobuf, limits raised on both ends);
against the best raw server doing the same work, a "raw numpy server" in the echo's process
that holds the rows in a numpy arena (np.take for a lookup, numpy SGD for a push) on the same
wire; and Redis MGET of the same value bytes where redis-server is installed; all in this
run, their calls alternated so that this shared machine's drift hits all alike.

    python -m tests.bench.bench_service [--quick] [--out docs/perf/service.json]
        [--png docs/perf/service.png]
    python -m tests.bench.bench_service --concurrency   # 1 vs 2 clients on two tables
    python -m tests.bench.bench_service --pieces        # lookup piece sizes, alternated

Shards and echo servers are subprocesses (as in production); the client is this process,
calling the shards at once (keys routed by key % num_shards), the echo likewise. Not part of
the test run.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tests.bench.cpu_time import process_cpu_s
from tests.bench.echo_server import echo_call, initial_rows, raw_calls
from tierps.client import EmbeddingClient, routing
from tierps.proto import wire
from tierps.server.cluster import LocalCluster
from tierps.storage import TableConfig, optim

BATCHES = (16384, 65536, 262144)
DIMS = (16, 64, 128)
SHARDS = (1, 2)
PLOT_DIM = 64  # the picture's dim (every dim is in the JSON)
TABLE_KEYS = 1 << 19  # keys stored per table, all in the host tier
MIN_SECONDS = 0.4  # each measurement repeats until it has run this long (and >= 5 times)
LR = 0.01  # the SGD step of tierps' table and the raw numpy server's
ROW_SEED = 0  # initial_rows' seed: tierps and the raw numpy server hold the same rows


def measure_together(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median seconds per call of each, their calls alternated, >= 5 calls each and
    >= MIN_SECONDS each."""
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
    """One echo server subprocess per shard (each serving the echo and the raw numpy
    server), and a raw client that calls them at once."""

    def __init__(self, count: int, root: Path) -> None:
        self.processes, addresses = [], []
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
            addresses.append(f"127.0.0.1:{json.loads(port_file.read_text())['port']}")
        options = wire.channel_options()
        self.channels = [grpc.insecure_channel(a, options=options) for a in addresses]
        self.calls = [echo_call(channel) for channel in self.channels]
        self.raw = [raw_calls(channel) for channel in self.channels]
        self.pool = ThreadPoolExecutor(max(1, count - 1))

    def round_trip(self, requests: list[bytes], reply_bytes: list[int]) -> None:
        """Each shard's request bytes out and its reply bytes back, all shards at once."""
        self._at_once(
            [lambda i=i: self.calls[i](requests[i], reply_bytes[i]) for i in range(len(requests))]
        )

    def fill_raw(self, dim: int) -> None:
        """Every raw numpy server holds initial_rows(TABLE_KEYS, dim), SGD at LR."""
        shape = {"table_rows": TABLE_KEYS, "dim": dim, "lr": LR, "seed": ROW_SEED}
        self._at_once(
            [lambda f=raw["fill"]: f(json.dumps(shape).encode(), timeout=120.0) for raw in self.raw]
        )

    def raw_call(self, method: str, requests: list[bytes]) -> list[bytes]:
        """The raw numpy servers' `method` (lookup, push) with each shard's request bytes,
        all shards at once; their replies."""
        return self._at_once(
            [
                lambda i=i: self.raw[i][method](requests[i], timeout=120.0)
                for i in range(len(requests))
            ]
        )

    def _at_once(self, calls: list[Callable[[], bytes]]) -> list[bytes]:
        """Runs the calls at once, the last in this thread (as the client does)."""
        *others, last = calls
        futures = [self.pool.submit(call) for call in others]
        mine = last()
        return [future.result() for future in futures] + [mine]

    def close(self) -> None:
        self.pool.shutdown()
        for channel in self.channels:
            channel.close()
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
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(root),
            ],
            stdout=subprocess.DEVNULL,
        )
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


def populate(client: EmbeddingClient, dim: int, direct: bool = False) -> str:
    """A table of TABLE_KEYS rows (initial_rows, as the raw numpy server holds), all in the
    host tier (SGD keeps dim floats a row): hashed, or direct (use_hashtable=False, row k
    of an arena holds key k: the raw numpy server's layout)."""
    table = f"bench{dim}{'_direct' if direct else ''}"
    index = {"use_hashtable": False, "capacity": TABLE_KEYS} if direct else {}
    client.create_table(
        TableConfig(
            table,
            dim,
            optimizer=optim.SGD(lr=LR),
            host_cache_bytes=TABLE_KEYS * dim * 8,
            **index,
        )
    )
    keys = np.arange(TABLE_KEYS, dtype=np.int64)
    client.assign(table, keys, initial_rows(TABLE_KEYS, dim, ROW_SEED))
    return table


def check_raw_server(
    client: EmbeddingClient, echo: EchoServers, tables: tuple[str, ...], shards: int, dim: int
) -> None:
    """Outside the timing: the raw numpy servers answer a lookup with the rows each of
    tierps' tables returns for the same keys (all hold initial_rows), and after one SGD push
    of the same gradients on each, still. Raises AssertionError where a baseline is wrong."""
    rng = np.random.default_rng(1)
    keys = rng.choice(TABLE_KEYS, 4096, replace=False).astype(np.int64)
    grads = rng.standard_normal((keys.size, dim), dtype=np.float32)
    at = shard_positions(keys, shards)

    def raw_rows() -> np.ndarray:
        replies = echo.raw_call("lookup", [keys[i].tobytes() for i in at])
        rows = np.empty((keys.size, dim), np.float32)
        for i, reply in zip(at, replies, strict=True):
            rows[i] = np.frombuffer(reply, np.float32).reshape(i.size, dim)
        return rows

    before = raw_rows()
    for table in tables:
        if not np.array_equal(client.lookup(table, keys), before):
            raise AssertionError(f"raw numpy server: lookup rows differ from {table!r}'s")
        client.push_gradients(table, keys, grads)
    echo.raw_call("push", [keys[i].tobytes() + grads[i].tobytes() for i in at])
    # each side rounds lr * grad and the difference once in float32 (2**-24 relative each),
    # and one side may round lr to float32 first: at most 2**-23 * (|row| + 3 lr |grad|)
    bound = 2.0**-23 * (np.abs(before) + 3 * LR * np.abs(grads))
    after = raw_rows()
    for table in tables:
        if not (np.abs(after - client.lookup(table, keys)) <= bound).all():
            raise AssertionError(f"raw numpy server: rows after a push differ from {table!r}'s")


def redis_mget(redis_server: Redis, batches: tuple[int, ...], dim: int) -> dict[int, float]:
    """Seconds of one MGET of `batch` 4*dim-byte values (stored first with MSET)."""
    seconds = {}
    for batch in batches:
        keys = [int(k).to_bytes(8, "little") for k in range(batch)]
        redis_server.client.mset(dict.fromkeys(keys, bytes(4 * dim)))
        seconds[batch] = measure_together({"mget": lambda k=keys: redis_server.client.mget(k)})[
            "mget"
        ]
    redis_server.client.flushall()
    return seconds


def sweep(
    quick: bool,
    root: Path,
    batches: tuple[int, ...] | None = None,
    dims: tuple[int, ...] | None = None,
    shard_counts: tuple[int, ...] = SHARDS,
) -> dict[str, Any]:
    batches = batches or ((16384, 65536) if quick else BATCHES)
    dims = dims or ((PLOT_DIM,) if quick else DIMS)
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
        },
        "one_message_bytes": wire.ONE_MESSAGE_BYTES,
        "table_keys": TABLE_KEYS,
        "baseline": "raw gRPC unary echo of each shard's request and reply bytes, one message "
        "each way, no protobuf (tests/bench/echo_server.py)",
        "raw_numpy": "the same work done the raw way (tests/bench/echo_server.py RawNumpy, in "
        "the echo's process, the same wire): rows in a dense numpy arena indexed "
        "by key; lookup = np.take into a reused buffer (mode=clip) then .tobytes() "
        "(faster than np.take(...).tobytes() at 4-16 MiB, equal at 1 MiB: "
        "docs/perf/profile-lookup.md, a raw server); push = arena[keys] -= lr * grads "
        "of views of the request, as np.take into the buffer, rows -= lr * grads, "
        "arena[keys] = rows (the same bits, about 2x faster); no checks; the "
        "client neither routes nor reassembles (requests built outside the "
        "timing, as for the echo). "
        "Checked once per dim to answer tierps' rows, before and after a push",
        "direct": "lookup_direct and push_direct: tierps on a direct table of the same rows "
        "(use_hashtable=False, capacity=table_keys: row k holds key k, the raw numpy server's "
        "layout, no hash index); the plain tierps figures are a hashed table's",
        "lookup": "EmbeddingClient.lookup: a writable array in the keys' order; lookup_view: "
        "copy=False (a read-only view of the reply where one reply holds every row "
        "in order). A shard's reply of 8 MiB or more goes as 2-4 calls of 4 MiB or "
        "more at once (client.routing.LOOKUP_PIECE_BYTES); the echo sends one "
        "message",
        "rows": [],
    }
    if shutil.which("redis-server"):
        redis_server = Redis(root)
        try:
            results["redis"] = redis_server.version
            results["redis_mget_s"] = {
                str(batch): s for batch, s in redis_mget(redis_server, batches, PLOT_DIM).items()
            }
        finally:
            redis_server.close()
    else:
        results["redis"] = None
        print("redis-server is not installed (apt-get install redis-server): no Redis baseline")
    for shards, client, echo in clusters(root / "data", shard_counts):
        for dim in dims:
            table, direct = populate(client, dim), populate(client, dim, direct=True)
            echo.fill_raw(dim)
            check_raw_server(client, echo, (table, direct), shards, dim)
            for batch in batches:
                row = measure_shape(client, echo, (table, direct), shards, dim, batch, rng)
                results["rows"].append(row)
                print(_line(row), flush=True)
            client.drop_table(table)
            client.drop_table(direct)
    return results


def clusters(
    root: Path, shard_counts: tuple[int, ...]
) -> Iterator[tuple[int, EmbeddingClient, EchoServers]]:
    """For each shard count in turn: a LocalCluster of that many shards, a client of it,
    and as many echo servers; all closed before the next."""
    for shards in shard_counts:
        with LocalCluster(shards, root / str(shards)) as cluster:
            echo = EchoServers(shards, root)
            client = EmbeddingClient(cluster.addresses, timeout_s=120.0)
            try:
                yield shards, client, echo
            finally:
                client.close()
                echo.close()


def shard_positions(keys: np.ndarray, shards: int) -> list[np.ndarray]:
    """Each shard's keys' positions in `keys`, in the order the client sends them (keys
    routed by key % shards; distinct keys go as given)."""
    owner = keys % shards
    return [np.flatnonzero(owner == s) for s in range(shards)]


def measure_shape(
    client: EmbeddingClient,
    echo: EchoServers,
    tables: tuple[str, str],
    shards: int,
    dim: int,
    batch: int,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """One shape's calls, alternated: tierps on the hashed table and on the direct one
    (tables), the echo and the raw numpy server; seconds a call and the ratios."""
    table, direct = tables
    keys = rng.choice(TABLE_KEYS, batch, replace=False).astype(np.int64)
    grads = rng.standard_normal((batch, dim), dtype=np.float32) * 1e-3
    mine = shard_positions(keys, shards)
    # the echo carries what a shard call carries: keys out and rows back; keys and
    # gradients out and an acknowledgement back (the raw numpy server reads them)
    key_bytes = [keys[at].tobytes() for at in mine]
    push_bytes = [keys[at].tobytes() + grads[at].tobytes() for at in mine]
    rows_back = [4 * dim * at.size for at in mine]
    seconds = measure_together(
        {
            "lookup_tierps": lambda: client.lookup(table, keys),
            "lookup_view_tierps": lambda: client.lookup(table, keys, copy=False),
            "lookup_echo": lambda: echo.round_trip(key_bytes, rows_back),
            "lookup_raw": lambda: echo.raw_call("lookup", key_bytes),
            "lookup_direct": lambda: client.lookup(direct, keys),
            "push_tierps": lambda: client.push_gradients(table, keys, grads),
            "push_direct": lambda: client.push_gradients(direct, keys, grads),
            "push_echo": lambda: echo.round_trip(push_bytes, [8] * shards),
            "push_raw": lambda: echo.raw_call("push", push_bytes),
        }
    )
    row: dict[str, Any] = {"shards": shards, "dim": dim, "batch": batch}
    for name, s in seconds.items():
        row[f"{name}_s"] = s
        row[f"{name}_keys_per_s"] = batch / s
    for op in ("lookup", "push"):
        row[f"{op}_vs_echo"] = seconds[f"{op}_echo"] / seconds[f"{op}_tierps"]
        row[f"{op}_vs_raw"] = seconds[f"{op}_raw"] / seconds[f"{op}_tierps"]
        row[f"{op}_raw_vs_echo"] = seconds[f"{op}_echo"] / seconds[f"{op}_raw"]
        row[f"{op}_direct_vs_raw"] = seconds[f"{op}_raw"] / seconds[f"{op}_direct"]
    row["lookup_view_vs_echo"] = seconds["lookup_echo"] / seconds["lookup_view_tierps"]
    return row


def _line(row: dict[str, Any]) -> str:
    parts = [f"shards={row['shards']} dim={row['dim']:>3} batch={row['batch']:>6}"]
    for op in ("lookup", "push"):
        parts.append(
            f"{op} {row[f'{op}_tierps_s'] * 1e3:6.1f} ms vs echo {row[f'{op}_echo_s'] * 1e3:6.1f}"
            f" ms, raw numpy {row[f'{op}_raw_s'] * 1e3:6.1f} ms "
            f"({row[f'{op}_tierps_keys_per_s'] / 1e6:5.2f}M keys/s, "
            f"{row[f'{op}_vs_echo']:.2f}x echo, {row[f'{op}_vs_raw']:.2f}x raw; direct "
            f"{row[f'{op}_direct_vs_raw']:.2f}x raw)"
        )
    parts.append(f"copy=False {row['lookup_view_vs_echo']:.2f}x")
    return " | ".join(parts)


def plot(results: dict[str, Any], path: Path) -> None:
    """Keys/s against batch size at PLOT_DIM (else the smallest dim measured), one panel per
    shard count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = {r["dim"] for r in results["rows"]}
    dim = PLOT_DIM if PLOT_DIM in dims or not dims else min(dims)
    fig, axes = plt.subplots(1, len(SHARDS), figsize=(11, 4.8), sharey=True)
    for ax, shards in zip(axes, SHARDS, strict=True):
        rows = [r for r in results["rows"] if r["shards"] == shards and r["dim"] == dim]
        batches = [r["batch"] for r in rows]
        lines = (
            ("lookup_echo", "raw unary echo, lookup bytes (ceiling)", "C0", "--"),
            ("lookup_raw", "raw numpy server, lookup (np.take)", "C0", ":"),
            ("lookup_tierps", "tierps lookup", "C0", "-"),
            ("lookup_direct", "tierps lookup, direct table", "C0", "-."),
            ("push_echo", "raw unary echo, push bytes (ceiling)", "C1", "--"),
            ("push_raw", "raw numpy server, push (numpy SGD)", "C1", ":"),
            ("push_tierps", "tierps push (SGD)", "C1", "-"),
            ("push_direct", "tierps push (SGD), direct table", "C1", "-."),
        )
        for key, label, color, style in lines:
            if f"{key}_keys_per_s" not in (rows[0] if rows else {}):
                continue  # a JSON written before this contender
            values = [r[f"{key}_keys_per_s"] for r in rows]
            marker = "^" if style == ":" else "o"
            ax.plot(batches, values, style, color=color, marker=marker, label=label)
        if results.get("redis_mget_s"):
            mget = results["redis_mget_s"]
            sizes = [b for b in batches if str(b) in mget]
            ax.plot(
                sizes,
                [b / mget[str(b)] for b in sizes],
                ":",
                color="C2",
                marker="s",
                label=f"Redis {results['redis']} MGET (redis-py)",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(batches, [f"{b // 1024}k" for b in batches])
        ax.set_xlabel("keys per call")
        ax.set_title(f"{shards} shard{'s' if shards > 1 else ''}, dim {dim}, loopback")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("keys/s")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(
        f"tierps over gRPC vs the raw transport of the same bytes, and a raw numpy server "
        f"({results['machine']['cpus']} cores, one run)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# -- 1 vs 2 concurrent clients (a shard on more than one core) -------------------------------


def _client_loop(address: str, table: str, keys: np.ndarray, calls: int, start: Any) -> None:
    """One trainer process: `calls` lookups and pushes of `keys` on `table`."""
    with EmbeddingClient([address], timeout_s=120.0) as client:
        grads = np.full((keys.size, client.table_config(table).dim), 1e-3, np.float32)
        client.lookup(table, keys)
        start.wait()
        for _ in range(calls):
            client.lookup(table, keys)
            client.push_gradients(table, keys, grads)


def concurrency(root: Path, batch: int = 65536, dim: int = 64, calls: int = 12) -> dict:
    """Calls per second of one shard serving one client process, then two at once (each on
    its own table): a shard on more than one core serves two at close to twice the rate,
    when the machine has the cores for both clients and the shard."""
    context = multiprocessing.get_context("spawn")
    keys = np.random.default_rng(1).choice(TABLE_KEYS, batch, replace=False).astype(np.int64)
    out: dict[str, Any] = {
        "batch": batch,
        "dim": dim,
        "calls_per_client": calls,
        "cpus": os.cpu_count(),
    }
    with LocalCluster(1, root / "concurrency") as cluster:
        with EmbeddingClient(cluster.addresses) as client:
            tables = [populate(client, dim)]
            client.create_table(
                TableConfig(
                    "other",
                    dim,
                    optimizer=optim.SGD(lr=0.01),
                    host_cache_bytes=TABLE_KEYS * dim * 8,
                )
            )
            client.assign("other", np.arange(TABLE_KEYS), np.zeros((TABLE_KEYS, dim), np.float32))
            tables.append("other")
        for clients in (1, 2, 1, 2):
            start = context.Event()
            processes = [
                context.Process(
                    target=_client_loop, args=(cluster.addresses[0], tables[i], keys, calls, start)
                )
                for i in range(clients)
            ]
            for process in processes:
                process.start()
            time.sleep(3.0)  # every client connected and warm
            shard_pid = cluster._processes[0].pid  # type: ignore[union-attr]
            cpu_before, started = process_cpu_s([shard_pid]), time.perf_counter()
            start.set()
            for process in processes:
                process.join()
            elapsed = time.perf_counter() - started
            cores = (process_cpu_s([shard_pid]) - cpu_before) / elapsed
            rate = clients * calls * 2 / elapsed  # a lookup and a push per round
            out.setdefault(f"{clients}_clients_calls_per_s", []).append(rate)
            out.setdefault(f"{clients}_clients_shard_cores", []).append(cores)
            print(
                f"{clients} client(s): {rate:.1f} calls/s ({elapsed:.2f} s), the shard busy "
                f"on {cores:.2f} cores",
                flush=True,
            )
    out["speedup_2_vs_1"] = max(out["2_clients_calls_per_s"]) / max(out["1_clients_calls_per_s"])
    print(f"2 clients vs 1: {out['speedup_2_vs_1']:.2f}x the calls/s")
    out["tables_of_one_call"] = tables_of_one_call(root)
    return out


def tables_of_one_call(root: Path, tables: int = 8, batch: int = 16384, dim: int = 16) -> dict:
    """In process: one Shard call carrying `tables` tables (served at once on the shard's
    table threads) against the same tables one call each (one after the other)."""
    from tierps.server.config import ServerConfig
    from tierps.server.shard import LookupBatch, PushBatch, Shard

    shard = Shard(ServerConfig(0, 1, root / "tables-of-one-call"))
    try:
        keys = np.arange(batch, dtype=np.int64)
        grads = np.full((batch, dim), 1e-3, np.float32)
        for t in range(tables):
            shard.admin.create_table(TableConfig(f"t{t}", dim, optimizer=optim.Adam(lr=0.01)))
        lookups = [LookupBatch(f"t{t}", dim, keys, True) for t in range(tables)]
        pushes = [PushBatch(f"t{t}", dim, keys, grads, 1) for t in range(tables)]
        seconds = measure_together(
            {
                "lookup_one_call": lambda: shard.lookup(lookups),
                "lookup_call_per_table": lambda: [shard.lookup([b]) for b in lookups],
                "push_one_call": lambda: shard.push_gradients(pushes),
                "push_call_per_table": lambda: [shard.push_gradients([b]) for b in pushes],
            }
        )
    finally:
        shard.close()
    out = {"tables": tables, "batch": batch, "dim": dim, "seconds": seconds}
    for op in ("lookup", "push"):
        out[f"{op}_speedup"] = seconds[f"{op}_call_per_table"] / seconds[f"{op}_one_call"]
        print(
            f"{op} of {tables} tables x {batch} keys in one call: "
            f"{seconds[f'{op}_one_call'] * 1e3:.1f} ms, one call per table: "
            f"{seconds[f'{op}_call_per_table'] * 1e3:.1f} ms ({out[f'{op}_speedup']:.2f}x)"
        )
    return out


# -- the lookup's piece size ------------------------------------------------------------------


def piece_counts(
    client: EmbeddingClient, table: str, dim: int, keys: np.ndarray, sizes: tuple[int, ...]
) -> dict[int, int]:
    """The most calls a shard's part of a lookup of `keys` goes as, at each piece size (the
    client's own routing, LOOKUP_PIECE_BYTES set to each size in turn)."""
    saved, counts = routing.LOOKUP_PIECE_BYTES, {}
    try:
        for size in sizes:
            routing.LOOKUP_PIECE_BYTES = size
            calls = client._router.lookup_calls({table: (dim, keys)})
            counts[size] = max(collections.Counter(shard for shard, _ in calls).values())
    finally:
        routing.LOOKUP_PIECE_BYTES = saved
    return counts


def piece_sizes(
    root: Path,
    shard_counts: tuple[int, ...],
    dims: tuple[int, ...],
    batches: tuple[int, ...],
    sizes: tuple[int, ...] = (512 << 10, 1 << 20, 2 << 20, 4 << 20),
    rounds: int = 2,
) -> dict[str, Any]:
    """Lookups at each LOOKUP_PIECE_BYTES in `sizes` (set between calls), alternated with
    each other and the echo in one process, `rounds` times a shape; shapes where every size
    cuts the same pieces are skipped."""
    rng = np.random.default_rng(5)
    saved = routing.LOOKUP_PIECE_BYTES
    out: dict[str, Any] = {"sizes": list(sizes), "rounds": rounds, "rows": []}
    try:
        for shards, client, echo in clusters(root / "pieces", shard_counts):
            for dim in dims:
                table = populate(client, dim)
                for batch in batches:
                    keys = rng.choice(TABLE_KEYS, batch, replace=False)
                    counts = piece_counts(client, table, dim, keys, sizes)
                    if len(set(counts.values())) > 1:
                        row = _pieces_shape(client, echo, table, shards, dim, keys, counts, rounds)
                        out["rows"].append(row)
    finally:
        routing.LOOKUP_PIECE_BYTES = saved
    return out


def _pieces_shape(
    client: EmbeddingClient,
    echo: EchoServers,
    table: str,
    shards: int,
    dim: int,
    keys: np.ndarray,
    counts: dict[int, int],
    rounds: int,
) -> dict[str, Any]:
    """One shape of piece_sizes: `rounds` alternated runs of a lookup at each piece size."""

    def lookup_in_pieces_of(size: int) -> Any:
        routing.LOOKUP_PIECE_BYTES = size
        return client.lookup(table, keys)

    mine = shard_positions(keys, shards)
    key_bytes = [keys[at].tobytes() for at in mine]
    rows_back = [4 * dim * at.size for at in mine]
    fns: dict[str, Callable[[], object]] = {
        f"{s >> 10}KiB": lambda s=s: lookup_in_pieces_of(s) for s in counts
    }
    fns["echo"] = lambda: echo.round_trip(key_bytes, rows_back)
    runs = [measure_together(fns) for _ in range(rounds)]
    row = {
        "shards": shards,
        "dim": dim,
        "batch": keys.size,
        "pieces": {f"{s >> 10}KiB": c for s, c in counts.items()},
        "seconds": runs,
    }
    timings = " | ".join(
        " ".join(f"{name} {t * 1e3:5.1f}" for name, t in run.items()) for run in runs
    )
    pieces = " ".join(f"{name}:{c}" for name, c in row["pieces"].items())
    print(
        f"shards={shards} dim={dim:>3} batch={keys.size:>6} {timings} ms; pieces {pieces}",
        flush=True,
    )
    return row


# -- where one RPC lookup's time goes ---------------------------------------------------------


def profile(root: Path, seconds: float = 6.0, batch: int = 65536, dim: int = 64) -> None:
    """py-spy (pip install py-spy) samples the client (this process) and the shard while
    the client looks up `batch` distinct hot keys over and over; prints each process's
    heaviest frames, as shares of its samples (docs/perf/profile-lookup.md)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with LocalCluster(1, root / "profile") as cluster:
        with EmbeddingClient(cluster.addresses, timeout_s=120.0) as client:
            table = populate(client, dim)
            keys = np.random.default_rng(2).choice(TABLE_KEYS, batch, replace=False)
            for _ in range(5):
                client.lookup(table, keys)
            pids = {"shard": cluster._processes[0].pid, "client": os.getpid()}  # type: ignore[union-attr]
            recorders = {
                name: subprocess.Popen(
                    [
                        spy,
                        "record",
                        "-p",
                        str(pid),
                        "-d",
                        str(int(seconds) + 1),
                        "-r",
                        "400",
                        "-f",
                        "raw",
                        "-o",
                        str(root / f"{name}.txt"),
                        "--nonblocking",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for name, pid in pids.items()
            }
            time.sleep(0.5)
            calls, started = 0, time.perf_counter()
            while time.perf_counter() - started < seconds:
                client.lookup(table, keys)
                calls += 1
            print(
                f"{batch} keys, dim {dim}: {(time.perf_counter() - started) / calls * 1e3:.1f}"
                f" ms per lookup ({calls} calls)"
            )
            for recorder in recorders.values():
                recorder.wait()
    for name in pids:
        _print_profile(name, root / f"{name}.txt")


def _print_profile(name: str, path: Path, top: int = 12) -> None:
    """The frames that were on the stack in most samples (inclusive), and the innermost."""
    inclusive: dict[str, int] = {}
    innermost: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        total += n
        innermost[frames[-1]] = innermost.get(frames[-1], 0) + n
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + n
    for title, counts in (("innermost", innermost), ("inclusive", inclusive)):
        print(f"-- {name}: {title} ({total} samples)")
        for frame, n in sorted(counts.items(), key=lambda item: -item[1])[:top]:
            print(f"{n / total:6.1%}  {frame}")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/perf/service.json"))
    parser.add_argument("--png", type=Path, default=Path("docs/perf/service.png"))
    parser.add_argument("--quick", action="store_true", help="fewer shapes, for a smoke run")
    parser.add_argument("--concurrency", action="store_true", help="1 vs 2 concurrent clients")
    parser.add_argument("--replot", action="store_true", help="redraw --png from --out")
    parser.add_argument("--profile", action="store_true", help="py-spy one lookup's time")
    parser.add_argument("--pieces", action="store_true", help="lookup piece sizes, A/B")
    parser.add_argument("--batches", type=_ints, help="keys per call, e.g. 65536,16384")
    parser.add_argument("--dims", type=_ints, help="dims, e.g. 16,64")
    parser.add_argument("--shards", type=_ints, default=SHARDS, help="shard counts, e.g. 1")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.out.read_text()), args.png)
        return 0
    root = Path(tempfile.mkdtemp(prefix="tierps-bench-"))
    try:
        if args.profile:
            profile(root, batch=(args.batches or (65536,))[0], dim=(args.dims or (64,))[0])
            return 0
        if args.pieces:
            out = args.out.with_name("service-pieces.json")
            found = piece_sizes(root, args.shards, args.dims or DIMS, args.batches or BATCHES)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(found, indent=2))
            print(f"wrote {out}")
            return 0
        if args.concurrency:
            out = args.out.with_name("service-concurrency.json")
            out.write_text(json.dumps(concurrency(root), indent=2))
            print(f"wrote {out}")
            return 0
        results = sweep(args.quick, root, args.batches, args.dims, args.shards)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    plot(results, args.png)
    print(f"wrote {args.out} and {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
