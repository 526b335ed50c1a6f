"""End-to-end DeepFM training throughput through tierps (a LocalCluster of 2 shards, the
shards applying Adam) against the same model over local torch.nn.EmbeddingBag(sparse=True)
tables trained by torch.optim.SparseAdam: the best a user could do without a parameter
server. All trainers run in one run, their chunks of steps alternating (so drift on this
shared machine hits all alike); each figure is the median samples/s over the chunks.

    python -m tests.bench.bench_deepfm [--out docs/perf/deepfm.json] [--quick]

Trainers, each a full step (lookup and pooling, DeepFM forward, backward - tierps: the push,
on which the shards run Adam - and the optimizers' steps), through the embeddings'
pipeline (tierps.client.torch.pipeline: the next batch's lookup overlaps the step):
- local: torch.nn.EmbeddingBag(sparse=True) per table + SparseAdam (the baseline);
- collection_s0 / collection_s1: one EmbeddingBagCollection, staleness 0 / 1;
- per_feature_s0 / per_feature_s1: one tierps EmbeddingBag per feature, staleness 0 / 1.

Cases: the target training shape (8 features, one table each of 200,000 ids, 4 ids per bag
drawn from Zipf(1.2), batch 2,048, dim 16) and the demo's (MovieLens-100k, batch 256, dim
16; its collection shares one table, its per-feature trainers use a table per feature).
torch runs one intra-op thread everywhere: on 2 cores the shards need the other.
Each row also gives the CPU milliseconds a step took in the trainer's main thread, its other
threads and the shards (medians over the chunks): on 2 cores a step is as fast as their sum
allows. Targets: collection >= 1.0x local, per feature >= 0.6x. Not part of the
test run.
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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import torch
from torch import nn

from tierps.client import EmbeddingClient
from tierps.client import torch as tierps_torch
from tierps.demo import data, training
from tierps.demo.deepfm import DEFAULT_HIDDEN, DeepFM, initial_weights
from tierps.server.cluster import LocalCluster

DIM = 16
SEED = 0
SHARDS = 2
TARGETS = {"collection": 1.0, "per_feature": 0.6}  # x local
ZIPF_FEATURES = 8
ZIPF_IDS = 200_000
ZIPF_A = 1.2
ZIPF_BAG = 4
ZIPF_BATCHES = 24  # distinct batches per chunk order; the chunks cycle through them


@dataclass(frozen=True)
class Case:
    name: str  # "zipf" (the target shape) or "movielens" (the demo's)
    batch_size: int
    steps: int  # per chunk


CASES = (Case("zipf", 2048, 8), Case("movielens", 256, 48))
QUICK_CASES = (Case("zipf", 2048, 4), Case("movielens", 256, 24))


def zipf_dataset(batch_size: int) -> data.CTRDataset:
    """The target shape: ZIPF_FEATURES features, each its own table of ZIPF_IDS ids, bags
    of ZIPF_BAG ids drawn from Zipf(ZIPF_A) (rank r -> a scattered id), random labels."""
    rng = np.random.default_rng(SEED)
    samples = ZIPF_BATCHES * batch_size
    features, columns, tables = [], {}, {}
    for index in range(ZIPF_FEATURES):
        name, table = f"f{index}", f"bench.f{index}"
        ranks = (rng.zipf(ZIPF_A, samples * ZIPF_BAG) - 1) % ZIPF_IDS
        ids = rng.permutation(ZIPF_IDS)[ranks]  # hot ranks scattered over ids and shards
        starts = np.arange(0, samples * ZIPF_BAG + 1, ZIPF_BAG, dtype=np.int64)
        columns[name] = data.RaggedColumn(ids.astype(np.int64), starts)
        features.append(data.SparseFeature(name, table))
        tables[table] = data.TableSpec(table, np.arange(ZIPF_IDS, dtype=np.int64), True)
    labels = (rng.random(samples) < 0.3).astype(np.float32)
    every = np.arange(samples, dtype=np.int64)
    return data.CTRDataset(
        f"zipf ({ZIPF_FEATURES} features x {ZIPF_IDS:,} ids, Zipf {ZIPF_A}, {ZIPF_BAG} per bag)",
        tuple(features), tables, columns, None, labels, every, every[:0],
    )  # fmt: skip


class PerFeatureEmbeddings(nn.Module):
    """One tierps.client.torch.EmbeddingBag per feature, each over its feature's table: the
    shape of a model ported feature by feature (one lookup and one push per feature)."""

    def __init__(
        self, client: EmbeddingClient, features: Sequence[data.SparseFeature], staleness: int
    ) -> None:
        super().__init__()
        self.features = list(features)
        self.bags = nn.ModuleDict(
            {
                f.name: tierps_torch.EmbeddingBag(
                    client, f.table, combiner=f.combiner, staleness=staleness
                )
                for f in self.features
            }
        )

    def sparse_optimizer(self) -> None:
        return None

    def pipeline(self, batches: Iterable[data.Batch]) -> Iterator[data.Batch]:
        inputs = [(bag, lambda b, name=name: b.features[name]) for name, bag in self.bags.items()]
        return tierps_torch.pipeline(batches, *inputs)

    def close(self) -> None:
        for bag in self.bags.values():
            bag.close()

    def forward(self, batch: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
        return {name: bag(*batch[name]) for name, bag in self.bags.items()}


class Trainer:
    """A model with its optimizers; `chunk` trains `steps` batches of a seeded order and
    returns samples/s."""

    def __init__(self, model: DeepFM) -> None:
        self.model = model
        self.dense = training.dense_optimizer_for(model)
        self.sparse = model.embeddings.sparse_optimizer()

    def chunk(
        self, dataset: data.CTRDataset, batch_size: int, steps: int, seed: int
    ) -> tuple[float, dict[str, float]]:
        """samples/s, and the CPU milliseconds a step took (CPU_PARTS: where they went)."""
        before = _cpu_seconds()
        _, _, seconds, samples = training.train_epoch(
            self.model, dataset, self.dense, self.sparse, batch_size=batch_size,
            shuffle_seed=seed, max_batches=steps,
        )  # fmt: skip
        # trainers alternate over shared tables, and a table is pipelined by one module at
        # a time: stop this one's background work before the next trainer's chunk
        self.model.embeddings.close()
        spent = _cpu_seconds()
        taken = min(steps, dataset.num_batches("train", batch_size))
        cpu = {part: 1000 * (spent[part] - before[part]) / taken for part in CPU_PARTS}
        return samples / seconds, cpu


# Where a step's CPU time goes: on 2 cores the trainer and the shards share them, so a step
# is as fast as the sum allows, whichever thread is on the critical path.
CPU_PARTS = ("trainer_main_thread", "trainer_other_threads", "shards")


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this thread, this process's other threads, and the shards
    (this process's child processes, read from /proc; 0 where there is no /proc)."""
    main, process = time.thread_time(), time.process_time()
    shards = 0.0
    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == me:  # ppid; then utime and stime, in clock ticks
            shards += (int(fields[11]) + int(fields[12])) / tick
    return {"trainer_main_thread": main, "trainer_other_threads": process - main, "shards": shards}


