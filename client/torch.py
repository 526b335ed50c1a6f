"""PyTorch modules over an EmbeddingClient (needs the `torch` extra).

`EmbeddingBag` follows torch.nn.EmbeddingBag's forward signature; `EmbeddingBagCollection`
pools many features at once, like torchrec's. Their tables live on the shards: forward
looks the bags up and pools them (one RPC per shard for every feature), and backward pushes
the gradients of the distinct keys, on which the shards run each table's optimizer: the
backward and the optimizer step are one fused call, as in fbgemm's table-batched
embeddings. The dense part of the model trains with any torch optimizer; the embeddings
need none.

In eval mode, or under torch.no_grad(), lookups create no rows and nothing is pushed.

The plain loop (forward, backward, the optimizers' steps, the next batch): at staleness 0,
backward returns with the push of a batch on the host held in the module, and the next
forward sends it with its own lookup as one call per shard (PushThenLookup: the shard
applies the push, then serves the lookup), so a step costs one RPC per shard and sees every
earlier push, bit for bit the synchronous loop. Any other call of the module (prefetch,
flush, close) sends a held push first, and so does any call of the client on the push's
tables (a lookup, a push, describe, a snapshot: tierps.client.in_flight), another module's
lookup of a shared table among them; a push no call follows is sent by the module's
finalizer, or at interpreter exit. A failed push is raised by the module's next call, once,
naming the backward and tables it came from. A batch on a GPU pushes at backward. So
backward's return is not the push's acknowledgement: `flush()` is (it returns once every push
is applied, or raises); a process killed before that loses the held push.

Pipelining: `module.pipeline(loader)` yields the loader's batches and looks each next batch
up in a background thread while the current one trains, so the trainer and the shards work
at once. `staleness` says what that lookup may miss:

- 0 (the default): nothing. The next batch's lookup is prepared before the step; backward
  sends its push with that lookup at once, in the background, overlapping the rest of the
  step (the dense optimizer, data loading). Training is exactly the synchronous one, bit
  for bit.
- 1: the lookup of step t + 1 starts before step t's push is applied, so it misses that one
  update of the keys both batches share (it sees every earlier push); backward hands its
  push to the background thread and returns at once. Pushes run in order; a failed one is
  raised by the module's next call (forward, prefetch, flush, close), once. Under
  pipeline(), the push of a batch on the host waits in the module for the prefetch that
  pipeline() makes next, and the two go as one call per shard (PushThenLookup: the shard
  applies the push, then serves the lookup), so a step costs one RPC per shard, not two;
  the order is the same, and so is every row. Any other call of the module sends a waiting
  push first, alone.

The work is split where the GIL is: for a batch on the host, the trainer's thread prepares
each prefetched lookup (checks, dedup, pooling layout) and computes each push's per-key
gradients, and the background thread only makes the RPCs (which release the GIL) and pools
the rows; a batch on a GPU is looked up and pushed whole in the background, as its layout
and gradients sync with the device.

`flush()` sends a held push, waits for the pushes in flight and raises a failure of one;
`close()` (or leaving a `with module:` block) also stops the background thread, which a
later call restarts.

A table is pipelined by one module at a time (per client): each module orders its own
lookups after its own pushes, so two modules pipelining one table would each miss the
other's pushes. Features that share a table belong in one EmbeddingBagCollection; a second
module's training prefetch of a table another live module pipelines is refused.

On a CUDA model: given a batch on a GPU (CUDA tensors or cupy arrays), the modules pool it
there (tierps.client.device_pooling) and return tensors on that device; backward runs there
too and sends only the distinct keys' gradients to the host for the push. Given a batch on
the host, they pool on the host and return CPU tensors, as before. `device` pins the device
to pool on instead.
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace, TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch import nn

from tierps.client.embedding import EmbeddingClient
from tierps.client.group_protocol import KeyGradients, PushGroup
from tierps.client.in_flight import mark_sender_thread
from tierps.client.initial_rows import InitialRows
from tierps.client.pooled_lookup import (
    Feature,
    FeatureBatch,
    PooledLookup,
    PreparedHost,
    PreparedPooling,
)
from tierps.client.pooling import Combiner
from tierps.client.push_then_lookup import PushNotApplied
from tierps.core import init, optim
from tierps.core.config import TableConfig

if TYPE_CHECKING:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedTensor

# embedding_bag_configs()' num_embeddings of a hashed table, which takes any key >= 0: the
# largest int64 (the key count, 2**63, does not fit the int64 TorchRec may store it in).
HASHED_NUM_EMBEDDINGS = 2**63 - 1
MAX_PREFETCHED = 4  # prefetched batches kept for their forward; older ones are dropped
STALENESS = (0, 1)  # the schedules a module offers (see the module docstring)

Item = TypeVar("Item")


def _outputs(pooled: PooledLookup, names: list[str]) -> tuple[torch.Tensor, ...]:
    """The outputs as tensors: a host lookup's numpy arrays without a copy; a device
    lookup's are views of one pooled block, copied apart (B x dim each) so that, as with
    torch's own modules, an in-place op on one output (relu_, +=) neither hits a view made
    inside a Function nor moves the version counter autograd checks on the others."""
    if pooled.device is None:
        return tuple(torch.from_numpy(pooled.outputs[name]) for name in names)
    return tuple(pooled.outputs[name].clone() for name in names)


class _Pooled(torch.autograd.Function):
    """Outputs of a PooledLookup as tensors; backward hands all their gradients to `push`
    (the module's: now, or in its background thread) at once."""

    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        pooled: PooledLookup,
        names: list[str],
        push: Callable[[PooledLookup, dict[str, Any]], None],
    ) -> Any:
        ctx.pooled, ctx.names, ctx.push = pooled, names, push
        return _outputs(pooled, names)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.push(ctx.pooled, dict(zip(ctx.names, grads, strict=True)))
        return None, None, None, None


