"""The shard: the tables of one shard over the storage cascade, and its data path (lookups,
pushes, push-then-lookup, assigns) behind the request checks (shard_checks) and the gate
that makes snapshots consistent (shard_gate). Its administration, upkeep, health and figures
are parts it owns: shard_admin, shard_maintenance, shard_health, shard_stats."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tierps.core.config import WritePolicy
from tierps.core.xp import gpu_arrays
from tierps.server.change_feed import ChangeFeed
from tierps.server.config import ServerConfig
from tierps.server.ledger import KEY_PREFIX as PUSH_RECORDS
from tierps.server.ledger import PushId, PushLedger
from tierps.server.lives import Lives
from tierps.server.replica import Replica
from tierps.server.shard_admin import ShardAdmin
from tierps.server.shard_checks import RequestChecks
from tierps.server.shard_gate import Gate
from tierps.server.shard_health import ShardHealth
from tierps.server.shard_maintenance import Maintenance
from tierps.server.shard_stats import (
    LOOKED_UP,
    PUSHED,
    KeyCounts,
    describe_table,
    proc_status_bytes,
    skipped_table,
)
from tierps.server.shard_threads import TableThreads
from tierps.storage import (
    BackendError,
    EmbeddingStore,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    snapshot_format,
)
from tierps.storage.snapshot_writing_marker import collect_abandoned_parts
from tierps.storage.table import EmbeddingTable

log = logging.getLogger("tierps.server")


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


class Shard:
    """Tables of shard `shard_id` of `num_shards`, stored under data_dir.

    The data dir remembers which shard it belongs to: opening it as another shard, or with
    another shard count, is refused (its keys would be on the wrong shard; load a snapshot to
    reshard instead).

    Every shard keeps the config of every table (ListTables and DescribeTable agree across
    the cluster); a table placed whole (placement="table") stores rows only on its owner,
    owner_shard(config, num_shards), and the other shards refuse its data calls.

    The shard serves the data calls itself; the rest is done by parts it owns, each handed
    what it needs: `checks` (RequestChecks: dims, key ownership, generations), `admin`
    (ShardAdmin: tables and snapshots, the load fence), `maintenance` (Maintenance: flushes,
    recovery, eviction), `health` (ShardHealth: whether it serves) and `key_counts`.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.shard_id = config.shard_id
        self.num_shards = config.num_shards
        self.where = f"shard {self.shard_id} of {self.num_shards}"
        self.started = time.time()
        self.metrics_port = 0  # the bound /metrics port, set by the daemon serving it
        # Per table: keys looked up and pushed since the start (Stats, metrics, top).
        self.key_counts = KeyCounts()
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
        self.checks = RequestChecks(self.store, self.shard_id, self.num_shards, self.where)
        self._gate = Gate()
        self._table_threads = TableThreads(f"tierps-tables-{self.shard_id}")
        # A push's tables are prepared and stored here (or, for a small call, in its calling
        # thread) while its calling thread holds their locks: work that never waits for a
        # table lock, so a lookup queued on the table threads behind such a lock cannot hold
        # up the push that holds it.
        self._push_threads = TableThreads(f"tierps-push-{self.shard_id}")
        self._admin_lock = threading.Lock()  # one table or snapshot change at a time
        self.health = ShardHealth(self.where, self.store)
        self.admin = ShardAdmin(
            config,
            self.where,
            self.store,
            self._gate,
            self._admin_lock,
            self.checks,
            self.health,
            self.key_counts,
        )
        try:
            for table in config.tables:
                self.checks.owner(table)
                self.store.create_table(table)
            self.lives = Lives(Path(config.data_dir), self.where, self.data_id)
            self.ledger = PushLedger(
                self.store.write_metadata_many, self.store.metadata(PUSH_RECORDS), self.where
            )
            # A replica's rows are a copy the training cluster sends again (a resync or the
            # changes since its saved cursors): an unclean end loses nothing of anyone's.
            at_risk = not config.follow and any(
                t.write_policy is WritePolicy.WRITE_BACK or t.promote_after
                for t in self.store.tables()
            )
            self.lives.begin(at_risk)
        except BaseException:
            self.store.close()  # release RocksDB's lock: the data dir can be opened again
            raise
        self.maintenance = Maintenance(
            config, self.where, self.store, self._gate, self._admin_lock, self.lives, self.health
        )
        # A replica shard (config.follow) follows a training cluster; ReadOnlyCheck, at the
        # server, refuses its writes.
        self.replica = (
            Replica(
                config,
                self.where,
                self.store,
                self._gate.shared,
                self.admin.create_table,
                self.admin.drop_table,
            )
            if config.follow
            else None
        )
        if new_dir:
            log.warning(
                "%s starts on a new, empty data dir %s (data id %s): if this shard held rows "
                "before, they are not here, and every client that knew them is told "
                "(DATA_LOSS) at its next call",
                self.where,
                config.data_dir,
                self.data_id,
                extra={"shard_id": self.shard_id, "data_id": self.data_id},
            )
        if not self.lives.ended_cleanly:
            log.warning(
                "%s: its previous life %d ended without a clean stop (killed, crashed or lost "
                "power); %s",
                self.where,
                self.lives.life - 1,
                "clients that knew it are told, once"
                if self.lives.life - 1 in self.lives.unclean
                else "its tables are all write-through: nothing acknowledged is missing",
                extra={"shard_id": self.shard_id, "life": self.lives.life},
            )

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

    # -- data calls --------------------------------------------------------------------------

    def lookup(
        self, batches: list[LookupBatch], out: Sequence[np.ndarray] | None = None
    ) -> list[np.ndarray]:
        """Weights of each batch's keys; every batch is checked before any is looked up.
        out: an array [n, dim] per batch to write them into (EmbeddingTable.lookup's out),
        such as views of the reply's bytes; else new arrays."""
        with self._gate.shared():
            targets = self._checked_lookup(batches)
            rows = self._serve_lookup(targets, batches, out)
        self.key_counts.count(batches, LOOKED_UP)
        return rows

    def _checked_lookup(self, batches: list[LookupBatch]) -> list[EmbeddingTable]:
        """Each lookup batch's table, every batch checked (dim, shard, key range)."""
        targets = [self.checks.checked(batch.table, batch.dim, batch.keys) for batch in batches]
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
        return self._table_threads.each(
            lambda item: item[0].lookup(item[1].keys, create=item[1].create, out=item[2]),
            list(zip(targets, batches, outs, strict=True)),
            values=sum(len(batch.keys) * batch.dim for batch in batches),
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
        self.key_counts.count(batches, PUSHED)
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
            target = self.checks.checked(batch.table, batch.dim, batch.keys)
            self.admin.check_not_replacing(batch.table, "push")
            if generations is not None:
                self.checks.check_generation(target, generations[index])
            checked.append((target, *target.check_gradients(batch.keys, batch.grads, batch.step)))
        return checked

    def _apply_push(self, checked: list[tuple[Any, ...]], applied: dict[str, int]) -> None:
        """Apply checked push batches as one unit, adding each table applied to `applied`
        (table -> distinct keys updated). Every table's lock is taken (in name order: no
        deadlock between calls) and its update computed and checked on copies (prepare, on
        the push threads, which take no table lock, or in this thread for a small call)
        before any row is stored: a refusal
        undoes every table's push. A storage failure while storing raises, naming the
        tables of this call stored and not stored on this shard."""
        if not checked:
            return
        tables = [item[0] for item in checked]
        values = sum(len(keys) * table.config.dim for table, keys, *_ in checked)
        begun: dict[int, Any] = {}
        try:
            for index in sorted(range(len(checked)), key=lambda i: tables[i].config.name):
                begun[index] = tables[index].begin_push(checked[index][3])
            stores = self._push_threads.each(
                lambda index: tables[index].prepare_push(begun[index], *checked[index][1:3]),
                list(range(len(checked))),
                values,
            )
        except BaseException as error:
            _end_pushes(tables, {index: error for index in begun}, begun)
            raise
        outcomes = self._push_threads.outcomes(lambda store: store(), stores, values)
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
            self.key_counts.count(pushes, PUSHED)
            rows = self._serve_lookup(targets, lookups, out(updated))
        self.key_counts.count(lookups, LOOKED_UP)
        return updated, rows

    def assign(self, batches: list[AssignBatch]) -> int:
        """Set each table's rows; every batch is checked before any is set."""
        with self._gate.shared():
            checked = []
            for batch in batches:
                target = self.checks.checked(batch.table, batch.dim, batch.keys)
                self.admin.check_not_replacing(batch.table, "assign")
                checked.append((target, *target.check_values(batch.keys, batch.values)))
            return sum(target.assign_checked(*args) for target, *args in checked)

    def change_feed(self, request: Any) -> ChangeFeed:
        """A follower's Follow stream of this shard's changed rows (server/change_feed.py);
        each of its reads is a data call's section of the gate."""
        return ChangeFeed(
            lambda: [config.name for config in self.store.tables()],
            self.store.table,
            request,
            self._gate.shared,
        )

    # -- figures -----------------------------------------------------------------------------

    def describe(self, name: str) -> dict[str, Any]:
        """A table's description on this shard (shard_stats.describe_table)."""
        with self._gate.shared():  # not while a load or drop replaces tables
            return self._describe(name)

    def _describe(self, name: str) -> dict[str, Any]:
        table = self.store.table(name)
        described = describe_table(table, self.shard_id, self.num_shards, self.key_counts)
        if self.replica is not None:
            described["lifecycle"].update(self.replica.lag(name))
        return described

    def stats(self) -> dict[str, Any]:
        """Every table's description, and this shard's own figures: memory, uptime,
        lives, last flush, whether its store can write, and its data dir's identity."""
        with self._gate.shared():
            tables = [self._describe(config.name) for config in self.admin.list_tables()]
        if self.replica is not None:  # the tables it does not follow, and why
            skipped = self.replica.skipped_tables()
            tables += [skipped_table(c, self.shard_id, self.num_shards) for c in skipped]
            tables.sort(key=lambda described: described["config"].name)
        return {
            "shard_id": self.shard_id,
            "num_shards": self.num_shards,
            "tables": tables,
            "rss_bytes": proc_status_bytes("VmRSS"),
            "peak_rss_bytes": proc_status_bytes("VmHWM"),
            "uptime_s": time.time() - self.started,
            "life": self.lives.life,
            "previous_life_clean": self.lives.ended_cleanly,
            "last_flush_unix_s": self.maintenance.last_flush or 0.0,
            "writable": self.store.writable,
            "metrics_port": self.metrics_port,
            "data_id": self.data_id,
            "data_created_unix_s": self.data_created,
        }

    # -- stop --------------------------------------------------------------------------------

    def close(self) -> None:
        """Flush dirty rows at once; then, after running data calls and any snapshot save
        or load (which read RocksDB until they finish), close RocksDB and record a clean
        stop. If the store cannot write (a full disk), one recovery is tried first; if the
        flush still fails this raises, RocksDB stays as it was and no clean stop is
        recorded: the next start knows rows may be lost. A replica stops following first."""
        if self.replica is not None:
            self.replica.stop()
        self.maintenance.stop_background()
        if not self.store.writable:
            self.maintenance.recover()
        with self._gate.exclusive():
            self.store.flush()  # durable now, even if the process is killed while it waits
        with self._admin_lock, self._gate.exclusive():
            self.store.close()
        self._table_threads.shutdown()
        self._push_threads.shutdown()
        self.lives.end_cleanly()


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
