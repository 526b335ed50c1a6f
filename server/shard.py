"""The shard: the tables of one shard over the storage cascade, behind the checks the wire
needs (key ownership, dims, sizes) and the locking that makes snapshots consistent."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from tierps.core.config import Placement, WritePolicy, key_shards, owner_shard
from tierps.core.errors import TableReplacedError, UnavailableError
from tierps.core.ownership import first_foreign_key
from tierps.core.xp import gpu_arrays
from tierps.server.config import ServerConfig
from tierps.server.ledger import KEY_PREFIX as PUSH_RECORDS
from tierps.server.ledger import PushId, PushLedger
from tierps.server.lives import Lives
from tierps.storage import (
    BackendError,
    EmbeddingStore,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    TableConfig,
    snapshot_catalog,
    snapshot_format,
    snapshot_writer,
)
from tierps.storage.snapshot_format import Progress
from tierps.storage.snapshot_reader import Snapshot
from tierps.storage.snapshot_writing_marker import collect_abandoned_parts
from tierps.storage.table import FLUSH_CHUNK_BYTES, EmbeddingTable

SNAPSHOT_CHUNK_ROWS = 65536
MAINTENANCE_TICK_S = 0.1  # how often the background thread looks at the store
RECOVERY_INTERVAL_S = 1.0  # a store that cannot write is retried this often
# A background flush writes chunks this large, holding a table's lock for one chunk at a
# time: about 1-2 ms of RocksDB writes here (a shutdown or snapshot flush uses 4 MiB)
BACKGROUND_FLUSH_CHUNK_BYTES = 256 << 10
BACKGROUND_FLUSH_PAUSE_S = 0.0002  # between chunks, so waiting calls get the table's lock
# The tables of one data call are served at once by this many threads (each table has its
# own lock, and the storage kernels release the GIL), so that a call carrying several tables
# (an EmbeddingBagCollection's features) uses more than one core.
TABLE_THREADS = max(1, min(8, os.cpu_count() or 1))
log = logging.getLogger("tierps.server")
Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass(frozen=True)
class LookupBatch:
    """One table's keys of a Lookup call."""

    table: str
    dim: int
    keys: np.ndarray
    create: bool


@dataclass(frozen=True)
class PushBatch:
    """One table's gradients of a PushGradients call."""

    table: str
    dim: int
    keys: np.ndarray
    grads: np.ndarray
    step: int


@dataclass(frozen=True)
class AssignBatch:
    """One table's values of an Assign call."""

    table: str
    dim: int
    keys: np.ndarray
    values: np.ndarray


