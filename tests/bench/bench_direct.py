"""Direct tables (use_hashtable=False) against hashed tables, measured in the same run.

    python -m tests.bench.bench_direct [--out bench-results/direct.json] [--quick]

Both tables hold the same rows (keys 0..rows-1, dim 64, Adam: 3 slots a row), all resident
in host memory (the hashed table's host budget holds every row), and see the same batches of
unique random keys. Reported: lookup and apply_gradients keys/s of each, and the ratio
direct / hashed (> 1: the direct table is faster), each the median of interleaved runs so
that drift hits both alike; np.take of the direct arena is given as a floor for lookups.
Prints a table and writes the figures as JSON. Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tierps.storage import EmbeddingStore, EmbeddingTable, TableConfig, optim
from tierps.storage.tiers import host_rows_for_budget

REPEATS = 7
FILL_CHUNK = 65536


def interleaved(runs: dict[str, Callable[[], object]], repeats: int = REPEATS) -> dict[str, float]:
    """Median seconds of each run, taking turns so that drift hits every one alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def hashed_budget(rows: int, row_bytes: int) -> int:
    """The smallest host budget (to 1 MiB) whose tier holds `rows` rows."""
    budget = rows * row_bytes
    while host_rows_for_budget(budget, row_bytes) < rows:
        budget += 1 << 20
    return budget


def make_tables(store: EmbeddingStore, rows: int, dim: int) -> dict[str, EmbeddingTable]:
    adam = optim.Adam(lr=0.01)
    direct = TableConfig("direct", dim, optimizer=adam, use_hashtable=False, capacity=rows)
    hashed = TableConfig(
        "hashed", dim, optimizer=adam, host_cache_bytes=hashed_budget(rows, direct.row_bytes)
    )
    tables = {"direct": store.create_table(direct), "hashed": store.create_table(hashed)}
    for table in tables.values():  # every row created (initial values), resident in memory
        for start in range(0, rows, FILL_CHUNK):
            table.lookup(np.arange(start, min(start + FILL_CHUNK, rows), dtype=np.int64))
        host = table.stats()["tiers"][table.tiers[0].name]
        assert host["rows"] == rows, host
    return tables


def bench_lookup(tables: dict[str, EmbeddingTable], rows: int, batch: int) -> dict[str, Any]:
    """lookup() of `batch` unique random resident keys, the same keys for both tables."""
    rng = np.random.default_rng(0)
    keys = rng.choice(rows, batch, replace=False).astype(np.int64)
    direct, hashed = tables["direct"], tables["hashed"]
    np.testing.assert_array_equal(direct.lookup(keys), hashed.lookup(keys))  # same rows
    arena = direct.tiers[0].arena
    dim = direct.config.dim
    t = interleaved(
        {
            "hashed": lambda: hashed.lookup(keys),
            "direct": lambda: direct.lookup(keys),
            "np_take": lambda: np.ascontiguousarray(np.take(arena, keys, axis=0)[:, :dim]),
        }
    )
    return {
        "batch": batch,
        "direct_s": t["direct"],
        "hashed_s": t["hashed"],
        "np_take_s": t["np_take"],
        "direct_keys_per_s": batch / t["direct"],
        "hashed_keys_per_s": batch / t["hashed"],
        "np_take_keys_per_s": batch / t["np_take"],
        "ratio_direct_over_hashed": t["hashed"] / t["direct"],
    }


def bench_apply(tables: dict[str, EmbeddingTable], rows: int, batch: int) -> dict[str, Any]:
    """apply_gradients (Adam) of `batch` unique random resident keys, the same keys and
    gradients for both tables; each table counts its own steps."""
    rng = np.random.default_rng(1)
    keys = rng.choice(rows, batch, replace=False).astype(np.int64)
    grads = rng.standard_normal((batch, tables["direct"].config.dim), dtype=np.float32)
    steps = {name: 0 for name in tables}

    def run(name: str) -> Callable[[], object]:
        def call() -> None:
            steps[name] += 1
            tables[name].apply_gradients(keys, grads, steps[name])

        return call

    t = interleaved({"hashed": run("hashed"), "direct": run("direct")})
    np.testing.assert_array_equal(  # both ran the same steps on the same rows
        tables["direct"].lookup(keys[:100]), tables["hashed"].lookup(keys[:100])
    )
    return {
        "batch": batch,
        "direct_s": t["direct"],
        "hashed_s": t["hashed"],
        "direct_keys_per_s": batch / t["direct"],
        "hashed_keys_per_s": batch / t["hashed"],
        "ratio_direct_over_hashed": t["hashed"] / t["direct"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="default bench-results/direct[-quick].json"
    )
    parser.add_argument("--quick", action="store_true", help="100,000 rows, for a smoke run")
    args = parser.parse_args()
    out = args.out or Path(f"bench-results/direct{'-quick' if args.quick else ''}.json")
    rows, dim = (100_000 if args.quick else 1_000_000), 64
    batches = (1024, 8192) if args.quick else (4096, 65536)
    root = Path(tempfile.mkdtemp(prefix="tierps-bench-direct-"))
    started = time.perf_counter()
    try:
        with EmbeddingStore(root / "db") as store:
            tables = make_tables(store, rows, dim)
            memory = {
                name: t.stats()["tiers"][t.tiers[0].name]["bytes"] for name, t in tables.items()
            }
            lookups = [bench_lookup(tables, rows, batch) for batch in batches]
            applies = [bench_apply(tables, rows, batch) for batch in batches]
            for name in list(tables):  # dropped, not flushed: the rows are of no further use
                store.drop_table(name)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "numpy": np.__version__,
        },
        "rows": rows,
        "dim": dim,
        "optimizer": "adam",
        "host_tier_bytes": memory,
        "lookup": lookups,
        "apply_gradients_adam": applies,
        "wall_s": time.perf_counter() - started,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"{rows:,} rows, dim {dim}, Adam; unique random resident keys; medians of {REPEATS}")
    print("| call | batch | direct keys/s | hashed keys/s | direct / hashed | np.take keys/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for call, figures in (("lookup", lookups), ("apply_gradients", applies)):
        for f in figures:
            take = f"{f['np_take_keys_per_s']:,.0f}" if "np_take_keys_per_s" in f else "-"
            print(
                f"| {call} | {f['batch']:,} | {f['direct_keys_per_s']:,.0f} | "
                f"{f['hashed_keys_per_s']:,.0f} | {f['ratio_direct_over_hashed']:.2f}x | {take} |"
            )
    print(
        f"host tier bytes: direct {memory['direct'] / 2**20:,.0f} MiB, hashed "
        f"{memory['hashed'] / 2**20:,.0f} MiB"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
