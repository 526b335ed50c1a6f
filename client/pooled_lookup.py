"""Pooled lookups: a batch of sparse features, each looked up in its table and pooled per
bag, and the way back (push_gradients). A lookup is prepared first (the checks, the dedup,
the pooling layout: nothing that depends on the rows) and fetched after (the RPCs and the
pooling), so that a pipelined trainer prepares in its own thread and fetches in the
background. A batch on the host is pooled by the host kernels (tierps.client.pooling); a
batch on a torch device is pooled there (tierps.client.device_pooling)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tierps.client.formats import COO, Bags, array_device, batch_arrays, float_array, to_bags
from tierps.client.pooling import (
    Combiner,
    PoolingLayout,
    distinct_keys,
    pool,
    stacked_pooling_layout,
    unpool,
)
from tierps.core.errors import InvalidArgumentError

if TYPE_CHECKING:  # torch is imported only by a call that pools on a torch device
    import torch

    from tierps.client.device_pooling import FeatureSpec, PoolingGroup


@dataclass(frozen=True)
class RowCalls:
    """The calls a pooled lookup makes on the cluster (an EmbeddingClient's)."""

    dim: Callable[[str], int]  # a table's dim
    # lookup_unique(tables, create, out=None): rows of each table's distinct keys
    lookup_unique: Callable[..., dict[str, np.ndarray]]
    # push_unique(pushes, step): per table, distinct keys and their summed gradients
    push_unique: Callable[[dict[str, tuple[np.ndarray, np.ndarray]], int | None], int]
    # push_then_lookup(pushes, step, tables, create): a push, then a lookup that sees it
    push_then_lookup: Callable[..., dict[str, np.ndarray]]
    # spread(table): over how many shards the table's keys spread (Router.spread); its
    # distinct keys are ordered by shard, so that each shard's reply rows are one block
    spread: Callable[[str], int]


@dataclass(frozen=True)
class Feature:
    """A sparse feature: its bags are looked up in `table` and pooled with `combiner`.
    Several features may share a table (their keys are deduplicated together)."""

    name: str
    table: str
    combiner: Combiner | str = Combiner.SUM

    def __post_init__(self) -> None:
        object.__setattr__(self, "combiner", Combiner.of(self.combiner, f"feature {self.name!r}"))


# A feature's batch: dense keys [..., nnz]; (values, offsets); (values, offsets, weights);
# a COO; or Bags already checked. See tierps.client.formats.
FeatureBatch = Any


@dataclass
class _TableKeys:
    """One table's part of a call: its distinct keys >= 0 (by shard, ascending within a
    shard: RowCalls.spread) and, per feature, the index of each of its keys among them (-1
    for padding)."""

    dim: int
    unique: np.ndarray
    inverse: dict[str, np.ndarray]


@dataclass
class _TablePooling:
    """One table's stacked pooling matrix and each of its features' rows in it."""

    matrix: PoolingLayout
    rows: dict[str, slice]


class PooledLookup:
    """The pooled rows of a batch of features, and the way back: push_gradients turns the
    gradients of the outputs into one gradient per distinct key (the transpose of the
    forward's sparse product) and pushes them, one RPC per shard."""

    device: str | None = None  # None: pooled on the host, outputs are numpy arrays

    def __init__(
        self,
        calls: RowCalls,
        features: dict[str, Feature],
        tables: dict[str, _TableKeys],
        pooling: dict[str, _TablePooling],
        outputs: dict[str, np.ndarray],
    ) -> None:
        self._calls = calls
        self._features = features
        self._tables = tables
        self._pooling = pooling
        self.outputs = outputs

    @property
    def output(self) -> np.ndarray:
        """The pooled rows of the one feature of a single-table lookup_pooled."""
        if len(self.outputs) != 1:
            raise ValueError(
                f"output expected a lookup of one feature, got {len(self.outputs)} "
                f"({', '.join(self.outputs)}): use outputs[name]"
            )
        return next(iter(self.outputs.values()))

    def push_gradients(
        self, grad_outputs: np.ndarray | Mapping[str, Any], step: int | None = None
    ) -> int:
        """Push d loss / d output (an array of output's shape, or a dict feature -> array
        for several features; features left out have zero gradient). Returns the number of
        distinct keys updated. `step` as in EmbeddingClient.push_gradients."""
        return self.push_keys(self.key_gradients(grad_outputs), step)

    def push_keys(self, pushes: dict[str, tuple[np.ndarray, np.ndarray]], step: int | None) -> int:
        """The RPCs of push_gradients: the distinct keys' gradients of key_gradients, pushed
        (one call per shard). Returns the number of distinct keys updated."""
        return self._calls.push_unique(pushes, step)

    def key_gradients(self, grad_outputs: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """push_gradients up to its RPCs: per table, the distinct keys to push and their
        summed gradients (new arrays, which outlive grad_outputs), for push_keys, or to
        hold for a later push (EmbeddingClient.prepare_pooled's fetch after a push)."""
        grad_outputs = self._by_feature(grad_outputs)
        grads = {
            name: float_array(
                f"feature {name!r}",
                "grad_output",
                grad,
                self.outputs[name].shape,
                "that of the pooled output",
            )
            for name, grad in grad_outputs.items()
        }
        pushes: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for table, pooling in self._pooling.items():
            names = [name for name in pooling.rows if name in grads]
            if not names:
                continue
            keys = self._tables[table]
            if len(pooling.rows) == 1:  # the table's one feature: its gradient is the stack
                stacked = grads[names[0]].reshape(-1, keys.dim)
            else:
                stacked = np.zeros((pooling.matrix.shape[0], keys.dim), np.float32)
                for name in names:
                    stacked[pooling.rows[name]] = grads[name].reshape(-1, keys.dim)
            summed = unpool(pooling.matrix, stacked)
            if len(names) < len(pooling.rows):  # only the keys of the features given move
                touched = np.unique(np.concatenate([keys.inverse[n] for n in names]))
                touched = touched[touched >= 0]
                pushes[table] = (keys.unique[touched], summed[touched])
            else:
                pushes[table] = (keys.unique, summed)
        return pushes

    def _by_feature(self, grad_outputs: Any) -> Mapping[str, Any]:
        """The gradients as a dict feature -> gradient, of known features."""
        if not isinstance(grad_outputs, Mapping):
            if len(self.outputs) != 1:
                raise InvalidArgumentError(
                    f"push_gradients: a lookup of {len(self.outputs)} features expected a dict "
                    f"feature -> gradient, got one array"
                )
            grad_outputs = {next(iter(self.outputs)): grad_outputs}
        unknown = sorted(set(grad_outputs) - set(self.outputs))
        if unknown:
            raise InvalidArgumentError(
                f"push_gradients: features expected among {sorted(self.outputs)}, got {unknown}"
            )
        return grad_outputs


class DevicePooledLookup(PooledLookup):
    """A PooledLookup pooled on a torch device (tierps.client.device_pooling): `outputs` are
    torch tensors on `device`, and push_gradients takes their gradients there (torch tensors
    or DLPack arrays such as cupy's), runs the backward there, and copies only the gradients
    of the distinct keys to the host, for the push."""

    def __init__(
        self,
        calls: RowCalls,
        groups: list[PoolingGroup],
        outputs: dict[str, torch.Tensor],
        device: str,
    ) -> None:
        self._calls = calls
        self._groups = groups
        self.outputs = outputs  # type: ignore[assignment]
        self.device = device

    def push_gradients(self, grad_outputs: Any, step: int | None = None) -> int:
        """Push d loss / d output (a tensor of output's shape on `device`, or a dict feature
        -> tensor; features left out have zero gradient), as PooledLookup.push_gradients."""
        return self.push_keys(self.key_gradients(grad_outputs), step)

    def key_gradients(self, grad_outputs: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The backward on the device, and the distinct keys' gradients copied to the host
        (a sync), checked: PooledLookup.key_gradients."""
        import torch

        from tierps.client.device_pooling import checked_gradient, refuse_gradient

        given = self._by_feature(grad_outputs)
        grads, bad = {}, []
        for name, grad in given.items():
            where, shape = f"feature {name!r}", tuple(self.outputs[name].shape)
            grads[name], finite = checked_gradient(where, grad, torch.device(self.device), shape)
            if finite is not None:
                bad.append((name, finite))
        pushes: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for group in self._groups:
            pushes.update(group.host_gradients(grads))  # syncs: the flags below are ready
        for name, flag in bad:
            if bool(flag):
                refuse_gradient(f"feature {name!r}", given[name], tuple(self.outputs[name].shape))
        return pushes


@dataclass
class PreparedHost:
    """A lookup_pooled_features of a batch on the host up to its RPCs (prepare):
    fetch(create) looks the distinct keys up and pools them."""

    calls: RowCalls
    features: dict[str, Feature]
    tables: dict[str, _TableKeys]
    pooling: dict[str, _TablePooling]
    shapes: dict[str, tuple[int, ...]]  # each feature's bag shape (its output's, less dim)

    def fetch(
        self, create: bool, after: tuple[dict[str, Any], int | None] | None = None
    ) -> PooledLookup:
        """The lookup, pooled. after: (pushes, step) of a push (key_gradients') to apply
        first, with the lookup seeing it (PushThenLookup.push_then_lookup: its failure is
        PushNotApplied)."""
        tables = {name: (keys.dim, keys.unique) for name, keys in self.tables.items()}
        if after is None:
            rows = self.calls.lookup_unique(tables, create)
        else:
            rows = self.calls.push_then_lookup(*after, tables, create)
        outputs = {}
        for table, pooling in self.pooling.items():
            dim = self.tables[table].dim
            pooled = pool(pooling.matrix, rows[table])  # every feature of the table
            for name, span in pooling.rows.items():
                outputs[name] = pooled[span].reshape(*self.shapes[name], dim)
        outputs = {name: outputs[name] for name in self.features}  # in the features' order
        return PooledLookup(self.calls, self.features, self.tables, self.pooling, outputs)


@dataclass
class PreparedDevice:
    """A lookup_pooled_features on a torch device, checked for its features: fetch(create)
    does the rest (its layout on the device and the copies of its rows there sync with the
    device, so they stay with the fetch, on the thread that makes it)."""

    calls: RowCalls
    device: str
    specs: list[FeatureSpec]
    include_last_offset: bool

    def fetch(self, create: bool) -> DevicePooledLookup:
        """Check, dedup and lay out the batch on the device, look the distinct keys up, copy
        their rows to the device once per group of tables of one dim, and pool them there."""
        from tierps.client.device_pooling import host_buffer, plan, torch_device

        on = torch_device(self.device)
        groups = plan(on, self.specs, self.calls.dim, self.include_last_offset)
        tables: dict[str, tuple[int, np.ndarray]] = {}
        out, buffers = {}, []
        for group in groups:
            buffer = host_buffer((group.num_unique + 1, group.dim), on)
            rows = buffer.numpy()
            rows[-1] = 0.0  # the zero row that padding entries point at
            for table, (lo, hi) in group.spans.items():
                tables[table], out[table] = (group.dim, group.unique[table]), rows[lo:hi]
            buffers.append(buffer)
        self.calls.lookup_unique(tables, create, out)  # the shards' replies land in the buffers
        outputs: dict[str, torch.Tensor] = {}
        for group, buffer in zip(groups, buffers, strict=True):
            outputs.update(group.forward(buffer.to(on, non_blocking=True)))
        outputs = {spec.name: outputs[spec.name] for spec in self.specs}
        return DevicePooledLookup(self.calls, groups, outputs, str(on))


# A pooled lookup up to its RPCs; its fetch(create) makes them and pools.
PreparedPooling = PreparedHost | PreparedDevice


def prepare(
    calls: RowCalls,
    batch: Mapping[str, FeatureBatch],
    features: Sequence[Feature],
    include_last_offset: bool,
    device: str | torch.device | None,
) -> PreparedPooling:
    """EmbeddingClient.prepare_pooled: the checks, the dedup, the routing's inputs and the
    pooling layout of a lookup_pooled_features, on the device pooling_device picks."""
    by_name = {feature.name: feature for feature in features}
    if len(by_name) != len(features):
        repeated = sorted({f.name for f in features if sum(g.name == f.name for g in features) > 1})
        raise InvalidArgumentError(f"features expected distinct names, got {repeated} repeated")
    if by_name.keys() != batch.keys():
        missing = sorted(set(by_name) - set(batch))
        unknown = sorted(set(batch) - set(by_name))
        raise InvalidArgumentError(
            f"batch expected exactly the features {sorted(by_name)}, got "
            f"{sorted(batch)} (missing {missing}, unknown {unknown})"
        )
    on = pooling_device({f"feature {name!r}": batch[name] for name in by_name}, device)
    if on is not None:
        specs = [
            feature_spec(name, f"feature {name!r}", batch[name], f.table, f.combiner)
            for name, f in by_name.items()
        ]
        return PreparedDevice(calls, on, specs, include_last_offset)
    bags = {
        name: _as_bags(f"feature {name!r}", batch[name], include_last_offset) for name in by_name
    }
    names_of: dict[str, list[str]] = {}  # each table's features, in the features' order
    for feature in features:
        names_of.setdefault(feature.table, []).append(feature.name)
    tables: dict[str, _TableKeys] = {}
    pooling: dict[str, _TablePooling] = {}
    for table, names in names_of.items():
        shards = calls.spread(table)
        if len(names) == 1:  # a table of one feature (the usual): nothing to join or cut
            unique, inverse = distinct_keys(bags[names[0]].keys, shards=shards)
            inverses = {names[0]: inverse}
            spans = {names[0]: slice(0, bags[names[0]].num_bags)}
        else:
            joined = np.concatenate([bags[n].keys for n in names])
            unique, inverse = distinct_keys(joined, shards=shards)
            key_bounds = [0, *itertools.accumulate(bags[n].keys.size for n in names)]
            bag_bounds = [0, *itertools.accumulate(bags[n].num_bags for n in names)]
            inverses, spans = {}, {}
            for i, name in enumerate(names):
                inverses[name] = inverse[key_bounds[i] : key_bounds[i + 1]]
                spans[name] = slice(bag_bounds[i], bag_bounds[i + 1])
        tables[table] = _TableKeys(calls.dim(table), unique, inverses)
        parts = [(bags[n], inverses[n], by_name[n].combiner) for n in names]
        pooling[table] = _TablePooling(stacked_pooling_layout(parts, unique.size), spans)
    shapes = {name: bags[name].shape for name in by_name}
    return PreparedHost(calls, by_name, tables, pooling, shapes)


def feature_spec(name: str, where: str, value: Any, table: str, combiner: Any) -> FeatureSpec:
    """A feature of a batch to pool on a torch device, as device_pooling.plan takes it."""
    from tierps.client.device_pooling import FeatureSpec

    return FeatureSpec(name, where, value, table, Combiner.of(combiner, where))


def pooling_device(
    batches: Mapping[str, FeatureBatch], device: str | torch.device | None
) -> str | None:
    """The torch device a call pools on: `device` when given (its arrays are checked where
    they are read); else None (the host kernels) when every array of the batches (given by
    their name in messages) is on the host, or the one GPU where all of them are."""
    if device is not None:
        return str(device)
    first: tuple[str, str, str] | None = None  # where, field, device of the first array
    for where, value in batches.items():
        for field, array in batch_arrays(value):
            found = array_device(array)
            if first is None:
                first = (where, field, found)
            elif found != first[2]:
                raise InvalidArgumentError(
                    f"{where}: field {field!r} expected an array on {first[2]}, as {first[0]} "
                    f"field {first[1]!r} is (a call pools on one device), got one on {found}"
                )
    return None if first is None or first[2] == "cpu" else first[2]


def _as_bags(where: str, value: FeatureBatch, include_last_offset: bool) -> Bags:
    if isinstance(value, Bags):
        return value
    if isinstance(value, tuple) and not isinstance(value, COO):
        if len(value) not in (2, 3):
            raise InvalidArgumentError(
                f"{where}: a tuple batch expected (values, offsets) or (values, offsets, "
                f"per_sample_weights), got {len(value)} items"
            )
        return to_bags(where, *value, include_last_offset=include_last_offset)
    return to_bags(where, value)
