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

It composes the parts that do the work, each a module of its own: routing (keys to shards
to calls), transport (the calls to one shard and their fan-out), pushes (a push's steps and
failures), push_then_lookup (the fused call), pooled_lookup (features pooled per bag) and
in_flight (the pushes a torch module holds or sends, which the client's later calls wait for).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tierps.client.admin import ClusterAdmin, Progress, RetryPolicy
from tierps.client.formats import Bags, as_array, float_array, to_bags
from tierps.client.in_flight import PendingPushes, PushSender
from tierps.client.initial_rows import InitialRows, read_initial_rows
from tierps.client.pooled_lookup import (
    Feature,
    FeatureBatch,
    PooledLookup,
    PreparedDevice,
    PreparedPooling,
    RowCalls,
    feature_spec,
    pooling_device,
    prepare,
)
from tierps.client.pooling import Combiner, distinct_keys, stacked_pooling_layout, unpool
from tierps.client.push_then_lookup import PushThenLookup
from tierps.client.pushes import Pushes
from tierps.client.routing import Router, distinct_live, key_and_row_bytes
from tierps.client.security import ChannelSecurity
from tierps.client.transport import ClusterLink, Transport
from tierps.core.config import TableConfig
from tierps.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    TableNotFoundError,
)
from tierps.proto import wire

if TYPE_CHECKING:  # torch is imported only by a call that pools on a torch device
    import torch

DEFAULT_MAX_CALL_BYTES = 256 << 20  # bulk bytes of one call (request or reply) per shard


