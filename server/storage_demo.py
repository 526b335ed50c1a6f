"""The storage demo: a Zipf trace through a table larger than its host budget.

`tierps storage-demo` runs it: it trains nothing, but drives the real storage engine (host
hash table over RocksDB) the way a trainer would - look up a batch, push gradients for it -
and reports throughput and hit rates per tier.
"""

from __future__ import annotations

import resource
import shutil
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tierps.server.workload import ZipfTrace
from tierps.storage import EmbeddingStore, TableConfig, optim
from tierps.storage.tiers import host_rows_for_budget


def peak_rss_mb() -> float:
    """Peak resident memory of this process image. VmHWM starts afresh at exec, unlike
    getrusage's ru_maxrss, which a child inherits from the process that forked it."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_storage_demo(
    data_dir: Path,
    *,
    dim: int = 32,
    host_mb: int = 64,
    oversubscription: float = 4.0,
    batch: int = 16384,
    steps: int = 150,
    zipf_a: float = 1.05,
    keep: bool = False,
) -> dict[str, float]:
    """Stream `steps` batches of lookup + apply_gradients through a table whose key space
    is `oversubscription` times what `host_mb` of host memory holds. Returns the summary."""
    store_dir = data_dir / "storage-demo"
    if store_dir.exists() and not keep:
        shutil.rmtree(store_dir)
    config = TableConfig(
        "demo", dim, optimizer=optim.Adagrad(lr=0.05), host_cache_bytes=host_mb << 20
    )
    host_rows = host_rows_for_budget(config.host_cache_bytes, config.row_bytes)
    universe = int(host_rows * oversubscription)
    print(
        f"table 'demo': dim {dim}, Adagrad ({config.row_bytes} B/row with state); host budget "
        f"{host_mb} MiB = {host_rows:,} rows; key space {universe:,} rows "
        f"({oversubscription:g}x the budget); Zipf({zipf_a}); data in {store_dir}"
    )
    trace = ZipfTrace(universe, zipf_a, seed=1)
    rng = np.random.default_rng(2)
    with EmbeddingStore(store_dir) as store:
        table = store.create_table(config)
        started = time.perf_counter()
        for step in tqdm(range(1, steps + 1), desc="zipf trace", unit="batch"):
            keys = trace.batch(batch)
            table.lookup(keys)
            grads = rng.standard_normal((batch, dim), dtype=np.float32) * 0.01
            table.apply_gradients(keys, grads, step)
        elapsed = time.perf_counter() - started
        stats = table.stats()
    host = stats["tiers"].get("host", {"hits": 0, "misses": 0, "rows": 0})
    rocks = stats["tiers"]["rocksdb"]
    looked_up = host["hits"] + host["misses"] or rocks["hits"] + rocks["misses"]
    summary = {
        "keys_per_s": steps * batch / elapsed,
        "lookup_and_update_steps_per_s": steps / elapsed,
        "host_hit_rate": host["hits"] / max(1, host["hits"] + host["misses"]),
        "rocksdb_hit_rate_of_host_misses": rocks["hits"] / max(1, rocks["hits"] + rocks["misses"]),
        "initialized_rows": stats["initialized"],
        "host_rows": host["rows"],
        "rows_spilled": stats["spilled"],
        "rows_written_to_rocksdb": rocks["rows_written"],
        "peak_rss_mb": peak_rss_mb(),
    }
    print(
        f"{steps * batch:,} keys in {elapsed:.1f} s: {summary['keys_per_s']:,.0f} keys/s "
        f"(each looked up, then updated by Adagrad)\n"
        f"host tier: hit rate {summary['host_hit_rate']:.1%} of {looked_up:,} finds, "
        f"{host['rows']:,} rows resident\n"
        f"rocksdb tier: hit rate {summary['rocksdb_hit_rate_of_host_misses']:.1%} of host "
        f"misses, {rocks['rows_written']:,} rows written back\n"
        f"new rows initialised: {stats['initialized']:,}; peak RSS "
        f"{summary['peak_rss_mb']:.0f} MB"
    )
    return summary
