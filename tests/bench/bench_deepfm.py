"""End-to-end DeepFM training throughput: through tierps (a LocalCluster of 2 shards, the
shards applying Adam) against the same model over local torch.nn.EmbeddingBag tables
(torch.optim.SparseAdam), same initial weights, same batches, measured in one run.

    python -m tests.bench.bench_deepfm [--out bench-results/deepfm.json] [--quick]

A step is a full training step: lookup and pooling, DeepFM forward, backward (tierps: the
push, on which the shards run Adam), both optimizers' steps. Chunks of steps alternate
between the trainers (so drift on this shared machine hits all alike); each figure is the median
samples/s over the chunks. Each side is measured with torch at one and two intra-op threads
and its faster figure counts (on 2 cores, two threads stall torch's parallel regions
whenever the shards or anything else hold a core). Target: tierps >= 0.5x the local
baseline. Not part of the test run.
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
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import torch

from tierps.client import EmbeddingClient
from tierps.demo import data
from tierps.demo import main as demo
from tierps.demo.deepfm import DEFAULT_HIDDEN, DeepFM, initial_weights
from tierps.server import LocalCluster

DIM = 16
SEED = 0
TARGET_RATIO = 0.5
SYNTHETIC_SAMPLES = 200_000


@dataclass(frozen=True)
class Case:
    dataset: str  # "movielens", "movielens-per-feature-tables" or "synthetic"
    batch_size: int


CASES = (
    Case("movielens", 256),
    Case("movielens", 1024),
    Case("movielens", 4096),
    Case("movielens-per-feature-tables", 1024),
    Case("synthetic", 1024),
    Case("synthetic", 4096),
)
QUICK_CASES = (Case("movielens", 1024), Case("synthetic", 1024))


def load(name: str) -> data.CTRDataset:
    if name == "movielens":
        return data.load_movielens(SEED)
    if name == "movielens-per-feature-tables":
        return data.load_movielens(SEED, shared_table=False)
    return data.load_synthetic(SYNTHETIC_SAMPLES, seed=SEED)


class Trainer:
    """A model with its optimizers; `chunk` trains `steps` batches of a seeded order and
    returns samples/s."""

    def __init__(self, model: DeepFM, threads: int) -> None:
        self.model = model
        self.threads = threads
        self.dense = demo.dense_optimizer_for(model)
        self.sparse = model.embeddings.sparse_optimizer()

    def chunk(self, dataset: data.CTRDataset, batch_size: int, steps: int, seed: int) -> float:
        torch.set_num_threads(self.threads)
        _, _, seconds, samples = demo.train_epoch(
            self.model, dataset, self.dense, self.sparse, batch_size=batch_size,
            shuffle_seed=seed, max_batches=steps,
        )  # fmt: skip
        return samples / seconds


def steps_per_chunk(batch_size: int, quick: bool) -> int:
    """About 16k samples per chunk (4k when quick), at least 4 steps."""
    return max(4, (4096 if quick else 16384) // batch_size)


def run_case(case: Case, client: EmbeddingClient, rounds: int, quick: bool) -> dict:
    dataset = load(case.dataset)
    weights = initial_weights(dataset.tables, DIM, SEED)
    demo.create_tables(client, dataset, dim=DIM, seed=SEED)
    trainers = {
        f"{side}_{threads}_thread{'s' if threads > 1 else ''}": Trainer(
            demo.build_tierps_model(client, dataset, dim=DIM, seed=SEED, weights=weights)
            if side == "tierps"
            else demo.build_local_model(dataset, dim=DIM, seed=SEED, weights=weights),
            threads,
        )
        for side in ("tierps", "local")
        for threads in (1, 2)
    }
    steps = steps_per_chunk(case.batch_size, quick)
    figures: dict[str, list[float]] = {name: [] for name in trainers}
    for round_index in range(rounds + 1):  # round 0 warms up
        for name, trainer in trainers.items():
            rate = trainer.chunk(dataset, case.batch_size, steps, seed=round_index)
            if round_index:
                figures[name].append(rate)
    medians = {name: statistics.median(rates) for name, rates in figures.items()}
    tierps = max(medians["tierps_1_thread"], medians["tierps_2_threads"])
    local = max(medians["local_1_thread"], medians["local_2_threads"])
    return {
        "dataset": case.dataset,
        "tables": len(dataset.tables),
        "features": len(dataset.features),
        "batch_size": case.batch_size,
        "steps_per_chunk": steps,
        "chunks": rounds,
        **{f"{name}_samples_per_s": rate for name, rate in medians.items()},
        "tierps_samples_per_s": tierps,
        "local_samples_per_s": local,
        "ratio": tierps / local,
        "meets_target": tierps / local >= TARGET_RATIO,
    }


def run(quick: bool) -> dict:
    cases = QUICK_CASES if quick else CASES
    rounds = 3 if quick else 7
    threads_before = torch.get_num_threads()
    results: dict = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "grpcio": grpc.__version__,
                    "numpy": np.__version__},
        "model": {"dim": DIM, "hidden": list(DEFAULT_HIDDEN),
                  "optimizer": "Adam lr 1e-3, sparse and dense (tierps optim.Adam on the "
                  "shards; torch.optim.SparseAdam locally)"},
        "shards": 2,
        "target_ratio": TARGET_RATIO,
        "rows": [],
    }  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="tierps-bench-deepfm-"))
    try:
        with (
            LocalCluster(2, root / "cluster") as cluster,
            EmbeddingClient(cluster.addresses) as client,
        ):
            for case in cases:
                started = time.perf_counter()
                row = run_case(case, client, rounds, quick)
                row["seconds"] = time.perf_counter() - started
                results["rows"].append(row)
                print(_line(row), flush=True)
    finally:
        torch.set_num_threads(threads_before)
        shutil.rmtree(root, ignore_errors=True)
    return results


def _line(row: dict) -> str:
    def side(name: str) -> str:
        return (
            f"{row[f'{name}_samples_per_s']:>8,.0f} samples/s (threads 1: "
            f"{row[f'{name}_1_thread_samples_per_s']:,.0f}, 2: "
            f"{row[f'{name}_2_threads_samples_per_s']:,.0f})"
        )

    return (
        f"{row['dataset']:<29} batch {row['batch_size']:>5}: tierps {side('tierps')} | local "
        f"EmbeddingBag {side('local')} | {row['ratio']:.2f}x (target >= {TARGET_RATIO}x: "
        f"{'met' if row['meets_target'] else 'NOT met'})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench-results/deepfm.json"))
    parser.add_argument("--quick", action="store_true", help="two cases, short chunks")
    args = parser.parse_args()
    results = run(args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
