"""A training shard's side of replication: the Follow stream of its changed rows.

A follower (a replica shard, server/replica.py) names, per table, the cursor it has reached
(storage/changes.py). Each round, for each table, the feed asks the table's change journal
for the keys changed since that cursor, keeps the follower's own keys (key_shards with the
follower's shard count), reads their rows as they are now (weights only) and sends them in
batches, the round's last batch of a table carrying the cursor that covers them. A table
the journal cannot answer for (no cursor, a restart or a load since, changes let go of) is
resynced: every row the follower owns, from an export cut after the new cursor was taken,
between a batch marked `resync` and one marked `resync_done`; a row the follower holds and
the resync did not send is gone. A round with nothing new sends, per table, a heartbeat at
most every `heartbeat_s`, so the follower knows it is current.

Back-pressure is gRPC's: the sync server pulls the next batch from this generator only
when the previous one was written to the stream, and the stream's HTTP/2 window is one
message, so a slow follower slows the feed's reads, never the training shard's pushes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import numpy as np

from tierps.core.config import Placement, key_shards
from tierps.core.errors import InvalidArgumentError, TableNotFoundError
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto.convert import table_config_to_proto
from tierps.storage.changes import Cursor
from tierps.storage.table import EmbeddingTable

DEFAULT_BATCH_ROWS = 16384  # rows a batch carries at most (dim 64: 4 MiB of weights)
# A round at most this often: a row changed several times within it is read and sent once,
# and a follower's apply is one call per table a round. Measured with the demo's DeepFM
# (docs/perf): 50 ms rounds cost a replica sharing the trainer's 2 cores 2.4x the CPU of
# 200 ms rounds, and freshness stays well under a second either way.
POLL_S = 0.2
HEARTBEAT_S = 0.25  # a table with nothing new is told its cursor this often


def parse_cursor(table: str, text: str) -> Cursor | None:
    """The follower's cursor of a table (None: it has none), or InvalidArgumentError."""
    if not text:
        return None
    try:
        return Cursor.decoded(text)
    except ValueError as error:
        raise InvalidArgumentError(
            f"Follow: table {table!r}: field 'cursor' {error}", table=table, field="cursor"
        ) from error


