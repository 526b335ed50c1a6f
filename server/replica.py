"""A read-only replica shard: it follows every shard of a training cluster (their Follow
streams, server/change_feed.py) and serves lookups of what it received, refusing writes.

A replica is shard i of its own cluster of M shards (any M: a serving fleet sized for its
readers, not for the trainers). It holds a Follow stream on each training shard j, asking
for the keys of its own cluster's shard i, and applies each stream's batches to its own
store: a table's first batch with a config creates the table as the replica keeps it
(`replica_config`: weights only, no optimizer state, no eviction of its own), rows are set
(assign), tombstones removed, and a resync of a table from shard j removes afterwards the
rows of j's keys (key_shards with the training cluster's N) that the resync did not send. A
training shard's `dropped` drops the table.

Start: a replica with no table yet and a snapshot dir (the training cluster's, shared)
first takes the newest complete snapshot chain there (`seed_from_snapshot`): the rows of its
own keys, link by link, and each training shard's cursor at the cut (its part's header), so
each stream sends only the changes since the cut where the training shard still holds them,
and resyncs the tables where it does not (it restarted or loaded a snapshot since).

Resume: each stream's cursors (per training data dir and table) are written to the store's
metadata, each only after a flush that holds the rows it covers (a flush, then the cursor),
so a restarted replica asks each training shard for the changes since where it was. A
training shard that restarted, loaded a snapshot or no longer keeps the changes since that
position answers with a resync; the replica logs each resync and why.

A broken stream (a training shard restarted, unreachable) is opened again with backoff,
each reconnect logged with its cause. Lag per table (`Replica.lag`): positions the replica
has not applied of the heads it was told, summed over training shards, and seconds since
the oldest change it has not applied (0 when every stream says it is at the head).

Adaptive tables (promote_after > 0) need their shard's bucket rows, which the stream does
not carry: the replica does not follow them, says so in one log line and lists them in its
Stats (`skipped`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tierps.client.security import ChannelSecurity, read_token
from tierps.core import optim
from tierps.core.config import Placement, TableConfig, WritePolicy, key_shards
from tierps.core.errors import FailedPreconditionError, Reason, TableNotFoundError
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto import wire
from tierps.proto.convert import table_config_to_dict, table_config_to_proto
from tierps.server.config import REPLICA_TOKEN_ENV, ServerConfig
from tierps.server.security import LOOKUPS, refusing_create
from tierps.server.shard_maintenance import BACKGROUND_FLUSH_CHUNK_BYTES, BACKGROUND_FLUSH_PAUSE_S
from tierps.server.status import refusal, status_of
from tierps.storage import EmbeddingStore
from tierps.storage.changes import Cursor
from tierps.storage.snapshot_catalog import list_snapshots
from tierps.storage.snapshot_chain import open_chain, shard_rows
from tierps.storage.table import EmbeddingTable

log = logging.getLogger("tierps.server")

CURSOR_PREFIX = b"replica-cursor/"  # + training data id + "/" + table: a "JOURNAL:POSITION"
BACKOFF_S = (0.1, 5.0)  # a broken stream is opened again after this long, doubling, at most
RPC_TIMEOUT_S = 10.0  # a training shard's Stats

_SERVICES = {
    name: f"/{pb.DESCRIPTOR.services_by_name[name].full_name}/"
    for name in ("EmbeddingService", "AdminService", "ChangeService")
}
# What a replica serves: lookups (create=false), its tables and figures, its snapshots' list,
# and its own Follow stream (a replica records what it applies, so it may be followed in
# turn). Every other call of tierps' services writes: refused, whatever it is.
READS = (
    LOOKUPS
    | {
        _SERVICES["AdminService"] + m
        for m in ("ListTables", "DescribeTable", "Stats", "ListSnapshots")
    }
    | {_SERVICES["ChangeService"] + "Follow"}
)


def replica_config(training: TableConfig, dtype: str) -> TableConfig:
    """The table as a replica keeps it: the training table's name, dim, initializer, seed,
    placement and lookups' settings, weights only (SGD: no optimizer state), its cold
    weights in `dtype`, write-back, and no eviction of its own (the training shard's
    evictions arrive as tombstones)."""
    return dataclasses.replace(
        training,
        optimizer=optim.SGD(),
        cold_dtype=dtype,
        cold_state_dtype="",
        write_policy=WritePolicy.WRITE_BACK,
        steps_to_live=0,
        min_l2_norm=0.0,
        evict_before_snapshot=False,
    )


def follow_security(config: ServerConfig) -> ChannelSecurity:
    """How a replica reaches the training shards: their CA and its client certificate, and
    the bearer token (role replica) of replica_token_file, else $TIERPS_REPLICA_TOKEN."""
    token = (
        read_token(config.replica_token_file)
        if config.replica_token_file is not None
        else os.environ.get(REPLICA_TOKEN_ENV) or None
    )
    return ChannelSecurity(
        ca_file=config.follow_tls_ca,
        cert_file=config.follow_tls_cert,
        key_file=config.follow_tls_key,
        server_name=config.follow_tls_server_name,
        token=token,
    )


class ReadOnlyCheck(grpc.ServerInterceptor):
    """The one place a replica refuses writes: every call of tierps' services but READS,
    and a lookup with create=true, with FailedPreconditionError(reason READ_ONLY) naming
    the shard and the training cluster it follows, before the shard is asked anything.
    `refused(method, code, cause, why)` counts and logs each refusal."""

    def __init__(
        self, where: str, follows: str, refused: Callable[[str, str, str, str], None]
    ) -> None:
        self.where = where
        self.follows = follows
        self._refused = refused

    def error(self, method: str, what: str) -> FailedPreconditionError:
        why = (
            f"{method} {what}, but this shard is a read-only replica following the training "
            f"cluster {self.follows}: send writes there"
        )
        error = FailedPreconditionError(
            f"{self.where}: {why}", reason=Reason.READ_ONLY, method=method, follows=self.follows
        )
        self._refused(method, status_of(error).name, "read_only", why)
        return error

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        method = details.method
        if handler is None or not any(method.startswith(s) for s in _SERVICES.values()):
            return handler  # health, reflection
        if method in LOOKUPS:
            return refusing_create(
                handler,
                method,
                lambda index: self.error(method, f"creates rows (message {index}: create=true)"),
            )
        if method not in READS:
            return refusal(handler, self.error(method, "writes"))
        return handler


@dataclass
class _Position:
    """Where one training shard's stream of one table is (Replica.lag)."""

    cursor: Cursor | None = None  # applied: every change up to it
    head: int = 0  # the newest head position the stream told
    behind_since: float | None = None  # Unix s of the oldest change not applied; None: at head
    current_at: float = 0.0  # Unix s when the stream last said it was at the head