@dataclass
class _Prefetch:
    """A batch looked up ahead of its forward. `key` holds the objects forward is given
    (matched by identity); `prepared` is its lookup up to the RPCs, or the error preparing
    it raised (raised again by its forward); `pushes` counts the module's pushes the lookup
    follows (None: deferred to the next push, staleness 0); `future` is None while
    deferred."""

    key: tuple[Any, ...]
    prepared: PreparedPooling | Exception
    create: bool
    pushes: int | None
    stream: Any  # the caller's CUDA stream, or None
    future: Future[PooledLookup] | None = None


def _stop(worker: ThreadPoolExecutor, held: list[Any], client: EmbeddingClient) -> None:
    """The finalizer of a module dropped unclosed (it holds no reference to the module):
    its held push (held[0], see EmbeddingBagCollection._held) is sent after the queued
    ones, which still run, then the thread ends. (At interpreter exit a live module's
    held push was sent before: _apply_pushes_at_exit.)"""
    if held[0] is not None:
        (pushes, step), held[0] = held[0], None
        try:
            worker.submit(client.push_unique, pushes, step)
        except RuntimeError as error:  # the thread pools are shut: say so, never silent
            sys.stderr.write(
                f"tierps: a held push of tables {sorted(pushes)} was not applied: {error}\n"
            )
    worker.shutdown(wait=False)


# The modules that held a push (pipeline()) or handed one to their background thread at
# staleness 0, for _apply_pushes_at_exit.
_PUSHING: weakref.WeakSet[Any] = weakref.WeakSet()


def _apply_pushes_at_exit() -> None:
    """At interpreter exit, before the thread pools shut (threading's exit hooks run the
    last registered first; concurrent.futures registered its own before this module):
    each live module's held push is sent (a pipeline left suspended) and its pushes in
    flight are waited for; a failure is written to stderr, as no call of the module will
    raise it."""
    for module in list(_PUSHING):
        module.wait_for_pushes()
        with module._failure_lock:
            failure = module._failure
        if failure is not None:
            sys.stderr.write(f"tierps: a push was not applied at exit: {failure}\n")


threading._register_atexit(_apply_pushes_at_exit)  # the hook concurrent.futures uses


# Which live module pipelines each table, per client (see the module docstring).
_PIPELINED: weakref.WeakKeyDictionary[EmbeddingClient, weakref.WeakValueDictionary[str, Any]] = (
    weakref.WeakKeyDictionary()
)
_PIPELINED_LOCK = threading.Lock()


@functools.cache
def _torchrec() -> SimpleNamespace | None:
    """The TorchRec classes this module uses, or None where torchrec is not installed.
    Imported on first use (a KeyedJaggedTensor batch, a TorchRec config), so that neither
    `import tierps.client` nor this module imports it; a torchrec that is installed but
    fails to import raises."""
    try:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.sparse.jagged_tensor import KeyedTensor
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] == "torchrec":
            return None
        raise
    return SimpleNamespace(
        KeyedTensor=KeyedTensor,
        EmbeddingBagConfig=EmbeddingBagConfig,
        PoolingType=PoolingType,
    )


def _require_torchrec(what: str) -> SimpleNamespace:
    torchrec = _torchrec()
    if torchrec is None:
        raise ImportError(
            f"EmbeddingBagCollection.{what} expected torchrec to be installed, but it is not "
            f"(pip install --no-deps torchrec fbgemm-gpu-cpu; see .ci/run for the pins)"
        )
    return torchrec


# TorchRec's pooling (PoolingType's value) <-> tierps' combiner; TorchRec has no sqrtn.
_COMBINER_OF_POOLING = {"SUM": Combiner.SUM, "MEAN": Combiner.MEAN}
_POOLING_OF_COMBINER = {combiner: pooling for pooling, combiner in _COMBINER_OF_POOLING.items()}


def jagged_features(
    batch: Mapping[str, FeatureBatch] | Any, include_last_offset: bool = False
) -> Mapping[str, FeatureBatch]:
    """A batch as a dict feature name -> (values, offsets[, per_sample_weights]): a dict as
    it is; a torchrec KeyedJaggedTensor read through its public methods (keys(), values(),
    offsets() - computed from its lengths when it was made with those -, stride(),
    weights_or_none()), without importing torchrec. Its layout is key-major: the stride()
    bags of keys()[0], then those of keys()[1], ... Each key's offsets are given in the form
    the module reads (include_last_offset: B + 1 of them). Variable batch sizes per key are
    refused."""
    if isinstance(batch, Mapping):
        return batch
    methods = ("keys", "values", "offsets", "stride", "weights_or_none")
    missing = [name for name in methods if not callable(getattr(batch, name, None))]
    if missing:
        raise TypeError(
            f"EmbeddingBagCollection: a batch expected a dict feature name -> bags, or a "
            f"torchrec KeyedJaggedTensor; got {type(batch).__name__} (without {missing})"
        )
    variable = getattr(batch, "variable_stride_per_key", None)
    if callable(variable) and variable():
        raise ValueError(
            "EmbeddingBagCollection: a KeyedJaggedTensor expected one batch size for every "
            "key, got variable strides per key (stride_per_key)"
        )
    keys, values, offsets = list(batch.keys()), batch.values(), batch.offsets()
    weights, stride = batch.weights_or_none(), int(batch.stride())
    if len(offsets) != len(keys) * stride + 1:
        raise ValueError(
            f"EmbeddingBagCollection: a KeyedJaggedTensor of {len(keys)} keys x stride "
            f"{stride} expected {len(keys) * stride + 1} offsets, got {len(offsets)}"
        )
    bounds = [int(b) for b in offsets[::stride][: len(keys) + 1]]  # one sync, not per key
    features: dict[str, FeatureBatch] = {}
    for index, key in enumerate(keys):
        start, end = bounds[index], bounds[index + 1]
        bags = offsets[index * stride : (index + 1) * stride + include_last_offset] - start
        part = (values[start:end], bags)
        features[key] = part if weights is None else (*part, weights[start:end])
    return features