class ChangeFeed:
    """The Follow stream of one follower from one shard's tables."""

    def __init__(
        self,
        tables: Callable[[], list[str]],
        table: Callable[[str], EmbeddingTable],
        request: pb.FollowRequest,
        section: Callable[[], AbstractContextManager[object]],
        *,
        poll_s: float = POLL_S,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        if request.shard_count < 1 or request.shard >= request.shard_count:
            raise InvalidArgumentError(
                f"Follow: fields 'shard' and 'shard_count' expected 0 <= shard < shard_count, "
                f"got shard {request.shard} of {request.shard_count}",
                field="shard_count",
            )
        self._tables = tables
        self._table = table
        # a data call's section of the shard's gate, around each read (never across a
        # yield: a slow follower must not hold back a snapshot cut or a load)
        self._section = section
        self.shard = int(request.shard)
        self.shard_count = int(request.shard_count)
        self.batch_rows = int(request.max_batch_rows) or DEFAULT_BATCH_ROWS
        self.cursors: dict[str, Cursor | None] = {
            given.table: parse_cursor(given.table, given.cursor) for given in request.cursors
        }
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self._told: dict[str, float] = {}  # when each table's cursor was last sent

    def _mine(self, table: EmbeddingTable, keys: np.ndarray) -> np.ndarray:
        """Which of keys the follower keeps (bool): none of a table placed whole on a shard
        its cluster does not have (the follower skips that table)."""
        config = table.config
        if config.placement is Placement.TABLE and config.table_shard >= self.shard_count:
            return np.zeros(keys.shape, dtype=bool)
        return key_shards(config, keys, self.shard_count) == self.shard

    def _owned(self, table: EmbeddingTable, keys: np.ndarray) -> np.ndarray:
        return keys[self._mine(table, keys)] if keys.size else keys

    def _batch(
        self, table: EmbeddingTable, keys: np.ndarray, rows: np.ndarray, **fields: object
    ) -> pb.ChangeBatch:
        dim = table.config.dim
        weights = np.ascontiguousarray(rows[:, :dim], dtype=np.float32)
        fields = {"head": table.changes.head, "head_unix_s": table.changes.head_time, **fields}
        return pb.ChangeBatch(
            table=table.config.name,
            keys=np.ascontiguousarray(keys, dtype="<i8").tobytes(),
            values=weights.astype("<f4", copy=False).tobytes(),
            **fields,  # type: ignore[arg-type]
        )

    def _resync(self, table: EmbeddingTable) -> Iterator[pb.ChangeBatch]:
        """Every row the follower owns, then the cursor taken before they were read: a
        change after it is sent again by a later round."""
        name = table.config.name
        with self._section():
            start = table.cursor()
            chunks = table.export_stored(self.batch_rows)
        config = table_config_to_proto(table.config.to_dict())
        yield pb.ChangeBatch(table=name, config=config, resync=True)
        while True:
            with self._section():
                chunk = next(chunks, None)
            if chunk is None:
                break
            keys, rows, _ = chunk
            owned = self._mine(table, keys)
            if owned.any():
                yield self._batch(table, keys[owned], rows[owned])
        self.cursors[name] = start
        self._told[name] = time.monotonic()
        yield pb.ChangeBatch(
            table=name, config=config, resync_done=True, cursor=start.encoded(), head=start.position
        )

    def _changes(self, table: EmbeddingTable, cursor: Cursor) -> Iterator[pb.ChangeBatch] | None:
        """The batches of a table's changes since cursor, the last one carrying the cursor
        that covers them (none: nothing new, and no heartbeat due); None where the journal
        cannot answer from cursor (a resync)."""
        with self._section():
            got = table.changed_since(cursor)
        if got is None:
            return None
        keys, head = got
        keys = self._owned(table, keys)
        name = table.config.name
        now = time.monotonic()
        heartbeat = head == cursor
        if heartbeat and now - self._told.get(name, 0.0) < self.heartbeat_s:
            return iter(())
        oldest = 0.0 if heartbeat else (table.changes.time_of(cursor.position + 1) or 0.0)
        # no keys of the follower's among the changes: one batch, the cursor alone
        chunks = [keys[at : at + self.batch_rows] for at in range(0, keys.size, self.batch_rows)]

        def batches() -> Iterator[pb.ChangeBatch]:
            for index, chunk in enumerate(chunks or [keys]):
                with self._section():
                    held, rows, gone = table.read_stored(chunk)
                fields: dict[str, object] = {"removed": np.ascontiguousarray(gone, "<i8").tobytes()}
                if index == len(chunks) - 1 or not chunks:
                    self.cursors[name] = head
                    self._told[name] = time.monotonic()
                    fields.update(
                        cursor=head.encoded(), head=head.position, oldest_change_unix_s=oldest
                    )
                    if heartbeat:  # the config, so a follower may check it is the same
                        fields["config"] = table_config_to_proto(table.config.to_dict())
                yield self._batch(table, held, rows, **fields)

        return batches()

    def batches(self, active: Callable[[], bool]) -> Iterator[pb.ChangeBatch]:
        """Rounds of batches for as long as active() says so (the call is live)."""
        while active():
            started = time.monotonic()
            names = self._tables()
            for gone in [name for name in self.cursors if name not in names]:
                del self.cursors[gone]
                yield pb.ChangeBatch(table=gone, dropped=True)
            for name in names:
                try:
                    with self._section():
                        table = self._table(name)
                except TableNotFoundError:  # dropped since the list: the next round says so
                    continue
                cursor = self.cursors.get(name)
                changes = None if cursor is None else self._changes(table, cursor)
                if changes is None:
                    changes = self._resync(table)
                yield from changes
            time.sleep(max(0.0, self.poll_s - (time.monotonic() - started)))