def trainers(client: EmbeddingClient, case: Case) -> tuple[dict[str, Trainer], data.CTRDataset]:
    """The case's trainers (tables created afresh) and its dataset."""
    if case.name == "zipf":
        dataset = per_feature = zipf_dataset(case.batch_size)
    else:
        dataset = data.load_movielens(SEED)
        per_feature = data.load_movielens(SEED, shared_table=False)
    training.create_tables(client, dataset, dim=DIM, seed=SEED)
    if per_feature is not dataset:
        training.create_tables(client, per_feature, dim=DIM, seed=SEED)
    weights = initial_weights(dataset.tables, DIM, SEED)
    built = {"local": training.build_local_model(dataset, dim=DIM, seed=SEED, weights=weights)}
    for staleness in (0, 1):
        built[f"collection_s{staleness}"] = training.build_tierps_model(
            client, dataset, dim=DIM, seed=SEED, staleness=staleness
        )
        embeddings = PerFeatureEmbeddings(client, per_feature.features, staleness)
        built[f"per_feature_s{staleness}"] = DeepFM(embeddings, dim=DIM, seed=SEED)
    return {name: Trainer(model) for name, model in built.items()}, dataset


def run_case(case: Case, client: EmbeddingClient, rounds: int) -> dict:
    made, dataset = trainers(client, case)
    figures: dict[str, list[float]] = {name: [] for name in made}
    cpu: dict[str, list[dict[str, float]]] = {name: [] for name in made}
    for round_index in range(rounds + 1):  # round 0 warms up (and creates the hot rows)
        for name, trainer in made.items():
            rate, step_cpu = trainer.chunk(dataset, case.batch_size, case.steps, seed=round_index)
            if round_index:
                figures[name].append(rate)
                cpu[name].append(step_cpu)
    medians = {name: statistics.median(rates) for name, rates in figures.items()}
    cpu_medians = {
        name: {part: statistics.median(c[part] for c in chunks) for part in CPU_PARTS}
        for name, chunks in cpu.items()
    }
    local = medians["local"]
    return {
        "case": case.name,
        "dataset": dataset.name,
        "batch_size": case.batch_size,
        "steps_per_chunk": case.steps,
        "chunks": rounds,
        "samples_per_s": medians,
        "ratio_to_local": {name: rate / local for name, rate in medians.items()},
        "cpu_ms_per_step": cpu_medians,  # medians over the chunks, per part (CPU_PARTS)
        "samples_per_s_each_chunk": figures,
    }


