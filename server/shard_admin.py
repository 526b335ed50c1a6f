"""A shard's administration: its tables (create, drop, list) and its snapshots (save a part,
commit, load, list, delete), with the load fence that refuses writes to the tables a load
is replacing."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tierps.core.errors import UnavailableError
from tierps.server.config import ServerConfig
from tierps.server.shard_checks import RequestChecks
from tierps.server.shard_gate import Gate
from tierps.server.shard_health import ShardHealth
from tierps.server.shard_maintenance import log_eviction
from tierps.server.shard_stats import KeyCounts
from tierps.storage import (
    EmbeddingStore,
    EmbeddingTable,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    TableConfig,
    snapshot_catalog,
    snapshot_chain,
    snapshot_format,
    snapshot_writer,
)
from tierps.storage.changes import Cursor
from tierps.storage.snapshot_format import Progress
from tierps.storage.snapshot_reader import Snapshot
from tierps.storage.snapshot_writer import TableCut

SNAPSHOT_CHUNK_ROWS = 65536
log = logging.getLogger("tierps.server")


class ShardAdmin:
    """Table and snapshot changes of one shard, one at a time (`admin_lock`). A drop, a
    snapshot cut and a load's swap hold `gate` exclusively, so no data call sees half of
    one; a load tells `health` while it swaps."""

    def __init__(
        self,
        config: ServerConfig,
        where: str,
        store: EmbeddingStore,
        gate: Gate,
        admin_lock: threading.Lock,
        checks: RequestChecks,
        health: ShardHealth,
        key_counts: KeyCounts,
    ) -> None:
        self.config = config
        self.shard_id = config.shard_id
        self.num_shards = config.num_shards
        self.where = where
        self.store = store
        self._gate = gate
        self._admin = admin_lock
        self.checks = checks
        self.health = health
        self.key_counts = key_counts
        # Tables a snapshot load is replacing now -> the snapshot: pushes and assigns to
        # them are refused (UNAVAILABLE: retried) from before the load stages its first row
        # until its swap, so none is acknowledged and then dropped by the swap.
        self._replacing: dict[str, str] = {}

    def check_not_replacing(self, name: str, call: str) -> None:
        """Refuse a write (`call`: "push", "assign") to a table a snapshot load is
        replacing now (UnavailableError: sent again after the load, it applies)."""
        source = self._replacing.get(name)
        if source is not None:
            raise UnavailableError(
                f"table {name!r} on {self.where} is being replaced by the load of snapshot "
                f"{source!r}: this {call} was not applied; send it again after the load",
                table=name,
            )

    # -- tables ------------------------------------------------------------------------------

    def create_table(self, config: TableConfig) -> bool:
        """True if created, False if it existed with this config. A table placed whole
        with a table_shard outside this cluster is refused (InvalidArgumentError)."""
        self.checks.owner(config)
        with self._admin:
            existed = config.name in {t.name for t in self.store.tables()}
            self.store.create_table(config)
            return not existed

    def drop_table(self, name: str) -> None:
        """Drop a table and its rows on this shard, once no data call runs."""
        with self._admin, self._gate.exclusive():
            self.store.drop_table(name)
        self.key_counts.forget(name)

    def list_tables(self) -> list[TableConfig]:
        """The configs of every table, in name order."""
        return sorted(self.store.tables(), key=lambda config: config.name)

    # -- snapshots ---------------------------------------------------------------------------

    def _snapshot_root(self) -> Path:
        if self.config.snapshot_dir is None:
            raise FailedPreconditionError(
                f"{self.where} has no snapshot directory: start it with --snapshot-dir"
            )
        return Path(self.config.snapshot_dir)

    def save_part(self, name: str, save_id: str, base: str = "") -> Iterator[Progress]:
        """Write this shard's part of snapshot `name`. Data calls wait while every table is
        flushed and a RocksDB snapshot of each is taken (the cut); the files are written from
        those snapshots afterwards, while the shard serves again. Tables with
        evict_before_snapshot are evicted first, inside the cut; every Progress says how many
        rows that removed (rows_evicted), and so does the log.

        base: the complete snapshot an incremental part builds on ("": a full part). Each
        table then writes only its rows changed since the base's cut and the tombstones of
        its keys removed since: from its change journal where the base's cursor for it is
        still answerable here (the base has this shard count, and no restart, load or
        journal overflow came between), else by comparing it with the base chain's rows of
        this shard; a table the base lacks writes every row. The last Progress and the log
        say which (diffs)."""
        root = self._snapshot_root()
        snapshot_format.check_name(name)
        snapshot_format.check_save_id(save_id)
        chain = snapshot_chain.open_chain(root, snapshot_format.check_name(base)) if base else None
        with self._admin:
            snapshot_writer.check_new(root, name)  # a refused save must not have evicted anything
            with self._gate.exclusive():
                tables = [self.store.table(config.name) for config in self.list_tables()]
                evicted = 0
                for table in tables:
                    if table.config.evict_before_snapshot:
                        removed = table.evict()
                        log_eviction(table, removed, f"before snapshot {name!r}", self.shard_id)
                        evicted += removed
                # rows with their step stamps, and the rest of the training state (clock,
                # bucket rows, admission and promotion counts), all as of this cut
                cuts = [self._cut(table, chain) for table in tables]
            estimate = sum(t.durable.stats()["rows"] for t in tables)
            link = None
            if chain is not None:
                link = snapshot_writer.BaseLink(
                    base, chain[0].save_id, chain[0].manifest[snapshot_format.CHECKSUM]
                )
            diffs = {cut.config.name: cut.diff for cut in cuts if cut.diff}
            if diffs:
                log.info(
                    "snapshot %r on base %r: tables' changes found by %s",
                    name,
                    base,
                    diffs,
                    extra={"shard_id": self.shard_id, "diffs": diffs},
                )
            for progress in snapshot_writer.write_part(
                root, name, save_id, self.shard_id, self.num_shards, cuts, estimate, link
            ):
                yield dataclasses.replace(progress, rows_evicted=evicted, diffs=diffs)

    def _cut(self, table: EmbeddingTable, chain: list[Snapshot] | None) -> TableCut:
        """A table's share of this shard's part, taken inside the cut (see save_part)."""
        config = table.config
        cursor = table.cursor()  # before the export: a change after it is read again later
        state = table.export_state()
        if chain is None:
            chunks = table.export_stored(SNAPSHOT_CHUNK_ROWS)
            return TableCut(config, chunks, state, cursor.encoded())
        base = chain[0]
        if base.configs.get(config.name) != config:  # new since the base, or another config
            chunks = table.export_stored(SNAPSHOT_CHUNK_ROWS)
            return TableCut(config, chunks, state, cursor.encoded(), snapshot_format.DIFF_ALL)
        changed = self._changed_since(table, base)
        if changed is not None:
            keys, head = changed
            chunks, gone = self._read_changed(table, keys)
            return TableCut(
                config, chunks, state, head.encoded(), snapshot_format.DIFF_JOURNAL, lambda: gone
            )
        comparison = snapshot_chain.Comparison(
            lambda: snapshot_chain.shard_rows(chain, config.name, self.shard_id, self.num_shards)
        )
        return TableCut(
            config,
            comparison.changed(table.export_stored(SNAPSHOT_CHUNK_ROWS)),
            state,
            cursor.encoded(),
            snapshot_format.DIFF_COMPARE,
            comparison.tombstones,
        )

    def _changed_since(
        self, table: EmbeddingTable, base: Snapshot
    ) -> tuple[np.ndarray, Cursor] | None:
        """The table's keys changed since the base's cut of this shard's part, from its
        journal; None where the journal cannot tell (another shard count, an unreadable
        cursor, another journal or one that let that position go)."""
        if base.num_shards != self.num_shards or base.version < snapshot_format.INCREMENTAL_VERSION:
            return None
        parts = base.tables[table.config.name]["parts"]
        part = next(p for p in parts if int(p["shard_id"]) == self.shard_id)
        try:
            cursor = Cursor.decoded(part["cursor"])
        except ValueError:
            return None
        return table.changed_since(cursor)

    @staticmethod
    def _read_changed(
        table: EmbeddingTable, keys: np.ndarray
    ) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray | None]], np.ndarray]:
        """The stored rows of keys (ascending) as chunks (keys, rows, steps), and the keys
        without a stored row (removed since: tombstones), read now (inside the cut). Rows
        are rounded as RocksDB holds them (cold_dtype), as a full save's and the compare
        path's export gives them: the same history saves the same bits either way."""
        chunks, gone = [], []
        width = table.config.row_width
        for start in range(0, keys.size, SNAPSHOT_CHUNK_ROWS):
            held, rows, absent = table.read_stored(keys[start : start + SNAPSHOT_CHUNK_ROWS])
            rows = table.codec.round(rows)
            steps = table.codec.steps(rows) if table.step_slots else None
            chunks.append((held, np.ascontiguousarray(rows[:, :width]), steps))
            gone.append(absent)
        return chunks, np.concatenate(gone) if gone else np.empty(0, np.int64)

    def commit_snapshot(self, name: str, save_id: str) -> Iterator[Progress]:
        """Write snapshot `name`'s manifest once every part of save `save_id` is there and
        agrees (snapshot_writer.commit); one Progress, done, with the snapshot's rows."""
        root = self._snapshot_root()
        try:
            manifest = snapshot_writer.commit(root, name, save_id)
        except ResourceExhaustedError as error:
            raise ResourceExhaustedError(
                f"{self.where} committing: {error}", reason=error.reason
            ) from None
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
        leaves every live row as it was and drops what it staged.

        An incremental snapshot loads its chain (snapshot_chain): every link checked so,
        each table staged from the oldest link it needs, then each newer link's rows put and
        tombstones deleted in the same staging; the training state is the newest link's."""
        root = self._snapshot_root()
        chain = snapshot_chain.open_chain(root, name)
        opened = chain[0]
        for config in opened.configs.values():
            try:
                self.checks.owner(config)
            except InvalidArgumentError as error:
                raise FailedPreconditionError(
                    f"snapshot {name!r} cannot load into this cluster of {self.num_shards} "
                    f"shards: {error}"
                ) from None
            self.store.check_creatable(config)  # before anything is staged
        for link in chain:
            link.check_files()
            link.check_headers()
        links = {
            table_name: snapshot_chain.table_links(chain, table_name)
            for table_name in opened.configs
        }
        # every part's state files read and checked (the other shards' too) before any
        # row is staged; this shard's share resolved (see snapshot_format.CARRIES for a reshard)
        states = {
            table_name: opened.state_for_shard(table_name, self.shard_id, self.num_shards)
            for table_name in opened.configs
        }
        total = sum(
            int(link.tables[table_name]["rows"])
            for table_name, used in links.items()
            for link in used
        )
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
                    for depth, link in enumerate(links[table_name]):  # oldest first
                        # a link's tombstones and rows are distinct keys: either order works
                        gone = link.tombstones_for_shard(table_name, self.shard_id, self.num_shards)
                        kept -= stage.rows.remove(gone) if gone.size else 0
                        for keys, rows, steps, scanned in link.rows_and_steps_for_shard(
                            table_name, self.shard_id, self.num_shards, SNAPSHOT_CHUNK_ROWS
                        ):
                            if keys.size:
                                # a newer link's row replaces a staged one: count new keys only
                                known = int(stage.rows.contains(keys).sum()) if depth else 0
                                stage.rows.write(keys, config.codec.widen(rows, steps))
                                kept += keys.size - known
                            done += scanned
                            yield Progress(done, total, str(opened.path), rows_kept=kept)
                with self._gate.exclusive():
                    self.health.set_loading(True)
                    try:
                        tables = self.store.install_staged(staged)
                        for table in tables:  # the soft state: clock and counts, in memory
                            table.restore_state(states[table.config.name])
                    finally:
                        self.health.set_loading(False)
            finally:
                for table_name in opened.configs:
                    self._replacing.pop(table_name, None)
                for stage in staged:  # a refused, failed or cancelled load: drop the staging
                    self.store.discard_staged(stage)
        yield Progress(done, total, str(opened.path), rows_kept=kept, done=True)

    def list_snapshots(self) -> list[dict[str, Any]]:
        """The snapshots under the snapshot dir (snapshot_catalog.list_snapshots)."""
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
        log.info(
            "removed %d snapshot paths",
            len(removed),
            extra={"shard_id": self.shard_id, "removed": removed},
        )
        return removed