@dataclass
class _Resync:
    """A resync of one table from one training shard in progress: the keys it sent."""

    why: str
    received: list[np.ndarray] = field(default_factory=list)


class Replica:
    """The followers of one replica shard: one thread per training shard (ShardFollower),
    the cursors they reached and their saving, the lag figures, the tables skipped."""

    def __init__(
        self,
        config: ServerConfig,
        where: str,
        store: EmbeddingStore,
        section: Callable[[], AbstractContextManager[object]],
        create_table: Callable[[TableConfig], object],
        drop_table: Callable[[str], None],
    ) -> None:
        self.where = where
        self.shard_id = config.shard_id
        self.num_shards = config.num_shards
        self.dtype = config.replica_dtype
        self.save_s = config.replica_save_s  # a restart resumes about this far behind at most
        self.follows = ",".join(config.follow)
        self.store = store
        self.section = section  # a data call's section of the shard's gate
        self._create_table = create_table
        self._drop_table = drop_table
        self.security = follow_security(config)
        self._lock = threading.Lock()  # the dicts below
        self._saving = threading.Lock()  # a cursor save, or a drop, at a time
        # per training data id: {table: cursor} as saved, read once at the start
        self.saved: dict[str, dict[str, str]] = {}
        for key, value in store.metadata(CURSOR_PREFIX):
            data_id, _, table = key[len(CURSOR_PREFIX) :].decode().partition("/")
            self.saved.setdefault(data_id, {})[table] = value.decode()
        self.snapshot_dir = config.snapshot_dir
        # from seed_from_snapshot: {(training shard count, shard): {table: cursor}}
        self.seeded: dict[tuple[int, int], dict[str, str]] = {}
        self.skipped: dict[str, TableConfig] = {}  # adaptive tables not followed
        self._unsaved: dict[tuple[str, str], Cursor] = {}  # (data id, table) -> cursor
        self.followers = [ShardFollower(self, address) for address in config.follow]
        self._stop = threading.Event()
        self._saver = threading.Thread(target=self._save_loop, name="tierps-replica-save")

    # -- life --------------------------------------------------------------------------------

    def start(self) -> None:
        """Seed from a snapshot where there is one to take, then follow (on a thread: the
        shard serves meanwhile, its lag telling how far behind it is)."""
        self._starter = threading.Thread(target=self._seed_then_follow, name="tierps-replica")
        self._starter.start()

    def _seed_then_follow(self) -> None:
        if self.snapshot_dir is not None and not self.saved and not self.store.tables():
            try:
                self.seed_from_snapshot(self.snapshot_dir)
            except Exception as error:  # noqa: BLE001 - the streams resync what it left
                log.warning(
                    "%s: starting from the newest snapshot failed (%s): every table is "
                    "resynced from the training shards instead",
                    self.where,
                    error,
                )
                self.seeded.clear()
        if self._stop.is_set():
            return
        for follower in self.followers:
            follower.start()
        self._saver.start()
        log.info("%s: a read-only replica following %s", self.where, self.follows)

    def seed_from_snapshot(self, root: Path) -> str | None:
        """Take the newest complete snapshot chain under root, if any: create its tables as
        the replica keeps them, put its rows of this shard's keys as the chain resolves them,
        and note each training shard's cursor at the cut (`seeded`) for the
        streams to ask from. Returns the snapshot's name (None: none there)."""
        complete = [info for info in list_snapshots(root) if info["complete"]]
        if not complete:
            return None
        newest = max(complete, key=lambda info: (info["created_unix"], info["name"]))
        chain = open_chain(root, newest["name"])
        started, rows = time.monotonic(), 0
        for name, config in chain[0].configs.items():
            table = self.table_for(table_config_to_proto(config.to_dict()))
            if table is None:  # not followed (adaptive)
                continue
            # the chain's rows of this shard's keys as its links resolve them (tombstones
            # applied): the one reading of a chain a compare-path snapshot uses too
            for keys, values, _ in shard_rows(chain, name, self.shard_id, self.num_shards):
                if self._stop.is_set():
                    return None
                if keys.size:
                    with self.section():
                        table.assign(keys, values[:, : config.dim])
                    rows += keys.size
            parts = chain[0].tables[name]["parts"]
            for part in parts:
                if part.get("cursor"):
                    where = (len(parts), int(part["shard_id"]))
                    self.seeded.setdefault(where, {})[name] = part["cursor"]
        log.info(
            "%s: started from snapshot %r (chain %s): %d rows of this shard's keys in %.1f s; "
            "the training shards send the changes since its cut",
            self.where,
            newest["name"],
            " -> ".join(link.name for link in chain),
            rows,
            time.monotonic() - started,
        )
        return newest["name"]

    def stop(self) -> None:
        """Stop following (each stream cancelled), then save the cursors reached."""
        self._stop.set()
        starter = getattr(self, "_starter", None)
        if starter is not None and starter.is_alive():
            starter.join()
        for follower in self.followers:
            follower.stop()
        if self._saver.is_alive():
            self._saver.join()
        self.save_cursors()

    # -- tables ------------------------------------------------------------------------------

    def table_for(
        self, message: pb.TableConfig, by: ShardFollower | None = None
    ) -> EmbeddingTable | None:
        """The replica's table of a batch's training config: created (or made again where
        the training table's config changed) as replica_config makes it; None for a table
        the replica does not follow."""
        training = TableConfig.from_dict(table_config_to_dict(message))
        why = None
        if training.promote_after:
            why = (
                f"it is adaptive (promote_after={training.promote_after}): its shard's bucket "
                f"rows are not in the change stream"
            )
        elif training.placement is Placement.TABLE and training.table_shard >= self.num_shards:
            why = (
                f"it is placed whole on shard {training.table_shard}, which a replica cluster "
                f"of {self.num_shards} shards does not have"
            )
        if why is not None:
            with self._lock:
                new = training.name not in self.skipped
                self.skipped[training.name] = training
            if new:
                log.warning(
                    "%s: table %r: %s, so this replica does not follow it",
                    self.where,
                    training.name,
                    why,
                )
            return None
        wanted = replica_config(training, self.dtype)
        try:
            table = self.store.table(training.name)
        except TableNotFoundError:
            table = None
        if table is not None and table.config != wanted:
            log.warning(
                "%s: table %r changed on the training cluster: dropping the replica's, "
                "following the new one",
                self.where,
                training.name,
            )
            self.drop(training.name, by=by)
        if table is None or table.config != wanted:
            self._create_table(wanted)
            table = self.store.table(training.name)
        return table

    def table(self, name: str) -> EmbeddingTable | None:
        try:
            return self.store.table(name)
        except TableNotFoundError:
            return None

    def drop(self, name: str, by: ShardFollower | None = None) -> None:
        """Drop a table (the training cluster dropped it, or changed its config) and forget
        its cursors. The other streams may have sent rows of it, and may send more before
        they hear of the drop: each is ended and opened again without a cursor of the
        table, so its training shard resyncs it (`ShardFollower.resync_later`)."""
        with self._saving:
            if self.table(name) is not None:
                self._drop_table(name)
                log.info("%s: table %r dropped, as on the training cluster", self.where, name)
            with self._lock:
                self.skipped.pop(name, None)
                for key in [key for key in self._unsaved if key[1] == name]:
                    del self._unsaved[key]
            for data_id in list(self.saved):
                self.saved[data_id].pop(name, None)
            for key, _ in self.store.metadata(CURSOR_PREFIX):
                if key.decode().rpartition("/")[2] == name:
                    self.store.write_metadata(key, None)
            for follower in self.followers:
                follower.forget(name)
                if follower is not by:
                    follower.resync_later(name)

    def forget_cursor(self, data_id: str, table: str) -> None:
        """Forget where a stream was in a table, saved or not (its rows were dropped)."""
        with self._saving:
            with self._lock:
                self._unsaved.pop((data_id, table), None)
            self.saved.get(data_id, {}).pop(table, None)
            self.store.write_metadata(CURSOR_PREFIX + f"{data_id}/{table}".encode(), None)

    # -- cursors -----------------------------------------------------------------------------

    def reached(self, data_id: str, table: str, cursor: Cursor) -> None:
        """A stream applied every change of table up to cursor: saved at the next save."""
        with self._lock:
            self._unsaved[(data_id, table)] = cursor

    def save_cursors(self) -> None:
        """Write the cursors reached since the last save, each after a flush of the store
        (which holds every row they cover: those were applied before they were noted)."""
        with self._saving:
            with self._lock:
                pending, self._unsaved = self._unsaved, {}
            if not pending:
                return
            try:
                with self.section():  # in small chunks: lookups wait one chunk at most
                    self.store.flush(BACKGROUND_FLUSH_CHUNK_BYTES, BACKGROUND_FLUSH_PAUSE_S)
                for (data_id, table), cursor in pending.items():
                    key = CURSOR_PREFIX + f"{data_id}/{table}".encode()
                    self.store.write_metadata(key, cursor.encoded().encode())
            except Exception:
                with self._lock:  # the newer ones noted meanwhile win
                    self._unsaved = {**pending, **self._unsaved}
                raise

    def _save_loop(self) -> None:
        while not self._stop.wait(self.save_s):
            try:
                self.save_cursors()
            except Exception as error:  # noqa: BLE001 - the store may recover; tried again
                log.warning("%s: cannot save the replica's cursors now: %s", self.where, error)

    # -- figures -----------------------------------------------------------------------------

    def lag(self, table: str) -> dict[str, float]:
        """TableDescription.lifecycle's replica figures of a table: "replica.lag_s" (the
        largest over the training shards) and "replica.lag_positions" (summed)."""
        now = time.time()
        seconds, positions = 0.0, 0
        for follower in self.followers:
            figures = follower.lag(table, now)
            if figures is not None:
                seconds = max(seconds, figures[0])
                positions += figures[1]
        return {"replica.lag_s": seconds, "replica.lag_positions": float(positions)}

    def skipped_tables(self) -> list[TableConfig]:
        with self._lock:
            return sorted(self.skipped.values(), key=lambda config: config.name)


