"""EmbeddingClient: what a trainer talks to. It routes keys to their shards (key % N; every
key of a table placed whole to its owner shard), removes duplicates before sending, calls
the shards at once, one RPC per shard carrying every table of the call, and pools bags with
the fused kernel of `pooling`, or, for a batch on a GPU (CUDA tensors, cupy arrays), on that
GPU with `device_pooling`.

    from tierps.client import EmbeddingClient, TableConfig, optim

    with EmbeddingClient(addresses) as client:
        client.create_table(TableConfig("items", dim=16, optimizer=optim.Adagrad(lr=0.05)))
        pooled = client.lookup_pooled("items", keys, offsets, combiner="mean")
        ...                                   # the model computes d loss / d pooled.output
        pooled.push_gradients(grad_output)    # the shards run the table's optimizer
"""

from __future__ import annotations

import collections
import itertools
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np

from tierps.client.admin import (
    ClusterAdmin,
    Progress,
    RetryPolicy,
    ShardError,
    refusal_of,
    too_large_for_one_message,
)
from tierps.client.formats import (
    COO,
    Bags,
    array_device,
    as_array,
    batch_arrays,
    float_array,
    to_bags,
)
from tierps.client.initial_rows import InitialRows, read_initial_rows
from tierps.client.pooling import (
    Combiner,
    distinct_keys,
    pool,
    pooling_matrix,
    stacked_pooling_matrix,
    unpool,
)
from tierps.client.security import ChannelSecurity
from tierps.core.compiled import all_distinct
from tierps.core.config import TableConfig, single_shard
from tierps.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    Reason,
    TableNotFoundError,
)
from tierps.core.ownership import group_by_shard
from tierps.core.validation import check_step
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto import wire

if TYPE_CHECKING:  # torch is imported only by a call that pools on a torch device
    import torch

    from tierps.client.device_pooling import FeatureSpec, PoolingGroup

DEFAULT_MAX_CALL_BYTES = 256 << 20  # bulk bytes of one call (request or reply) per shard
# A lookup whose reply from one shard is at least 2 * LOOKUP_PIECE_BYTES goes as up to
# LOOKUP_PIECES calls at once (of LOOKUP_PIECE_BYTES or more each): the shard's storage work
# on one overlaps the transfer of another. Measured (docs/perf/profile-lookup.md): 16 MiB
# in 4 pieces 1.1-1.5x faster than in 2, and 2 faster than 1; with two pieces to
# a shard at once, smaller pieces still do not pay (to within ~20%): 4 MiB in 2
# pieces 0.89-1.13x the time of one call, in 4 pieces 1.08-1.67x; 8 MiB in 4 pieces
# 1.03-1.42x the time of 2 pieces.
LOOKUP_PIECE_BYTES = 4 << 20
LOOKUP_PIECES = 4
PIECES_AT_ONCE = 2  # calls of one fan-out to one shard at once (its lanes, see _fan_out)
# One table's part of a call to a shard: (table, dim, keys, their positions in the table's
# distinct keys).
Batch = tuple[str, int, np.ndarray, np.ndarray]
# What _fan_out hands each call: its batches, or what the caller pairs with a shard.
Work = TypeVar("Work")


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
    """One table's part of a call: its distinct keys >= 0 and, per feature, the index of
    each of its keys among them (-1 for padding)."""

    dim: int
    unique: np.ndarray
    inverse: dict[str, np.ndarray]


@dataclass
class _TablePooling:
    """One table's stacked pooling matrix and each of its features' rows in it."""

    matrix: Any
    rows: dict[str, slice]


