"""The demo's reusable pieces: DeepFM built over local tables or the cluster's, the training
loop, evaluation and its metrics. `tierps demo` (tierps.demo.main), each rank of
`tierps demo --trainers N` (tierps.demo.trainers), the tests and the benchmarks use them:
`train`, `train_epoch`, `predict`, `evaluate`, `build_local_model`, `build_tierps_model`,
`create_tables`, `auc`, `logloss`. This module imports only the standard library at the top
(numpy and torch inside the functions), so importing it keeps `tierps --help` fast.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

    from tierps.client import EmbeddingClient
    from tierps.demo.data import Batch, CTRDataset
    from tierps.demo.deepfm import DeepFM, SparseOptimizer

DEFAULT_BATCH_SIZE = 256  # MovieLens' (tierps.demo.main picks one per dataset)
DEFAULT_DIM = 16
DEFAULT_LR = 1e-3
EVAL_BATCH_SIZE = 8192


# -- metrics --------------------------------------------------------------------------------------


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve: the Mann-Whitney U statistic over ranks of the scores,
    ties given their average rank. NaN if only one class is present."""
    import numpy as np

    labels = np.asarray(labels).reshape(-1) > 0.5
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if labels.shape != scores.shape:
        raise ValueError(
            f"auc: labels and scores expected one shape, got {labels.shape} and {scores.shape}"
        )
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    distinct, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    first_rank = np.cumsum(counts) - counts + 1  # 1-based rank of each distinct score's first
    average_rank = first_rank + (counts - 1) / 2.0
    rank_sum = average_rank[inverse.reshape(-1)][labels].sum()
    return float((rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives))


