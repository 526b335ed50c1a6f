"""What an incremental snapshot saves over a full one, measured in one run.

    python -m tests.bench.bench_incremental [--out bench-results/incremental.json]
        [--rows 1000000] [--changed 0.01] [--rounds 3]

One in-process shard (server/shard.py's Shard over RocksDB in a temporary directory) holds a
table of `rows` rows (dim 16, Adagrad: 128 bytes a row). Each round, the contenders in turn:
a full snapshot save (the baseline), then pushes to `changed` of the rows (random keys),
then an incremental save on that full snapshot (its changes found by the table's journal).
Reported: each save's seconds (both phases: the part and the commit) and bytes on disk,
medians over the rounds, and incremental / full for each (target: <= 3% of each at 1%
changed). Prints a table and writes JSON. Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tierps.server.config import ServerConfig
from tierps.server.shard import PushBatch, Shard
from tierps.storage import TableConfig, optim, snapshot_catalog

DIM = 16
TABLE = TableConfig("t", DIM, optimizer=optim.Adagrad(lr=0.05))


def push(shard: Shard, keys: np.ndarray, step: int, chunk: int = 100_000) -> None:
    rng = np.random.default_rng(step)
    for start in range(0, keys.size, chunk):
        part = keys[start : start + chunk]
        grads = rng.normal(size=(part.size, DIM)).astype(np.float32)
        shard.push_gradients([PushBatch(TABLE.name, DIM, part, grads, step)])


def save(shard: Shard, root: Path, name: str, base: str = "") -> tuple[float, int, dict]:
    """(seconds, bytes on disk, the diffs the part reported) of one save, both phases."""
    start = time.perf_counter()
    parts = list(shard.admin.save_part(name, f"{name}-id", base))
    list(shard.admin.commit_snapshot(name, f"{name}-id"))
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in (root / name).rglob("*") if p.is_file())
    return seconds, size, parts[-1].diffs


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/incremental.json"))
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--changed", type=float, default=0.01)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tierps-bench-incremental-") as tmp:
        root = Path(tmp) / "snapshots"
        shard = Shard(
            ServerConfig(
                shard_id=0,
                num_shards=1,
                data_dir=Path(tmp) / "data",
                snapshot_dir=root,
                tables=(TABLE,),
            )
        )
        try:
            keys = np.arange(args.rows, dtype=np.int64)
            push(shard, keys, step=1)  # every row stored, with optimizer state
            rng = np.random.default_rng(0)
            full: list[tuple[float, int]] = []
            incremental: list[tuple[float, int]] = []
            for round_ in range(args.rounds):
                seconds, size, _ = save(shard, root, f"full-{round_}")
                full.append((seconds, size))
                changed = np.sort(rng.choice(keys, int(args.rows * args.changed), replace=False))
                push(shard, changed, step=2 + round_)
                seconds, size, diffs = save(shard, root, f"inc-{round_}", base=f"full-{round_}")
                assert diffs == {TABLE.name: "journal"}, diffs
                incremental.append((seconds, size))
                for name in (f"inc-{round_}", f"full-{round_}"):  # newest first
                    snapshot_catalog.delete(root, name)
        finally:
            shard.close()
    medians = {
        name: {
            "seconds": statistics.median(s for s, _ in runs),
            "bytes": statistics.median(b for _, b in runs),
        }
        for name, runs in (("full", full), ("incremental", incremental))
    }
    ratios = {
        field: medians["incremental"][field] / medians["full"][field]
        for field in ("seconds", "bytes")
    }
    results: dict[str, Any] = {
        "rows": args.rows,
        "changed": args.changed,
        "rounds": args.rounds,
        "dim": DIM,
        "optimizer": "adagrad",
        "full": full,
        "incremental": incremental,
        "medians": medians,
        "incremental_over_full": ratios,
        "target": "<= 0.03 of each at 1% changed",
        "met": all(ratio <= 0.03 for ratio in ratios.values()),
        "machine": platform.platform(),
    }
    print(
        f"{args.rows:,} rows (dim {DIM}, Adagrad), {args.changed:.0%} changed, "
        f"median of {args.rounds} rounds"
    )
    print(f"{'save':<12} {'seconds':>9} {'MiB':>9}")
    for name, figures in medians.items():
        print(f"{name:<12} {figures['seconds']:>9.3f} {figures['bytes'] / 2**20:>9.2f}")
    print(
        f"incremental / full: seconds {ratios['seconds']:.2%}, bytes {ratios['bytes']:.2%} "
        f"(target <= 3% of each: {'met' if results['met'] else 'missed'})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