class EmbeddingClient(ClusterAdmin):
    """A trainer's client of the cluster whose shard i listens at addresses[i] (None: the
    addresses in TIERPS_ADDRESSES, as `tierps cluster` prints them); a context manager. It
    has every ClusterAdmin call (create_table, drop_table, list_tables, describe,
    save_snapshot, load_snapshot, list_snapshots, stats) and the data calls.

    Every data call has a deadline of timeout_s per shard call. A call failing with UNAVAILABLE is
    retried by gRPC as `retry` says; any failure a shard gives is raised as a ShardError
    naming the shard and its address. Bad input is refused before anything is sent.

    A push a torch module's backward holds or sends in the background (push_in_flight) is
    seen by every later call of this client on its tables (lookups, pushes, assign,
    describe, evict, snapshots, drop_table): the module sends and finishes it first.
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
        self._configs: dict[str, TableConfig] = {}
        self._stale_dims: dict[str, int] = {}  # the dim a table had when it was found re-created
        self._lock = threading.Lock()
        self._in_flight = PendingPushes()
        # The parts call back this client's public methods late bound (lambda), so that a
        # subclass's or a wrapper's table_config, table_step or push_unique sees every call,
        # a pooled lookup's push included.
        self._router = Router(
            lambda table: self.table_config(table), self.num_shards, max_call_bytes
        )
        link = ClusterLink(
            self.addresses,
            lambda: self.timeout_s,
            self._metadata,
            self._learn_lives,
            self._know_generations,
            self._relearn_generations,
            self._forget_stale_config,
        )
        self._transport = Transport(
            link,
            self._router,
            self._channels,
            self._plain_channels,
            chunk_bytes=chunk_bytes,
            one_message_bytes=one_message_bytes,
        )
        self._pushes = Pushes(self._transport, self._router, lambda table: self.table_step(table))
        self._fused = PushThenLookup(
            self._transport,
            self._router,
            self._pushes,
            lambda pushes, step: self.push_unique(pushes, step),
        )
        self._row_calls = RowCalls(
            lambda table: self.table_config(table).dim,
            self._lookup_unique,
            lambda pushes, step: self.push_unique(pushes, step),
            self._push_then_lookup,
            self._router.spread,
        )

    def close(self) -> None:
        self._transport.close()
        super().close()

    # -- pushes in flight ------------------------------------------------------------------------

    def push_in_flight(self, tables: Iterable[str], sender: PushSender) -> None:
        """`sender` (a torch module) holds or sends a push to `tables` that backward has
        returned from: this client's later calls on those tables have it send and finish
        its pushes first (sender.wait_for_pushes), except on a module's background thread
        (in_flight.mark_sender_thread), which sends its calls in order itself."""
        self._in_flight.add(tables, sender)

    def _lookup_unique(
        self,
        tables: dict[str, tuple[int, np.ndarray]],
        create: bool,
        out: dict[str, np.ndarray] | None = None,
        *,
        read_only: bool = False,
    ) -> dict[str, np.ndarray]:
        """Transport.lookup_unique, after the pending pushes to its tables."""
        self._in_flight.wait(tables)
        return self._transport.lookup_unique(tables, create, out, read_only=read_only)

    def _push_then_lookup(
        self,
        pushes: dict[str, tuple[np.ndarray, np.ndarray]],
        step: int | None,
        tables: dict[str, tuple[int, np.ndarray]],
        create: bool,
    ) -> dict[str, np.ndarray]:
        """PushThenLookup.push_then_lookup, after the pending pushes to its tables."""
        self._in_flight.wait([*pushes, *tables])
        return self._fused.push_then_lookup(pushes, step, tables, create)

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    @property
    def chunk_bytes(self) -> int:
        """The bulk bytes of one message of a streamed call (the transport's, which sends)."""
        return self._transport.chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, value: int) -> None:
        self._transport.chunk_bytes = value

    @property
    def max_call_bytes(self) -> int:
        """The bulk bytes of one call (request or reply) per shard, more going as several
        calls (the router's, which cuts the calls)."""
        return self._router.max_call_bytes

    @max_call_bytes.setter
    def max_call_bytes(self, value: int) -> None:
        self._router.max_call_bytes = value

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
        self._learn([config])
        if rows is not None:
            if not created:  # another client created it after the check above
                raise FailedPreconditionError(
                    f"{where} was created by another caller meanwhile: initial rows expected "
                    f"for a table this call creates, so none were written"
                )
            self.assign(config.name, *rows)
        return created

    def drop_table(self, name: str) -> None:
        self._in_flight.wait([name])
        self._forget_table(name)
        super().drop_table(name)

    def _learn(self, configs: Iterable[TableConfig]) -> None:
        """Remember these tables' configs."""
        with self._lock:
            for config in configs:
                self._configs[config.name] = config

    def _forget_stale_config(self, name: str, expected: int, got: int) -> bool:
        """A shard refused the dim `got` for a table whose dim is `expected`. Where `got` is
        the dim this client knew (its calls sent it), the table was created again since:
        forget what the client knew of it, to learn it again, and say True. So it is for a
        late refusal of the same calls (another shard's, or one that came back after a
        concurrent call relearned the table), which forgets nothing more. Else the caller's
        own rows had another dim: nothing changes (False)."""
        if got == expected:
            return False
        with self._lock:
            config = self._configs.get(name)
            forget = config is not None and config.dim == got
            if forget:
                self._stale_dims[name] = got
                self._forget_learned(name)
            elif self._stale_dims.get(name) != got:
                return False
        if forget:
            self._pushes.forget(name)  # its own lock
        return True

    def _forget_table(self, name: str) -> None:
        """Forget what this client learned of a table (its config, generations and step),
        to learn it again at its next call: the table was dropped, or created again."""
        with self._lock:
            self._forget_learned(name)
        self._pushes.forget(name)

    def _forget_learned(self, name: str) -> None:
        """_forget_table's part under the client's lock (held by the caller)."""
        self._configs.pop(name, None)
        for known in self._generations:
            known.pop(name, None)

    def table_config(self, name: str) -> TableConfig:
        """The config of a table (asked of shard 0 once, then remembered)."""
        with self._lock:
            if name in self._configs:
                return self._configs[name]
        configs = {config.name: config for config in self.list_tables()}
        self._learn(configs.values())
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

    def _rows_given(
        self, table: str, where: str, field: str, values: Any, shape: tuple[int, ...], dim: int
    ) -> tuple[np.ndarray, int]:
        """A call's rows [*shape, dim] as float32 [n, dim], and the dim. Rows that do not fit
        the dim this client knows have it ask the cluster once: the table may have been
        created again with another dim, which is then the one they are checked against."""
        expected = "[*keys.shape, dim]"
        try:
            return float_array(where, field, values, (*shape, dim), expected).reshape(-1, dim), dim
        except InvalidArgumentError:
            with self._lock:
                self._configs.pop(table, None)
            config = self.table_config(table)
            if config.dim == dim:
                raise
            self._forget_table(table)  # created again: its generations and step are new too
            self._learn([config])
            rows = float_array(where, field, values, (*shape, config.dim), expected)
            return rows.reshape(-1, config.dim), config.dim

    def lookup(
        self, table: str, keys: Any, *, create: bool = True, copy: bool = True
    ) -> np.ndarray:
        """Weights [*keys.shape, dim] of keys (any integer array), in their order. Keys < 0
        give zero rows. create=True (training) stores rows for new keys; create=False
        (evaluation) returns their initial values and stores nothing. copy=False: where
        the rows arrive in the keys' order (distinct keys >= 0, one shard), a read-only view
        of the reply instead of a writable copy."""
        where, keys, flat, dim = self._dense_call(table, keys)
        lookup_unique = self._lookup_unique
        if distinct_live(flat):  # sent as given: the rows come back in the keys' order
            rows = lookup_unique({table: (dim, flat)}, create, read_only=not copy)[table]
            return rows.reshape(*keys.shape, dim)
        unique, inverse = distinct_keys(flat)
        if unique.size == 0:  # padding only
            return np.zeros((*keys.shape, dim), np.float32)
        rows = lookup_unique({table: (dim, unique)}, create, read_only=True)[table]
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
        grads, dim = self._rows_given(table, where, "grads", grads, keys.shape, dim)
        if distinct_live(flat):  # pushed as given: no sums
            return self.push_unique({table: (flat, grads)}, step)
        unique, inverse = distinct_keys(flat)
        bags = Bags(flat, np.arange(flat.size + 1, dtype=np.int64), None, (flat.size,))
        layout = stacked_pooling_layout([(bags, inverse, Combiner.SUM)], unique.size)
        return self.push_unique({table: (unique, unpool(layout, grads))}, step)

    def assign(self, table: str, keys: Any, values: Any) -> int:
        """Set the weights [*keys.shape, dim] of keys and reset their optimizer state.
        Where a key repeats, its last value wins; keys < 0 are ignored."""
        where, keys, flat, dim = self._dense_call(table, keys)
        values, dim = self._rows_given(table, where, "values", values, keys.shape, dim)
        self._in_flight.wait([table])
        last = flat.size - 1 - np.unique(flat[::-1], return_index=True)[1]
        last = last[flat[last] >= 0]
        calls = self._router.route({table: (dim, flat[last])}, key_and_row_bytes)
        transport = self._transport
        replies = transport.fan_out(
            calls, lambda shard, batches: transport.assign_call(shard, batches, values, last)
        )
        return sum(reply.num_keys for reply in replies)

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
        value = (
            keys
            if offsets is None and per_sample_weights is None
            else (keys, offsets, per_sample_weights)
        )
        on = pooling_device({where: value}, device)
        if on is not None:
            spec = feature_spec(table, where, value, table, combiner)
            return PreparedDevice(self._row_calls, on, [spec], include_last_offset).fetch(create)
        batch = to_bags(
            where,
            keys,
            offsets,
            per_sample_weights,
            include_last_offset=include_last_offset,
        )
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
        return self.prepare_pooled(batch, features, include_last_offset, device).fetch(create)

    def prepare_pooled(
        self,
        batch: Mapping[str, FeatureBatch],
        features: Sequence[Feature],
        include_last_offset: bool = False,
        device: str | torch.device | None = None,
    ) -> PreparedPooling:
        """lookup_pooled_features up to its RPCs: the checks, the dedup, the routing's inputs
        and the pooling layout, none of which depends on the rows (a pipelined trainer does
        this in its own thread and only the fetch in the background). Its fetch(create)
        makes the RPCs and pools: a PooledLookup, as lookup_pooled_features returns it. A
        batch on the host gives a PreparedHost, whose fetch may first apply a push (its
        `after`), in one call per shard with the lookup."""
        return prepare(self._row_calls, batch, features, include_last_offset, device)

    def push_unique(
        self, pushes: dict[str, tuple[np.ndarray, np.ndarray]], step: int | None
    ) -> int:
        """Push, per table, gradients already summed per key: pushes maps a table to its
        distinct keys >= 0 and their gradients [u, dim], as PooledLookup.push_gradients and
        TrainerGroup compute them (nothing is summed again). A table with no keys is not
        pushed and takes no step. `step` as in push_gradients. Returns the number of keys
        updated."""
        self._in_flight.wait(pushes)
        return self._pushes.push_unique(pushes, step)

    def table_step(self, name: str) -> int:
        """The table's step clock on the cluster: the largest step pushed to it on any shard
        (0: none yet). It is kept across shard restarts and in snapshots, so a trainer that
        starts again, or loads a snapshot, continues from it."""
        return max(int(described.get("current_step", 0)) for described in self.describe(name))

    def describe(self, name: str) -> list[dict[str, Any]]:
        self._in_flight.wait([name])
        return super().describe(name)

    def evict(self, table: str) -> dict[str, Any]:
        self._in_flight.wait([table])
        return super().evict(table)

    def save_snapshot(
        self, name: str, *, base: str | None = None, progress: Progress | None = None
    ) -> dict[str, Any]:
        self._in_flight.wait()
        return super().save_snapshot(name, base=base, progress=progress)

    def load_snapshot(self, name: str, *, progress: Progress | None = None) -> dict[str, Any]:
        self._in_flight.wait()
        result = super().load_snapshot(name, progress=progress)
        self._pushes.forget()  # the tables' clocks are the snapshot's now: learn them again
        return result

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
