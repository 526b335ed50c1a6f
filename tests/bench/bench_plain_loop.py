"""The plain training loop (no pipeline(): forward, backward, the optimizers' steps, the next
batch) through tierps.client.torch at staleness 0, against the same loop over local
torch.nn.EmbeddingBag(sparse=True) tables with SparseAdam, and against pipeline() at
staleness 0 and 1. DeepFM, 2 local shards applying Adam, the target training shape: 8
features, one table each of 200,000 ids, 4 ids a bag drawn from Zipf(1.2), batch 2,048,
dim 16. The trainers alternate by chunks of steps within one run (drift on a shared machine
hits all alike); each figure is the median over the chunks.

    python -m tests.bench.bench_plain_loop [--out PATH] [--quick]
        [--baseline-python OTHER_CHECKOUT/.venv/bin/python]

--baseline-python adds `plain_baseline`: the same plain loop run by another checkout's
interpreter (its own tierps; for instance the synchronous backward before the overlap), a
chunk a round in a process of its own against the same shards.

Each row also gives the CPU milliseconds a step took: the trainer's main thread, its other
threads (the modules' background threads, the client's call threads) and the shards. On 2
cores a step is as fast as their sum allows. Target: plain >= 1.3x local. Not part of the
test run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from tests.bench.bench_deepfm import cpu_seconds
from tierps.client import EmbeddingClient
from tierps.demo import data, training
from tierps.demo.deepfm import DeepFM, initial_weights
from tierps.server.cluster import LocalCluster

DIM = 16
SEED = 0
SHARDS = 2
BATCH = 2048
FEATURES = 8
IDS = 200_000
ZIPF_A = 1.2
BAG = 4
BATCHES = 24  # distinct batches; the chunks cycle through them in seeded orders
TARGET = 1.3  # plain / local
CPU_PARTS = ("trainer_main_thread", "trainer_other_threads", "shards")


def dataset() -> data.CTRDataset:
    """FEATURES features, each its own table of IDS ids, bags of BAG ids drawn from
    Zipf(ZIPF_A) (rank r -> a scattered id), random labels."""
    rng = np.random.default_rng(SEED)
    samples = BATCHES * BATCH
    features, columns, tables = [], {}, {}
    for index in range(FEATURES):
        name, table = f"f{index}", f"plain.f{index}"
        ranks = (rng.zipf(ZIPF_A, samples * BAG) - 1) % IDS
        ids = rng.permutation(IDS)[ranks]
        starts = np.arange(0, samples * BAG + 1, BAG, dtype=np.int64)
        columns[name] = data.RaggedColumn(ids.astype(np.int64), starts)
        features.append(data.SparseFeature(name, table))
        tables[table] = data.TableSpec(table, np.arange(IDS, dtype=np.int64), True)
    labels = (rng.random(samples) < 0.3).astype(np.float32)
    every = np.arange(samples, dtype=np.int64)
    return data.CTRDataset(
        f"zipf ({FEATURES} features x {IDS:,} ids, Zipf {ZIPF_A}, {BAG} per bag)",
        tuple(features),
        tables,
        columns,
        None,
        labels,
        every,
        every[:0],
    )


def plain(model: DeepFM) -> Callable[[Iterable[data.Batch]], Iterator[data.Batch]]:
    """The plain loop's batches: as they come; the pushes in flight are waited for after
    the last step (inside the timed loop)."""

    def steps(batches: Iterable[data.Batch]) -> Iterator[data.Batch]:
        yield from batches
        model.embeddings.flush()

    return steps


class Trainer:
    """A model, its optimizers and its loop (plain or the embeddings' pipeline)."""

    def __init__(self, model: DeepFM, plain_loop: bool) -> None:
        self.model = model
        self.dense = training.dense_optimizer_for(model)
        self.sparse = model.embeddings.sparse_optimizer()
        self.steps = plain(model) if plain_loop else None

    def chunk(
        self, corpus: data.CTRDataset, steps: int, seed: int, shards_parent: int
    ) -> tuple[float, dict[str, float]]:
        """samples/s of `steps` steps, and the CPU milliseconds a step took, per part."""
        before = cpu_seconds(shards_parent)
        _, _, seconds, samples = training.train_epoch(
            self.model,
            corpus,
            self.dense,
            self.sparse,
            batch_size=BATCH,
            shuffle_seed=seed,
            max_batches=steps,
            steps=self.steps,
        )
        spent = cpu_seconds(shards_parent)
        self.model.embeddings.close()  # the next trainer pipelines the same tables
        taken = min(steps, corpus.num_batches("train", BATCH))
        cpu = {part: 1000 * (spent[part] - before[part]) / taken for part in CPU_PARTS}
        return samples / seconds, cpu


def tierps_trainer(client: EmbeddingClient, corpus: data.CTRDataset, **kind: object) -> Trainer:
    staleness = int(kind.get("staleness", 0))  # type: ignore[call-overload]
    model = training.build_tierps_model(client, corpus, dim=DIM, seed=SEED, staleness=staleness)
    return Trainer(model, plain_loop=bool(kind.get("plain", False)))


def baseline_chunk(
    python: str, addresses: list[str], steps: int, seed: int
) -> tuple[float, dict[str, float]]:
    """A chunk of the plain loop run by another interpreter (its own tierps), in a process
    of its own: a warm-up chunk, then the timed one."""
    done = subprocess.run(
        [
            python,
            "-m",
            "tests.bench.bench_plain_loop",
            "--one-chunk",
            ",".join(addresses),
            "--steps",
            str(steps),
            "--seed",
            str(seed),
            "--shards-parent",
            str(os.getpid()),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"the baseline chunk failed:\n{done.stderr}")
    rate, cpu = json.loads(done.stdout.strip().splitlines()[-1])
    return rate, cpu


def one_chunk(addresses: str, steps: int, seed: int, shards_parent: int) -> None:
    """--one-chunk: the plain loop over the tables the parent made; prints [rate, cpu]."""
    torch.set_num_threads(1)
    corpus = dataset()
    with EmbeddingClient(addresses.split(",")) as client:
        trainer = tierps_trainer(client, corpus, plain=True)
        trainer.chunk(corpus, 2, seed + 1000, shards_parent)  # warm-up: channels, tables
        print(json.dumps(trainer.chunk(corpus, steps, seed, shards_parent)))


def run(quick: bool, baseline_python: str | None) -> dict:
    steps, rounds = (4, 3) if quick else (8, 5)
    torch.set_num_threads(1)  # on 2 cores the shards need the other
    corpus = dataset()
    root = Path(tempfile.mkdtemp(prefix="tierps-bench-plain-"))
    try:
        with (
            LocalCluster(SHARDS, root / "cluster") as cluster,
            EmbeddingClient(cluster.addresses) as client,
        ):
            training.create_tables(client, corpus, dim=DIM, seed=SEED)
            weights = initial_weights(corpus.tables, DIM, SEED)
            local = training.build_local_model(corpus, dim=DIM, seed=SEED, weights=weights)
            made: dict[str, Trainer | None] = {
                "local": Trainer(local, plain_loop=True),
                "plain": tierps_trainer(client, corpus, plain=True),
                "pipeline_s0": tierps_trainer(client, corpus, staleness=0),
                "pipeline_s1": tierps_trainer(client, corpus, staleness=1),
            }
            if baseline_python:
                made["plain_baseline"] = None
            # every batch's rows made first: a chunk that creates rows costs the shards more
            tierps_trainer(client, corpus, plain=True).chunk(corpus, BATCHES, 0, os.getpid())
            rates: dict[str, list[float]] = {name: [] for name in made}
            cpus: dict[str, list[dict[str, float]]] = {name: [] for name in made}
            for index in range(rounds + 1):  # round 0 warms up
                for name, trainer in made.items():
                    if trainer is None:
                        assert baseline_python is not None
                        rate, cpu = baseline_chunk(
                            baseline_python, list(cluster.addresses), steps, index
                        )
                    else:
                        rate, cpu = trainer.chunk(corpus, steps, index, os.getpid())
                    if index:
                        rates[name].append(rate)
                        cpus[name].append(cpu)
                print(
                    f"round {index}: "
                    + ", ".join(
                        f"{name} {values[-1]:,.0f}" for name, values in rates.items() if values
                    ),
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "dataset": corpus.name,
        "batch_size": BATCH,
        "dim": DIM,
        "shards": SHARDS,
        "cpus": os.cpu_count(),
        "steps_per_chunk": steps,
        "chunks": rounds,
        "baseline_python": baseline_python,
        "samples_per_s": medians,
        "ratio_to_local": {name: rate / medians["local"] for name, rate in medians.items()},
        "target_plain_x_local": TARGET,
        "cpu_ms_per_step": {
            name: {part: statistics.median(c[part] for c in chunks) for part in CPU_PARTS}
            for name, chunks in cpus.items()
        },
        "samples_per_s_each_chunk": rates,
    }


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="shorter chunks, fewer rounds")
    parser.add_argument("--baseline-python", default=None)
    parser.add_argument("--one-chunk", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--shards-parent", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_chunk is not None:
        one_chunk(args.one_chunk, args.steps, args.seed, args.shards_parent)
        return 0
    results = run(args.quick, args.baseline_python)
    rates, ratios = results["samples_per_s"], results["ratio_to_local"]
    for name, rate in rates.items():
        cpu = results["cpu_ms_per_step"][name]
        parts = " / ".join(f"{cpu[part]:.1f}" for part in CPU_PARTS)
        print(
            f"{name:15s} {rate:9,.0f} samples/s  {ratios[name]:.2f}x local  "
            f"CPU ms a step (main / other threads / shards) {parts}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