class ShardFollower:
    """One training shard's Follow stream, on a thread of its own, applied to the replica's
    store; opened again with backoff when it breaks."""

    def __init__(self, replica: Replica, address: str) -> None:
        self.replica = replica
        self.address = address
        self.where = f"{replica.where} following {address}"
        self._thread = threading.Thread(
            target=self._run, name=f"tierps-follow-{address}", daemon=True
        )
        self._stopping = threading.Event()
        self._call: Any = None
        self._lock = threading.Lock()  # positions
        self.positions: dict[str, _Position] = {}
        self.connected = False
        self.data_id = ""
        self.training_shard = -1
        self.training_shards = 0
        self._resyncs: dict[str, _Resync] = {}
        self._to_forget: set[str] = set()  # tables dropped under this stream (resync_later)
        self._sent: dict[str, str] = {}  # the cursor each table was asked from (resync's why)
        self.resyncs = 0  # resyncs begun (tests, logs)
        self.reconnects = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(10)

    def forget(self, table: str) -> None:
        with self._lock:
            self.positions.pop(table, None)
        self._resyncs.pop(table, None)

    def _forget_dropped(self) -> None:
        """Forget where this stream was in the tables resync_later named (on this stream's
        thread, while no stream of it runs)."""
        with self._lock:
            forget, self._to_forget = self._to_forget, set()
            for table in forget:
                self.positions.pop(table, None)
        for table in forget:
            self.replica.forget_cursor(self.data_id, table)

    def resync_later(self, table: str) -> None:
        """The replica dropped table, of which this stream may have sent rows: end the
        stream and open it again without a cursor of the table, so the training shard
        resyncs it. The cursor is forgotten on this stream's own thread once the stream has
        ended (`_run`), so no batch of it is noted after."""
        with self._lock:
            self._to_forget.add(table)
        call = self._call
        if call is not None:
            call.cancel()

    # -- the stream --------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = BACKOFF_S[0]
        metadata = self.replica.security.metadata()
        options = wire.channel_options()
        while not self._stopping.is_set():
            applied = False
            try:
                with self.replica.security.channel(self.address, options) as channel:
                    self._forget_dropped()  # named while no stream ran
                    request = self._request(channel, metadata)
                    self._call = pb_grpc.ChangeServiceStub(channel).Follow(
                        request, metadata=metadata
                    )
                    if self._stopping.is_set():
                        self._call.cancel()
                    self.connected = True
                    for batch in self._call:
                        if self._to_forget:
                            why = "the replica dropped a table this stream sent rows of"
                            break
                        self._apply(batch)
                        applied = True
                    else:
                        why = "the training shard ended the stream"
            except grpc.RpcError as error:
                why = f"{error.code().name}: {error.details()}"
            except Exception as error:  # noqa: BLE001 - a bad batch: log it, follow again
                log.exception("%s: applying its changes failed", self.where)
                why = f"applying a batch failed: {error}"
            finally:
                self.connected = False
                self._call = None
                self._resyncs.clear()
                self._forget_dropped()
            if self._stopping.is_set():
                break
            backoff = BACKOFF_S[0] if applied else min(backoff * 2, BACKOFF_S[1])
            self.reconnects += 1
            log.warning(
                "%s: the stream broke (%s); following again in %.1f s",
                self.where,
                why,
                backoff,
                extra={"follows": self.address, "reconnects": self.reconnects},
            )
            self._stopping.wait(backoff)

    def _request(self, channel: grpc.Channel, metadata: Any) -> pb.FollowRequest:
        """Learn the training shard (its data dir's id, its shard id and count: Stats), then
        the FollowRequest: every table the replica holds, with the cursor reached from this
        data dir (saved or applied), or none (a resync)."""
        stats = pb_grpc.AdminServiceStub(channel).Stats(
            pb.StatsRequest(), metadata=metadata, timeout=RPC_TIMEOUT_S
        )
        if stats.data_id != self.data_id:
            if self.data_id:
                log.warning(
                    "%s: the training shard's data dir changed (data id %s, was %s): every "
                    "table is resynced",
                    self.where,
                    stats.data_id,
                    self.data_id,
                )
            with self._lock:  # where it was on this data dir, or the snapshot it started from
                saved = self.replica.saved.get(stats.data_id) or self.replica.seeded.get(
                    (stats.num_shards, stats.shard_id), {}
                )
                self.positions = {
                    table: _Position(Cursor.decoded(cursor)) for table, cursor in saved.items()
                }
            self.data_id = stats.data_id
        self.training_shard = stats.shard_id
        self.training_shards = stats.num_shards
        held = {config.name for config in self.replica.store.tables()}
        with self._lock:
            cursors = {table: p.cursor for table, p in self.positions.items() if table in held}
        self._sent = {
            table: "" if cursor is None else cursor.encoded()
            for table, cursor in ((t, cursors.get(t)) for t in held)
        }
        return pb.FollowRequest(
            shard=self.replica.shard_id,
            shard_count=self.replica.num_shards,
            cursors=[pb.FollowCursor(table=t, cursor=c) for t, c in sorted(self._sent.items())],
        )

    # -- a batch -----------------------------------------------------------------------------

    def _apply(self, batch: pb.ChangeBatch) -> None:
        name = batch.table
        if batch.dropped:
            self.replica.drop(name, by=self)
            return
        if batch.HasField("config"):
            table = self.replica.table_for(batch.config, by=self)
        else:
            table = self.replica.table(name)
        if table is None:  # skipped, or dropped while its batches were on their way
            return
        if batch.resync:
            self._begin_resync(name)
        keys = np.frombuffer(batch.keys, dtype="<i8")
        removed = np.frombuffer(batch.removed, dtype="<i8")
        with self.replica.section():
            if keys.size:
                values = np.frombuffer(batch.values, dtype="<f4").reshape(keys.size, -1)
                table.assign(keys, values)
            if removed.size:
                table.remove(removed)
        if name in self._resyncs and keys.size:
            self._resyncs[name].received.append(keys)
        if batch.resync_done:
            self._end_resync(table)
        self._note(name, batch)

    def _begin_resync(self, name: str) -> None:
        sent = self._sent.get(name)
        if sent is None:
            why = "a table new to this stream"
        elif not sent:
            why = "no position of it from this training data dir yet"
        else:
            why = (
                f"the training shard cannot answer from position {sent} (it restarted or "
                f"loaded a snapshot since, or no longer keeps the changes since then)"
            )
        self._resyncs[name] = _Resync(why)
        self.resyncs += 1
        log.warning(
            "%s: resync of table %r: %s",
            self.where,
            name,
            why,
            extra={"table": name, "follows": self.address},
        )

    def _end_resync(self, table: EmbeddingTable) -> None:
        """Remove the rows of this training shard's keys that the resync did not send."""
        name = table.config.name
        resync = self._resyncs.pop(name, None)
        if resync is None:
            return
        received = np.unique(np.concatenate(resync.received)) if resync.received else None
        removed = 0
        with self.replica.section():
            for keys, _ in table.export():
                owners = key_shards(table.config, keys, self.training_shards)
                mine = keys[owners == self.training_shard]
                gone = mine if received is None else mine[~np.isin(mine, received)]
                if gone.size:
                    table.remove(gone)
                    removed += gone.size
        log.info(
            "%s: resync of table %r done: %d rows received, %d rows it no longer holds removed",
            self.where,
            name,
            0 if received is None else received.size,
            removed,
            extra={"table": name, "follows": self.address},
        )

    def _note(self, name: str, batch: pb.ChangeBatch) -> None:
        """The lag figures and the cursor a batch tells."""
        cursor = Cursor.decoded(batch.cursor) if batch.cursor else None
        with self._lock:
            position = self.positions.setdefault(name, _Position())
            position.head = max(position.head, int(batch.head))
            if cursor is not None:
                position.cursor = cursor
                position.head = max(cursor.position, int(batch.head))
            applied = position.cursor.position if position.cursor is not None else -1
            if cursor is not None and applied >= position.head:
                position.behind_since = None
                position.current_at = time.time()
            elif position.behind_since is None:
                position.behind_since = (
                    batch.oldest_change_unix_s or batch.head_unix_s or time.time()
                )
        if cursor is not None and name not in self._resyncs:
            self._sent[name] = cursor.encoded()  # where a later resync of it starts from
            self.replica.reached(self.data_id, name, cursor)

    def lag(self, table: str, now: float) -> tuple[float, int] | None:
        """(seconds, positions) this stream is behind on table; None: it never told of it.
        A stream that is broken is behind since it was last at the head."""
        with self._lock:
            position = self.positions.get(table)
            if position is None:
                return None
            applied = position.cursor.position if position.cursor is not None else 0
            positions = max(0, position.head - applied)
            if position.behind_since is None and self.connected:
                return 0.0, positions
            since = position.behind_since
            if since is None:  # broken while at the head: behind since then, at most
                since = position.current_at or now
            return max(0.0, now - since), positions