class Gate:
    """Many data calls at once, or one exclusive section (a snapshot cut, a load, a drop).
    An exclusive waiter blocks new data calls, so it is never starved."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if self._active == 0:
                    self._cond.notify_all()

    def contended(self) -> bool:
        """Whether an exclusive section waits: long shared work (a background flush) should
        let go at its next chance, as new data calls already wait behind it. Read without
        the lock: a hint, and an int read is atomic."""
        return self._waiting > 0

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            while self._exclusive or self._active:
                self._cond.wait()
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


def _hit_rate(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else 0.0


def _lifecycle(stats: dict[str, Any]) -> dict[str, float]:
    """A table's feature-lifecycle figures as TableDescription.lifecycle names them
    ("admission.keys_counted", "eviction.removed_total", "adaptive.keys_promoted", ...);
    empty when no such feature is on."""
    return {
        f"{feature}.{name}": float(value)
        for feature in ("admission", "eviction", "adaptive")
        for name, value in (stats.get(feature) or {}).items()
    }


class Shard:
    """Tables of shard `shard_id` of `num_shards`, stored under data_dir.

    The data dir remembers which shard it belongs to: opening it as another shard, or with
    another shard count, is refused (its keys would be on the wrong shard; load a snapshot to
    reshard instead).

    Every shard keeps the config of every table (ListTables and DescribeTable agree across
    the cluster); a table placed whole (placement="table") stores rows only on its owner,
    owner_shard(config, num_shards), and the other shards refuse its data calls.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.shard_id = config.shard_id
        self.num_shards = config.num_shards
        self.where = f"shard {self.shard_id} of {self.num_shards}"
        self.started = time.time()
        self.metrics_port = 0  # the bound /metrics port, set by the daemon serving it
        # Per table: [keys looked up, keys pushed] since the start (Stats, metrics, top).
        self._key_counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        self._key_counts_lock = threading.Lock()
        self.data_id, self.data_created, new_dir = self._check_identity(Path(config.data_dir))
        if config.require_gpu:
            module, why = gpu_arrays(config.gpu_arrays)
            if module is None:
                raise FailedPreconditionError(f"{self.where}: require_gpu is set, but {why}")
        self.store = EmbeddingStore(
            Path(config.data_dir) / "rocksdb",
            shard_id=self.shard_id,
            gpu_cache_bytes=config.gpu_cache_bytes,
            gpu_arrays=config.gpu_arrays,
            sync_writes=config.sync_writes,
            max_step_leap=config.max_step_leap,
        )
        collect_abandoned_parts(config.snapshot_dir, self.shard_id, self.num_shards)
        self._gate = Gate()
        self._table_threads = ThreadPoolExecutor(
            TABLE_THREADS, thread_name_prefix=f"tierps-tables-{self.shard_id}"
        )
        # A push's tables are prepared and stored here while its calling thread holds their
        # locks: work that never waits for a table lock, so a lookup queued on the table
        # threads behind such a lock cannot hold up the push that holds it.
        self._push_threads = ThreadPoolExecutor(
            TABLE_THREADS, thread_name_prefix=f"tierps-push-{self.shard_id}"
        )
        self._admin = threading.Lock()  # one table or snapshot change at a time
        # Tables a snapshot load is replacing now -> the snapshot: pushes and assigns to
        # them are refused (UNAVAILABLE: retried) from before the load stages its first row
        # until its swap, so none is acknowledged and then dropped by the swap.
        self._replacing: dict[str, str] = {}
        # Told whether the shard serves: False while a snapshot loads or while the store
        # cannot write; the server wires it to health.
        self.on_serving_change: Callable[[bool], None] = lambda serving: None
        self._loading = False
        self._store_ok = True
        self._serving = True
        self._publish_lock = threading.Lock()  # one health change at a time, in order
        self._stop = threading.Event()
        self._maintainer: threading.Thread | None = None
        self.flushes = 0  # background flushes completed
        self.last_flush: float | None = None  # when the last whole flush began
        try:
            for table in config.tables:
                self.owner(table)
                self.store.create_table(table)
            self.lives = Lives(Path(config.data_dir), self.where, self.data_id)
            self.ledger = PushLedger(
                self.store.write_metadata, self.store.metadata(PUSH_RECORDS), self.where
            )
            at_risk = any(
                t.write_policy is WritePolicy.WRITE_BACK or t.promote_after
                for t in self.store.tables()
            )
            self.lives.begin(at_risk)
        except BaseException:
            self.store.close()  # release RocksDB's lock: the data dir can be opened again
            raise
        if new_dir:
            log.warning(
                "%s starts on a new, empty data dir %s (data id %s): if this shard held rows "
                "before, they are not here, and every client that knew them is told "
                "(DATA_LOSS) at its next call", self.where, config.data_dir, self.data_id,
                extra={"shard_id": self.shard_id, "data_id": self.data_id},
            )  # fmt: skip
        if not self.lives.ended_cleanly:
            log.warning(
                "%s: its previous life %d ended without a clean stop (killed, crashed or lost "
                "power); %s", self.where, self.lives.life - 1,
                "clients that knew it are told, once" if self.lives.life - 1 in self.lives.unclean
                else "its tables are all write-through: nothing acknowledged is missing",
                extra={"shard_id": self.shard_id, "life": self.lives.life},
            )  # fmt: skip

    def _check_identity(self, data_dir: Path) -> tuple[str, float, bool]:
        """The data dir's identity (SHARD.json): the shard it belongs to, and an id and
        creation time made once, when the dir is first used. Returns (id, created, whether
        the dir is new)."""
        data_dir.mkdir(parents=True, exist_ok=True)
        identity_file = data_dir / "SHARD.json"
        identity = {"shard_id": self.shard_id, "num_shards": self.num_shards}
        new = not identity_file.exists()
        stored = {} if new else json.loads(identity_file.read_text())
        if not new and {key: stored.get(key) for key in identity} != identity:
            raise FailedPreconditionError(
                f"data dir {data_dir} holds shard {stored.get('shard_id')} of "
                f"{stored.get('num_shards')}, but this daemon was started as {self.where}; "
                f"start it with those flags, or load a snapshot into a new data dir to reshard"
            )
        if "data_id" not in stored:  # a new dir, or one made before dirs had an id
            stored = {**identity, "data_id": uuid.uuid4().hex, "created": time.time()}
            snapshot_format.write_json_atomic(identity_file, stored)
        return str(stored["data_id"]), float(stored["created"]), new

    # -- checks ------------------------------------------------------------------------------

    def _table(self, name: str, dim: int | None = None) -> Any:
        table = self.store.table(name)
        if dim is not None and dim != table.config.dim:
            raise InvalidArgumentError(
                f"table {name!r} on {self.where}: field 'dim' expected {table.config.dim} "
                f"(the table's), got {dim}"
            )
        return table

    def _checked(self, name: str, dim: int, keys: np.ndarray) -> EmbeddingTable:
        """The table, after checking the caller's dim and that every key is this shard's:
        all of a call's batches are checked so before any is served. Keys in range (a
        direct-index table) are checked by the caller: the table's check_gradients and
        check_values do for pushes and assigns, a lookup checks them itself."""
        table = self._table(name, dim)
        self.check_keys(table.config, keys)
        return table

    def owner(self, config: TableConfig) -> int | None:
        """The shard holding a table placed whole, None for a row-placed one; a table_shard
        outside this cluster is refused (InvalidArgumentError naming table, field and shard)."""
        if config.placement is not Placement.TABLE:
            return None
        try:
            return owner_shard(config, self.num_shards)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{error} (refused by {self.where})") from None

    def check_keys(self, config: TableConfig, keys: np.ndarray) -> None:
        """Refuse keys >= 0 that belong to another shard, naming the first; a table placed
        whole on another shard is refused whatever the keys."""
        if self.num_shards == 1:
            return
        owner = self.owner(config)
        if owner is not None:
            if owner != self.shard_id:
                chosen = (
                    f"table_shard={config.table_shard}" if config.table_shard >= 0
                    else "table_shard=-1: the shard chosen from its name"
                )  # fmt: skip
                raise InvalidArgumentError(
                    f"table {config.name!r} is placed whole on shard {owner} "
                    f"(placement='table', {chosen}), not on {self.where}; send its keys "
                    f"to shard {owner}"
                )
            return
        index = first_foreign_key(config, keys, self.num_shards, self.shard_id)
        if index >= 0:
            shard = int(key_shards(config, keys[index : index + 1], self.num_shards)[0])
            raise InvalidArgumentError(
                f"table {config.name!r}: key {int(keys[index])} at index {index} belongs to "
                f"shard {shard}, not to {self.where} (a key k lives on shard "
                f"k % {self.num_shards})"
            )

    # -- data calls --------------------------------------------------------------------------

    def _each_table(
        self,
        work: Callable[[Item], Result],
        items: Sequence[Item],
        threads: ThreadPoolExecutor | None = None,
    ) -> list[Result]:
        """work(item) for each table's item of a call (a call names a table once): the first
        in this thread, the others at once on the shard's table threads (or `threads`).
        Every item runs to its end; then the first failure, in the call's order, is raised."""
        outcomes = self._each_outcome(work, items, threads)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes

    def _each_outcome(
        self,
        work: Callable[[Item], Result],
        items: Sequence[Item],
        threads: ThreadPoolExecutor | None = None,
    ) -> list[Any]:
        """_each_table's runs: each item's result, or the exception it raised."""
        if len(items) == 1:
            try:
                return [work(items[0])]
            except BaseException as error:  # noqa: BLE001 - the caller raises it
                return [error]
        pool = self._table_threads if threads is None else threads
        futures = [pool.submit(work, item) for item in items[1:]]
        outcomes: list[Any] = []
        try:
            outcomes.append(work(items[0]))
        except BaseException as error:  # noqa: BLE001 - returned, in order
            outcomes.append(error)
        for future in futures:
            error = future.exception()
            outcomes.append(future.result() if error is None else error)
        return outcomes

    def lookup(
        self, batches: list[LookupBatch], out: Sequence[np.ndarray] | None = None
    ) -> list[np.ndarray]:
        """Weights of each batch's keys; every batch is checked before any is looked up.
        out: an array [n, dim] per batch to write them into (EmbeddingTable.lookup's out),
        such as views of the reply's bytes; else new arrays."""
        with self._gate.shared():
            targets = self._checked_lookup(batches)
            rows = self._serve_lookup(targets, batches, out)
        self._count_keys(batches, 0)
        return rows

    def _checked_lookup(self, batches: list[LookupBatch]) -> list[EmbeddingTable]:
        """Each lookup batch's table, every batch checked (dim, shard, key range)."""
        targets = [self._checked(batch.table, batch.dim, batch.keys) for batch in batches]
        for target, batch in zip(targets, batches, strict=True):
            target.check_key_range(np.asarray(batch.keys, dtype=np.int64))
        return targets

    def _serve_lookup(
        self,
        targets: list[EmbeddingTable],
        batches: list[LookupBatch],
        out: Sequence[np.ndarray] | None,
    ) -> list[np.ndarray]:
        outs = [None] * len(batches) if out is None else list(out)
        return self._each_table(
            lambda item: item[0].lookup(item[1].keys, create=item[1].create, out=item[2]),
            list(zip(targets, batches, outs, strict=True)),
        )

    def push_gradients(
        self,
        batches: list[PushBatch],
        push_id: PushId | None = None,
        generations: Sequence[int] | None = None,
    ) -> int:
        """Apply each table's gradients as one unit: every batch (its gradients, step, the
        generation it was made against, and the non-finite result of its update) is checked
        before any table changes, and one refusal changes none. `push_id`: the call's
        identity (server/ledger.py): a repeat of an applied call applies nothing again.
        `generations`: per batch, the generation of the table's rows it was made against
        (0: not known). Returns the distinct keys updated, over all batches."""
        with self._gate.shared():
            updated = self._push(batches, push_id, generations)
        self._count_keys(batches, 1)
        return updated

    def _push(
        self,
        batches: list[PushBatch],
        push_id: PushId | None,
        generations: Sequence[int] | None,
        then: Callable[[], None] = lambda: None,
    ) -> int:
        """push_gradients' work inside the gate: what the ledger says this call applied
        already is skipped, the rest checked and applied, then `then()` (a fused lookup's
        checks) runs before anything is applied."""
        if generations is not None and len(generations) != len(batches):
            raise InvalidArgumentError(
                f"push on {self.where}: metadata 'tierps-generations' expected one generation "
                f"per table batch ({len(batches)}), got {len(generations)}"
            )
        applied = self.ledger.begin(push_id) if push_id is not None else {}
        try:
            todo = [i for i, batch in enumerate(batches) if batch.table not in applied]
            checked = self._checked_push(
                [batches[i] for i in todo],
                None if generations is None else [generations[i] for i in todo],
            )
            then()
            self._apply_push(checked, applied)
        finally:
            if push_id is not None:
                self.ledger.end(push_id, applied)
        return sum(applied.get(batch.table, 0) for batch in batches)

    def _checked_push(
        self, batches: list[PushBatch], generations: Sequence[int] | None = None
    ) -> list[tuple[Any, ...]]:
        """Each push batch's table and its checked arguments, every batch checked (its
        gradients, step and generation included; a table a load is replacing refused)."""
        checked = []
        for index, batch in enumerate(batches):
            target = self._checked(batch.table, batch.dim, batch.keys)
            self._check_not_replacing(batch.table, "push")
            if generations is not None:
                self._check_generation(target, generations[index])
            checked.append((target, *target.check_gradients(batch.keys, batch.grads, batch.step)))
        return checked

    def _check_not_replacing(self, name: str, call: str) -> None:
        source = self._replacing.get(name)
        if source is not None:
            raise UnavailableError(
                f"table {name!r} on {self.where} is being replaced by the load of snapshot "
                f"{source!r}: this {call} was not applied; send it again after the load"
            )

    def _check_generation(self, table: EmbeddingTable, known: int) -> None:
        generation = table.generation
        if known and generation is not None and known != generation.id:
            raise TableReplacedError(
                f"table {table.config.name!r} on {self.where}: this push was made against "
                f"generation {known} of its rows, but they were replaced since: the table "
                f"holds {generation.describe()}. Nothing was applied; look the rows up again "
                f"before pushing"
            )

    def _apply_push(self, checked: list[tuple[Any, ...]], applied: dict[str, int]) -> None:
        """Apply checked push batches as one unit, adding each table applied to `applied`
        (table -> distinct keys updated). Every table's lock is taken (in name order: no
        deadlock between calls) and its update computed and checked on copies (prepare,
        on the push threads, which take no table lock) before any row is stored: a refusal
        undoes every table's push. A storage failure while storing raises, naming the
        tables of this call stored and not stored on this shard."""
        if not checked:
            return
        tables = [item[0] for item in checked]
        begun: dict[int, Any] = {}
        try:
            for index in sorted(range(len(checked)), key=lambda i: tables[i].config.name):
                begun[index] = tables[index].begin_push(checked[index][3])
            stores = self._each_table(
                lambda index: tables[index].prepare_push(begun[index], *checked[index][1:3]),
                list(range(len(checked))),
                self._push_threads,
            )
        except BaseException as error:
            _end_pushes(tables, {index: error for index in begun}, begun)
            raise
        outcomes = self._each_outcome(lambda store: store(), stores, self._push_threads)
        errors = {i: o for i, o in enumerate(outcomes) if isinstance(o, BaseException)}
        _end_pushes(tables, {i: errors.get(i) for i in begun}, begun)
        stored = {tables[i].config.name: n for i, n in enumerate(outcomes) if i not in errors}
        applied.update(stored)
        if not errors:
            return
        failure = errors[min(errors)]
        if not stored:
            raise failure
        missing = sorted(tables[i].config.name for i in errors)
        message = (
            f"{failure} (on {self.where}, this push's tables {sorted(stored)} were applied "
            f"and {missing} were not; the same call sent again applies only those)"
        )
        try:
            partial = type(failure)(message)
        except TypeError:  # an error made of other arguments (numpy's, cupy's out of memory)
            kind = ResourceExhaustedError if isinstance(failure, MemoryError) else BackendError
            partial = kind(message)
        partial.applied_tables = sorted(stored)  # type: ignore[attr-defined]  # told in trailers
        raise partial from failure

    def push_then_lookup(
        self,
        pushes: list[PushBatch],
        lookups: list[LookupBatch],
        out: Callable[[int], Sequence[np.ndarray] | None] = lambda _: None,
        push_id: PushId | None = None,
        generations: Sequence[int] | None = None,
    ) -> tuple[int, list[np.ndarray]]:
        """A push, then a lookup that sees it: every batch of both is checked before the
        push is applied (a refused call changes nothing); then the lookup is served, into
        out(the push's distinct keys updated) when that gives arrays. Returns (the push's
        distinct keys updated, the rows). A failure after the push was applied (the lookup's
        storage) is raised as it is: the push stays applied. push_id and generations: as
        push_gradients'."""
        with self._gate.shared():
            targets: list[EmbeddingTable] = []
            updated = self._push(
                pushes, push_id, generations, lambda: targets.extend(self._checked_lookup(lookups))
            )
            self._count_keys(pushes, 1)
            rows = self._serve_lookup(targets, lookups, out(updated))
        self._count_keys(lookups, 0)
        return updated, rows

    def _count_keys(self, batches: Sequence[LookupBatch | PushBatch], kind: int) -> None:
        """Count the batches' keys per table (kind 0: looked up, 1: pushed), once a call
        that succeeded."""
        with self._key_counts_lock:
            for batch in batches:
                self._key_counts[batch.table][kind] += int(batch.keys.size)

    def assign(self, batches: list[AssignBatch]) -> int:
        """Set each table's rows; every batch is checked before any is set."""
        with self._gate.shared():
            checked = []
            for batch in batches:
                target = self._checked(batch.table, batch.dim, batch.keys)
                self._check_not_replacing(batch.table, "assign")
                checked.append((target, *target.check_values(batch.keys, batch.values)))
            return sum(target.assign_checked(*args) for target, *args in checked)

    # -- tables ------------------------------------------------------------------------------

    def create_table(self, config: TableConfig) -> bool:
        """True if created, False if it existed with this config. A table placed whole
        with a table_shard outside this cluster is refused (InvalidArgumentError)."""
        self.owner(config)
        with self._admin:
            existed = config.name in {t.name for t in self.store.tables()}
            self.store.create_table(config)
            return not existed

    def drop_table(self, name: str) -> None:
        with self._admin, self._gate.exclusive():
            self.store.drop_table(name)
        with self._key_counts_lock:
            self._key_counts.pop(name, None)

    def list_tables(self) -> list[TableConfig]:
        return sorted(self.store.tables(), key=lambda config: config.name)

    def describe(self, name: str) -> dict[str, Any]:
        with self._gate.shared():  # not while a load or drop replaces tables
            return self._describe(name)

    def _describe(self, name: str) -> dict[str, Any]:
        table = self.store.table(name)
        stats = table.stats()
        return {
            "config": table.config,
            "shard_id": self.shard_id,
            "num_shards": self.num_shards,
            "tiers": [
                {
                    "name": tier,
                    "rows": figures["rows"],
                    "bytes": figures["bytes"],
                    "hits": figures["hits"],
                    "misses": figures["misses"],
                    "hit_rate": _hit_rate(figures["hits"], figures["misses"]),
                    "scratch_bytes": figures.get("scratch_bytes", 0),  # the host tier's
                }
                for tier, figures in stats["tiers"].items()
            ],
            "initialized": stats["initialized"],
            "created": stats["created"],
            "lifecycle": _lifecycle(stats),
            "current_step": table.current_step,
            "keys_looked_up": self._key_counts.get(name, (0, 0))[0],
            "keys_pushed": self._key_counts.get(name, (0, 0))[1],
            "generation": table.generation.id,
            "generation_snapshot": table.generation.snapshot or "",
        }

    def stats(self) -> dict[str, Any]:
        with self._gate.shared():
            tables = [self._describe(config.name) for config in self.list_tables()]
        return {
            "shard_id": self.shard_id,
            "num_shards": self.num_shards,
            "tables": tables,
            "rss_bytes": _proc_status_bytes("VmRSS"),
            "peak_rss_bytes": _proc_status_bytes("VmHWM"),
            "uptime_s": time.time() - self.started,
            "life": self.lives.life,
            "previous_life_clean": self.lives.ended_cleanly,
            "last_flush_unix_s": self.last_flush or 0.0,
            "writable": self.store.writable,
            "metrics_port": self.metrics_port,
            "data_id": self.data_id,
            "data_created_unix_s": self.data_created,
        }

    # -- eviction ----------------------------------------------------------------------------

    def evict(self, name: str) -> dict[str, int]:
        """Remove this shard's stale (steps_to_live) and small (min_l2_norm) rows of a table
        from every tier: {"removed": rows, "current_step": the table's step here}. A table
        with neither option removes nothing. Other calls on the table wait meanwhile."""
        with self._admin, self._gate.shared():  # not while a save, load or drop runs
            table = self.store.table(name)
            removed = table.evict()
        self._log_eviction(table, removed, "evict")
        return {"removed": removed, "current_step": table.current_step}

    def _log_eviction(self, table: EmbeddingTable, removed: int, cause: str) -> None:
        if table.evicts:
            log.info(
                "evicted %d rows of table %r (%s)", removed, table.config.name, cause,
                extra={"shard_id": self.shard_id, "table": table.config.name,
                       "rows_evicted": removed, "current_step": table.current_step},
            )  # fmt: skip

    # -- snapshots ---------------------------------------------------------------------------

    def _snapshot_root(self) -> Path:
        if self.config.snapshot_dir is None:
            raise FailedPreconditionError(
                f"{self.where} has no snapshot directory: start it with --snapshot-dir"
            )
        return Path(self.config.snapshot_dir)

    def save_part(self, name: str, save_id: str) -> Iterator[Progress]:
        """Write this shard's part of snapshot `name`. Data calls wait while every table is
        flushed and a RocksDB snapshot of each is taken (the cut); the files are written from
        those snapshots afterwards, while the shard serves again. Tables with
        evict_before_snapshot are evicted first, inside the cut; every Progress says how many
        rows that removed (rows_evicted), and so does the log."""
        root = self._snapshot_root()
        snapshot_format.check_name(name)
        snapshot_format.check_save_id(save_id)
        with self._admin:
            snapshot_writer.check_new(root, name)  # a refused save must not have evicted anything
            with self._gate.exclusive():
                tables = [self.store.table(config.name) for config in self.list_tables()]
                evicted = 0
                for table in tables:
                    if table.config.evict_before_snapshot:
                        removed = table.evict()
                        self._log_eviction(table, removed, f"before snapshot {name!r}")
                        evicted += removed
                # rows with their step stamps, and the rest of the training state (clock,
                # bucket rows, admission and promotion counts), all as of this cut
                exports = [
                    (t.config, t.export_stored(SNAPSHOT_CHUNK_ROWS), t.export_state())
                    for t in tables
                ]
            estimate = sum(t.durable.stats()["rows"] for t in tables)
            for progress in snapshot_writer.write_part(
                root, name, save_id, self.shard_id, self.num_shards, exports, estimate
            ):
                yield dataclasses.replace(progress, rows_evicted=evicted)

    def commit_snapshot(self, name: str, save_id: str) -> Iterator[Progress]:
        root = self._snapshot_root()
        try:
            manifest = snapshot_writer.commit(root, name, save_id)
        except ResourceExhaustedError as error:
            raise ResourceExhaustedError(f"{self.where} committing: {error}") from None
        rows = sum(entry["rows"] for entry in manifest["tables"].values())
        yield Progress(rows, rows, str(root / name), done=True)

    def load_snapshot(self, name: str) -> Iterator[Progress]:
        """Replace the snapshot's tables with its rows of this shard's keys, all of them or
        none. The whole snapshot is checked (Snapshot: manifest, part headers,
        every file's content), every part read, checked and this shard's rows written to
        staged column families while the live tables serve lookups on unchanged (pushes
        and assigns to them are refused with UNAVAILABLE from before the first row is
        staged, so none is acknowledged and then replaced); only when all of it passed do
        data calls wait (health NOT_SERVING) while one atomic RocksDB write swaps the staged
        tables in, each with a new generation naming the snapshot. A refused or failed load
        leaves every live row as it was and drops what it staged."""
        root = self._snapshot_root()
        opened = Snapshot(root, name)
        for config in opened.configs.values():
            try:
                self.owner(config)
            except InvalidArgumentError as error:
                raise FailedPreconditionError(
                    f"snapshot {name!r} cannot load into this cluster of {self.num_shards} "
                    f"shards: {error}"
                ) from None
            self.store.check_creatable(config)  # before anything is staged
        opened.check_files()
        opened.check_headers()
        # every part's state files read and checked (the other shards' too) before any
        # row is staged; this shard's share resolved (see snapshot_format.CARRIES for a reshard)
        states = {
            table_name: opened.state_for_shard(table_name, self.shard_id, self.num_shards)
            for table_name in opened.configs
        }
        total = opened.rows_total
        done = kept = 0
        with self._admin:
            staged: list[Any] = []
            with self._gate.exclusive():  # the pushes running now end before the fence
                self._replacing.update(dict.fromkeys(opened.configs, name))
            try:
                for table_name, config in opened.configs.items():
                    stage = self.store.stage_table(config, source=name)
                    staged.append(stage)
                    state = states[table_name]
                    stage.steps = (state.get("current_step", 0), state.get("first_step", 0))
                    if stage.buckets is not None and "buckets" in state:
                        index = np.arange(config.hash_bucket_size, dtype=np.int64)
                        stage.buckets.write(index, state["buckets"])
                    for keys, rows, steps, scanned in opened.rows_and_steps_for_shard(
                        table_name, self.shard_id, self.num_shards, SNAPSHOT_CHUNK_ROWS
                    ):
                        if keys.size:
                            stage.rows.write(keys, config.codec.widen(rows, steps))
                        done += scanned
                        kept += keys.size
                        yield Progress(done, total, str(opened.path), rows_kept=kept)
                with self._gate.exclusive():
                    self._set_loading(True)
                    try:
                        tables = self.store.install_staged(staged)
                        for table in tables:  # the soft state: clock and counts, in memory
                            table.restore_state(states[table.config.name])
                    finally:
                        self._set_loading(False)
            finally:
                for table_name in opened.configs:
                    self._replacing.pop(table_name, None)
                for stage in staged:  # a refused, failed or cancelled load: drop the staging
                    self.store.discard_staged(stage)
        yield Progress(done, total, str(opened.path), rows_kept=kept, done=True)

    def list_snapshots(self) -> list[dict[str, Any]]:
        return snapshot_catalog.list_snapshots(self._snapshot_root())

    def delete_snapshot(self, name: str, save_id: str, incomplete_only: bool) -> list[str]:
        """Remove a snapshot, one save's files of it, or (no name, incomplete_only) every
        failed save's leftovers (snapshot_catalog.delete, snapshot_catalog.gc); the paths
        removed."""
        root = self._snapshot_root()
        with self._admin:  # not while this shard saves or loads
            if not name:
                if not incomplete_only:
                    raise InvalidArgumentError(
                        "DeleteSnapshot: field 'name' expected a snapshot name, or empty with "
                        "incomplete_only=true (every failed save's leftovers), got neither"
                    )
                removed = snapshot_catalog.gc(root)
            else:
                removed = snapshot_catalog.delete(
                    root, name, save_id=save_id, incomplete_only=incomplete_only
                )
        log.info("removed %d snapshot paths", len(removed),
                 extra={"shard_id": self.shard_id, "removed": removed})  # fmt: skip
        return removed

    # -- background work: flushes, recovery, health ------------------------------------------

    def start_background(self) -> None:
        """Start the maintenance thread: a flush of every dirty row each flush_interval_s
        (0: none), and while the store cannot write, a recovery attempt each
        RECOVERY_INTERVAL_S, with health NOT_SERVING until it succeeds."""
        if self._maintainer is None:
            self._maintainer = threading.Thread(
                target=self._maintain, name=f"tierps-maintain-{self.shard_id}", daemon=True
            )
            self._maintainer.start()

    def _maintain(self) -> None:
        interval = self.config.flush_interval_s
        next_flush = time.monotonic() + interval
        next_recovery = 0.0
        while not self._stop.wait(MAINTENANCE_TICK_S):
            now = time.monotonic()
            try:
                if not self.store.writable:
                    self._set_store_ok(False)
                    if now >= next_recovery:
                        next_recovery = now + RECOVERY_INTERVAL_S
                        self._recover()
                    continue
                self._set_store_ok(True)
                if interval and now >= next_flush:
                    done = self.flush(
                        BACKGROUND_FLUSH_CHUNK_BYTES, BACKGROUND_FLUSH_PAUSE_S, background=True
                    )
                    next_flush = now + interval if done else now  # yielded: again next tick
            except BackendError as error:
                log.warning("%s: background work failed: %s", self.where, error)
            except Exception:  # noqa: BLE001 - the thread must outlive one bad round
                log.exception("%s: background work failed", self.where)

    def flush(
        self,
        chunk_bytes: int = FLUSH_CHUNK_BYTES,
        pause_s: float = 0.0,
        *,
        background: bool = False,
    ) -> bool:
        """Write every dirty row of every table down to RocksDB (and fsync its log); what
        a crash after this returns can lose starts where it started. Data calls wait at
        most one chunk of chunk_bytes at a time (pause_s between chunks lets them in). A
        background flush also yields to a snapshot, load or drop waiting for the gate:
        it stops between chunks and returns False (the rest stays dirty for the next)."""
        started = time.time()
        with self._gate.shared():
            stop = self._gate.contended if background else None
            if not self.store.flush(chunk_bytes, pause_s, stop):
                return False
            self.last_flush = started
            self.flushes += 1
        self.lives.flushed(started)
        return True

    def _recover(self) -> bool:
        # not while a snapshot save or load reads or stages (_admin): reopening RocksDB
        # would pull the database from under them
        with self._admin, self._gate.exclusive():
            recovered = self.store.recover()
        if recovered:
            self.last_flush = time.time()
            self.lives.flushed(self.last_flush)
            self._set_store_ok(True)
        return recovered

    def _set_store_ok(self, ok: bool) -> None:
        self._store_ok = ok
        self._publish()

    def _set_loading(self, loading: bool) -> None:
        self._loading = loading
        self._publish()

    def publish_serving(self) -> None:
        """Tell on_serving_change the state now: SERVING if the store can write and no
        load runs (a server starting up; later changes are told as they happen)."""
        with self._publish_lock:
            self._store_ok = self.store.writable  # now, not as of the last maintenance tick
            self._serving = self._store_ok and not self._loading
            self.on_serving_change(self._serving)

    def _publish(self) -> None:
        with self._publish_lock:
            serving = self._store_ok and not self._loading
            if serving != self._serving:
                self._serving = serving
                if not self._store_ok:
                    log.warning("%s: its store cannot write: %s", self.where,
                                self.store.write_state.failure)  # fmt: skip
                self.on_serving_change(serving)

    def close(self) -> None:
        """Flush dirty rows at once; then, after running data calls and any snapshot save
        or load (which read RocksDB until they finish), close RocksDB and record a clean
        stop. If the store cannot write (a full disk), one recovery is tried first; if the
        flush still fails this raises, RocksDB stays as it was and no clean stop is
        recorded: the next start knows rows may be lost."""
        self._stop.set()
        if self._maintainer is not None:
            self._maintainer.join()
        if not self.store.writable:
            self._recover()
        with self._gate.exclusive():
            self.store.flush()  # durable now, even if the process is killed while it waits
        with self._admin, self._gate.exclusive():
            self.store.close()
        self._table_threads.shutdown()
        self._push_threads.shutdown()
        self.lives.end_cleanly()


def _proc_status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status (0 where there is none)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0



def _end_pushes(
    tables: list[EmbeddingTable], errors: dict[int, BaseException | None], begun: dict[int, Any]
) -> None:
    """End every begun push (kept where its error is None, else undone), each lock let go
    whatever another's end raised; then the first such failure is raised."""
    failed: BaseException | None = None
    for index, push in begun.items():
        try:
            tables[index].end_push(push, errors.get(index))
        except BaseException as error:  # noqa: BLE001 - every table's lock must go first
            failed = failed or error
    if failed is not None:
        raise failed
