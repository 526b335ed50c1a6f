"""A shard's upkeep: the background thread that flushes dirty rows and recovers a store that
cannot write, flushes asked for, and eviction of stale and small rows."""

from __future__ import annotations

import logging
import threading
import time

from tierps.server.config import ServerConfig
from tierps.server.lives import Lives
from tierps.server.shard_gate import Gate
from tierps.server.shard_health import ShardHealth
from tierps.storage import BackendError, EmbeddingStore
from tierps.storage.table import FLUSH_CHUNK_BYTES, EmbeddingTable

MAINTENANCE_TICK_S = 0.1  # how often the background thread looks at the store
RECOVERY_INTERVAL_S = 1.0  # a store that cannot write is retried this often
# A background flush writes chunks this large, holding a table's lock for one chunk at a
# time: about 1-2 ms of RocksDB writes here (a shutdown or snapshot flush uses 4 MiB)
BACKGROUND_FLUSH_CHUNK_BYTES = 256 << 10
BACKGROUND_FLUSH_PAUSE_S = 0.0002  # between chunks, so waiting calls get the table's lock
log = logging.getLogger("tierps.server")


def log_eviction(table: EmbeddingTable, removed: int, cause: str, shard_id: int) -> None:
    """Log the rows an eviction removed from a table that evicts (none logged otherwise)."""
    if table.evicts:
        log.info(
            "evicted %d rows of table %r (%s)",
            removed,
            table.config.name,
            cause,
            extra={
                "shard_id": shard_id,
                "table": table.config.name,
                "rows_evicted": removed,
                "current_step": table.current_step,
            },
        )


class Maintenance:
    """Flushes, recovery and eviction of one shard's store. Data calls hold `gate` shared;
    table and snapshot changes hold `admin_lock` (a recovery or eviction waits for them);
    a flush is recorded in `lives`, and whether the store can write is told to `health`."""

    def __init__(
        self,
        config: ServerConfig,
        where: str,
        store: EmbeddingStore,
        gate: Gate,
        admin_lock: threading.Lock,
        lives: Lives,
        health: ShardHealth,
    ) -> None:
        self.config = config
        self.where = where
        self.store = store
        self._gate = gate
        self._admin_lock = admin_lock
        self.lives = lives
        self.health = health
        self._stop = threading.Event()
        self._maintainer: threading.Thread | None = None
        self.flushes = 0  # background flushes completed
        self.last_flush: float | None = None  # when the last whole flush began

    def start_background(self) -> None:
        """Start the maintenance thread: a flush of every dirty row each flush_interval_s
        (0: none), and while the store cannot write, a recovery attempt each
        RECOVERY_INTERVAL_S, with health NOT_SERVING until it succeeds."""
        if self._maintainer is None:
            self._maintainer = threading.Thread(
                target=self._maintain,
                name=f"tierps-maintain-{self.config.shard_id}",
                daemon=True,
            )
            self._maintainer.start()

    def stop_background(self) -> None:
        """Stop the maintenance thread, after the round it is in."""
        self._stop.set()
        if self._maintainer is not None:
            self._maintainer.join()

    def _maintain(self) -> None:
        interval = self.config.flush_interval_s
        next_flush = time.monotonic() + interval
        next_recovery = 0.0
        while not self._stop.wait(MAINTENANCE_TICK_S):
            now = time.monotonic()
            try:
                if not self.store.writable:
                    self.health.set_store_ok(False)
                    if now >= next_recovery:
                        next_recovery = now + RECOVERY_INTERVAL_S
                        self.recover()
                    continue
                self.health.set_store_ok(True)
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

    def recover(self) -> bool:
        """Try once to make a store that cannot write write again (store.recover); True
        if it can now."""
        # not while a snapshot save or load reads or stages (the admin lock): reopening
        # RocksDB would pull the database from under them
        with self._admin_lock, self._gate.exclusive():
            recovered = self.store.recover()
        if recovered:
            self.last_flush = time.time()
            self.lives.flushed(self.last_flush)
            self.health.set_store_ok(True)
        return recovered

    def evict(self, name: str) -> dict[str, int]:
        """Remove this shard's stale (steps_to_live) and small (min_l2_norm) rows of a table
        from every tier: {"removed": rows, "current_step": the table's step here}. A table
        with neither option removes nothing. Other calls on the table wait meanwhile."""
        with self._admin_lock, self._gate.shared():  # not while a save, load or drop runs
            table = self.store.table(name)
            removed = table.evict()
        log_eviction(table, removed, "evict", self.config.shard_id)
        return {"removed": removed, "current_step": table.current_step}