class PooledLookup:
    """The pooled rows of a batch of features, and the way back: push_gradients turns the
    gradients of the outputs into one gradient per distinct key (the transpose of the
    forward's sparse product) and pushes them, one RPC per shard."""

    device: str | None = None  # None: pooled on the host, outputs are numpy arrays

    def __init__(
        self,
        client: EmbeddingClient,
        features: dict[str, Feature],
        tables: dict[str, _TableKeys],
        pooling: dict[str, _TablePooling],
        outputs: dict[str, np.ndarray],
    ) -> None:
        self._client = client
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
        return self._push_keys(self._key_gradients(grad_outputs), step)

    def _push_keys(self, pushes: dict[str, tuple[np.ndarray, np.ndarray]], step: int | None) -> int:
        """push_gradients' RPCs: the distinct keys' gradients of _key_gradients, pushed."""
        return self._client.push_unique(pushes, step)

    def _key_gradients(self, grad_outputs: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """push_gradients up to its RPCs: per table, the distinct keys to push and their
        summed gradients (new arrays, which outlive grad_outputs)."""
        grad_outputs = self._by_feature(grad_outputs)
        grads = {
            name: float_array(
                f"feature {name!r}", "grad_output", grad, self.outputs[name].shape,
                "that of the pooled output",
            )
            for name, grad in grad_outputs.items()
        }  # fmt: skip
        pushes: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for table, pooling in self._pooling.items():
            names = [name for name in pooling.rows if name in grads]
            if not names:
                continue
            keys = self._tables[table]
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
        client: EmbeddingClient,
        groups: list[PoolingGroup],
        outputs: dict[str, torch.Tensor],
        device: str,
    ) -> None:
        self._client = client
        self._groups = groups
        self.outputs = outputs  # type: ignore[assignment]
        self.device = device

    def push_gradients(self, grad_outputs: Any, step: int | None = None) -> int:
        """Push d loss / d output (a tensor of output's shape on `device`, or a dict feature
        -> tensor; features left out have zero gradient), as PooledLookup.push_gradients."""
        return self._push_keys(self._key_gradients(grad_outputs), step)

    def _key_gradients(self, grad_outputs: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The backward on the device, and the distinct keys' gradients copied to the host
        (a sync), checked: PooledLookup._key_gradients."""
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


class PushNotApplied(Exception):
    """Raised by EmbeddingClient._push_then_lookup when its push failed (on some shard):
    `error` is the push's error, as a push alone would raise it."""

    def __init__(self, error: ShardError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class _PreparedHost:
    """A host lookup_pooled_features up to its RPCs (EmbeddingClient._prepare_pooled):
    fetch(create) looks the distinct keys up and pools them."""

    client: EmbeddingClient
    features: dict[str, Feature]
    tables: dict[str, _TableKeys]
    pooling: dict[str, _TablePooling]
    shapes: dict[str, tuple[int, ...]]  # each feature's bag shape (its output's, less dim)

    def fetch(
        self, create: bool, after: tuple[dict[str, Any], int | None] | None = None
    ) -> PooledLookup:
        """The lookup, pooled. after: (pushes, step) of a push (_key_gradients') to apply
        first, with the lookup seeing it (EmbeddingClient._push_then_lookup)."""
        tables = {name: (keys.dim, keys.unique) for name, keys in self.tables.items()}
        if after is None:
            rows = self.client._lookup_unique(tables, create)
        else:
            rows = self.client._push_then_lookup(*after, tables, create)
        outputs = {}
        for table, pooling in self.pooling.items():
            dim = self.tables[table].dim
            pooled = pool(pooling.matrix, rows[table])  # every feature of the table
            for name, span in pooling.rows.items():
                outputs[name] = pooled[span].reshape(*self.shapes[name], dim)
        outputs = {name: outputs[name] for name in self.features}  # in the features' order
        return PooledLookup(self.client, self.features, self.tables, self.pooling, outputs)


@dataclass
class _PreparedDevice:
    """A lookup_pooled_features on a torch device, checked for its features: fetch(create)
    does the rest (its layout on the device and the copies of its rows there sync with the
    device, so they stay with the fetch, on the thread that makes it)."""

    client: EmbeddingClient
    device: str
    specs: list[FeatureSpec]
    include_last_offset: bool

    def fetch(self, create: bool) -> DevicePooledLookup:
        return self.client._lookup_pooled_on(
            self.device, self.specs, create, self.include_last_offset
        )


_PreparedPooling = _PreparedHost | _PreparedDevice


class EmbeddingClient(ClusterAdmin):
    """A trainer's client of the cluster whose shard i listens at addresses[i] (None: the
    addresses in TIERPS_ADDRESSES, as `tierps cluster` prints them); a context manager. It
    has every ClusterAdmin call (create_table, drop_table, list_tables, describe,
    save_snapshot, load_snapshot, list_snapshots, stats) and the data calls.

    Every data call has a deadline of timeout_s per shard call. A call failing with UNAVAILABLE is
    retried by gRPC as `retry` says; any failure a shard gives is raised as a ShardError
    naming the shard and its address. Bad input is refused before anything is sent.
    """

    def __init__(
        self,
        addresses: Sequence[str] | str | None = None,
        *,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        chunk_bytes: int = wire.CHUNK_BYTES,
        max_call_bytes: int = DEFAULT_MAX_CALL_BYTES,
        one_message_bytes: int = wire.ONE_MESSAGE_BYTES,
        security: ChannelSecurity | None = None,
    ) -> None:
        if not 8 + 4 <= chunk_bytes <= wire.MAX_MESSAGE_BYTES // 2:
            raise ValueError(
                f"EmbeddingClient: chunk_bytes expected in [12, {wire.MAX_MESSAGE_BYTES // 2}] "
                f"(half the message limit), got {chunk_bytes}"
            )
        if not 0 <= one_message_bytes <= wire.ONE_MESSAGE_BYTES:
            raise ValueError(
                f"EmbeddingClient: one_message_bytes expected in [0, {wire.ONE_MESSAGE_BYTES}] "
                f"(0: always stream), got {one_message_bytes}"
            )
        super().__init__(addresses, timeout_s=timeout_s, retry=retry, security=security)
        # Data calls' own threads: snapshot streams hold the admin pool for as long as they
        # run, and a prefetch may fan out while a push does.
        self._calls = ThreadPoolExecutor(2 * len(self.addresses), thread_name_prefix="tierps-calls")
        self.chunk_bytes = chunk_bytes
        self.max_call_bytes = max_call_bytes
        self._data = [pb_grpc.EmbeddingServiceStub(channel) for channel in self._channels]
        # The one-message calls, their bytes encoded and decoded here (tierps.proto.wire):
        # no serializers, so gRPC hands over the bytes as they are.
        service = f"/{pb.DESCRIPTOR.services_by_name['EmbeddingService'].full_name}"
        # On the plain channels: their calls pass their metadata themselves (self._metadata).
        plain = self._plain_channels
        self._lookup_one = [c.unary_unary(f"{service}/LookupUnary") for c in plain]
        self._push_one = [
            c.unary_unary(
                f"{service}/PushGradientsUnary",
                response_deserializer=pb.PushGradientsResponse.FromString,
            )
            for c in plain
        ]
        self._push_then_lookup_one = [c.unary_unary(f"{service}/PushThenLookup") for c in plain]
        # Whether shard i takes PushThenLookup: False once it answered UNIMPLEMENTED (an
        # older shard), and its pushes and lookups go as separate calls from then on.
        self._fuses = [True] * len(self.addresses)
        # Request bulk bytes a PushThenLookup to shard i may carry (its push and its lookup's
        # keys): max_call_bytes, lowered for a shard that refused one as over its per-call
        # limit (a lower max_batch_bytes); its pushes and lookups then go separately.
        self._fused_call_bytes = [max_call_bytes] * len(self.addresses)
        # Bulk bytes a call to shard i may carry as one message each way: lowered for a
        # shard that refused a call as too large for one (its message limit is lower).
        self._one_message_bytes = [one_message_bytes] * len(self.addresses)
        self._configs: dict[str, TableConfig] = {}
        self._steps: dict[str, int] = {}
        self._lock = threading.Lock()
        # Each push call's identity (wire.PUSH_ID_HEADER): this client's id and a number of
        # its own, the same on every retry of the call, so that a shard applies it once.
        self._client_id = uuid.uuid4().hex
        self._sequence = itertools.count(1)

    def close(self) -> None:
        self._calls.shutdown(wait=False)
        super().close()

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    # -- tables (cached: the client needs each table's dim) ------------------------------------

    def create_table(self, config: TableConfig, *, initial: InitialRows | None = None) -> bool:
        """Create the table on every shard; True if any shard created it, False if every
        shard had it with this config. `initial`: its first rows, as (keys, values) or the
        path of a .npy / .npz file read here (tierps.client.initial_rows); they are checked
        before anything is created, and written (with fresh optimizer state) only into a
        table this call created: for an existing table it is FailedPreconditionError."""
        where = f"table {config.name!r}"
        rows = None if initial is None else read_initial_rows(where, initial, config)
        if rows is not None and config.name in {t.name for t in self.list_tables()}:
            raise FailedPreconditionError(
                f"{where} exists already: initial rows expected for a table this call "
                f"creates; use assign to set the rows of an existing table"
            )
        created = super().create_table(config)
        with self._lock:
            self._configs[config.name] = config
        if rows is not None:
            if not created:  # another client created it after the check above
                raise FailedPreconditionError(
                    f"{where} was created by another caller meanwhile: initial rows expected "
                    f"for a table this call creates, so none were written"
                )
            self.assign(config.name, *rows)
        return created

    def drop_table(self, name: str) -> None:
        with self._lock:
            self._configs.pop(name, None)
            self._steps.pop(name, None)
            for known in self._generations:
                known.pop(name, None)
        super().drop_table(name)

    def table_config(self, name: str) -> TableConfig:
        """The config of a table (asked of shard 0 once, then remembered)."""
        with self._lock:
            if name in self._configs:
                return self._configs[name]
        configs = {config.name: config for config in self.list_tables()}
        with self._lock:
            self._configs.update(configs)
        if name not in configs:
            known = ", ".join(sorted(configs)) or "none"
            raise TableNotFoundError(
                f"table {name!r} not found on the cluster at {self.addresses[0]} (tables: {known})"
            )
        return configs[name]

    # -- plain rows ------------------------------------------------------------------------------

    def _dense_call(self, table: str, keys: Any) -> tuple[str, np.ndarray, np.ndarray, int]:
        """(where, keys as an array, keys flattened and checked, the table's dim) of a call
        on keys of any shape."""
        where = f"table {table!r}"
        keys = as_array(where, "keys", keys)
        flat = to_bags(where, keys.reshape(-1, 1)).keys
        return where, keys, flat, self.table_config(table).dim

    def lookup(
        self, table: str, keys: Any, *, create: bool = True, copy: bool = True
    ) -> np.ndarray:
        """Weights [*keys.shape, dim] of keys (any integer array), in their order. Keys < 0
        give zero rows. create=True (training) stores rows for new keys; create=False
        (evaluation) returns their initial values and stores nothing. copy=False: where
        the rows arrive in the keys' order (distinct keys >= 0, one shard), a read-only view
        of the reply instead of a writable copy."""
        where, keys, flat, dim = self._dense_call(table, keys)
        if _distinct_live(flat):  # sent as given: the rows come back in the keys' order
            rows = self._lookup_unique({table: (dim, flat)}, create, read_only=not copy)[table]
            return rows.reshape(*keys.shape, dim)
        unique, inverse = distinct_keys(flat)
        if unique.size == 0:  # padding only
            return np.zeros((*keys.shape, dim), np.float32)
        rows = self._lookup_unique({table: (dim, unique)}, create, read_only=True)[table]
        out = np.take(rows, inverse, axis=0)  # one copy, in the keys' order; -1 takes the last
        if unique.size < flat.size:  # padding may be among them: zero rows
            out[inverse < 0] = 0.0
        return out.reshape(*keys.shape, dim)

    def push_gradients(self, table: str, keys: Any, grads: Any, step: int | None = None) -> int:
        """Push the gradients [*keys.shape, dim] of keys' rows; the shards run the table's
        optimizer. Gradients of repeated keys are summed; keys < 0 are ignored. `step`
        (from 1) feeds Adam's bias correction; left out, it counts this client's pushes to
        the table. Returns the number of distinct keys updated."""
        where, keys, flat, dim = self._dense_call(table, keys)
        shape = (*keys.shape, dim)
        grads = float_array(where, "grads", grads, shape, "[*keys.shape, dim]").reshape(-1, dim)
        if _distinct_live(flat):  # pushed as given: no sums
            return self.push_unique({table: (flat, grads)}, step)
        unique, inverse = distinct_keys(flat)
        bags = Bags(flat, np.arange(flat.size + 1, dtype=np.int64), None, (flat.size,))
        matrix = pooling_matrix(bags, inverse, unique.size, Combiner.SUM)
        return self.push_unique({table: (unique, unpool(matrix, grads))}, step)

    def assign(self, table: str, keys: Any, values: Any) -> int:
        """Set the weights [*keys.shape, dim] of keys and reset their optimizer state.
        Where a key repeats, its last value wins; keys < 0 are ignored."""
        where, keys, flat, dim = self._dense_call(table, keys)
        shape = (*keys.shape, dim)
        values = float_array(where, "values", values, shape, "[*keys.shape, dim]").reshape(-1, dim)
        last = flat.size - 1 - np.unique(flat[::-1], return_index=True)[1]
        last = last[flat[last] >= 0]
        calls = self._route({table: (dim, flat[last])}, _key_and_row_bytes)

        def call(shard: int, batches: list[Batch]) -> Any:
            requests = (
                request
                for name, dim, keys, at in batches
                for request in wire.assign_requests(
                    name,
                    dim,
                    _wire_keys(keys).tobytes(),
                    values[last[at]].tobytes(),
                    self.chunk_bytes,
                )
            )
            size = sum(wire.stream_bytes(name, dim, 0, keys.size, 4 * dim, self.chunk_bytes)
                       for name, dim, keys, _ in batches)  # fmt: skip
            return self._data[shard].Assign(
                requests, timeout=self.timeout_s, metadata=wire.declared(size)
            )

        return sum(reply.num_keys for reply in self._fan_out(calls, call))

    # -- pooled ----------------------------------------------------------------------------------

    def lookup_pooled(
        self,
        table: str,
        keys: Any,
        offsets: Any = None,
        *,
        combiner: Combiner | str = Combiner.SUM,
        per_sample_weights: Any = None,
        include_last_offset: bool = False,
        create: bool = True,
        device: str | torch.device | None = None,
    ) -> PooledLookup:
        """Pool bags of keys of one table (dense -1-padded keys [..., nnz], CSR values with
        offsets, or a COO; see tierps.client.formats). `.output` is [..., dim] for dense
        keys and [B, dim] otherwise; `.push_gradients(grad_output)` trains. Combiners:
        tierps.client.pooling. `device` as in lookup_pooled_features."""
        where = f"table {table!r}"
        value = keys if offsets is None and per_sample_weights is None else (
            keys, offsets, per_sample_weights
        )  # fmt: skip
        on = _pooling_device({where: value}, device)
        if on is not None:
            spec = self._spec(table, where, value, table, combiner)
            return self._lookup_pooled_on(on, [spec], create, include_last_offset)
        batch = to_bags(
            where, keys, offsets, per_sample_weights,
            include_last_offset=include_last_offset,
        )  # fmt: skip
        return self.lookup_pooled_features(
            {table: batch}, [Feature(table, table, combiner)], create=create
        )

    def lookup_pooled_features(
        self,
        batch: Mapping[str, FeatureBatch],
        features: Sequence[Feature],
        *,
        create: bool = True,
        include_last_offset: bool = False,
        device: str | torch.device | None = None,
    ) -> PooledLookup:
        """Pool a batch of several features (feature name -> dense keys, (values, offsets),
        (values, offsets, per_sample_weights), a COO, or Bags), each looked up in its
        feature's table: one lookup RPC per shard for all of them, like torchrec's
        EmbeddingBagCollection. `.outputs[name]` holds each feature's pooled rows.

        Where it pools: a batch on the host (numpy, lists, CPU tensors) is pooled by the host
        kernels, its outputs numpy arrays. A batch on a GPU (CUDA tensors or DLPack arrays
        such as cupy's, every array of it on one device) is pooled there, forward and
        backward, its outputs torch tensors there: a DevicePooledLookup. `device` (a torch
        device: "cuda:0", "cpu") pools on that device instead, with torch tensor outputs;
        the batch's arrays must be on it (host arrays count as "cpu")."""
        return self._prepare_pooled(batch, features, include_last_offset, device).fetch(create)

    def _prepare_pooled(
        self,
        batch: Mapping[str, FeatureBatch],
        features: Sequence[Feature],
        include_last_offset: bool,
        device: str | torch.device | None,
    ) -> _PreparedPooling:
        """lookup_pooled_features up to its RPCs: the checks, the dedup, the routing's inputs
        and the pooling layout, none of which depends on the rows (a pipelined trainer does
        this in its own thread and only the fetch in the background)."""
        by_name = {feature.name: feature for feature in features}
        if len(by_name) != len(features):
            repeated = sorted(
                {f.name for f in features if sum(g.name == f.name for g in features) > 1}
            )
            raise InvalidArgumentError(f"features expected distinct names, got {repeated} repeated")
        if by_name.keys() != batch.keys():
            missing = sorted(set(by_name) - set(batch))
            unknown = sorted(set(batch) - set(by_name))
            raise InvalidArgumentError(
                f"batch expected exactly the features {sorted(by_name)}, got "
                f"{sorted(batch)} (missing {missing}, unknown {unknown})"
            )
        on = _pooling_device({f"feature {name!r}": batch[name] for name in by_name}, device)
        if on is not None:
            specs = [
                self._spec(name, f"feature {name!r}", batch[name], f.table, f.combiner)
                for name, f in by_name.items()
            ]
            return _PreparedDevice(self, on, specs, include_last_offset)
        bags = {
            name: _as_bags(f"feature {name!r}", batch[name], include_last_offset)
            for name in by_name
        }
        tables: dict[str, _TableKeys] = {}
        pooling: dict[str, _TablePooling] = {}
        for table in dict.fromkeys(f.table for f in features):
            names = [f.name for f in features if f.table == table]
            keys = np.concatenate([bags[name].keys for name in names])
            unique, inverse = distinct_keys(keys)
            key_bounds = np.cumsum([0] + [bags[name].keys.size for name in names])
            inverses = {n: inverse[key_bounds[i] : key_bounds[i + 1]] for i, n in enumerate(names)}
            tables[table] = _TableKeys(self.table_config(table).dim, unique, inverses)
            parts = [(bags[n], inverses[n], by_name[n].combiner) for n in names]
            bag_bounds = np.cumsum([0] + [bags[n].num_bags for n in names])
            spans = {n: slice(bag_bounds[i], bag_bounds[i + 1]) for i, n in enumerate(names)}
            pooling[table] = _TablePooling(stacked_pooling_matrix(parts, unique.size), spans)
        shapes = {name: bags[name].shape for name in by_name}
        return _PreparedHost(self, by_name, tables, pooling, shapes)

    @staticmethod
    def _spec(name: str, where: str, value: Any, table: str, combiner: Any) -> FeatureSpec:
        from tierps.client.device_pooling import FeatureSpec

        return FeatureSpec(name, where, value, table, Combiner.of(combiner, where))

    def _lookup_pooled_on(
        self, device: str, specs: list[FeatureSpec], create: bool, include_last_offset: bool
    ) -> DevicePooledLookup:
        """lookup_pooled_features on a torch device: check, dedup and lay out the batch
        there, look the distinct keys up, copy their rows to the device once per group of
        tables of one dim, and pool them there."""
        from tierps.client.device_pooling import host_buffer, plan, torch_device

        on = torch_device(device)
        groups = plan(on, specs, lambda table: self.table_config(table).dim, include_last_offset)
        tables: dict[str, tuple[int, np.ndarray]] = {}
        out, buffers = {}, []
        for group in groups:
            buffer = host_buffer((group.num_unique + 1, group.dim), on)
            rows = buffer.numpy()
            rows[-1] = 0.0  # the zero row that padding entries point at
            for table, (lo, hi) in group.spans.items():
                tables[table], out[table] = (group.dim, group.unique[table]), rows[lo:hi]
            buffers.append(buffer)
        self._lookup_unique(tables, create, out)  # the shards' replies land in the buffers
        outputs: dict[str, torch.Tensor] = {}
        for group, buffer in zip(groups, buffers, strict=True):
            outputs.update(group.forward(buffer.to(on, non_blocking=True)))
        outputs = {spec.name: outputs[spec.name] for spec in specs}
        return DevicePooledLookup(self, groups, outputs, str(on))

    # -- the wire --------------------------------------------------------------------------------

    def _lookup_unique(
        self,
        tables: dict[str, tuple[int, np.ndarray]],
        create: bool,
        out: dict[str, np.ndarray] | None = None,
        *,
        read_only: bool = False,
    ) -> dict[str, np.ndarray]:
        """Rows [u, dim] of each table's distinct keys >= 0: one call per shard for all.
        `out`: arrays [u, dim] to write them into (views of a larger buffer may do). Without
        it, new arrays; or, with read_only, for a table whose rows all came in one reply, a
        read-only view of that reply (no copy)."""
        calls = self._route(tables, lambda dim: max(8, 4 * dim), pieces=True)  # row back
        if out is None:
            whole = {name for _, batches in calls for name, _, keys, _ in batches
                     if read_only and keys.size == tables[name][1].size}  # fmt: skip
            out = {name: np.empty((keys.size, dim), np.float32)
                   for name, (dim, keys) in tables.items() if name not in whole}  # fmt: skip
        else:
            out = dict(out)

        self._fan_out(calls, lambda shard, batches: self._lookup_into(shard, batches, create, out))
        return out

    def _lookup_into(
        self, shard: int, batches: list[Batch], create: bool, out: dict[str, np.ndarray]
    ) -> None:
        """One lookup call of _lookup_unique's to a shard, its rows placed in `out`."""
        self._place_rows(shard, batches, self._lookup_call(shard, batches, create), out)

    def _place_rows(
        self, shard: int, batches: list[Batch], values: Any, out: dict[str, np.ndarray]
    ) -> None:
        """A lookup reply's rows (bytes-like values), placed by batch: into out[table] at the
        batch's positions, or, for a table not in `out`, as a view of the reply (every row
        of the table, in the order of its keys)."""
        if len(values) != _reply_bytes(batches):
            raise self._reply_size_error(shard, batches, str(len(values)))
        offset = 0
        for name, dim, keys, at in batches:  # placed here, while other shards answer
            rows = np.frombuffer(values, "<f4", keys.size * dim, offset)
            rows = rows.reshape(keys.size, dim)
            if name in out and at[-1] - at[0] == at.size - 1:  # ascending: a span
                out[name][at[0] : at[-1] + 1] = rows
            elif name in out:
                out[name][at] = rows
            else:  # every row of the table, in the order of its keys
                out[name] = rows
            offset += 4 * dim * keys.size

    def _lookup_call(self, shard: int, batches: list[Batch], create: bool) -> Any:
        """The rows of one call's batches, as bytes-like values: in one message each way
        where both fit, else streamed (also after the shard refused one message as too
        large: a lookup changes nothing it could repeat)."""
        bulk = max(sum(8 * keys.size for _, _, keys, _ in batches), _reply_bytes(batches))
        self._know_generations(shard, [name for name, *_ in batches])
        if bulk <= self._one_message_bytes[shard]:
            request = wire.encode_batches(
                [(name, dim, create, (_wire_keys(keys),)) for name, dim, keys, _ in batches]
            )
            try:
                reply = self._lookup_one[shard](
                    request,
                    timeout=self.timeout_s,
                    metadata=self._metadata(shard, *wire.declared(len(request))),
                )
                return wire.lookup_reply_values(reply)
            except grpc.RpcError as error:
                if not self._refused_as_too_large(shard, error, bulk):
                    raise
        requests = (
            request
            for name, dim, keys, _ in batches
            for request in wire.lookup_requests(
                name, dim, _wire_keys(keys).tobytes(), create=create, chunk_bytes=self.chunk_bytes
            )
        )
        values = np.empty(_reply_bytes(batches), np.uint8)  # the chunks land in place
        filled = 0
        size = sum(wire.stream_bytes(name, dim, create, keys.size, 0, self.chunk_bytes)
                   for name, dim, keys, _ in batches)  # fmt: skip
        replies = self._data[shard].Lookup(
            requests, timeout=self.timeout_s, metadata=wire.declared(size)
        )
        for response in replies:
            chunk = np.frombuffer(response.values, np.uint8)
            if filled + chunk.size > values.size:
                raise self._reply_size_error(shard, batches, f"more than {values.size}")
            values[filled : filled + chunk.size] = chunk
            filled += chunk.size
        return values[:filled]

    def _reply_size_error(self, shard: int, batches: list[Batch], got: str) -> ShardError:
        names = sorted({name for name, *_ in batches})
        return ShardError(
            shard, self.addresses[shard], grpc.StatusCode.INTERNAL,
            f"lookup reply of tables {names} expected {_reply_bytes(batches)} bytes, got {got}",
        )  # fmt: skip

    def _refused_as_too_large(self, shard: int, error: grpc.RpcError, bulk: int) -> bool:
        """Whether the shard refused a one-message call of `bulk` bytes (its larger way) as
        too large for one message, before it touched anything (gRPC's message limit, or the
        shard's own reply check): then this shard's one-message calls stay below `bulk`."""
        too_large = too_large_for_one_message(error)
        if too_large:
            with self._lock:
                limit = self._one_message_bytes[shard]
                self._one_message_bytes[shard] = min(limit, bulk - 1)
        return too_large

    def push_unique(
        self, pushes: dict[str, tuple[np.ndarray, np.ndarray]], step: int | None
    ) -> int:
        """Push, per table, gradients already summed per key: pushes maps a table to its
        distinct keys >= 0 and their gradients [u, dim], as PooledLookup.push_gradients and
        TrainerGroup compute them (nothing is summed again). A table with no keys is not
        pushed and takes no step. `step` as in push_gradients. Returns the number of keys
        updated."""
        pushes = {t: (keys, grads) for t, (keys, grads) in pushes.items() if keys.size}
        steps = self._reserve_steps(list(pushes), step)
        calls = self._route_push(pushes)
        try:
            replies = self._fan_out(calls, lambda i, b: self._push_call(i, b, steps, pushes))
        except ShardError as error:
            raise self._push_failure(error, steps, step) from None
        self._push_done(steps, step)
        return sum(reply.num_keys for reply in replies)

    def _route_push(
        self, pushes: dict[str, tuple[np.ndarray, np.ndarray]]
    ) -> list[tuple[int, list[Batch]]]:
        return self._route(
            {t: (grads.shape[1], keys) for t, (keys, grads) in pushes.items()},
            _key_and_row_bytes,
        )

    def _push_call(
        self,
        shard: int,
        batches: list[Batch],
        steps: dict[str, int],
        pushes: dict[str, tuple[np.ndarray, np.ndarray]],
    ) -> Any:
        """One push call of push_unique's to a shard: its PushGradientsResponse."""
        bulk = sum(_key_and_row_bytes(dim) * keys.size for _, dim, keys, _ in batches)
        identity = self._push_identity(shard, [name for name, *_ in batches])
        if bulk <= self._one_message_bytes[shard]:
            request = _push_request(batches, steps, pushes)
            try:
                return self._push_one[shard](
                    request,
                    timeout=self.timeout_s,
                    metadata=self._metadata(shard, *wire.declared(len(request)), *identity),
                )
            except grpc.RpcError as error:
                # refused before it was read: nothing applied, the stream may carry it
                if not self._refused_as_too_large(shard, error, bulk):
                    raise

        def grads_of(name: str, keys: np.ndarray, at: np.ndarray) -> np.ndarray:
            grads = pushes[name][1]  # every key of the table in this call: no gather
            grads = grads if keys.size == grads.shape[0] else grads[at]
            return np.ascontiguousarray(grads, "<f4")

        parts = [(name, dim, keys, grads_of(name, keys, at)) for name, dim, keys, at in batches]
        requests = (
            request
            for name, dim, keys, grads in parts
            for request in wire.push_requests(
                name, dim, steps[name], _wire_keys(keys).tobytes(), grads.tobytes(),
                self.chunk_bytes,
            )
        )  # fmt: skip
        size = sum(
            wire.stream_bytes(name, dim, steps[name], k.size, 4 * dim, self.chunk_bytes)
            for name, dim, k, _ in parts
        )
        return self._data[shard].PushGradients(
            requests, timeout=self.timeout_s, metadata=(*wire.declared(size), *identity)
        )

    def _know_generations(self, shard: int, tables: list[str]) -> dict[str, int]:
        """The generations of a shard's tables this client knows, learned first where one
        of `tables` is not known yet (a table made after this client first asked): at the
        table's first lookup, so that a load between that lookup and its push is told."""
        known = self._generations[shard]
        if any(table not in known for table in tables):
            if shard not in self._life_denied:
                self._relearn_generations(shard)
            known = self._generations[shard]
            for table in tables:  # not told (a reader's Stats, no such table): 0, unchecked,
                known.setdefault(table, 0)  # and not asked again at every call
        return known

    def _push_identity(self, shard: int, tables: list[str]) -> tuple[tuple[str, str], ...]:
        """The metadata that makes a push call to a shard safe to send again: a new push id,
        and the generation of each table's rows there as this client knows it (learned
        once per table; 0 where the shard does not say, as to a reader)."""
        known = self._know_generations(shard, tables)
        generations = ",".join(str(known.get(table, 0)) for table in tables)
        return (
            (wire.PUSH_ID_HEADER, f"{self._client_id}:{next(self._sequence)}"),
            (wire.GENERATIONS_HEADER, generations),
        )

    def _push_failure(
        self, error: ShardError, steps: dict[str, int], step: int | None
    ) -> ShardError:
        """The error a failed push raises: where it was applied on no shard, its steps are
        given back (unless the caller chose the step); where on some, it says which shards
        and tables. A push refused for rows replaced under it (TABLE_REPLACED) has this client
        learn the tables' generations again: the next push goes on the new rows."""
        if error.reason is Reason.TABLE_REPLACED:
            for shard in range(self.num_shards):
                self._relearn_generations(shard)
        if not error.succeeded and not error.applied_tables:
            if step is None:
                self._release_steps(steps)
            return error
        failed = error.failed or [error.shard_id]
        in_part = (
            f"; shard {error.shard_id} applied its part of tables {error.applied_tables} and "
            f"not of the others" if error.applied_tables else ""
        )  # fmt: skip
        partial = ShardError(  # part of the push is in: its step stays taken; say where
            error.shard_id, error.address, error.code,
            f"{error.details} (this push of tables {sorted(steps)} was applied on shards "
            f"{error.succeeded}, and not on shards {failed}{in_part}; send only the failed "
            f"shards' part again, or nothing)", error.reason, error.facts,
        )  # fmt: skip
        partial.succeeded, partial.failed = error.succeeded, error.failed
        partial.applied_tables = error.applied_tables
        return partial

    def _push_done(self, steps: dict[str, int], step: int | None) -> None:
        if step is not None:  # later pushes without a step count on from the one given
            with self._lock:
                for table, given in steps.items():
                    self._steps[table] = max(self._steps.get(table, 0), given)

    def _push_then_lookup(
        self,
        pushes: dict[str, tuple[np.ndarray, np.ndarray]],
        step: int | None,
        tables: dict[str, tuple[int, np.ndarray]],
        create: bool,
    ) -> dict[str, np.ndarray]:
        """push_unique(pushes, step), then _lookup_unique(tables, create) seeing it, in one
        PushThenLookup call per shard where every shard's parts of both are one call each
        and fit in one message each way (or a shard has a part of one of them only, sent
        alone); else those two, as separate calls for all shards (a lookup cut into pieces
        then sends them at once). A shard that refuses the fused call as too large, or does
        not know it, gets its push call, then its lookup call. A push not applied on every
        shard of its calls (refused, or a failure before they ran: table_step, routing,
        learning a shard's life) raises PushNotApplied with the error push_unique would
        raise; a lookup that failed after the push was applied everywhere raises its
        ShardError."""
        pushes = {t: (keys, grads) for t, (keys, grads) in pushes.items() if keys.size}
        if not pushes:
            return self._lookup_unique(tables, create)
        try:
            push_calls = self._route_push(pushes)
            lookup_calls = self._route(tables, lambda dim: max(8, 4 * dim), pieces=True)
        except ShardError as error:  # nothing sent, no step taken
            raise PushNotApplied(error) from None
        parts: dict[int, tuple[list[list[Batch]], list[list[Batch]]]] = {}
        for shard, batches in push_calls:
            parts.setdefault(shard, ([], []))[0].append(batches)
        for shard, batches in lookup_calls:
            parts.setdefault(shard, ([], []))[1].append(batches)
        if not all(self._fuses_parts(shard, *both) for shard, both in parts.items()):
            try:
                self.push_unique(pushes, step)
            except ShardError as error:
                raise PushNotApplied(error) from None
            return self._lookup_unique(tables, create)
        try:
            steps = self._reserve_steps(list(pushes), step)
        except ShardError as error:  # table_step failed: no step taken, nothing sent
            raise PushNotApplied(error) from None
        out = {name: np.empty((keys.size, dim), np.float32) for name, (dim, keys) in tables.items()}
        # each shard's push call and lookup call (None: it has no part of that one)
        work = {shard: (push[0] if push else None, lookup[0] if lookup else None)
                for shard, (push, lookup) in parts.items()}  # fmt: skip
        pushed: set[int] = set()  # shards whose part of the push is applied
        push_failed: dict[int, ShardError] = {}

        def run(shard: int, both: tuple[list[Batch] | None, list[Batch] | None]) -> None:
            push, lookup = both
            values = None  # the fused call's reply, once it returned
            try:
                if push is not None and lookup is not None:
                    values = self._fused_call(shard, push, lookup, steps, pushes, create)
                if values is None and push is not None:
                    self._push_call(shard, push, steps, pushes)
            except grpc.RpcError as error:
                if _push_applied(error):
                    pushed.add(shard)  # the push is in; its lookup failed
                else:
                    push_failed[shard] = ShardError.of(shard, self.addresses[shard], error)
                raise
            pushed.add(shard)  # before its reply is read, which may fail
            if values is not None and lookup is not None:
                self._place_rows(shard, lookup, wire.push_then_lookup_reply(values)[0], out)
            elif lookup is not None:
                self._lookup_into(shard, lookup, create, out)

        try:
            self._fan_out(list(work.items()), run)
        except ShardError as error:
            # the push is applied only where every shard of its calls says so; anything
            # else (a push refused, or a failure before any call ran) is no silent loss
            push_shards = {shard for shard, _ in push_calls}
            if push_shards <= pushed:  # a lookup failed after the push went in
                self._push_done(steps, step)
                raise
            failure = push_failed[min(push_failed)] if push_failed else error
            failure.succeeded = sorted(pushed & push_shards)
            failure.failed = sorted(push_shards - pushed)
            raise PushNotApplied(self._push_failure(failure, steps, step)) from None
        self._push_done(steps, step)
        return out

    def _fused_call(
        self,
        shard: int,
        push: list[Batch],
        lookup: list[Batch],
        steps: dict[str, int],
        pushes: dict[str, tuple[np.ndarray, np.ndarray]],
        create: bool,
    ) -> Any:
        """One PushThenLookup to a shard: its reply, undecoded (its push is applied); None
        (nothing done) where it does not fit in one message each way, or the shard refused
        it as too large or does not know it."""
        if not self._fits_fused(shard, push, lookup):
            return None
        request_bytes, bulk = _fused_bytes(push, lookup)
        request, fields = wire.encode_push_then_lookup_in_place(
            [(name, dim, steps[name], (8 * keys.size, 4 * dim * keys.size))
             for name, dim, keys, _ in push],
            [(name, dim, create, (_wire_keys(keys),)) for name, dim, keys, _ in lookup],
        )  # fmt: skip
        _fill_push(push, fields, pushes)
        identity = self._push_identity(shard, [name for name, *_ in push])
        try:
            reply = self._push_then_lookup_one[shard](
                request,
                timeout=self.timeout_s,
                metadata=self._metadata(shard, *wire.declared(len(request)), *identity),
            )
        except grpc.RpcError as error:
            if _push_applied(error):  # whatever else it says: the push must not go again
                raise
            if error.code() is grpc.StatusCode.UNIMPLEMENTED:  # an older shard
                self._fuses[shard] = False
                return None
            if self._refused_as_too_large(shard, error, bulk):  # before it was read
                return None
            if self._refused_per_call(shard, error, request_bytes):  # likewise
                return None
            raise
        return reply

    def _fuses_parts(self, shard: int, push: list[list[Batch]], lookup: list[list[Batch]]) -> bool:
        """Whether a shard's push calls and lookup calls go as at most one fused call:
        one of each that fits it (_fits_fused), or calls of one kind only, one at most."""
        if len(push) > 1 or len(lookup) > 1:
            return False
        return not (push and lookup) or self._fits_fused(shard, push[0], lookup[0])

    def _fits_fused(self, shard: int, push: list[Batch], lookup: list[Batch]) -> bool:
        """Whether the shard takes this push and lookup as one PushThenLookup: it knows
        the call, both ways fit in one message, and the request in one call."""
        request_bytes, bulk = _fused_bytes(push, lookup)
        return (
            self._fuses[shard]
            and bulk <= self._one_message_bytes[shard]
            and request_bytes <= self._fused_call_bytes[shard]
        )

    def _refused_per_call(self, shard: int, error: grpc.RpcError, bulk: int) -> bool:
        """Whether the shard refused a PushThenLookup of `bulk` request bytes as over its
        per-call limit (CallLimits, before any handler ran: nothing applied); then this
        shard's fused calls stay below `bulk`."""
        refused = refusal_of(error)[0] is Reason.CALL_TOO_LARGE
        if refused:
            with self._lock:
                self._fused_call_bytes[shard] = min(self._fused_call_bytes[shard], bulk - 1)
        return refused

    def table_step(self, name: str) -> int:
        """The table's step clock on the cluster: the largest step pushed to it on any shard
        (0: none yet). It is kept across shard restarts and in snapshots, so a trainer that
        starts again, or loads a snapshot, continues from it."""
        return max(int(described.get("current_step", 0)) for described in self.describe(name))

    def load_snapshot(self, name: str, *, progress: Progress | None = None) -> dict[str, Any]:
        result = super().load_snapshot(name, progress=progress)
        with self._lock:  # the tables' clocks are the snapshot's now: learn them again
            self._steps.clear()
        return result

    def _reserve_steps(self, tables: list[str], step: int | None) -> dict[str, int]:
        """The step of a push to each table: the one given, or one more than the last push's
        (reserved at once, so concurrent pushes to a table get distinct steps). A table this
        client has not pushed to yet continues from its clock on the cluster (table_step)."""
        if step is not None:
            for table in tables:
                check_step(f"table {table!r}", step)
            return dict.fromkeys(tables, int(step))
        with self._lock:
            unknown = [table for table in tables if table not in self._steps]
        learned = {table: self.table_step(table) for table in unknown}
        with self._lock:
            for table in tables:
                self._steps[table] = self._steps.get(table, learned.get(table, 0)) + 1
            return {table: self._steps[table] for table in tables}

    def _release_steps(self, steps: dict[str, int]) -> None:
        """Give back the steps of a failed push, where no later push took one since."""
        with self._lock:
            for table, step in steps.items():
                if self._steps.get(table) == step:
                    self._steps[table] = step - 1

    def _route(
        self,
        tables: dict[str, tuple[int, np.ndarray]],
        bytes_per_key: Callable[[int], int],
        *,
        pieces: bool = False,
    ) -> list[tuple[int, list[Batch]]]:
        """The calls to make: (shard, [(table, dim, keys, their positions, ascending)]),
        each call at most max_call_bytes (bytes_per_key(dim) per key); a shard with no keys
        gets none. Key k goes to shard k % N, or, of a table placed whole, to the table's
        owner_shard. `pieces` (lookups): a shard's part of LOOKUP_PIECE_BYTES or more goes
        as up to LOOKUP_PIECES calls at once, so that the shard looks one piece up while
        another's reply is on the wire (a lookup changes nothing a failed piece leaves
        half done). A push is not cut into pieces: its part for a shard is one call, applied
        whole or not at all, unless that part is over max_call_bytes (256 MiB by default),
        which only several calls can carry, and a failed one of them leaves the shard's part
        applied in part (its ShardError then does not count the shard as succeeded)."""
        calls: list[tuple[int, list[Batch]]] = []
        per_shard: list[list[Batch]] = [[] for _ in self.addresses]
        for name, (dim, keys) in tables.items():
            config = self.table_config(name)
            owner = single_shard(config, self.num_shards)
            if owner is not None:  # every key on one shard: no split
                if keys.size:
                    per_shard[owner].append((name, dim, keys, np.arange(keys.size)))
                continue
            grouped, order, bounds = group_by_shard(config, keys, self.num_shards)
            for shard in range(self.num_shards):
                span = slice(bounds[shard], bounds[shard + 1])
                if order[span].size:
                    per_shard[shard].append((name, dim, grouped[span], order[span]))
        for shard, batches in enumerate(per_shard):
            limit = self.max_call_bytes
            if pieces:
                total = sum(keys.size * bytes_per_key(dim) for _, dim, keys, _ in batches)
                count = min(LOOKUP_PIECES, total // LOOKUP_PIECE_BYTES)
                widest = max(bytes_per_key(dim) for _, dim, _, _ in batches) if batches else 0
                if count > 1:  # rounded up to whole keys: count pieces, not one more
                    limit = min(limit, -(-total // count) + widest - 1)
            call: list[Batch] = []
            room = limit
            for name, dim, keys, at in batches:
                start = 0
                while start < keys.size:
                    if room < bytes_per_key(dim) and call:  # full: the rest in another call
                        calls.append((shard, call))
                        call, room = [], limit
                    take = min(keys.size - start, max(1, room // bytes_per_key(dim)))
                    call.append((name, dim, keys[start : start + take], at[start : start + take]))
                    room -= take * bytes_per_key(dim)
                    start += take
            if call:
                calls.append((shard, call))
        return calls

    def _fan_out(
        self, calls: list[tuple[int, Work]], call: Callable[[int, Work], Any]
    ) -> list[Any]:
        """call(shard, work) for every call (work: its batches, or what the caller pairs
        with the shard), all at once but at most PIECES_AT_ONCE to one shard: a shard's
        calls go in that many lanes, each lane's calls one after another (a shard's
        in-flight byte budget is sized for two calls at once, and a call of a split push
        or assign may carry max_call_bytes). The last lane runs in this thread, the others
        on the client's call threads (persistent: a gRPC future would start a thread per
        call; there are two a shard, so every lane of a fan-out runs at once). Returns the
        results in call order once every call has ended; if any failed, raises the first
        failure as a ShardError naming its shard, with `succeeded` set to the shards whose
        calls went through."""
        if not calls:
            return []
        self._learn_lives([shard for shard, _ in calls])
        lanes: dict[tuple[int, int], list[int]] = {}
        seen: collections.Counter[int] = collections.Counter()
        for index, (shard, _) in enumerate(calls):
            lanes.setdefault((shard, seen[shard] % PIECES_AT_ONCE), []).append(index)
            seen[shard] += 1
        outcomes: list[Any] = [None] * len(calls)

        def run_lane(indices: list[int]) -> None:
            for index in indices:
                shard, work = calls[index]
                try:
                    outcomes[index] = self._on(shard, lambda i, _, w=work: call(i, w))
                except ShardError as error:
                    outcomes[index] = error

        *others, last = lanes.values()
        futures = [self._calls.submit(run_lane, indices) for indices in others]
        try:
            run_lane(last)
        finally:  # none left running into the caller's output, whatever the last raised
            wait(futures)
        for future in futures:
            future.result()  # raises what a lane raised other than a ShardError (a bug)
        failures = [outcome for outcome in outcomes if isinstance(outcome, ShardError)]
        if failures:
            # a shard counts only if every one of its calls went through (a part of more
            # than max_call_bytes goes as several calls, which may fail one by one)
            failed = {shard for (shard, _), outcome in zip(calls, outcomes, strict=True)
                      if isinstance(outcome, ShardError)}  # fmt: skip
            failures[0].succeeded = sorted({shard for shard, _ in calls} - failed)
            failures[0].failed = sorted(failed)
            raise failures[0]
        return outcomes


def _push_request(
    batches: list[Batch],
    steps: dict[str, int],
    pushes: dict[str, tuple[np.ndarray, np.ndarray]],
) -> bytes:
    """A one-message push of these batches, serialized: each batch's keys and gradients
    (its rows of pushes[table][1], at its positions) written straight into the message's
    bytes (wire.encode_batches_in_place): one copy of the gradients, no gather and join."""
    request, fields = wire.encode_batches_in_place(
        [(name, dim, steps[name], (8 * keys.size, 4 * dim * keys.size))
         for name, dim, keys, _ in batches]
    )  # fmt: skip
    _fill_push(batches, fields, pushes)
    return request


def _fill_push(
    batches: list[Batch],
    fields: list[list[np.ndarray]],
    pushes: dict[str, tuple[np.ndarray, np.ndarray]],
) -> None:
    """Write each push batch's keys and gradients into its fields' views (of a request's
    bytes, from wire's in-place encoders)."""
    for (name, dim, keys, at), (key_bytes, grad_bytes) in zip(batches, fields, strict=True):
        key_bytes.view("<i8")[...] = keys
        grads, out = pushes[name][1], grad_bytes.view("<f4").reshape(keys.size, dim)
        if keys.size == grads.shape[0]:  # every key of the table in this call: in order
            out[...] = grads
        else:  # "clip": positions are valid; numpy buffers `out` only for mode="raise"
            np.take(grads, at, axis=0, out=out, mode="clip")


def _fused_bytes(push: list[Batch], lookup: list[Batch]) -> tuple[int, int]:
    """A PushThenLookup's request bulk (the push's keys and gradients, the lookup's keys),
    and its larger way's bulk (that or the reply's rows)."""
    request = sum(_key_and_row_bytes(dim) * keys.size for _, dim, keys, _ in push)
    request += sum(8 * keys.size for _, _, keys, _ in lookup)
    return request, max(request, _reply_bytes(lookup))


def _push_applied(error: grpc.RpcError) -> bool:
    """Whether a failed PushThenLookup's shard says its push was applied (trailing
    metadata wire.PUSHED_HEADER): then only its lookup failed."""
    return any(key == wire.PUSHED_HEADER for key, _ in error.trailing_metadata() or ())


def _key_and_row_bytes(dim: int) -> int:
    """A key's bulk bytes in a push or an assign: the key (int64) and its row (float32)."""
    return 8 + 4 * dim


def _reply_bytes(batches: list[Batch]) -> int:
    return sum(4 * dim * keys.size for _, dim, keys, _ in batches)


def _pooling_device(
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


def _distinct_live(keys: np.ndarray) -> bool:
    """Whether keys (int64, 1-D) are distinct and none is padding (< 0): then a call sends
    them as given, with no dedup and no reordering. The compiled check decides (a bitmap
    or a hash set, compiled.all_distinct; a sort without the host kernels)."""
    if keys.size == 0 or keys.min() < 0:
        return False
    distinct = all_distinct(keys)
    return distinct if distinct is not None else np.unique(keys).size == keys.size


def _wire_keys(keys: np.ndarray) -> np.ndarray:
    """Keys as the wire carries them: C-contiguous little-endian int64 (no copy if so)."""
    return np.ascontiguousarray(keys, "<i8")
