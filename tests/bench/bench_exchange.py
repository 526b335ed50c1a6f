"""Sync mode's gradient exchange: the bytes a rank passes to the collectives a step, counted
by tierps.client.distributed.exchange_gradients itself, against its distinct keys' key and
gradient bytes, on the DeepFM benchmark's shape (8 features, a table of 200,000 ids each, 4
ids a bag from Zipf(1.2), dim 16; bench_deepfm's generator) for N = 2 and 4 real gloo ranks
(spawned, over a file store). Two batch splits: 2,048 samples per rank (the benchmark's
batch on every trainer) and 2,048 in all (2,048 / N per rank).

Alongside, in the same run on the same ranks: what the exchange it replaced passed
(dist.all_gather_object of the pickled per-table arrays: each rank's pickle, padded to the
largest, and every rank receives all N), and the median ms of a step's exchange and sums,
new against old, alternating step by step. Then the same byte model on paper for N = 8 and
100 from distinct-key counts of batches drawn the same way (no collectives).

    python -m tests.bench.bench_exchange [--steps 8] [--out bench-results/exchange.json]

Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from tests.bench.bench_deepfm import DIM, ZIPF_A, ZIPF_BAG, ZIPF_FEATURES, ZIPF_IDS
from tierps.client.distributed import exchange_gradients, key_owners

BATCH = 2048
TABLES = tuple(f"bench.f{index}" for index in range(ZIPF_FEATURES))
KEY_AND_ROW_BYTES = 8 + 4 * DIM  # an int64 key and its float32 gradient row
MEASURED_RANKS = (2, 4)
MODELLED_RANKS = (8, 100)


def rank_pushes(step: int, rank: int, batch: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """One rank's pushes of one step: per table, the distinct ids of `batch` bags of
    ZIPF_BAG Zipf(ZIPF_A) ids (hot ranks scattered over the ids, as bench_deepfm's), and
    random gradients."""
    rng = np.random.default_rng([step, rank, batch])
    scatter = np.random.default_rng(0).permutation(ZIPF_IDS)  # the same on every rank
    pushes = {}
    for table in TABLES:
        ranks = (rng.zipf(ZIPF_A, batch * ZIPF_BAG) - 1) % ZIPF_IDS
        keys = np.unique(scatter[ranks]).astype(np.int64)
        pushes[table] = (keys, rng.normal(size=(keys.size, DIM)).astype(np.float32))
    return pushes


def all_gathered_sums(pushes: Any, world: int) -> list[Any]:
    """The exchange it replaced: every rank's pickled pushes gathered whole (returned),
    summed per key in rank order on every rank."""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, pushes)
    for table in TABLES:
        keys = np.concatenate([part[table][0] for part in gathered])
        grads = np.concatenate([part[table][1] for part in gathered])
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        np.add.reduceat(grads[order], starts, axis=0) / np.float32(world)
    return gathered


def all_gathered_bytes(gathered: list[Any]) -> tuple[int, int]:
    """What all_gather_object passed and received: a size (int64) and the pickle padded to
    the largest rank's, from each rank."""
    largest = max(len(pickle.dumps(part)) for part in gathered) + 8
    return largest, len(gathered) * largest


def run_rank(rank: int, world: int, store: str, out: str, batch: int, steps: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rows = []
    for step in range(steps):
        pushes = rank_pushes(step, rank, batch)
        distinct = sum(keys.size for keys, _ in pushes.values())
        own = sum(int((key_owners(keys, world) == rank).sum()) for keys, _ in pushes.values())
        dist.barrier()
        began = time.perf_counter()
        _, passed = exchange_gradients(pushes, TABLES)
        new_ms = (time.perf_counter() - began) * 1e3
        dist.barrier()
        began = time.perf_counter()
        gathered = all_gathered_sums(pushes, world)
        old_ms = (time.perf_counter() - began) * 1e3
        old_passed, old_received = all_gathered_bytes(gathered)
        rows.append(
            {
                "distinct_keys": distinct,
                "distinct_bytes": distinct * KEY_AND_ROW_BYTES,
                "passed_bytes": passed,
                "to_itself_bytes": own * KEY_AND_ROW_BYTES,  # its own keys: a local copy
                "old_passed_bytes": old_passed,
                "old_received_bytes": old_received,
                "new_ms": new_ms,
                "old_ms": old_ms,
            }
        )
    Path(out, f"rank-{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def measured(world: int, batch: int, steps: int) -> dict[str, float]:
    """Medians over ranks and steps of one spawned job of `world` ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        torch_mp.start_processes(
            run_rank,
            args=(world, f"{tmp}/store", tmp, batch, steps),
            nprocs=world,
            start_method="spawn",
        )
        reports = [Path(tmp, f"rank-{rank}.json").read_text() for rank in range(world)]
    rows = [row for report in reports for row in json.loads(report)]
    median = {name: statistics.median(row[name] for row in rows) for name in rows[0]}
    ratio = statistics.median(row["passed_bytes"] / row["distinct_bytes"] for row in rows)
    out = statistics.median(
        (row["passed_bytes"] - row["to_itself_bytes"]) / row["distinct_bytes"] for row in rows
    )
    return {**median, "passed_vs_distinct": ratio, "leaving_vs_distinct": out}


def modelled(world: int, batch: int, steps: int) -> dict[str, float]:
    """The same bytes on paper: a rank passes its distinct keys' key and gradient bytes
    plus 2 counts per table and rank (int64); 1/world of the keys is its own. The old
    gather passed about the same pickle but received world of them."""
    distinct = statistics.median(
        sum(keys.size for keys, _ in rank_pushes(step, 0, batch).values()) for step in range(steps)
    )
    payload = distinct * KEY_AND_ROW_BYTES
    counts = 2 * len(TABLES) * world * 8
    return {
        "distinct_keys": distinct,
        "distinct_bytes": payload,
        "passed_bytes": payload + counts,
        "passed_vs_distinct": (payload + counts) / payload,
        "leaving_vs_distinct": (payload * (world - 1) / world + counts) / payload,
        "old_received_bytes": world * payload,
    }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench-results/exchange.json"))
    args = parser.parse_args()
    results: dict[str, Any] = {"benchmark": "bench_exchange", "dim": DIM, "tables": len(TABLES)}
    print(
        f"{'split':>14} {'N':>4} {'distinct keys':>13} {'passed KiB':>10} {'x distinct':>10} "
        f"{'leaving x':>9} {'old recv KiB':>12} {'new ms':>7} {'old ms':>7}"
    )
    for split in ("per rank", "in all"):
        for world in (*MEASURED_RANKS, *MODELLED_RANKS):
            batch = BATCH if split == "per rank" else BATCH // world
            how = measured if world in MEASURED_RANKS else modelled
            row = how(world, batch, args.steps)
            results[f"{split}, N={world}"] = {"batch_per_rank": batch, "how": how.__name__, **row}
            print(
                f"{split:>14} {world:>4} {row['distinct_keys']:>13,.0f} "
                f"{row['passed_bytes'] / 1024:>10,.1f} {row['passed_vs_distinct']:>10.3f} "
                f"{row['leaving_vs_distinct']:>9.3f} {row['old_received_bytes'] / 1024:>12,.1f} "
                f"{row.get('new_ms', float('nan')):>7.2f} {row.get('old_ms', float('nan')):>7.2f}",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