def run(quick: bool) -> dict:
    cases = QUICK_CASES if quick else CASES
    rounds = 3 if quick else 5
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    results: dict = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "grpcio": grpc.__version__,
                    "numpy": np.__version__, "load_average_at_start": os.getloadavg()},
        "model": {"dim": DIM, "hidden": list(DEFAULT_HIDDEN), "torch_threads": 1,
                  "optimizer": "Adam lr 1e-3, sparse and dense (tierps optim.Adam on the "
                  "shards; torch.optim.SparseAdam locally)"},
        "shards": SHARDS,
        "targets_x_local": TARGETS,
        "rows": [],
    }  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="tierps-bench-deepfm-"))
    try:
        with (
            LocalCluster(SHARDS, root / "cluster") as cluster,
            EmbeddingClient(cluster.addresses) as client,
        ):
            for case in cases:
                started = time.perf_counter()
                row = run_case(case, client, rounds)
                row["seconds"] = time.perf_counter() - started
                results["rows"].append(row)
                print(_line(row), flush=True)
    finally:
        torch.set_num_threads(threads_before)
        shutil.rmtree(root, ignore_errors=True)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    return results


def _line(row: dict) -> str:
    rates, ratios = row["samples_per_s"], row["ratio_to_local"]
    others = " | ".join(
        f"{name} {rates[name]:,.0f} ({ratios[name]:.2f}x)" for name in rates if name != "local"
    )
    cpu = " | ".join(
        f"{name} " + "/".join(f"{parts[part]:.2f}" for part in CPU_PARTS)
        for name, parts in row["cpu_ms_per_step"].items()
    )
    return (
        f"{row['case']} batch {row['batch_size']}: local EmbeddingBag+SparseAdam "
        f"{rates['local']:,.0f} samples/s | {others}\n  CPU ms a step "
        f"({' / '.join(CPU_PARTS)}): {cpu}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/perf/deepfm.json"))
    parser.add_argument("--quick", action="store_true", help="shorter chunks, fewer rounds")
    args = parser.parse_args()
    results = run(args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