def logloss(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross-entropy of sigmoid(logits) against 0/1 labels, computed stably."""
    import numpy as np

    labels = np.asarray(labels, dtype=np.float64).reshape(-1)
    logits = np.asarray(logits, dtype=np.float64).reshape(-1)
    return float(np.mean(np.logaddexp(0.0, logits) - labels * logits))


# -- models ---------------------------------------------------------------------------------------


def build_local_model(
    dataset: CTRDataset,
    *,
    dim: int = DEFAULT_DIM,
    seed: int = 0,
    optimizer: SparseOptimizer | None = None,
    weights: dict[str, np.ndarray] | None = None,
) -> DeepFM:
    """DeepFM over local torch.nn.EmbeddingBag tables (the baseline), starting from
    `weights` (default: initial_weights(dataset.tables, dim, seed))."""
    from tierps.demo.deepfm import (
        DeepFM,
        LocalEmbeddings,
        SparseOptimizer,
        initial_weights,
    )

    optimizer = optimizer or SparseOptimizer(lr=DEFAULT_LR)
    if weights is None:
        weights = initial_weights(dataset.tables, dim, seed)
    embeddings = LocalEmbeddings(dataset.features, dataset.tables, weights, optimizer)
    return DeepFM(embeddings, dim=dim, num_dense=dataset.num_dense, seed=seed)


def create_tables(
    client: EmbeddingClient,
    dataset: CTRDataset,
    *,
    dim: int = DEFAULT_DIM,
    seed: int = 0,
    optimizer: SparseOptimizer | None = None,
    host_cache_bytes: int = 64 << 20,
    drop_others: bool = False,
    direct: bool = False,
) -> list[str]:
    """Create the dataset's tables on the cluster, dropping any left by an earlier run
    (whatever their config). drop_others: drop every other table too (the demo's own
    cluster: a table of another dataset's run would fill every snapshot). direct: a table
    whose keys are the ids 0..n-1 (TableSpec.dense_keys) is a direct table of n rows
    (use_hashtable=False: no hash index), the others hashed. Returns their names."""
    from tierps.demo.deepfm import SparseOptimizer, TierpsEmbeddings

    optimizer = optimizer or SparseOptimizer(lr=DEFAULT_LR)
    capacities = {
        name: spec.num_keys for name, spec in dataset.tables.items() if direct and spec.dense_keys
    }
    configs = TierpsEmbeddings.table_configs(
        dataset.features,
        dim,
        optimizer,
        seed=seed,
        host_cache_bytes=host_cache_bytes,
        direct=capacities,
    )
    existing = {config.name for config in client.list_tables()}
    names = [config.name for config in configs]
    for name in sorted(existing - set(names)) if drop_others else ():
        client.drop_table(name)
    for config in configs:
        if config.name in existing:
            client.drop_table(config.name)
        client.create_table(config)
    return names


def build_tierps_model(
    client: EmbeddingClient,
    dataset: CTRDataset,
    *,
    dim: int = DEFAULT_DIM,
    seed: int = 0,
    weights: dict[str, np.ndarray] | None = None,
    staleness: int = 0,
) -> DeepFM:
    """DeepFM over the cluster's tables (made by create_tables). With `weights` (as
    build_local_model takes), every key's row is assigned from them first, so the model
    starts where the local one does; without, rows start from the tables' initializer.
    staleness: the embedding pipeline's (tierps.client.torch.EmbeddingBagCollection)."""
    from tierps.demo.deepfm import DeepFM, TierpsEmbeddings

    embeddings = TierpsEmbeddings(client, dataset.features, staleness=staleness)
    if weights is not None:
        embeddings.assign(dataset.tables, weights)
    return DeepFM(embeddings, dim=dim, num_dense=dataset.num_dense, seed=seed)


# -- training -------------------------------------------------------------------------------------


@dataclass
class EpochResult:
    """One epoch: train figures are over the epoch's batches as they were trained."""

    epoch: int
    train_logloss: float
    train_auc: float
    test_logloss: float
    test_auc: float
    train_seconds: float
    samples_per_s: float


def train_epoch(
    model: DeepFM,
    dataset: CTRDataset,
    dense_optimizer: torch.optim.Optimizer,
    sparse_optimizer: torch.optim.Optimizer | None,
    *,
    batch_size: int,
    shuffle_seed: int,
    progress: str | None = None,
    max_batches: int | None = None,
    share: tuple[int, int] = (0, 1),
    steps: Callable[[Iterable[Batch]], Iterable[Batch]] | None = None,
    forward: Callable[[Batch], torch.Tensor] | None = None,
) -> tuple[float, float, float, int]:
    """One pass over the train rows in the order shuffle_seed gives, through the model's
    embedding pipeline (tierps: the next batch is looked up while one trains, as the
    tables' staleness allows). Returns (train logloss, train AUC, seconds, samples).
    Data-parallel training (tierps.demo.trainers) gives this rank's `share` of each
    batch (CTRDataset.batches), the group's `steps` (TrainerGroup.pipeline) in place of
    the embeddings' pipeline and the DistributedDataParallel model's `forward`."""
    import numpy as np
    import torch
    from tqdm import tqdm

    model.train()
    total = dataset.num_batches("train", batch_size, share[1])
    if max_batches is not None:
        total = min(total, max_batches)
    ordered = dataset.batches("train", batch_size, shuffle_seed=shuffle_seed, share=share)
    batches = itertools.islice(ordered, total)
    bar = tqdm(total=total, desc=progress, unit="batch", disable=True if progress is None else None)
    labels, logits = [], []
    samples = 0
    loss_fn = torch.nn.BCEWithLogitsLoss()
    steps = steps or model.embeddings.pipeline
    forward = forward or model
    started = time.perf_counter()
    for batch in steps(batches):
        dense_optimizer.zero_grad(set_to_none=True)
        if sparse_optimizer is not None:
            sparse_optimizer.zero_grad(set_to_none=True)
        output = forward(batch)
        loss = loss_fn(output, torch.from_numpy(batch.labels))
        loss.backward()  # tierps: pushes the tables' gradients; the shards step them
        dense_optimizer.step()
        if sparse_optimizer is not None:
            sparse_optimizer.step()
        samples += len(batch)
        labels.append(batch.labels)
        logits.append(output.detach().numpy())
        bar.update()
        if not bar.disable and bar.n % 20 == 0:  # a disabled bar's n stays 0
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
    seconds = time.perf_counter() - started  # the pipeline flushed its pushes at the end
    bar.close()
    all_labels, all_logits = np.concatenate(labels), np.concatenate(logits)
    return logloss(all_labels, all_logits), auc(all_labels, all_logits), seconds, samples


def predict(
    model: DeepFM,
    dataset: CTRDataset,
    split: str = "test",
    batch_size: int = EVAL_BATCH_SIZE,
    share: tuple[int, int] = (0, 1),
) -> tuple[np.ndarray, np.ndarray]:
    """(labels, logits) of every sample of `split`, in order (of this rank's `share`, as
    CTRDataset.batches gives it); no rows are created or trained (eval mode)."""
    import numpy as np
    import torch

    model.eval()
    labels, logits = [], []
    with torch.no_grad():
        for batch in dataset.batches(split, batch_size, share=share):
            labels.append(batch.labels)
            logits.append(model(batch).numpy())
    model.train()
    return np.concatenate(labels), np.concatenate(logits)


def evaluate(
    model: DeepFM, dataset: CTRDataset, split: str = "test", batch_size: int = EVAL_BATCH_SIZE
) -> tuple[float, float]:
    """(logloss, AUC) of the model on `split`."""
    labels, logits = predict(model, dataset, split, batch_size)
    return logloss(labels, logits), auc(labels, logits)


def dense_optimizer_for(model: DeepFM, lr: float = DEFAULT_LR) -> torch.optim.Optimizer:
    """torch.optim.Adam over the dense part (MLP, bias, dense weights). foreach: one
    multi-tensor kernel per update stage instead of a Python loop over the parameters;
    the same update as the for-loop (equal bit for bit when measured here), ~0.2 ms a step less."""
    import torch

    return torch.optim.Adam(model.dense_parameters(), lr=lr, foreach=True)


def train(
    model: DeepFM,
    dataset: CTRDataset,
    *,
    epochs: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
    lr: float = DEFAULT_LR,
    seed: int = 0,
    progress: str | None = None,
    on_epoch: Callable[[EpochResult], None] | None = None,
) -> list[EpochResult]:
    """Train for `epochs` epochs (epoch e's order is shuffled by seed and e, so two models
    trained with one seed see the same batches), evaluating on the test rows after each."""
    dense_optimizer = dense_optimizer_for(model, lr)
    sparse_optimizer = model.embeddings.sparse_optimizer()
    results = []
    for epoch in range(1, epochs + 1):
        train_loss, train_auc, seconds, samples = train_epoch(
            model,
            dataset,
            dense_optimizer,
            sparse_optimizer,
            batch_size=batch_size,
            shuffle_seed=epoch_seed(seed, epoch),
            progress=None if progress is None else f"{progress} epoch {epoch}/{epochs}",
        )
        test_loss, test_auc = evaluate(model, dataset, "test")
        result = EpochResult(
            epoch, train_loss, train_auc, test_loss, test_auc, seconds, samples / seconds
        )
        results.append(result)
        if on_epoch is not None:
            on_epoch(result)
    return results


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of an epoch."""
    return seed * 1_000_003 + epoch