class KeyedPooled:
    """Pooled rows of several features in torchrec's KeyedTensor conventions, the output of
    a KeyedJaggedTensor batch where torchrec is not installed (where it is, the output is
    torchrec's own KeyedTensor): values() is one tensor [B, sum of the features' dims], the
    features side by side in keys() order; to_dict() (and [key]) give each feature's
    [B, dim] slice of it. KeyedTensor's other methods (regroup, to, record_stream, ...) are
    torchrec's alone."""

    def __init__(self, keys: list[str], outputs: list[torch.Tensor]) -> None:
        self._keys = list(keys)
        self._length_per_key = [int(output.shape[1]) for output in outputs]
        self._values = torch.cat(outputs, dim=1) if outputs else torch.empty(0, 0)

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return 1

    def length_per_key(self) -> list[int]:
        return list(self._length_per_key)

    def offset_per_key(self) -> list[int]:
        return [0, *itertools.accumulate(self._length_per_key)]

    def to_dict(self) -> dict[str, torch.Tensor]:
        parts = torch.split(self._values, self._length_per_key, dim=1)
        return dict(zip(self._keys, parts, strict=True))

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.to_dict()[key]

    def __repr__(self) -> str:
        shape = tuple(self._values.shape)
        return f"KeyedPooled(keys={self._keys}, dims={self._length_per_key}, values {shape})"


def _keyed(keys: list[str], outputs: list[torch.Tensor]) -> KeyedTensor | KeyedPooled:
    """The outputs side by side as torchrec's KeyedTensor, or a KeyedPooled where torchrec
    is not installed."""
    torchrec = _torchrec()
    if torchrec is None:
        return KeyedPooled(keys, outputs)
    values = torch.cat(outputs, dim=1) if outputs else torch.empty(0, 0)
    lengths = [int(output.shape[1]) for output in outputs]
    return torchrec.KeyedTensor(keys=list(keys), length_per_key=lengths, values=values)


