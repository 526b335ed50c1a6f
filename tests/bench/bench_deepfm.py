"""End-to-end DeepFM training throughput: tierps (a LocalCluster of 2 shards) against
TorchRec's and FBGEMM's fused CPU embedding kernels and against local torch tables, all
training the same model on the same batches in one run. Contenders take turns in rounds, a
chunk of steps each (so drift on this shared machine hits all alike); each figure is the
median over the rounds.

    python -m tests.bench.bench_deepfm [--out docs/perf/deepfm.json]
        [--png docs/perf/deepfm.png] [--quick] [--case zipf_200k|zipf_2m|movielens]... [--replot]
        [--contender NAME]...

Contenders, each a full training step (lookup and pooling, DeepFM forward, backward with the
sparse optimizer's update, the dense Adam step):
- torchrec_dmp: torchrec.EmbeddingBagCollection sharded by DistributedModelParallel on the
  CPU, a world of 1 on gloo (the planner's choice there: table-wise, the fused kernel); the
  fused optimizer EXACT_ADAGRAD, set as TorchRec takes it, by
  torch.distributed.optim._apply_optimizer_in_backward(torch.optim.Adagrad, ...) before
  sharding. The target baseline.
- fbgemm_tbe: FBGEMM's SplitTableBatchedEmbeddingBagsCodegen used directly (what TorchRec's
  fused kernel runs): EmbeddingLocation.HOST, ComputeDevice.CPU, OptimType.EXACT_ADAGRAD.
  FBGEMM's CPU mode has no Adam ("Optimizer adam is not supported in CPU mode"), so both
  TorchRec rows are Adagrad.
- local_adagrad / local_adam: one torch.nn.EmbeddingBag(sparse=True) per table, trained by
  torch.optim.Adagrad / torch.optim.SparseAdam: the best a user could do without a parameter
  server or TorchRec.
- tierps_{adagrad,adam}_{plain,s0,s1}: tierps.client.torch.EmbeddingBagCollection, the
  shards applying Adagrad / Adam as the pushes arrive; plain: `out = ebc(features);
  loss.backward(); opt.step()`, no pipeline; s0 / s1: through its pipeline() (the next batch
  looked up while one trains) at staleness 0 / 1. Each has its own tables, hashed.
- tierps_adagrad_direct_plain: tierps_adagrad_plain over direct tables (use_hashtable=False,
  capacity the table's ids: row k of an arena holds id k, as TorchRec's and FBGEMM's tables
  do), where the dataset's ids are 0..n-1 (in every case here).
The Adagrad contenders share one learning rate (ADAGRAD_LR, eps 1e-10, torch's Adagrad), the
Adam ones another (ADAM_LR); the dense part trains with torch.optim.Adam (lr 1e-3) in all.
Local torch, TorchRec and FBGEMM start from the same initial rows; tierps from its
initializer (the same distribution, rows made as keys arrive).

The model is tierps.demo's DeepFM (MLP 256-128-1 over the embeddings, FM second order, first
order): rows of DIM = 16 floats, a first-order weight and a 15-wide embedding, as TorchRec's
fused kernels take widths divisible by 4. Shapes: 8 features, one table each of 200,000 and
of 2,000,000 ids, 4 ids per bag drawn from Zipf(1.2), batch 2,048, labels that depend on the
ids (so that a model which learns its rows shows it); and the demo's MovieLens-100k (batch
256, 8 features over one shared table). torch runs one intra-op thread everywhere: on 2 cores
the shards need the other.

Each row gives samples/s, the CPU milliseconds a step took in the trainer's main thread, its
other threads and the shards (medians over the chunks: on 2 cores a step is as fast as their
sum allows), the ratio to TorchRec DMP and to local torch with the same optimizer, and the
training loss of every chunk: a contender trains if its loss falls from the first chunk to
the last by most of what local torch's with the same optimizer falls (TRAINS_FRACTION); the
benchmark exits 1 if one does not. The picture: samples/s by contender, grouped by shape.
Not part of the test run.

TorchRec cannot be an extra (it requires the CUDA fbgemm-gpu); install it as .ci/run does,
after the bench extra (pip install -e '.[dev,bench]'):

    pip install --no-deps torchrec==1.9.2 fbgemm-gpu-cpu==1.8.0
    pip install tensordict==0.15.3 torchmetrics==1.0.3 tqdm pyre-extensions==0.0.32

Without TorchRec (or FBGEMM) their rows are skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from torch import nn

from tests.bench.cpu_time import children_cpu_s
from tierps.client import EmbeddingClient
from tierps.demo import data, training
from tierps.demo.deepfm import DEFAULT_HIDDEN, DeepFM, SparseOptimizer, initial_weights
from tierps.server.cluster import LocalCluster

DIM = 16  # floats a table row: DeepFM's first-order weight and its EMBEDDING_DIM embedding
EMBEDDING_DIM = DIM - 1
SEED = 0
SHARDS = 2
ADAGRAD_LR = 0.01  # torch's default; every Adagrad contender
ADAGRAD_EPS = 1e-10  # torch's and tierps' default (FBGEMM's is 1e-8: given explicitly)
ADAM_LR = 1e-3  # every Adam contender, sparse and dense
DENSE_LR = 1e-3  # torch.optim.Adam on the MLP and bias, in every contender
ZIPF_FEATURES = 8
ZIPF_IDS = 200_000
ZIPF_IDS_LARGE = 2_000_000
ZIPF_A = 1.2
ZIPF_BAG = 4
ZIPF_BATCHES = 24  # distinct batches; each chunk trains a shuffle of them
ZIPF_CLICK_RATE = 0.3
# A contender trains if its loss falls from the first chunk to the last by at least this
# part of what local torch's with the same optimizer falls (tierps starts from other random
# rows of the same distribution, and staleness 1 lags a step; TorchRec and FBGEMM start from
# the same rows and follow torch's Adagrad to ~1e-4). Frozen rows, only the MLP learning,
# fall by far less (measured on zipf_200k: 0.08, against 0.19 with Adam and 0.45 with Adagrad).
TRAINS_FRACTION = 0.8
CPU_PARTS = ("trainer_main_thread", "trainer_other_threads", "shards")
BASELINE = "torchrec_dmp"


@dataclass(frozen=True)
class Case:
    name: str
    ids: int  # per table (Zipf cases); 0: MovieLens, its own tables
    batch_size: int
    steps: int  # per chunk


CASES = (
    Case("zipf_200k", ZIPF_IDS, 2048, 8),
    Case("zipf_2m", ZIPF_IDS_LARGE, 2048, 8),
    Case("movielens", 0, 256, 48),
)
QUICK_CASES = (
    Case("zipf_200k", ZIPF_IDS, 2048, 3),
    Case("zipf_2m", ZIPF_IDS_LARGE, 2048, 3),
    Case("movielens", 0, 256, 12),
)


@dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # torchrec, fbgemm, local, tierps
    optimizer: str  # adagrad, adam (SparseOptimizer's kinds)
    loop: str  # plain: out = model(batch) ... ; pipeline: through the embeddings' pipeline()
    staleness: int = 0  # tierps' pipeline
    direct: bool = False  # tierps: direct tables (row k holds id k), not hashed ones

    @property
    def sparse_optimizer(self) -> SparseOptimizer:
        lr = ADAGRAD_LR if self.optimizer == "adagrad" else ADAM_LR
        return SparseOptimizer(self.optimizer, lr)

    @property
    def describe(self) -> str:
        optimizer = {"adagrad": "Adagrad", "adam": "Adam"}[self.optimizer]
        what = {
            "torchrec": f"TorchRec DMP, fused {optimizer}",
            "fbgemm": f"FBGEMM TBE, fused {optimizer}",
            "local": f"torch EmbeddingBag + {'SparseAdam' if optimizer == 'Adam' else optimizer}",
            "tierps": f"tierps, {optimizer}",
        }[self.kind]
        loop = "plain loop" if self.loop == "plain" else f"pipeline staleness {self.staleness}"
        index = ", direct tables" if self.direct else ""
        return what if self.kind != "tierps" else f"{what}{index}, {loop}"


CONTENDERS = (
    Contender("torchrec_dmp", "torchrec", "adagrad", "plain"),
    Contender("fbgemm_tbe", "fbgemm", "adagrad", "plain"),
    Contender("local_adagrad", "local", "adagrad", "plain"),
    Contender("local_adam", "local", "adam", "plain"),
    Contender("tierps_adagrad_plain", "tierps", "adagrad", "plain"),
    Contender("tierps_adagrad_s0", "tierps", "adagrad", "pipeline", 0),
    Contender("tierps_adagrad_s1", "tierps", "adagrad", "pipeline", 1),
    Contender("tierps_adam_plain", "tierps", "adam", "plain"),
    Contender("tierps_adam_s0", "tierps", "adam", "pipeline", 0),
    Contender("tierps_adam_s1", "tierps", "adam", "pipeline", 1),
    Contender("tierps_adagrad_direct_plain", "tierps", "adagrad", "plain", direct=True),
)


# -- data -----------------------------------------------------------------------------------------


def zipf_dataset(ids: int, batch_size: int) -> data.CTRDataset:
    """The target shape: ZIPF_FEATURES features, each its own table of `ids` ids, bags of
    ZIPF_BAG ids drawn from Zipf(ZIPF_A) (rank r -> a scattered id). A sample clicks with
    probability sigmoid(the sum over features of the bag's mean hidden effect + a bias for
    ZIPF_CLICK_RATE), each id's effect N(0, 1): a model that learns its rows does better
    than the click rate alone."""
    rng = np.random.default_rng(SEED)
    samples = ZIPF_BATCHES * batch_size
    features, columns, tables = [], {}, {}
    logits = np.zeros(samples)
    for index in range(ZIPF_FEATURES):
        name = table = f"f{index}"
        ranks = (rng.zipf(ZIPF_A, samples * ZIPF_BAG) - 1) % ids
        keys = rng.permutation(ids)[ranks]  # hot ranks scattered over ids and shards
        starts = np.arange(0, samples * ZIPF_BAG + 1, ZIPF_BAG, dtype=np.int64)
        columns[name] = data.RaggedColumn(keys.astype(np.int64), starts)
        features.append(data.SparseFeature(name, table))
        tables[table] = data.TableSpec(table, np.arange(ids, dtype=np.int64), True)
        logits += rng.standard_normal(ids)[keys].reshape(samples, ZIPF_BAG).mean(1)
    low, high = -20.0, 20.0  # the bias for the click rate, by bisection
    for _ in range(60):
        bias = (low + high) / 2
        below = _sigmoid(logits + bias).mean() < ZIPF_CLICK_RATE
        low, high = (bias, high) if below else (low, bias)
    labels = (rng.random(samples) < _sigmoid(logits + bias)).astype(np.float32)
    every = np.arange(samples, dtype=np.int64)
    return data.CTRDataset(
        f"zipf ({ZIPF_FEATURES} features x {ids:,} ids, Zipf {ZIPF_A}, {ZIPF_BAG} per bag)",
        tuple(features),
        tables,
        columns,
        None,
        labels,
        every,
        every[:0],
    )


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def case_dataset(case: Case) -> data.CTRDataset:
    if case.name == "movielens":
        return data.load_movielens(SEED)
    return zipf_dataset(case.ids, case.batch_size)


def own_tables(dataset: data.CTRDataset, prefix: str) -> data.CTRDataset:
    """The dataset with its tables renamed `prefix`.<table>: a contender's own tables on the
    cluster (the batches, keyed by feature, stay the same)."""
    features = tuple(dataclasses.replace(f, table=f"{prefix}.{f.table}") for f in dataset.features)
    tables = {
        f"{prefix}.{name}": dataclasses.replace(spec, name=f"{prefix}.{name}")
        for name, spec in dataset.tables.items()
    }
    return dataclasses.replace(dataset, features=features, tables=tables)


def one_pooling(dataset: data.CTRDataset, features: Sequence[data.SparseFeature]) -> str:
    """The one pooling mode of features that TorchRec pools by table and FBGEMM by module:
    their combiner, or "mean" where they differ, which a feature of one id in every bag
    pools as "sum" does (MovieLens: genres is a mean-pooled bag, the others single ids)."""
    combiners = {f.combiner for f in features}
    if len(combiners) == 1:
        return combiners.pop()
    for feature in features:
        if feature.combiner == "sum" and not dataset.columns[feature.name].one_per_sample:
            raise ValueError(
                f"{dataset.name}: feature {feature.name!r} (table {feature.table!r}) expected "
                f"one id a bag to be pooled by 'mean' with its table's other features, got bags "
                f"of several ids"
            )
    return "mean"


def _dense_keys(dataset: data.CTRDataset) -> None:
    """TorchRec and FBGEMM address rows by id: every table's keys must be 0..V-1."""
    for name, spec in dataset.tables.items():
        if not spec.dense_keys:
            raise ValueError(
                f"{dataset.name}: table {name!r} expected keys 0..V-1 (TorchRec and FBGEMM "
                f"address rows by id), got {spec.num_keys} keys that are not"
            )


