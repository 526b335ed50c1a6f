"""DeepFM (Guo et al. 2017) in torch, with a pluggable embedding layer.

    logit = bias + sum_f w_f + <dense, u>                    (first order)
          + 1/2 * sum_d [(sum_f v_fd)^2 - sum_f v_fd^2]      (FM second order)
          + MLP([v_1, ..., v_F, dense])                      (deep part)

Each sparse feature f pools one row of width dim + 1 per sample: column 0 is its
first-order weight w_f, columns 1.. its embedding v_f (the two train together, so one
lookup serves both). The rows come from either

- `TierpsEmbeddings`: tables on the cluster through tierps.client.torch's
  EmbeddingBagCollection; the shards apply the sparse optimizer as gradients arrive; or
- `LocalEmbeddings`: one torch.nn.EmbeddingBag(sparse=True) per table, trained by torch's
  sparse optimizer (SparseAdam or Adagrad): the baseline.

Given the same initial weights (`initial_weights`, copied to the cluster with
`TierpsEmbeddings.assign`) and the same `SparseOptimizer`, the two compute the same model.
The dense part (MLP, bias, dense weights) trains with torch.optim.Adam either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tierps.client import EmbeddingClient, Feature, TableConfig, init, optim
from tierps.client.torch import EmbeddingBagCollection
from tierps.demo.data import Batch, SparseFeature, TableSpec

INIT_STD = 0.01  # embeddings start as N(0, INIT_STD**2), as in common DeepFM set-ups
DEFAULT_HIDDEN = (256, 128)

BagBatch = Mapping[str, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class SparseOptimizer:
    """The optimizer of the embedding tables, on either side: "adam" (tierps optim.Adam,
    torch.optim.SparseAdam) or "adagrad" (tierps optim.Adagrad, torch.optim.Adagrad), with
    torch's default betas / eps."""

    kind: str = "adam"
    lr: float = 1e-3

    def __post_init__(self) -> None:
        if self.kind not in ("adam", "adagrad"):
            raise ValueError(
                f"SparseOptimizer: kind expected 'adam' or 'adagrad', got {self.kind!r}"
            )
        if not self.lr > 0:
            raise ValueError(f"SparseOptimizer: lr expected > 0, got {self.lr}")

    def for_tierps(self) -> optim.Optimizer:
        return optim.Adam(lr=self.lr) if self.kind == "adam" else optim.Adagrad(lr=self.lr)

    def for_torch(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        if self.kind == "adam":
            return torch.optim.SparseAdam(list(params), lr=self.lr)
        return torch.optim.Adagrad(list(params), lr=self.lr)


def row_width(dim: int) -> int:
    """Floats per row: the first-order weight and the dim-wide embedding."""
    return dim + 1


def initial_weights(
    tables: Mapping[str, TableSpec], dim: int, seed: int, std: float = INIT_STD
) -> dict[str, np.ndarray]:
    """Initial rows [num_keys, dim + 1] of each table (row i is the table's keys[i]),
    N(0, std**2) from a generator seeded by `seed`."""
    rng = np.random.default_rng(seed)
    return {
        name: rng.normal(0.0, std, (spec.num_keys, row_width(dim))).astype(np.float32)
        for name, spec in sorted(tables.items())
    }


def _table_names(features: Sequence[SparseFeature]) -> list[str]:
    """The tables the features use, in order of first use."""
    return list(dict.fromkeys(feature.table for feature in features))


def _module_name(table: str) -> str:
    return "table_" + table.replace(".", "_")  # module names may not hold "."


class LocalEmbeddings(nn.Module):
    """The baseline: one torch.nn.EmbeddingBag(sparse=True) per table, a row per key of the
    table's TableSpec (keys that are not 0..V-1 are mapped to rows by binary search). The
    features of a table that share a combiner are pooled in one embedding_bag call."""

    def __init__(
        self,
        features: Sequence[SparseFeature],
        tables: Mapping[str, TableSpec],
        weights: Mapping[str, np.ndarray],
        optimizer: SparseOptimizer,
    ) -> None:
        super().__init__()
        self.features = list(features)
        self.optimizer_spec = optimizer
        self.specs = {name: tables[name] for name in _table_names(self.features)}
        self.groups: dict[tuple[str, str], list[str]] = {}
        for feature in self.features:
            self.groups.setdefault((feature.table, feature.combiner), []).append(feature.name)
        self.bags = nn.ModuleDict()
        for name, spec in self.specs.items():
            initial = torch.from_numpy(np.ascontiguousarray(weights[name], dtype=np.float32))
            if initial.shape[0] != spec.num_keys:
                raise ValueError(
                    f"table {name!r}: initial weights expected {spec.num_keys} rows (one per "
                    f"key), got {initial.shape[0]}"
                )
            self.bags[_module_name(name)] = nn.EmbeddingBag.from_pretrained(
                initial.clone(), freeze=False, mode="sum", sparse=True
            )

    def sparse_optimizer(self) -> torch.optim.Optimizer | None:
        """torch's sparse optimizer over the tables (step it with the dense one)."""
        return self.optimizer_spec.for_torch(self.bags.parameters())

    def pipeline(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """The batches as they come: the tables are in this process, nothing to fetch."""
        return iter(batches)

    def flush(self) -> None:
        """Nothing in flight: torch's optimizer steps the tables in place."""

    def close(self) -> None:
        """Nothing to stop."""

    def _rows(self, table: str, keys: np.ndarray) -> np.ndarray:
        spec = self.specs[table]
        if spec.dense_keys:
            return keys
        return np.searchsorted(spec.keys, keys)

    def forward(self, batch: BagBatch) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for (table, combiner), names in self.groups.items():
            values = [batch[name][0] for name in names]
            starts = np.cumsum([0] + [v.size for v in values[:-1]])
            offsets = np.concatenate(
                [batch[name][1] + start for name, start in zip(names, starts, strict=True)]
            )
            rows = self._rows(table, np.concatenate(values))
            pooled = nn.functional.embedding_bag(
                torch.from_numpy(rows),
                self.bags[_module_name(table)].weight,
                torch.from_numpy(offsets),
                mode=combiner,
                sparse=True,
            )
            counts = [batch[name][1].size for name in names]
            out.update(zip(names, torch.split(pooled, counts), strict=True))
        return out


class TierpsEmbeddings(nn.Module):
    """The tables on the cluster: one tierps table per TableSpec (created by `create_tables`),
    pooled through tierps.client.torch.EmbeddingBagCollection; backward pushes the
    gradients and the shards run the table's optimizer."""

    def __init__(
        self, client: EmbeddingClient, features: Sequence[SparseFeature], *, staleness: int = 0
    ) -> None:
        super().__init__()
        self.features = list(features)
        self.client = client
        self.collection = EmbeddingBagCollection(
            client,
            [Feature(f.name, f.table, f.combiner) for f in self.features],
            staleness=staleness,
        )

    @staticmethod
    def table_configs(
        features: Sequence[SparseFeature],
        dim: int,
        optimizer: SparseOptimizer,
        *,
        seed: int = 0,
        host_cache_bytes: int = 256 << 20,
        direct: Mapping[str, int] | None = None,
    ) -> list[TableConfig]:
        """The configs of the tables the features use: rows dim + 1 wide, N(0, INIT_STD**2)
        for keys never assigned, the sparse optimizer. direct: table -> capacity, for
        tables whose keys are the ids 0..capacity-1 that are to be direct tables (row k of
        an arena holds key k, no hash index); the others are hashed, host_cache_bytes each."""
        direct = direct or {}
        return [
            TableConfig(
                name,
                row_width(dim),
                initializer=init.Normal(0.0, INIT_STD),
                optimizer=optimizer.for_tierps(),
                seed=seed,
                host_cache_bytes=host_cache_bytes,
                **({"use_hashtable": False, "capacity": direct[name]} if name in direct else {}),
            )
            for name in _table_names(features)
        ]

    def assign(self, tables: Mapping[str, TableSpec], weights: Mapping[str, np.ndarray]) -> int:
        """Set every key's row (and reset its optimizer state) to the given initial weights,
        as LocalEmbeddings starts from them. Returns the number of rows set."""
        chunk = 1 << 16
        done = 0
        for name in _table_names(self.features):
            keys, rows = tables[name].keys, weights[name]
            for start in range(0, keys.size, chunk):
                done += self.client.assign(
                    name, keys[start : start + chunk], rows[start : start + chunk]
                )
        return done

    def sparse_optimizer(self) -> torch.optim.Optimizer | None:
        """None: the shards apply the optimizer during backward."""
        return None

    def pipeline(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """The batches, each next one's rows looked up while the current one trains
        (EmbeddingBagCollection.pipeline; what the lookup may miss: its staleness)."""
        return self.collection.pipeline(batches, features=lambda batch: batch.features)

    def flush(self) -> None:
        """Wait for the pushes in flight (EmbeddingBagCollection.flush)."""
        self.collection.flush()

    def close(self) -> None:
        """Stop the collection's background thread (EmbeddingBagCollection.close)."""
        self.collection.close()

    def forward(self, batch: BagBatch) -> dict[str, torch.Tensor]:
        return self.collection(batch)


class DeepFM(nn.Module):
    """DeepFM over `embeddings` (LocalEmbeddings or TierpsEmbeddings, rows dim + 1 wide).
    The dense layers are initialised from torch's generator seeded with `seed`, so two
    models built with one seed start alike. forward(batch) returns logits [B]."""

    def __init__(
        self,
        embeddings: LocalEmbeddings | TierpsEmbeddings,
        *,
        dim: int,
        num_dense: int = 0,
        hidden: Sequence[int] = DEFAULT_HIDDEN,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.field_names = [feature.name for feature in embeddings.features]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layers: list[nn.Module] = []
            width = len(self.field_names) * dim + num_dense
            for size in hidden:
                layers += [nn.Linear(width, size), nn.ReLU()]
                width = size
            layers.append(nn.Linear(width, 1))
            self.mlp = nn.Sequential(*layers)
            self.dense_linear = nn.Linear(num_dense, 1, bias=False) if num_dense else None
        self.bias = nn.Parameter(torch.zeros(1))

    def dense_parameters(self) -> list[nn.Parameter]:
        """Everything but the embedding tables: what torch.optim.Adam trains."""
        return [p for name, p in self.named_parameters() if not name.startswith("embeddings.")]

    def forward(self, batch: Batch) -> torch.Tensor:
        pooled = self.embeddings(batch.features)
        rows = torch.stack([pooled[name] for name in self.field_names], dim=1)  # [B, F, dim+1]
        first_order = rows[:, :, 0].sum(1)
        vectors = rows[:, :, 1:]
        summed = vectors.sum(1)
        second_order = 0.5 * (summed * summed - (vectors * vectors).sum(1)).sum(1)
        deep_input = vectors.flatten(1)
        logit = self.bias + first_order + second_order
        if self.dense_linear is not None:
            dense = torch.from_numpy(batch.dense)
            deep_input = torch.cat([deep_input, dense], dim=1)
            logit = logit + self.dense_linear(dense).squeeze(1)
        return logit + self.mlp(deep_input).squeeze(1)