class EmbeddingBagCollection(nn.Module):
    """Pooled embeddings of several features, each bound to a table of the cluster.

    forward(batch) takes a dict feature name -> that feature's bags (a dense -1-padded
    tensor [..., nnz], (values, offsets), (values, offsets, per_sample_weights), or a COO;
    tensors or numpy arrays) and returns a dict feature name -> pooled tensor; or a torchrec
    KeyedJaggedTensor, and then returns torchrec's KeyedTensor of the features, in
    `features` order (a KeyedPooled, its conventions, where torchrec is not installed).

    A drop-in for torchrec.EmbeddingBagCollection: from_torchrec(client, tables, ...) makes
    the module, and its tables on the cluster, from TorchRec's EmbeddingBagConfigs, and
    embedding_bag_configs() describes its tables as those, so that TorchRec's models (DLRM,
    SparseArch) take it in place of theirs. torchrec stays optional: it is imported on first
    use, never by `import tierps.client`.

    staleness: 0 (synchronous, the default: a lookup sees every earlier push) or 1 (a
    prefetched lookup may miss the one push before it); see the module docstring.
    pipeline(loader) yields the loader's batches, each next one prefetched; prefetch(batch)
    starts the lookup of a later batch, which the forward of that same batch object then
    uses (a lookup older than `staleness` pushes at its forward is made again). flush()
    sends a held push and waits for background pushes; close() also stops the background
    thread. A TrainerGroup pushes for it through the methods of
    tierps.client.group_protocol.GroupMember (join_group, wait_for_pushes, ...).

    A batch on a GPU is pooled there and gives tensors there; one on the host gives CPU
    tensors. `device` ("cuda:0", "cpu"; None: where the batch is) pools on that torch
    device, whose arrays the batch must be on (host arrays count as "cpu").
    """

    def __init__(
        self,
        client: EmbeddingClient,
        features: Sequence[Feature],
        *,
        include_last_offset: bool = False,
        device: str | torch.device | None = None,
        staleness: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(staleness, bool) or staleness not in STALENESS:
            raise ValueError(
                f"EmbeddingBagCollection: staleness expected 0 (synchronous) or 1 (a lookup "
                f"may miss the previous step's push), got {staleness!r}"
            )
        self.client = client
        self.features = list(features)
        self.include_last_offset = include_last_offset
        self.device = device
        self.staleness = staleness
        for feature in self.features:
            client.table_config(feature.table)  # an unknown table fails here, not mid-step
        self._names = [feature.name for feature in self.features]
        # A KeyedTensor's keys as TorchRec orders them: by table (in the order the features
        # first name them), then the table's features; the features' order where no two
        # tables interleave
        tables = list(dict.fromkeys(feature.table for feature in self.features))
        self._keyed_names = [
            feature.name for table in tables for feature in self.features if feature.table == table
        ]
        # The background thread, started by the first task: the prefetched lookups and
        # (staleness 1) the pushes, in the order given, so that a lookup sees exactly the
        # pushes handed over before it.
        self._worker: ThreadPoolExecutor | None = None
        self._finalizer: weakref.finalize | None = None
        self._prefetched: list[_Prefetch] = []  # oldest first
        self._pushes = 0  # pushes of this module so far (handed to the thread or done)
        self._last_push: Future[None] | None = None  # the latest background push
        self._failure: BaseException | None = None  # of a background push, not yet raised
        self._failure_lock = threading.Lock()
        # the group (a TrainerGroup, tierps.client.distributed) that steps and pushes with
        # other ranks: see join_group
        self._group: PushGroup | None = None
        # Staleness 0 (no lookup deferred to the push), and staleness 1 under pipeline():
        # backward's push of a host batch waits here for the module's next lookup (its
        # forward, or the prefetch pipeline() makes), and goes with it as one call per shard
        # (PushThenLookup.push_then_lookup); any other call of the module sends it first.
        self._hold_pushes = False  # set by pipeline() while a prefetch follows the step
        # (pushes, step) of the held push, or None: in a list the finalizer shares (_stop),
        # so that a module dropped unclosed still sends it
        self._held_slot: list[tuple[dict[str, Any], int | None] | None] = [None]

    @property
    def _held(self) -> tuple[dict[str, Any], int | None] | None:
        return self._held_slot[0]

    @_held.setter
    def _held(self, held: tuple[dict[str, Any], int | None] | None) -> None:
        self._held_slot[0] = held

    # -- TorchRec's configs --------------------------------------------------------------------

    @classmethod
    def from_torchrec(
        cls,
        client: EmbeddingClient,
        tables: Sequence[EmbeddingBagConfig],
        *,
        optimizer: optim.Optimizer,
        initializer: init.Initializer | None = None,
        initial: Mapping[str, InitialRows | torch.Tensor | np.ndarray] | None = None,
        table_options: Mapping[str, Any] | None = None,
        include_last_offset: bool = False,
        device: str | torch.device | None = None,
        staleness: int = 0,
    ) -> EmbeddingBagCollection:
        """The module of TorchRec's EmbeddingBagCollection(tables=tables), its tables made on
        the cluster: one tierps table per config (its name and embedding_dim; created if
        missing, kept if there with the same config), one feature per name of its
        feature_names (the table's name where none, as TorchRec does), pooled as its pooling
        says (SUM or MEAN).

        optimizer: every table's (the shards apply it at backward). initializer: every
        table's; None gives each table TorchRec's default, uniform in [weight_init_min,
        weight_init_max] (+-sqrt(1 / num_embeddings) where not set; a config's init_fn is
        not read). initial: table name -> its first rows, (keys, values) or a file as
        EmbeddingClient.create_table takes, or a matrix [n, dim] whose row i is key i's (a
        TorchRec table's weight). table_options: more TableConfig fields for every table
        (host_cache_bytes, use_hashtable, ...). The other arguments are the constructor's.

        The tables are hashed (unless table_options say otherwise): they take any key >= 0,
        not only those below num_embeddings."""
        given = list(tables)
        rows = dict(initial or {})
        names = [config.name for config in given]
        unknown = sorted(set(rows) - set(names))
        if unknown:
            raise ValueError(
                f"EmbeddingBagCollection.from_torchrec: initial expected rows of the tables "
                f"{names}, got rows of {unknown} too"
            )
        features: list[Feature] = []
        table_of: dict[str, str] = {}
        made: list[tuple[TableConfig, Any]] = []
        for config in given:
            where = f"EmbeddingBagCollection.from_torchrec: table {config.name!r}"
            pooling, data_type = _enum_value(config.pooling), _enum_value(config.data_type)
            if pooling not in _COMBINER_OF_POOLING:
                raise ValueError(
                    f"{where}: pooling expected PoolingType.SUM or PoolingType.MEAN, got "
                    f"PoolingType.{pooling} (unpooled rows are TorchRec's EmbeddingCollection, "
                    f"not this module)"
                )
            if data_type != "FP32":
                raise ValueError(
                    f"{where}: data_type expected DataType.FP32 (tierps trains float32 rows), "
                    f"got DataType.{data_type}"
                )
            for name in config.feature_names or [config.name]:
                if name in table_of:
                    raise ValueError(
                        f"{where}: feature {name!r} expected in one table, got it in "
                        f"{table_of[name]!r} too (tierps names a feature's output by the "
                        f"feature alone)"
                    )
                table_of[name] = config.name
                features.append(Feature(name, config.name, _COMBINER_OF_POOLING[pooling]))
            table_init = initializer
            if table_init is None:
                low, high = config.get_weight_init_min(), config.get_weight_init_max()
                table_init = init.Uniform(low, high)
            table = TableConfig(
                config.name,
                config.embedding_dim,
                initializer=table_init,
                optimizer=optimizer,
                **dict(table_options or {}),
            )
            made.append((table, _initial_rows(rows.get(config.name))))
        for table, first_rows in made:  # every config checked before any table is made
            client.create_table(table, initial=first_rows)
        return cls(
            client,
            features,
            include_last_offset=include_last_offset,
            device=device,
            staleness=staleness,
        )

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The module's tables as TorchRec's EmbeddingBagConfigs, as TorchRec's models read
        them: one per table, in the order `features` first names them, with its name and
        embedding_dim, its features' names (feature_names) and their pooling (SUM or MEAN).
        num_embeddings: a table of use_hashtable=False, its capacity; a hashed table takes
        any key >= 0, so HASHED_NUM_EMBEDDINGS (the largest int64). A table whose features
        pool with sqrtn, or with different combiners, has no config and is refused."""
        torchrec = _require_torchrec("embedding_bag_configs()")
        by_table: dict[str, list[Feature]] = {}
        for feature in self.features:
            by_table.setdefault(feature.table, []).append(feature)
        configs = []
        for table, features in by_table.items():
            combiners = sorted({str(feature.combiner) for feature in features})
            pooling = _POOLING_OF_COMBINER.get(features[0].combiner)
            if len(combiners) > 1 or pooling is None:
                named = {feature.name: str(feature.combiner) for feature in features}
                raise ValueError(
                    f"EmbeddingBagCollection.embedding_bag_configs(): table {table!r} expected "
                    f"its features to pool with one combiner, sum or mean (TorchRec's "
                    f"PoolingType.SUM / MEAN), got {named}"
                )
            config = self.client.table_config(table)
            hashed = config.use_hashtable
            configs.append(
                torchrec.EmbeddingBagConfig(
                    num_embeddings=HASHED_NUM_EMBEDDINGS if hashed else config.capacity,
                    embedding_dim=config.dim,
                    name=table,
                    feature_names=[feature.name for feature in features],
                    pooling=torchrec.PoolingType(pooling),
                )
            )
        return configs

    # -- the background thread ---------------------------------------------------------------

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._started_worker().submit(fn, *args)

    def _started_worker(self) -> ThreadPoolExecutor:
        """The background thread's pool, started (with its finalizer) if it is not."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(
                1, thread_name_prefix="tierps-pipeline", initializer=mark_sender_thread
            )
            self._finalizer = weakref.finalize(
                self, _stop, self._worker, self._held_slot, self.client
            )
        return self._worker

    def _submit_lookup(self, entry: _Prefetch) -> None:
        """Start entry's lookup in the background, after every push made so far."""
        entry.pushes = self._pushes
        if isinstance(entry.prepared, Exception):
            entry.future = Future()
            entry.future.set_exception(entry.prepared)
        else:
            entry.future = self._submit(_fetch_on, entry.prepared, entry.create, entry.stream)

    def _send_held(self) -> None:
        """Hand a held push to the background thread, alone."""
        held, self._held = self._held, None
        self._send_alone(held)

    def _send_alone(self, held: tuple[dict[str, Any], int | None] | None) -> None:
        """Apply `held` ((pushes, step), taken from _held; None: nothing) as a push alone,
        here, after the pushes in flight (every caller waits for it next, and no background
        thread is started for it); its failure is kept for the module's next call, as a
        background push's is."""
        if held is None:
            return
        pushes, step = held
        if self._last_push is not None:
            wait_for([self._last_push])
        try:
            self.client.push_unique(pushes, step)
        except Exception as error:  # noqa: BLE001 - kept for the module's next call
            self._keep_failure(error, self._push_named(pushes, step, self._pushes))

    def _push_then_fetch(
        self, push: tuple[KeyGradients, int | None], entry: _Prefetch, what: str
    ) -> PooledLookup:
        """A push, then entry's lookup, as one call per shard (in the background thread).
        A failed push is kept for the module's next call, as a push alone, and fails the
        lookup too."""
        assert isinstance(entry.prepared, PreparedHost)
        try:
            return entry.prepared.fetch(entry.create, push)
        except PushNotApplied as failed:
            self._keep_failure(failed.error, what)
            raise failed.error from None

    @property
    def push_failed(self) -> bool:
        """Whether a background push failed and its failure is not raised yet."""
        with self._failure_lock:
            return self._failure is not None

    def raise_push_failure(self) -> None:
        """Raise a background push's failure, once; prefetched lookups are dropped with it
        (they were made around a push that did not happen)."""
        with self._failure_lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            self._prefetched.clear()
            raise failure

    def wait_for_pushes(self) -> None:
        """Wait until the pushes in flight are done (a held push sent first), without
        raising a failure: the module's next call (or raise_push_failure) raises it."""
        self._send_held()
        if self._last_push is not None:
            wait_for([self._last_push])

    def flush(self) -> None:
        """Send a held push, wait until every push of this module is applied, and raise
        the failure of one that was sent after its backward had returned (once)."""
        self.wait_for_pushes()
        self.raise_push_failure()

    @property
    def group(self) -> PushGroup | None:
        """The group (a TrainerGroup) this module pushes with, or None: it pushes alone."""
        return self._group

    def join_group(self, group: PushGroup, *, staleness: int) -> None:
        """Push with `group` from now on (called by TrainerGroup, which checks that the
        module is in no other group): this module's pushes so far are applied first, then
        its pushes carry group.step, and in sync mode backward hands them to the group."""
        self.flush()
        self.staleness = staleness
        self._group = group

    def _claim_tables(self) -> None:
        """Make this module the one that pipelines its tables on its client, or refuse."""
        tables = {feature.table for feature in self.features}
        with _PIPELINED_LOCK:
            owners = _PIPELINED.setdefault(self.client, weakref.WeakValueDictionary())
            for table in sorted(tables):
                owner = owners.get(table)
                if owner is not None and owner is not self:
                    raise ValueError(
                        f"table {table!r}: expected one module to pipeline it per client, "
                        f"but another live module ({type(owner).__name__} of features "
                        f"{[f.name for f in owner.features]}) already prefetches it; put "
                        f"the features sharing a table in one EmbeddingBagCollection, or "
                        f"close() the other module first"
                    )
            for table in tables:
                owners[table] = self

    def _release_tables(self) -> None:
        with _PIPELINED_LOCK:
            owners = _PIPELINED.get(self.client)
            for feature in self.features if owners is not None else ():
                if owners.get(feature.table) is self:
                    del owners[feature.table]

    def close(self) -> None:
        """flush(), then stop the background thread (prefetched lookups are dropped). The
        module stays usable: a later prefetch or background push starts a new thread."""
        self._release_tables()
        self._send_held()
        worker, finalizer = self._worker, self._finalizer
        self._worker = self._finalizer = None
        self._prefetched.clear()
        if worker is not None and finalizer is not None:
            finalizer.detach()
            worker.shutdown(wait=True)  # runs what is queued, then joins the thread
        self._last_push = None
        self.raise_push_failure()

    def __enter__(self) -> EmbeddingBagCollection:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except Exception:
            if exc is None:
                raise  # else the error already leaving the block is the one to see

    # -- pushes ------------------------------------------------------------------------------

    def _push(self, pooled: PooledLookup, grads: dict[str, torch.Tensor]) -> None:
        """backward's push. A host lookup's per-key gradients are computed here (new arrays;
        a bad gradient is refused here), then the push is held for the module's next lookup
        (staleness 0; staleness 1 under pipeline()), or sent at once with the lookup
        deferred to it (staleness 0 under pipeline()), or handed to the background thread
        (staleness 1). A device lookup's push is applied here at staleness 0 (its gradients
        sync with the device), and done in the background at staleness 1 (its gradients
        copied: autograd may reuse their buffers); a group's push in sync mode is applied
        here. Then the lookups deferred to it start."""
        self._send_held()
        group = self._group
        step = None if group is None else group.step  # a group's pushes carry the job's step
        holds = self.staleness == 0 or self._hold_pushes
        if group is None and holds and pooled.device is None:
            self._hold_or_send(pooled.key_gradients(_gradients(pooled, grads)), step)
        elif group is not None and group.mode == "sync":
            group.push_together(pooled.key_gradients(_gradients(pooled, grads)))
        elif self.staleness == 0:  # a device batch: its gradients sync with the device
            pooled.push_gradients(_gradients(pooled, grads), step)
        else:
            if pooled.device is None:
                pushes = pooled.key_gradients(_gradients(pooled, grads))
                send = functools.partial(pooled.push_keys, pushes)
            else:
                given = {name: grad.detach().clone() for name, grad in grads.items()}
                send = functools.partial(pooled.push_gradients, given)
            stream = _current_stream()
            tables = {f.table for f in self.features if f.name in grads}
            what = self._push_named(tables, step, self._pushes + 1)
            self._last_push = self._submit(self._push_in_background, send, step, stream, what)
            if group is not None:
                group.track(step, self._last_push)
        self._pushes += 1
        for entry in self._prefetched:
            if entry.future is None:  # deferred to this push
                self._submit_lookup(entry)

    def _hold_or_send(self, pushes: KeyGradients, step: int | None) -> None:
        """A host batch's push that goes with a lookup as one call per shard
        (PushThenLookup: the shard applies the push, then serves the lookup): at staleness
        0, with the first lookup deferred to it (pipeline()'s prefetch of the next batch),
        in the background thread now; else held for the module's next lookup (its forward,
        or the prefetch pipeline() makes), which any other call of the module sends first,
        alone. The client's later calls on its tables have it sent and applied first
        (EmbeddingClient.push_in_flight)."""
        deferred = (entry for entry in self._prefetched if entry.future is None)
        fused = next((e for e in deferred if isinstance(e.prepared, PreparedHost)), None)
        if self.staleness == 0 and fused is not None:
            what = self._push_named(pushes, step, self._pushes + 1)
            fused.pushes = self._pushes + 1  # the push is counted: the lookup sees it
            fused.future = self._submit(self._push_then_fetch, (pushes, step), fused, what)
            self._last_push = fused.future
        else:
            self._held = (pushes, step)
            self._started_worker()  # its finalizer sends the held push if the module is dropped
        _PUSHING.add(self)  # and _apply_pushes_at_exit, if it lives at interpreter exit
        self.client.push_in_flight(pushes, self)

    def _push_named(
        self, tables: Iterable[str] | KeyGradients, step: int | None, number: int
    ) -> str:
        """How a failed background push is named: the backward of this module it came
        from, its tables, and the job's step where a group gave one."""
        job_step = "" if step is None else f", step {step}"
        return f"the push of backward {number} of this module (tables {sorted(tables)}{job_step})"

    def _push_in_background(
        self, send: Callable[[int | None], int], step: int | None, stream: Any, what: str
    ) -> None:
        try:
            with _on_stream(stream):
                send(step)
        except BaseException as error:  # noqa: BLE001 - kept for the caller's next call
            self._keep_failure(error, what)

    def _keep_failure(self, error: BaseException, what: str) -> None:
        """Keep a background push's failure for the module's next call."""
        _noted(error, what)
        with self._failure_lock:
            if self._failure is None:  # the first failure is the one to see
                self._failure = error

    # -- lookups -----------------------------------------------------------------------------

    def _trains(self) -> bool:
        """Training mode with autograd on: lookups create rows and backward pushes."""
        return self.training and torch.is_grad_enabled()

    def _prepare(self, batch: Mapping[str, FeatureBatch] | Any) -> PreparedPooling:
        """The batch's lookup up to its RPCs (EmbeddingClient.prepare_pooled); a
        KeyedJaggedTensor is read as the dict of its features (jagged_features)."""
        return self.client.prepare_pooled(
            jagged_features(batch, self.include_last_offset),
            self.features,
            self.include_last_offset,
            self.device,
        )

    def prefetch(self, batch: Mapping[str, FeatureBatch]) -> None:
        """Start looking up `batch` for a later forward(batch) of the same object. At
        staleness 0 a training lookup waits for the next push (backward) to start, so that
        it misses nothing; at staleness 1 it starts now."""
        self._prefetch((batch,), batch)

    def _prefetch(self, key: tuple[Any, ...], batch: Mapping[str, FeatureBatch]) -> None:
        held, self._held = self._held, None
        try:
            self.raise_push_failure()
            create = self._trains()  # grad mode is per thread: read it here
            if create:
                self._claim_tables()
            try:
                prepared: PreparedPooling | Exception = self._prepare(batch)
            except Exception as error:  # a bad batch: raised by its forward, as before
                prepared = error
        except BaseException:
            self._send_alone(held)
            raise
        entry = _Prefetch(key, prepared, create, None, _current_stream())
        if held is not None and isinstance(prepared, PreparedHost):
            entry.pushes = self._pushes  # the held push is counted: the lookup sees it
            what = self._push_named(held[0], held[1], self._pushes)
            entry.future = self._submit(self._push_then_fetch, held, entry, what)
            self._last_push = entry.future
        else:
            self._send_alone(held)
            if not (create and self.staleness == 0):
                self._submit_lookup(entry)
        self._prefetched = [*self._prefetched[-(MAX_PREFETCHED - 1) :], entry]

    def pipeline(
        self,
        items: Iterable[Item],
        features: Callable[[Item], Mapping[str, FeatureBatch]] | None = None,
    ) -> Iterator[Item]:
        """Yield the items in order; before yielding one, start the lookup of the next
        (prefetch(features(next item)); default: the item is the batch), so that the forward
        of features(item) finds its rows looked up. After the last item, flush(). A loop
        left early waits for the pushes in flight; their failure is raised by the next call.

            for batch in ebc.pipeline(loader, features=lambda b: b.sparse):
                loss = loss_fn(model(batch), batch.labels)  # model calls ebc(batch.sparse)
                loss.backward(); optimizer.step(); optimizer.zero_grad()

        Several modules at once: the module-level pipeline()."""
        return pipeline(items, (self, features if features is not None else _itself))

    def forward(
        self, batch: Mapping[str, FeatureBatch] | Any
    ) -> dict[str, torch.Tensor] | KeyedTensor | KeyedPooled:
        """The pooled rows of each feature of the batch: a dict feature name -> tensor for a
        dict batch; for a torchrec KeyedJaggedTensor, torchrec's KeyedTensor (keys() in the
        order of embedding_bag_configs()' tables and their features, values() [B, sum of
        dims]), as torchrec.EmbeddingBagCollection returns; a KeyedPooled, with its
        conventions, where torchrec is not installed."""
        pooled = self._forward((batch,), batch)
        if isinstance(batch, Mapping):
            return pooled
        return _keyed(self._keyed_names, [pooled[name] for name in self._keyed_names])

    def _forward(
        self, key: tuple[Any, ...], batch: Mapping[str, FeatureBatch]
    ) -> dict[str, torch.Tensor]:
        held, self._held = self._held, None
        try:
            self.raise_push_failure()
            trains = self._trains()
            pooled = self._take_prefetched(key, trains)
            prepared = None if pooled is not None else self._prepare(batch)
        except BaseException:
            self._send_alone(held)
            raise
        if pooled is None and held is not None and isinstance(prepared, PreparedHost):
            pooled = self._fetch_after(prepared, trains, held)
        elif pooled is None:
            self._send_alone(held)
            self.wait_for_pushes()  # a lookup made now sees every push made before it
            self.raise_push_failure()
            pooled = prepared.fetch(trains)
        else:
            self._send_alone(held)
        if trains:
            anchor = torch.empty(0, requires_grad=True)  # makes autograd call backward
            outputs = _Pooled.apply(anchor, pooled, self._names, self._push)
        else:
            outputs = _outputs(pooled, self._names)
        return dict(zip(self._names, outputs, strict=True))

    def _fetch_after(
        self, prepared: PreparedHost, trains: bool, held: tuple[KeyGradients, int | None]
    ) -> PooledLookup:
        """A held push, then this forward's lookup, as one call per shard, here (the
        pushes before it are waited for first). A failed push is raised as a background
        push's failure is (raise_push_failure): once, here."""
        self.wait_for_pushes()
        self.raise_push_failure()
        try:
            return prepared.fetch(trains, held)
        except PushNotApplied as failed:
            self._prefetched.clear()  # as raise_push_failure: made around a push that failed
            raise _noted(failed.error, self._push_named(*held, self._pushes)) from None

    def _take_prefetched(self, key: tuple[Any, ...], trains: bool) -> PooledLookup | None:
        """The prefetched lookup of this batch, if one is recent enough. Entries prefetched
        before it were skipped: they are dropped, so that no later forward of a reused
        batch object takes rows older than allowed; so are entries of the other mode."""
        pooled = None
        for index, entry in enumerate(self._prefetched):
            if entry.create == trains and _same(entry.key, key):
                del self._prefetched[: index + 1]
                if entry.future is not None and self._pushes - entry.pushes <= self.staleness:
                    wait_for([entry.future])
                    self.raise_push_failure()  # a push it went with failed: raised once
                    pooled = entry.future.result()  # a failed prefetch raises here
                break
        self._prefetched = [entry for entry in self._prefetched if entry.create == trains]
        return pooled