# -- TorchRec and FBGEMM as DeepFM's embeddings ---------------------------------------------------


def _lengths(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return np.diff(offsets, append=values.size)


class FusedEmbeddings(nn.Module):
    """DeepFM's embedding layer over a module whose backward applies the optimizer itself
    (TorchRec's sharded collection, FBGEMM's table-batched embedding): no sparse optimizer
    to step, no pipeline, nothing to flush."""

    features: list[data.SparseFeature]

    def sparse_optimizer(self) -> None:
        return None

    def pipeline(self, batches: Iterable[data.Batch]) -> Iterator[data.Batch]:
        return iter(batches)

    def flush(self) -> None:
        """Nothing in flight: the optimizer ran in backward."""

    def close(self) -> None:
        """Nothing to stop."""


class TorchRecEmbeddings(FusedEmbeddings):
    """torchrec.EmbeddingBagCollection (a table per dataset table, on the meta device)
    sharded by DistributedModelParallel on the CPU, trained by the fused EXACT_ADAGRAD that
    _apply_optimizer_in_backward(torch.optim.Adagrad) asks for; its rows set to `weights`.
    The default process group (a world of 1 on gloo) must be up."""

    def __init__(
        self, dataset: data.CTRDataset, weights: Mapping[str, np.ndarray], lr: float
    ) -> None:
        super().__init__()
        import torchrec
        from torch.distributed.optim import _apply_optimizer_in_backward
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        _dense_keys(dataset)
        self.features = list(dataset.features)
        self._kjt = KeyedJaggedTensor
        pooling = {"sum": torchrec.PoolingType.SUM, "mean": torchrec.PoolingType.MEAN}
        configs = []
        for name, spec in dataset.tables.items():
            mine = [f for f in self.features if f.table == name]
            configs.append(
                torchrec.EmbeddingBagConfig(
                    name=name,
                    num_embeddings=spec.num_keys,
                    embedding_dim=DIM,
                    feature_names=[f.name for f in mine],
                    pooling=pooling[one_pooling(dataset, mine)],
                )
            )
        collection = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        _apply_optimizer_in_backward(
            torch.optim.Adagrad, collection.parameters(), {"lr": lr, "eps": ADAGRAD_EPS}
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchRec's deprecation notices
            logging.disable(logging.WARNING)  # and its planner's advice for multi-host set-ups
            try:
                self.dmp = DistributedModelParallel(collection, device=torch.device("cpu"))
            finally:
                logging.disable(logging.NOTSET)
        with torch.no_grad():
            for key, sharded in self.dmp.state_dict().items():
                table = key.split(".")[-2]  # embedding_bags.<table>.weight
                for shard in sharded.local_shards():
                    row, col = shard.metadata.shard_offsets
                    rows, cols = shard.tensor.shape
                    given = weights[table][row : row + rows, col : col + cols]
                    shard.tensor.copy_(torch.from_numpy(given))

    def forward(self, batch: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict:
        names = [f.name for f in self.features]
        values = np.concatenate([batch[name][0] for name in names])
        lengths = np.concatenate([_lengths(*batch[name]) for name in names])
        features = self._kjt(
            keys=names, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths)
        )
        return self.dmp(features).to_dict()


class FbgemmEmbeddings(FusedEmbeddings):
    """FBGEMM's SplitTableBatchedEmbeddingBagsCodegen over the dataset's tables (HOST, CPU),
    trained by its fused EXACT_ADAGRAD; its rows set to `weights`."""

    def __init__(
        self, dataset: data.CTRDataset, weights: Mapping[str, np.ndarray], lr: float
    ) -> None:
        super().__init__()
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        _dense_keys(dataset)
        self.features = list(dataset.features)
        tables = list(dataset.tables)
        mode = one_pooling(dataset, self.features)
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [
                (dataset.tables[t].num_keys, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)
                for t in tables
            ],
            feature_table_map=[tables.index(f.table) for f in self.features],
            optimizer=EmbOptimType.EXACT_ADAGRAD,
            learning_rate=lr,
            eps=ADAGRAD_EPS,
            pooling_mode=PoolingMode.SUM if mode == "sum" else PoolingMode.MEAN,
        )
        with torch.no_grad():
            for rows, table in zip(self.tbe.split_embedding_weights(), tables, strict=True):
                rows.copy_(torch.from_numpy(weights[table]))

    def forward(self, batch: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> dict:
        names = [f.name for f in self.features]
        values = [batch[name][0] for name in names]
        starts = np.cumsum([0] + [v.size for v in values])
        offsets = np.concatenate(
            [batch[name][1] + start for name, start in zip(names, starts[:-1], strict=True)]
            + [starts[-1:]]
        )
        pooled = self.tbe(torch.from_numpy(np.concatenate(values)), torch.from_numpy(offsets))
        return dict(zip(names, torch.split(pooled, DIM, dim=1), strict=True))


def kernel_missing(kind: str) -> str | None:
    """Why TorchRec's or FBGEMM's rows cannot run here, or None."""
    module = "torchrec" if kind == "torchrec" else "fbgemm_gpu"
    try:
        __import__(module)
    except Exception as error:  # noqa: BLE001 - an absent or broken install alike
        return f"{module} does not import ({type(error).__name__}: {error}); see the docstring"
    return None


# -- trainers -------------------------------------------------------------------------------------


class Trainer:
    """A contender's model with its optimizers; `chunk` trains `steps` batches of a seeded
    order."""

    def __init__(self, contender: Contender, model: DeepFM) -> None:
        self.contender = contender
        self.model = model
        self.dense = training.dense_optimizer_for(model, DENSE_LR)
        self.sparse = model.embeddings.sparse_optimizer()
        # plain: the batches as they come (forward looks up, backward pushes)
        self.loop: Callable[[Iterable[data.Batch]], Iterable[data.Batch]] | None = (
            iter if contender.loop == "plain" else None
        )

    def chunk(
        self, dataset: data.CTRDataset, batch_size: int, steps: int, seed: int
    ) -> tuple[float, dict[str, float], float]:
        """samples/s, the CPU milliseconds a step took (CPU_PARTS: where they went), and the
        chunk's training loss."""
        before = cpu_seconds()
        loss, _, seconds, samples = training.train_epoch(
            self.model,
            dataset,
            self.dense,
            self.sparse,
            batch_size=batch_size,
            shuffle_seed=seed,
            max_batches=steps,
            steps=self.loop,
        )
        self.model.embeddings.close()  # no background work left to run into the next chunk
        spent = cpu_seconds()
        taken = min(steps, dataset.num_batches("train", batch_size))
        cpu = {part: 1000 * (spent[part] - before[part]) / taken for part in CPU_PARTS}
        return samples / seconds, cpu, loss


def cpu_seconds(shards_parent: int | None = None) -> dict[str, float]:
    """CPU seconds so far of this thread, this process's other threads, and the shards (the
    processes whose parent is `shards_parent`, by default this process; read from /proc, 0
    where there is no /proc)."""
    main, process = time.thread_time(), time.process_time()
    parent = os.getpid() if shards_parent is None else shards_parent
    shards = children_cpu_s(parent)
    return {"trainer_main_thread": main, "trainer_other_threads": process - main, "shards": shards}


def build(
    contender: Contender,
    dataset: data.CTRDataset,
    weights: Mapping[str, np.ndarray],
    client: EmbeddingClient,
) -> DeepFM:
    """The contender's DeepFM; a tierps contender's tables are made afresh."""
    optimizer = contender.sparse_optimizer
    if contender.kind == "local":
        return training.build_local_model(
            dataset, dim=EMBEDDING_DIM, seed=SEED, optimizer=optimizer, weights=dict(weights)
        )
    if contender.kind == "tierps":
        own = own_tables(dataset, contender.name)
        training.create_tables(
            client,
            own,
            dim=EMBEDDING_DIM,
            seed=SEED,
            optimizer=optimizer,
            direct=contender.direct,
        )
        return training.build_tierps_model(
            client, own, dim=EMBEDDING_DIM, seed=SEED, staleness=contender.staleness
        )
    fused = TorchRecEmbeddings if contender.kind == "torchrec" else FbgemmEmbeddings
    embeddings = fused(dataset, weights, optimizer.lr)
    return DeepFM(embeddings, dim=EMBEDDING_DIM, num_dense=dataset.num_dense, seed=SEED)


def chosen(names: Sequence[str]) -> list[Contender]:
    """The contenders named (all when none is), with what their ratios need: TorchRec DMP
    and local torch with the same optimizer."""
    if not names:
        return list(CONTENDERS)
    by_name = {c.name: c for c in CONTENDERS}
    wanted = {BASELINE, *names, *(f"local_{by_name[n].optimizer}" for n in names)}
    return [c for c in CONTENDERS if c.name in wanted]


def run_case(
    case: Case,
    client: EmbeddingClient,
    rounds: int,
    skipped: Mapping[str, str],
    contenders: Sequence[Contender] = CONTENDERS,
) -> dict[str, Any]:
    dataset = case_dataset(case)
    weights = initial_weights(dataset.tables, EMBEDDING_DIM, SEED)
    made = {
        c.name: Trainer(c, build(c, dataset, weights, client))
        for c in contenders
        if c.kind not in skipped
    }
    del weights  # each contender holds its own copy
    rates: dict[str, list[float]] = {name: [] for name in made}
    cpu: dict[str, list[dict[str, float]]] = {name: [] for name in made}
    losses: dict[str, list[float]] = {name: [] for name in made}
    for round_index in range(rounds + 1):  # round 0 warms up (and makes tierps' hot rows)
        for name, trainer in made.items():
            rate, step_cpu, loss = trainer.chunk(
                dataset, case.batch_size, case.steps, seed=round_index
            )
            losses[name].append(loss)
            if round_index:
                rates[name].append(rate)
                cpu[name].append(step_cpu)
    for contender in contenders:
        if contender.kind == "tierps":
            for table in own_tables(dataset, contender.name).tables:
                client.drop_table(table)
    rows: dict[str, dict[str, Any]] = {}
    for name, trainer in made.items():
        rows[name] = {
            "what": trainer.contender.describe,
            "optimizer": trainer.contender.optimizer,
            "samples_per_s": statistics.median(rates[name]),
            "cpu_ms_per_step": {
                part: statistics.median(c[part] for c in cpu[name]) for part in CPU_PARTS
            },
            "samples_per_s_each_chunk": rates[name],
            "loss_each_chunk": losses[name],  # round 0's first
        }
    for row in rows.values():
        same = rows.get(f"local_{row['optimizer']}")
        baseline = rows.get(BASELINE)
        row["ratio_to_torchrec_dmp"] = (
            None if baseline is None else row["samples_per_s"] / baseline["samples_per_s"]
        )
        row["ratio_to_local_same_optimizer"] = row["samples_per_s"] / same["samples_per_s"]
        first, last = row["loss_each_chunk"][0], row["loss_each_chunk"][-1]
        reference = same["loss_each_chunk"][0] - same["loss_each_chunk"][-1]
        row["trains"] = bool(last < first and first - last >= TRAINS_FRACTION * reference)
    return {
        "case": case.name,
        "dataset": dataset.name,
        "ids_per_table": case.ids or None,
        "batch_size": case.batch_size,
        "steps_per_chunk": case.steps,
        "chunks": rounds,
        "click_rate": float(dataset.labels.mean()),
        "contenders": rows,
    }


def run(quick: bool, only: Sequence[str] = (), names: Sequence[str] = ()) -> dict[str, Any]:
    cases = [c for c in (QUICK_CASES if quick else CASES) if not only or c.name in only]
    rounds = 2 if quick else 7
    skipped = {kind: why for kind in ("torchrec", "fbgemm") if (why := kernel_missing(kind))}
    for kind, why in skipped.items():
        print(f"skipping the {kind} rows: {why}", flush=True)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "grpcio": grpc.__version__,
            "numpy": np.__version__,
            "torchrec": _version("torchrec"),
            "fbgemm_gpu": _version("fbgemm_gpu"),
            "load_average_at_start": os.getloadavg(),
        },
        "model": {
            "row_floats": DIM,
            "embedding_dim": EMBEDDING_DIM,
            "hidden": list(DEFAULT_HIDDEN),
            "torch_threads": 1,
            "adagrad": {"lr": ADAGRAD_LR, "eps": ADAGRAD_EPS},
            "adam_lr": ADAM_LR,
            "dense": f"torch.optim.Adam lr {DENSE_LR}",
        },
        "shards": SHARDS,
        "contenders_chosen": list(names),  # none: every contender
        "skipped": skipped,
        "rows": [],
    }
    own_group = False
    if "torchrec" not in skipped and not torch.distributed.is_initialized():
        # a world of 1 on gloo, as a CPU user runs DistributedModelParallel; an in-process store
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
        )
        own_group = True
    root = Path(tempfile.mkdtemp(prefix="tierps-bench-deepfm-"))
    try:
        with (
            LocalCluster(SHARDS, root / "cluster") as cluster,
            EmbeddingClient(cluster.addresses) as client,
        ):
            for case in cases:
                started, load = time.perf_counter(), os.getloadavg()
                try:
                    row = run_case(case, client, rounds, skipped, chosen(names))
                except data.DatasetUnavailableError as error:
                    print(f"skipping {case.name}: {error}", flush=True)
                    continue
                row["seconds"] = time.perf_counter() - started
                row["load_average_at_start_and_end"] = [load, os.getloadavg()]
                results["rows"].append(row)
                print(_table(row), flush=True)
    finally:
        torch.set_num_threads(threads_before)
        if own_group:
            torch.distributed.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    return results


