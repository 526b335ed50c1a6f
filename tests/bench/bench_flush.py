"""How long a background flush holds up data calls, measured in one run.

    python -m tests.bench.bench_flush [--out bench-results/flush.json] [--rows 200000]

A write-back table (dim 64, Adam: 768 bytes a row) holds `rows` dirty rows in its host
tier. One thread looks up a batch of 256 hot keys in a loop; meanwhile the main thread
flushes every dirty row to RocksDB in chunks (the background flush's 256 KiB, and the 4 MiB
of a stop or snapshot flush). Reported: the lookup latency (median, p99, max) with no flush
running - the baseline, measured in the same run - and during each flush, the flush's own
time and rows/s, and a raw rocksdict write of one chunk's bytes as one WriteBatch (the floor
of one chunk's lock hold). Prints a table and writes JSON. Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from rocksdict import Options, Rdict, WriteBatch

from tierps.storage import EmbeddingStore, TableConfig, optim
from tierps.storage.table import FLUSH_CHUNK_BYTES

BACKGROUND_CHUNK_BYTES = 256 << 10  # server/shard_maintenance.py's BACKGROUND_FLUSH_CHUNK_BYTES
DIM = 64
PAUSE_S = 0.0002  # server/shard_maintenance.py's BACKGROUND_FLUSH_PAUSE_S


def lookups_while(table: Any, hot: np.ndarray, work: Any) -> tuple[list[float], float]:
    """Lookup latencies (s) of `hot` in a loop while work() runs (or for 1 s if None)."""
    latencies: list[float] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            table.lookup(hot)
            latencies.append(time.perf_counter() - started)

    thread = threading.Thread(target=loop)
    thread.start()
    started = time.perf_counter()
    if work is None:
        time.sleep(1.0)
    else:
        work()
    took = time.perf_counter() - started
    stop.set()
    thread.join()
    return latencies, took


def summary(latencies: list[float]) -> dict[str, float]:
    values = np.array(latencies) * 1e3
    return {
        "calls": int(values.size),
        "median_ms": float(np.median(values)),
        "p99_ms": float(np.percentile(values, 99)),
        "max_ms": float(values.max()),
    }


def raw_chunk_write_ms(path: Path, chunk_bytes: int, row_bytes: int) -> float:
    """Median ms of one rocksdict WriteBatch carrying a chunk's rows (the floor)."""
    db = Rdict(str(path), Options(raw_mode=True))
    rows = max(1, chunk_bytes // row_bytes)
    value = bytes(row_bytes)
    times = []
    for round_ in range(20):
        batch = WriteBatch(raw_mode=True)
        for i in range(rows):
            batch.put((round_ * rows + i).to_bytes(8, "big"), value)
        started = time.perf_counter()
        db.write(batch)
        times.append(time.perf_counter() - started)
    db.close()
    return float(np.median(times) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--out", type=Path, default=Path("bench-results/flush.json"))
    args = parser.parse_args()
    results: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(),
        "rows": args.rows,
    }
    with tempfile.TemporaryDirectory() as tmp:
        config = TableConfig(
            "t", DIM, optimizer=optim.Adam(lr=0.01), host_cache_bytes=args.rows * 900 + (64 << 20)
        )
        with EmbeddingStore(Path(tmp) / "db") as store:
            table = store.create_table(config)
            keys = np.arange(args.rows, dtype=np.int64)
            hot = keys[:256]
            results["no_flush"] = summary(lookups_while(table, hot, None)[0])
            for name, chunk in (
                ("background_256KiB", BACKGROUND_CHUNK_BYTES),
                ("stop_4MiB", FLUSH_CHUNK_BYTES),
            ):
                for start in range(0, keys.size, 65536):  # every row dirty again
                    part = keys[start : start + 65536]
                    table.apply_gradients(part, np.ones((part.size, DIM), np.float32), 1)
                pause = PAUSE_S if chunk == BACKGROUND_CHUNK_BYTES else 0.0
                latencies, took = lookups_while(
                    table, hot, lambda c=chunk, p=pause: table.flush(c, p)
                )
                results[name] = {
                    **summary(latencies),
                    "flush_s": took,
                    "flush_rows_per_s": args.rows / took,
                }
        for name, chunk in (
            ("raw_write_256KiB_ms", BACKGROUND_CHUNK_BYTES),
            ("raw_write_4MiB_ms", FLUSH_CHUNK_BYTES),
        ):
            results[name] = raw_chunk_write_ms(Path(tmp) / name, chunk, config.stored_bytes)
    base = results["no_flush"]
    print(f"lookup of 256 hot keys, {args.rows} dirty rows (dim {DIM}, Adam)")
    print(f"{'while':<20}{'calls':>8}{'median ms':>11}{'p99 ms':>9}{'max ms':>9}{'flush s':>9}")
    for name in ("no_flush", "background_256KiB", "stop_4MiB"):
        r = results[name]
        print(
            f"{name:<20}{r['calls']:>8}{r['median_ms']:>11.3f}{r['p99_ms']:>9.2f}"
            f"{r['max_ms']:>9.2f}{r.get('flush_s', 0):>9.2f}"
        )
    print(
        f"raw rocksdict write of one chunk: 256 KiB {results['raw_write_256KiB_ms']:.2f} ms, "
        f"4 MiB {results['raw_write_4MiB_ms']:.2f} ms"
    )
    print(
        f"max lookup latency during the background flush / without a flush: "
        f"{results['background_256KiB']['max_ms'] / base['max_ms']:.2f}x"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