class EmbeddingBag(nn.Module):
    """torch.nn.EmbeddingBag over a table of the cluster: forward(input, offsets=None,
    per_sample_weights=None) as torch's (input 2-D [B, N] without offsets, with keys < 0 as
    padding; or 1-D values with offsets), returning [B, dim]. combiner: "sum", "mean" or
    "sqrtn"; per_sample_weights work with all three (tierps.client.pooling). Input on a GPU
    is pooled there; `device` and `staleness` as in EmbeddingBagCollection, and so are
    prefetch (with forward's arguments), pipeline, flush and close."""

    def __init__(
        self,
        client: EmbeddingClient,
        table: str,
        *,
        combiner: Combiner | str = Combiner.SUM,
        include_last_offset: bool = False,
        device: str | torch.device | None = None,
        staleness: int = 0,
    ) -> None:
        super().__init__()
        self.table = table
        self.bags = EmbeddingBagCollection(
            client,
            [Feature(table, table, combiner)],
            include_last_offset=include_last_offset,
            device=device,
            staleness=staleness,
        )

    @property
    def staleness(self) -> int:
        return self.bags.staleness

    def _batch(self, input: Any, offsets: Any, per_sample_weights: Any) -> dict[str, Any]:
        if offsets is None and per_sample_weights is None:
            return {self.table: input}
        return {self.table: (input, offsets, per_sample_weights)}  # dense keys: offsets None

    def forward(
        self,
        input: torch.Tensor | np.ndarray,
        offsets: torch.Tensor | np.ndarray | None = None,
        per_sample_weights: torch.Tensor | np.ndarray | None = None,
    ) -> torch.Tensor:
        key = (input, offsets, per_sample_weights)
        return self.bags._forward(key, self._batch(*key))[self.table]

    def prefetch(
        self,
        input: torch.Tensor | np.ndarray,
        offsets: torch.Tensor | np.ndarray | None = None,
        per_sample_weights: torch.Tensor | np.ndarray | None = None,
    ) -> None:
        """Start looking up the bags of a later forward given these same objects."""
        key = (input, offsets, per_sample_weights)
        self.bags._prefetch(key, self._batch(*key))

    def pipeline(
        self, items: Iterable[Item], inputs: Callable[[Item], Any] | None = None
    ) -> Iterator[Item]:
        """As EmbeddingBagCollection.pipeline; inputs(item) gives forward's input, or a tuple
        (input, offsets[, per_sample_weights]) (default: the item itself)."""
        return pipeline(items, (self, inputs if inputs is not None else _itself))

    def flush(self) -> None:
        """As EmbeddingBagCollection.flush."""
        self.bags.flush()

    def close(self) -> None:
        """As EmbeddingBagCollection.close."""
        self.bags.close()

    def __enter__(self) -> EmbeddingBag:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.bags.__exit__(*exc_info)