def _version(module: str) -> str | None:
    try:
        return str(getattr(__import__(module), "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - absent or broken: no version
        return None


def _table(row: dict[str, Any]) -> str:
    head = (
        f"{row['case']}: {row['dataset']}, batch {row['batch_size']}, {row['chunks']} chunks "
        f"of {row['steps_per_chunk']} steps, {row['seconds']:.0f} s, load average "
        f"{' -> '.join(f'{load[0]:.1f}' for load in row['load_average_at_start_and_end'])}\n"
        f"  {'contender':27} {'samples/s':>10} {'xTorchRec':>9} {'xlocal':>7}  "
        f"{'CPU ms/step main+other+shards':>30}  loss first -> last (trains)"
    )
    lines = [head]
    for name, c in row["contenders"].items():
        ms = c["cpu_ms_per_step"]
        x_trec = c["ratio_to_torchrec_dmp"]
        cpu = "+".join(f"{ms[part]:.1f}" for part in CPU_PARTS)
        loss = c["loss_each_chunk"]
        lines.append(
            f"  {name:27} {c['samples_per_s']:>10,.0f} "
            f"{'-' if x_trec is None else f'{x_trec:.2f}x':>9} "
            f"{c['ratio_to_local_same_optimizer']:>6.2f}x  {cpu:>30}  "
            f"{loss[0]:.4f} -> {loss[-1]:.4f} ({'yes' if c['trains'] else 'NO'})"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Samples/s by contender, grouped by shape (one group a row of the results)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    names = [c.name for c in CONTENDERS if any(c.name in r["contenders"] for r in rows)]
    colors = {"torchrec": "#2ca02c", "fbgemm": "#98df8a", "local": "#7f7f7f"}
    tierps_colors = {
        "adagrad": ("#08519c", "#3182bd", "#9ecae1"),
        "adam": ("#a63603", "#e6550d", "#fdae6b"),
    }
    fig, ax = plt.subplots(figsize=(11, 6.6))
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        contender = next(c for c in CONTENDERS if c.name == name)
        if contender.kind == "tierps":
            shade = 0 if contender.loop == "plain" else 1 + contender.staleness
            color = tierps_colors[contender.optimizer][shade]
        else:
            color = colors[contender.kind]
        hatch = "//" if contender.kind == "local" and contender.optimizer == "adam" else None
        hatch = ".." if contender.direct else hatch
        xs = [
            i + (index - (len(names) - 1) / 2) * width
            for i, r in enumerate(rows)
            if name in r["contenders"]
        ]
        ys = [r["contenders"][name]["samples_per_s"] for r in rows if name in r["contenders"]]
        ax.bar(xs, ys, width, color=color, hatch=hatch, edgecolor="white", label=contender.describe)
    labels = []
    for r in rows:
        shape = f"{r['ids_per_table']:,} ids a table" if r["ids_per_table"] else r["dataset"]
        labels.append(f"{shape}\nbatch {r['batch_size']:,}")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("samples/s (median over the chunks)")
    ax.yaxis.set_major_formatter(lambda value, _: f"{value / 1000:.0f}k")
    ax.grid(True, axis="y", alpha=0.3)
    fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)
    ax.set_title(
        f"DeepFM training on {results['machine']['cpus']} CPU cores, one run: tierps "
        f"({results['shards']} shards) vs TorchRec / FBGEMM fused kernels vs local torch",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/perf/deepfm.json"))
    parser.add_argument("--png", type=Path, default=Path("docs/perf/deepfm.png"))
    parser.add_argument("--quick", action="store_true", help="shorter chunks, fewer rounds")
    parser.add_argument("--replot", action="store_true", help="redraw --png from --out")
    parser.add_argument(
        "--case",
        action="append",
        default=[],
        choices=[case.name for case in CASES],
        help="run only this shape (repeatable; default: all)",
    )
    parser.add_argument(
        "--contender",
        action="append",
        default=[],
        choices=[c.name for c in CONTENDERS],
        help="race only this contender (repeatable; TorchRec DMP and local torch with the "
        "same optimizer always run, for the ratios; default: all)",
    )
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.out.read_text()), args.png)
        return 0
    results = run(args.quick, args.case, args.contender)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    plot(results, args.png)
    print(f"wrote {args.out} and {args.png}")
    failing = [
        f"{row['case']} {name}"
        for row in results["rows"]
        for name, c in row["contenders"].items()
        if not c["trains"]
    ]
    if failing:
        print(
            f"did not train (loss fell by less than {TRAINS_FRACTION} of local torch's with "
            f"the same optimizer): {', '.join(failing)}"
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
