"""A shard's table with a GPU tier holding 10% of its rows, against the same table without
the GPU tier, on one Zipf(1.05) trace: lookup keys/s, training-step keys/s (lookup + Adam
push) and the hit rate of each tier over the measured batches.

    python -m tests.bench.bench_gpu_shard [--quick] [--gpu-arrays auto|numpy]
        [--out bench-results/gpu_shard.json]

Both tables are a shard's storage (EmbeddingStore over RocksDB in a temp dir) with the same
host budget (30% of the rows); the gRPC layer is the same for both and left out. Without a
usable GPU it prints why and exits 0, unless --gpu-arrays numpy runs the GPU tier's code on
host arrays (a smoke run: its figures say nothing about a GPU). Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tierps.core.xp import GPU_ARRAYS, gpu_arrays
from tierps.storage import EmbeddingStore, TableConfig, optim
from tierps.storage.tiers import host_rows_for_budget

ZIPF_A = 1.05


def budget_for(rows: int, row_bytes: int) -> int:
    """The smallest byte budget (in MiB steps) that holds `rows` rows with their index."""
    budget = rows * row_bytes
    while host_rows_for_budget(budget, row_bytes) < rows:
        budget += 1 << 20
    return budget


def trace(keys: int, batch: int, steps: int, seed: int) -> list[np.ndarray]:
    """Zipf(1.05) batches over `keys` ids, spread over the int64 range by a fixed bijection
    (hot keys are not small ids)."""
    rng = np.random.default_rng(seed)
    spread = np.uint64(0x9E3779B97F4A7C15)
    out = []
    for _ in range(steps):
        ranks = (rng.zipf(ZIPF_A, batch) - 1) % keys
        out.append((ranks.astype(np.uint64) * spread >> np.uint64(1)).astype(np.int64))
    return out


def run(root: Path, name: str, config: TableConfig, arrays: str, batches: dict) -> dict[str, Any]:
    with EmbeddingStore(root / name, gpu_arrays=arrays) as store:
        table = store.create_table(config)
        for keys in batches["warm"]:  # fill every tier the way training does
            table.lookup(keys)
            table.apply_gradients(keys, np.ones((keys.size, config.dim), np.float32), 1)
        before = table.stats()["tiers"]
        started = time.perf_counter()
        for keys in batches["measure"]:
            table.lookup(keys)
        lookup_s = time.perf_counter() - started
        after_lookups = table.stats()["tiers"]
        grads = np.full((batches["measure"][0].size, config.dim), 1e-3, np.float32)
        started = time.perf_counter()
        for step, keys in enumerate(batches["measure"], start=2):
            table.lookup(keys)
            table.apply_gradients(keys, grads[: keys.size], step)
        train_s = time.perf_counter() - started
        keys_done = sum(k.size for k in batches["measure"])
        hit_rates = {}
        for tier, stats in after_lookups.items():
            hits = stats["hits"] - before[tier].get("hits", 0)
            misses = stats["misses"] - before[tier].get("misses", 0)
            if "hits" in stats:
                hit_rates[tier] = hits / max(1, hits + misses)
        return {
            "tiers": list(after_lookups),
            "lookup_keys_per_s": keys_done / lookup_s,
            "train_keys_per_s": keys_done / train_s,
            "hit_rate_during_lookups": hit_rates,
            "rows": {tier: stats["rows"] for tier, stats in table.stats()["tiers"].items()},
        }


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/gpu_shard.json"))
    parser.add_argument("--quick", action="store_true", help="200,000 keys, for a smoke run")
    parser.add_argument("--gpu-arrays", choices=GPU_ARRAYS, default="auto")
    parser.add_argument("--dim", type=int, default=32)
    args = parser.parse_args()
    module, why = gpu_arrays(args.gpu_arrays)
    if module is None:
        print(f"no usable GPU: skipped ({why})")
        return 0
    keys = 200_000 if args.quick else 4_000_000
    batch = 16_384 if args.quick else 65_536
    steps = 20 if args.quick else 60
    optimizer = optim.Adam(lr=1e-3)
    row_bytes = 4 * args.dim * optimizer.size_factor
    base = TableConfig(
        "t", args.dim, optimizer=optimizer, host_cache_bytes=budget_for(keys * 3 // 10, row_bytes)
    )
    with_gpu = TableConfig.from_dict(
        {**base.to_dict(), "gpu_cache_bytes": budget_for(keys // 10, row_bytes)}
    )
    batches = {"warm": trace(keys, batch, steps, 1), "measure": trace(keys, batch, steps, 2)}
    root = Path(tempfile.mkdtemp(prefix="tierps-bench-gpu-shard-"))
    try:
        without = run(root, "host", base, args.gpu_arrays, batches)
        gpu = run(root, "gpu", with_gpu, args.gpu_arrays, batches)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    device = "numpy arrays (smoke run)"
    if args.gpu_arrays == "auto":
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        device = name.decode() if isinstance(name, bytes) else str(name)
    results = {
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "gpu": device},
        "keys": keys,
        "dim": args.dim,
        "batch": batch,
        "steps": steps,
        "zipf_a": ZIPF_A,
        "optimizer": "adam",
        "gpu_rows": keys // 10,
        "host_rows": keys * 3 // 10,
        "without_gpu_tier": without,
        "with_gpu_tier": gpu,
        "lookup_ratio": gpu["lookup_keys_per_s"] / without["lookup_keys_per_s"],
        "train_ratio": gpu["train_keys_per_s"] / without["train_keys_per_s"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"device: {device}; {keys:,} keys, dim {args.dim}, Adam, Zipf({ZIPF_A}), batch {batch:,}")
    print("| shard | tiers | lookup keys/s | train keys/s | hit rate per tier (lookups) |")
    print("| --- | --- | --- | --- | --- |")
    for label, r in (("without GPU tier", without), ("GPU tier 10%", gpu)):
        rates = ", ".join(f"{t} {v:.1%}" for t, v in r["hit_rate_during_lookups"].items())
        print(
            f"| {label} | {'/'.join(r['tiers'])} | {r['lookup_keys_per_s']:,.0f} | "
            f"{r['train_keys_per_s']:,.0f} | {rates} |"
        )
    print(
        f"ratio with/without: lookup {results['lookup_ratio']:.2f}x, "
        f"train {results['train_ratio']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