PipelinedModule = EmbeddingBagCollection | EmbeddingBag


def pipeline(
    items: Iterable[Item],
    *modules: tuple[PipelinedModule, Callable[[Item], Any]],
    before_each: Callable[[bool], None] | None = None,
) -> Iterator[Item]:
    """Yield the items in order, each next item's lookup started in every module before the
    current item is yielded: module.prefetch(inputs(next item)) for each (module, inputs)
    given (a tuple is spread: EmbeddingBag.prefetch(input, offsets[, per_sample_weights])).
    After the last item every module is flushed; a loop left early waits for the pushes in
    flight (their failure is raised by the module's next call). For a model of one
    EmbeddingBag per feature:

        for batch in pipeline(loader, *((bag, lambda b, f=f: b.features[f])
                                        for f, bag in bags.items())):
            ...

    before_each(more), if given, runs before each item's next item is prefetched (`more`:
    whether there is one): TrainerGroup.pipeline counts its steps there.
    """
    iterator = iter(items)
    try:
        upcoming = next(iterator)
    except StopIteration:
        return
    try:
        while True:
            item = upcoming
            try:
                upcoming = next(iterator)
                more = True
            except StopIteration:
                more = False
            if before_each is not None:
                before_each(more)
            if not more:
                yield item
                break
            for module, inputs in modules:
                given = inputs(upcoming)
                module.prefetch(*given) if isinstance(given, tuple) else module.prefetch(given)
                collection_of(module)._hold_pushes = True  # the next prefetch takes the push
            yield item
            for module, _ in modules:
                collection_of(module)._hold_pushes = False
    finally:  # also for a loop left early; its failure is raised by the module's next call
        for module, _ in modules:
            collection_of(module)._hold_pushes = False
            collection_of(module).wait_for_pushes()
    for module, _ in modules:
        module.flush()


def _enum_value(value: Any) -> str:
    """An enum member's value (TorchRec's PoolingType, DataType), or the value given."""
    return str(getattr(value, "value", value))


def _initial_rows(rows: InitialRows | torch.Tensor | np.ndarray | None) -> InitialRows | None:
    """from_torchrec's initial rows as create_table takes them: a matrix [n, dim] (a
    TorchRec table's weight) is the rows of keys 0..n-1."""
    if isinstance(rows, torch.Tensor):
        rows = rows.detach().cpu().numpy()
    if isinstance(rows, np.ndarray):
        return np.arange(rows.shape[0] if rows.ndim else 0), rows
    return rows


def collection_of(module: PipelinedModule) -> EmbeddingBagCollection:
    """The EmbeddingBagCollection that looks up and pushes for `module`: the module
    itself, or an EmbeddingBag's `bags`."""
    return module.bags if isinstance(module, EmbeddingBag) else module


def _noted(error: BaseException, what: str) -> BaseException:
    """`error`, of a push that failed after its backward had returned, with a note naming
    the push (`what`)."""
    error.add_note(
        f"tierps: {what} was sent after its backward had returned (held for the module's "
        f"next lookup, or in its background thread); its gradients were not applied (or, "
        f"per ShardError.succeeded, only on some shards)"
    )
    return error


def _itself(item: Any) -> Any:
    return item


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """The same objects, one by one (a batch is matched by identity, not by value)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _gradients(pooled: PooledLookup, grads: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The gradients as push_gradients takes them, without a copy: numpy arrays of a host
    lookup, tensors on the device of a device lookup."""
    if pooled.device is None:
        return {name: grad.detach().cpu().numpy() for name, grad in grads.items()}
    return {name: grad.detach() for name, grad in grads.items()}


def _fetch_on(prepared: PreparedPooling, create: bool, stream: Any) -> PooledLookup:
    """A prepared lookup's fetch in the background thread, on the CUDA stream the caller
    was on: a device batch's kernels then queue behind the work that made the batch."""
    with _on_stream(stream):
        return prepared.fetch(create)


def _current_stream() -> Any:
    """The caller's CUDA stream (a thread starts on the default one), or None."""
    return torch.cuda.current_stream() if torch.cuda.is_initialized() else None


def _on_stream(stream: Any) -> AbstractContextManager[Any]:
    """torch.cuda.stream(stream), or nothing for None."""
    return torch.cuda.stream(stream) if stream is not None else nullcontext()
