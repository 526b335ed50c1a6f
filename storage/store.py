"""EmbeddingStore: the tables of one shard, over one RocksDB database.

Each table has a column family for its rows; the table configs live in the default column
family, so a reopened store knows its tables.

A table's tiers: a hashed table (use_hashtable=True) gets a host CacheTier within its
host_cache_bytes budget (none when the budget holds no row) over RocksDB. A direct table
(use_hashtable=False, capacity=N) gets a DirectTier over RocksDB instead: all N rows in
memory whatever host_cache_bytes says, so create_table refuses one whose arena would take
more than DIRECT_MEMORY_FRACTION of this machine's physical memory; likewise a counting Bloom
filter (admission="bloom") whose counters would.

Either kind gets a GPU CacheTier on top, on cupy, within a GPU budget: the table's
gpu_cache_bytes, or the store's gpu_cache_bytes (a shard's --gpu-cache-mb) when the table
leaves it 0. Where no GPU is usable, the store logs one warning and the table is served
without that tier.

A table with steps_to_live > 0 keeps its current and first pushed steps (EmbeddingTable's
current_step, first_step) in the default column family too, written at every flush (and so
at close), read when the table opens; its rows carry their own last-update steps.

A table with adaptive embedding (hash_bucket_size = B, promote_after > 0) keeps its B shared
bucket rows in memory (storage/adaptive.py) and durable in a column family of their own,
"buckets.<table>" (key: bucket index), written at every flush; create_table refuses B rows
over DIRECT_MEMORY_FRACTION of physical memory, like a direct table's arena.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from rocksdict import Checkpoint, Options, Rdict, WriteBatch, WriteOptions

from tierps.core.codec import RowCodec
from tierps.core.config import TableConfig, config_differences
from tierps.core.errors import (
    BackendError,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    TableNotFoundError,
    quoted,
)
from tierps.core.validation import DEFAULT_MAX_STEP_LEAP
from tierps.core.xp import gpu_arrays
from tierps.storage import host_kernels
from tierps.storage.adaptive import BucketRows
from tierps.storage.admission import bloom_bytes
from tierps.storage.rocksdb_tier import RocksDBTier, WriteState, backend_error
from tierps.storage.table import FLUSH_CHUNK_BYTES, EmbeddingTable
from tierps.storage.tiers import (
    CacheTier,
    DirectTier,
    Tier,
    direct_arena_bytes,
    host_rows_for_budget,
)

log = logging.getLogger("tierps.storage")

FORMAT_VERSION = 1
_FORMAT_KEY = b"tierps/format_version"
_CONFIG_PREFIX = b"tierps/table/"
_STEPS_PREFIX = b"tierps/steps/"  # sorts before _CONFIG_PREFIX: the table scan never sees it
# A table's column families where a snapshot load staged them (sorts before _CONFIG_PREFIX
# too); without it, "table.<name>" and "buckets.<name>".
_FAMILY_PREFIX = b"tierps/family/"
# A table's generation: {"id", "snapshot", "at"}, made anew when the table is created and
# when a snapshot load replaces it (Generation)
_GENERATION_PREFIX = b"tierps/generation/"
_CF_PREFIX = "table."
_BUCKETS_CF_PREFIX = "buckets."  # adaptive embedding's bucket rows of a table
_PROBE_KEY = b"tierps/probe"  # written by recover() to prove the store writes again
RECOVERY_HEADROOM_BYTES = 4 << 20  # free space recover() wants beyond RocksDB's log files


DIRECT_MEMORY_FRACTION = 0.5  # a direct table's arena may take at most this share of RAM
MEMTABLE_BYTES = 16 << 20  # per column family; RocksDB's default (64 MiB) is large per table
DB_MEMTABLE_BYTES = 64 << 20  # all memtables of the store together


def physical_memory_bytes() -> int:
    """This machine's physical memory (os.sysconf), or 0 where it cannot be told."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def check_memory_share(
    where: str, what: str, need: int, got: str, fix: str, memory_bytes: int | None = None
) -> None:
    """Refuse (ResourceExhaustedError) memory of `need` bytes that a table holds whole per
    shard, when it is over DIRECT_MEMORY_FRACTION of physical memory (`memory_bytes`, this
    machine's by default; unknown memory is not checked). The one bound of the direct
    arena, the Bloom filter and the bucket rows: "{where}: {what} expected at most L bytes
    (50% of this machine's M bytes), got {got}; {fix}"."""
    memory = physical_memory_bytes() if memory_bytes is None else memory_bytes
    limit = int(memory * DIRECT_MEMORY_FRACTION)
    if need and memory and need > limit:
        raise ResourceExhaustedError(
            f"{where}: {what} expected at most {limit} bytes ({DIRECT_MEMORY_FRACTION:.0%} of "
            f"this machine's {memory} bytes), got {got}; {fix}"
        )


def check_direct_size(config: TableConfig, where: str, memory_bytes: int | None = None) -> None:
    """A direct table's arena - all `capacity` rows, weights and optimizer state, plus two
    flag bytes a row - within check_memory_share's bound. The bound is per table and shard:
    it catches a capacity no machine of this size can hold, not the sum of many tables. A
    hashed table is not checked: its host_cache_bytes budget bounds it and its other rows
    live in RocksDB."""
    if config.use_hashtable:
        return
    per_row = direct_arena_bytes(1, config.stored_bytes)
    need = config.capacity * per_row
    check_memory_share(
        where,
        "field 'capacity' (use_hashtable=False holds all its rows in memory)",
        need,
        f"{config.capacity} rows x {per_row} bytes (dim {config.dim} with "
        f"{config.optimizer.kind}'s state, and the flags) = {need} bytes",
        "lower capacity, or use a hashed table (use_hashtable=True), whose host_cache_bytes "
        "budget keeps the other rows in RocksDB only",
        memory_bytes,
    )


def check_admission_size(config: TableConfig, where: str, memory_bytes: int | None = None) -> None:
    """A counting Bloom filter's counters (admission="bloom"), sized from max_elements and
    false_positive_rate and allocated per shard when the table opens, within
    check_memory_share's bound."""
    need = bloom_bytes(config)
    check_memory_share(
        where,
        "field 'max_elements'",
        need,
        f"max_elements={config.max_elements} at false_positive_rate="
        f"{config.false_positive_rate:g}: {need} bytes of Bloom filter counters on each shard",
        "lower max_elements, raise false_positive_rate, or use admission='counter'",
        memory_bytes,
    )


def check_bucket_size(config: TableConfig, where: str, memory_bytes: int | None = None) -> None:
    """Adaptive embedding's hash_bucket_size rows - weights and optimizer state, held in
    memory on every shard - within check_memory_share's bound."""
    need = config.hash_bucket_size * config.row_bytes
    check_memory_share(
        where,
        "field 'hash_bucket_size'",
        need,
        f"hash_bucket_size={config.hash_bucket_size}: {config.hash_bucket_size} rows x "
        f"{config.row_bytes} bytes = {need} bytes on each shard",
        "lower hash_bucket_size",
        memory_bytes,
    )


def _options() -> Options:
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.create_missing_column_families(True)
    options.set_write_buffer_size(MEMTABLE_BYTES)
    options.set_max_write_buffer_number(2)
    options.set_db_write_buffer_size(DB_MEMTABLE_BYTES)
    return options


@dataclass(frozen=True)
class Generation:
    """Which life of a table's rows a shard holds: `id` is made anew (at random) when the
    table is created and when a snapshot load replaces its rows (`snapshot`, at `at`, Unix
    seconds). A push made against rows of another generation is refused: they were replaced
    under its trainer."""

    id: int
    snapshot: str | None = None
    at: float = 0.0

    @classmethod
    def new(cls, snapshot: str | None = None) -> Generation:
        return cls(secrets.randbits(63) or 1, snapshot or None, time.time())

    def encoded(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    def describe(self) -> str:
        made = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))
        how = f"loaded from snapshot {self.snapshot!r}" if self.snapshot else "created"
        return f"generation {self.id} ({how} at {made})"


@dataclass
class StagedTable:
    """A table's rows that a snapshot load writes aside (EmbeddingStore.stage_table):
    `rows` (stored_width) and `buckets` (adaptive bucket rows) in column families of their
    own, and the step clock (current_step, first_step) it installs with them."""

    config: TableConfig
    rows: RocksDBTier
    buckets: RocksDBTier | None
    families: tuple[str, str]
    steps: tuple[int, int] = (0, 0)
    source: str = ""  # the snapshot loaded: the generation it installs names it
    installed: bool = False  # live now: its families are the table's, never to be dropped
    closed: bool = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for tier in (self.rows, self.buckets):
                if tier is not None:
                    tier.close()


class EmbeddingStore:
    """Tables of one shard: cache tiers over RocksDB at `path` (created if missing).

    gpu_cache_bytes: the GPU tier's budget for tables whose own gpu_cache_bytes is 0 (0: none).
    gpu_arrays: "auto" puts GPU tiers on cupy where a GPU is usable; "numpy" runs the same
    tier code on host arrays (tests; trying a GPU configuration without a GPU).

    sync_writes: fsync RocksDB's log on every write (WriteOptions.sync), so that what a
    write-through table acknowledged survives a power loss too, not only a killed process.

    max_step_leap: how far one push may move a table's clock forward (check_step_leap in
    core/validation.py; 0: no limit).

    Opening drops the column families that a snapshot load killed before it finished left
    behind (_drop_orphan_families), logging each with its size.

    A failed RocksDB write (a full disk, an I/O error) is remembered (write_state): the store
    refuses writes from then on with that cause, while every row not yet written stays in
    the memory tiers, until recover() reopens RocksDB and writes them down.

    Use as a context manager, or call close(): it flushes dirty rows and releases RocksDB.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        shard_id: int = 0,
        gpu_cache_bytes: int = 0,
        gpu_arrays: str = "auto",
        sync_writes: bool = False,
        max_step_leap: int = DEFAULT_MAX_STEP_LEAP,
    ) -> None:
        self.path = Path(path)
        self.max_step_leap = max_step_leap  # every table's (EmbeddingTable.max_step_leap)
        self.shard_id = shard_id
        self.sync_writes = sync_writes
        self._metadata_options = WriteOptions()  # made once: a push writes metadata a call
        self._metadata_options.sync = sync_writes
        self.write_state = WriteState()
        self.recoveries = 0  # times recover() made a failed store writable again
        self.gpu_cache_bytes = gpu_cache_bytes
        self.gpu_arrays = gpu_arrays
        self._gpu_warned = False
        self._lock = threading.Lock()
        self.path.mkdir(parents=True, exist_ok=True)
        self._db: Rdict | None = self._open_db()
        version = self._db.get(_FORMAT_KEY)
        if version is None:
            self._put(_FORMAT_KEY, str(FORMAT_VERSION).encode())
        elif int(version) != FORMAT_VERSION:
            raise FailedPreconditionError(
                f"shard {shard_id}: store at {self.path} has format version {int(version)}, "
                f"expected {FORMAT_VERSION}"
            )
        self._tables: dict[str, EmbeddingTable] = {}
        if gpu_cache_bytes:  # say it at start, not at the first table
            self._usable_gpu(
                f"shard {shard_id} asks for a GPU cache of {gpu_cache_bytes} bytes per table"
            )
        stored = self.metadata(_CONFIG_PREFIX)
        configs = [TableConfig.from_dict(json.loads(raw)) for _, raw in stored]
        self.orphans_dropped = self._drop_orphan_families(configs)
        for config in configs:
            self._open_table(config)

    def _where(self, name: str) -> str:
        return f"table '{name}' on shard {self.shard_id}"

    def _open_db(self) -> Rdict:
        families = Rdict.list_cf(str(self.path)) if (self.path / "CURRENT").exists() else []
        try:
            return Rdict(
                str(self.path),
                _options(),
                column_families={cf: _options() for cf in families if cf != "default"},
            )
        except Exception as error:
            raise backend_error(f"open {self.path}", f"shard {self.shard_id}", error) from error

    def _drop_orphan_families(self, configs: list[TableConfig]) -> dict[str, int]:
        """Drop the column families of ours ("table.*", "buckets.*") that no stored table
        uses, logging each with its size; returns {family: bytes}. Only a process killed
        during a snapshot load leaves such families: stage_table writes a table's rows into
        new families ("table.<name>@<tag>", a name no live family has), and install_staged
        makes them the table's in one atomic write of _FAMILY_PREFIX records; killed before
        that write, the staged families are used by no table, and killed after it but
        before it dropped the families they replaced, those are. Which families a table
        uses is read from its records, as _open_table reads them, so a family that any
        stored table reads is never dropped. Runs at open, before any table is served."""
        used = set()
        for config in configs:
            rows, buckets = self._families(config.name)
            used.add(rows)
            if config.promote_after:
                used.add(buckets)
        dropped: dict[str, int] = {}
        for family in Rdict.list_cf(str(self.path)):
            if not family.startswith((_CF_PREFIX, _BUCKETS_CF_PREFIX)) or family in used:
                continue
            handle = self._db.get_column_family(family)
            try:  # what it takes on disk: its SST files, and its memtable (in the log)
                size = handle.property_int_value("rocksdb.total-sst-files-size") or 0
                size += handle.property_int_value("rocksdb.cur-size-all-mem-tables") or 0
            finally:
                handle.close()
            try:
                self._db.drop_column_family(family)
            except Exception as error:  # noqa: BLE001 - garbage left, nothing lost: say so
                log.warning(
                    "shard %d: could not drop column family %r, which no table uses "
                    "(left by a killed snapshot load): %s",
                    self.shard_id,
                    family,
                    error,
                )
                continue
            dropped[family] = size
            log.warning(
                "shard %d: dropped column family %r of %d bytes, which no table uses: a "
                "snapshot load killed before it finished left it",
                self.shard_id,
                family,
                size,
                extra={"shard_id": self.shard_id, "family": family, "bytes": size},
            )
        return dropped

    def _put(self, key: bytes, value: bytes | None) -> None:
        """Write (or delete, value None) one metadata key of the default column family, as
        the tiers write rows: refused while the store has failed, and a failure remembered."""
        self.write_state.check()
        try:
            if value is None:
                self._db.delete(key, self._metadata_options)
            else:
                self._db.put(key, value, self._metadata_options)
        except Exception as error:
            where = f"shard {self.shard_id}"
            raise self.write_state.failed(backend_error("write metadata", where, error)) from error

    def _put_many(self, writes: Sequence[tuple[bytes, bytes | None]]) -> None:
        """_put of several keys in one atomic RocksDB write (one WriteBatch: all of them land
        or none), refused and remembered alike."""
        if len(writes) == 1:
            self._put(*writes[0])
            return
        batch = WriteBatch(raw_mode=True)
        for key, value in writes:
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
        self.write_state.check()
        try:
            self._db.write(batch, self._metadata_options)
        except Exception as error:
            where = f"shard {self.shard_id}"
            raise self.write_state.failed(backend_error("write metadata", where, error)) from error

    def _durables(self) -> list[RocksDBTier]:
        """Every RocksDB tier of this store: each table's rows and adaptive bucket rows."""
        tiers = [table.durable for table in self._tables.values()]
        tiers += [t.buckets.durable for t in self._tables.values() if t.buckets is not None]
        return [tier for tier in tiers if isinstance(tier, RocksDBTier)]

    @property
    def writable(self) -> bool:
        """False after a failed write, until recover() succeeds."""
        return self.write_state.failure is None

    def recover(self, min_free_bytes: int = RECOVERY_HEADROOM_BYTES) -> bool:
        """Make a store whose writes failed writable again, without losing a row: True once
        it is (at once when nothing failed), False while it cannot be yet.

        RocksDB keeps refusing writes after a failed one until the database is reopened, so
        this reopens it - when the file system has room for RocksDB to replay its log into
        tables (the log's size plus min_free_bytes) - rebinds every table's tier to it, writes
        a probe, and then flushes every dirty row, which the memory tiers kept all along. The
        caller keeps data calls out meanwhile (the shard's gate)."""
        if self.writable:
            return True
        logs = sum(f.stat().st_size for f in self.path.glob("*.log"))
        if shutil.disk_usage(self.path).free < logs + min_free_bytes:
            return False
        tiers = self._durables()
        for tier in tiers:
            tier.close()
        try:
            self._db.close()
        except Exception:  # noqa: BLE001 - RocksDB says "Writer has previous error"; closed
            log.debug("closing the failed store of shard %d", self.shard_id, exc_info=True)
        try:
            self._db = self._open_db()
        except BackendError as error:
            log.warning("shard %d: reopening its store failed: %s", self.shard_id, error)
            return False  # the tiers stay closed and refuse with the first cause meanwhile
        for tier in tiers:
            tier.bind(self._db)
        failure, self.write_state.failure = self.write_state.failure, None
        try:
            self._put(_PROBE_KEY, str(time.time()).encode())
            self.flush()
        except BackendError as error:
            log.warning("shard %d: its store is still not writable: %s", self.shard_id, error)
            return False
        self.recoveries += 1
        log.warning(
            "shard %d: its store is writable again (it had failed: %s); every dirty row is written",
            self.shard_id,
            failure,
        )
        return True

    def _family(self, family: str) -> str:
        """Make sure column family `family` exists; returns its name."""
        try:
            self._db.get_column_family(family).close()
        except Exception:
            self._db.create_column_family(family, _options()).close()
        return family

    def _families(self, name: str) -> tuple[str, str]:
        """The column families of a table's rows and bucket rows."""
        staged = self._db.get(_FAMILY_PREFIX + name.encode())
        if staged is None:
            return _CF_PREFIX + name, _BUCKETS_CF_PREFIX + name
        rows, buckets = json.loads(staged)
        return rows, buckets

    def _open_table(self, config: TableConfig) -> EmbeddingTable:
        where = self._where(config.name)
        rows_family, buckets_family = self._families(config.name)
        family = self._family(rows_family)
        tiers: list[Tier] = []
        # with the compiled host kernels, a push trains resident rows where they lie
        compiled = host_kernels.host_launcher() is not None
        if not config.use_hashtable:
            tiers.append(DirectTier(config, compiled=compiled))
        elif host_rows_for_budget(config.host_cache_bytes, config.stored_bytes) > 0:
            tiers.append(CacheTier(config, config.host_cache_bytes, trains_in_place=compiled))
        tiers.append(self._rocksdb_tier(family, config.codec, where))
        gpu = self._gpu_tier(config)
        if gpu is not None:
            tiers.insert(0, gpu)
        buckets = None
        if config.promote_after:
            bucket_family = self._family(buckets_family)
            buckets = BucketRows(
                config, self._rocksdb_tier(bucket_family, config.bucket_codec, f"{where} buckets")
            )
        table = EmbeddingTable(
            config, tiers, where=where, buckets=buckets, max_step_leap=self.max_step_leap
        )
        table.generation = self._generation(config.name)
        steps = self._db.get(_STEPS_PREFIX + config.name.encode())
        if steps is not None:
            table.current_step, table.first_step = json.loads(steps)
        self._tables[config.name] = table
        return table

    def _generation(self, name: str) -> Generation:
        """A table's generation as stored; one made now for a table stored without one."""
        raw = self._db.get(_GENERATION_PREFIX + name.encode())
        if raw is not None:
            return Generation(**json.loads(raw))
        generation = Generation.new()
        self._put(_GENERATION_PREFIX + name.encode(), generation.encoded())
        return generation

    def write_metadata(self, key: bytes, value: bytes | None) -> None:
        """Write (value None: delete) one key of the shard's own records (not a table's
        rows), as durably as the rows: refused while the store cannot write."""
        self._put(key, value)

    def write_metadata_many(self, writes: Sequence[tuple[bytes, bytes | None]]) -> None:
        """write_metadata of several keys, (key, value or None) each, in one atomic write:
        after a crash, all of them are there or none (the push ledger writes a call's record
        and deletes the records it forgets so)."""
        if writes:
            self._put_many(writes)

    def metadata(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """The shard's own records whose key starts with prefix, in key order."""
        found = []
        for key, value in self._db.items(from_key=prefix):
            if not key.startswith(prefix):
                break
            found.append((key, value))
        return found

    def _rocksdb_tier(self, family: str, codec: RowCodec, where: str) -> RocksDBTier:
        return RocksDBTier(
            self._db, family, codec, where=where, sync=self.sync_writes, state=self.write_state
        )

    def _gpu_budget(self, config: TableConfig) -> int:
        """A table's GPU tier budget: its own gpu_cache_bytes, else the store's default."""
        return config.gpu_cache_bytes or self.gpu_cache_bytes

    def _gpu_tier(self, config: TableConfig) -> CacheTier | None:
        """The table's GPU tier, or None: no GPU budget, a budget below one row, or no
        usable GPU (warned once per store)."""
        budget = self._gpu_budget(config)
        if budget == 0 or host_rows_for_budget(budget, config.stored_bytes) == 0:
            return None
        where = self._where(config.name)
        xp = self._usable_gpu(f"{where} asks for a GPU cache of {budget} bytes")
        if xp is None:
            return None
        try:
            return CacheTier(
                config, budget, xp=xp, name="gpu", trains_in_place=True, preallocate=True
            )
        except MemoryError as error:  # cupy's OutOfMemoryError: e.g. reopened on a fuller GPU
            log.warning(
                "%s: its GPU cache of %d bytes does not fit the GPU now (%s): served from the "
                "host tier and RocksDB",
                where,
                budget,
                error,
            )
            return None

    def _usable_gpu(self, asked: str) -> ModuleType | None:
        """The GPU tiers' array module; None, with one warning per store, where no GPU is
        usable."""
        xp, why = self.gpu_module()
        if xp is None and not self._gpu_warned:
            self._gpu_warned = True
            log.warning(
                "%s, but no GPU is usable (%s): tables are served from the host tier and RocksDB",
                asked,
                why,
            )
        return xp

    def gpu_module(self) -> tuple[ModuleType | None, str]:
        """The GPU tiers' array module (None where no GPU is usable) and why not."""
        return gpu_arrays(self.gpu_arrays)

    def create_table(self, config: TableConfig) -> EmbeddingTable:
        """Create a table; the same config again is a no-op, a different one is refused, and
        so is a direct table or a Bloom filter too large for memory (see check_direct_size,
        check_admission_size)."""
        if not isinstance(config, TableConfig):
            raise InvalidArgumentError(
                f"shard {self.shard_id}: create_table expected a TableConfig, "
                f"got {type(config).__name__}"
            )
        with self._lock:
            existing = self._tables.get(config.name)
            if existing is not None:
                if existing.config != config:
                    raise FailedPreconditionError(
                        f"{self._where(config.name)} exists with another config: "
                        f"{config_differences(existing.config, config)}"
                    )
                return existing
            self.check_creatable(config)
            self._put(_GENERATION_PREFIX + config.name.encode(), Generation.new().encoded())
            self._put(_CONFIG_PREFIX + config.name.encode(), json.dumps(config.to_dict()).encode())
            return self._open_table(config)

    def check_creatable(self, config: TableConfig) -> None:
        """Refuse (ResourceExhaustedError) a table whose direct arena, Bloom filter or bucket
        rows would not fit this machine's memory, or whose GPU tier would not fit the GPU's:
        run by create_table, and by a snapshot load for every table before it drops any."""
        where = self._where(config.name)
        check_direct_size(config, where)
        check_admission_size(config, where)
        check_bucket_size(config, where)
        self._check_gpu_size(config, where)

    def _check_gpu_size(self, config: TableConfig, where: str) -> None:
        """Refuse a GPU tier (allocated whole when the table opens) over the GPU memory free
        now: the driver's free memory and what cupy's pool holds unused."""
        budget = self._gpu_budget(config)
        xp, _ = self.gpu_module()
        if budget == 0 or xp is None or xp is np:
            return
        free = int(xp.cuda.runtime.memGetInfo()[0]) + int(xp.get_default_memory_pool().free_bytes())
        if budget > free:
            raise ResourceExhaustedError(
                f"{where}: field 'gpu_cache_bytes' expected at most the {free} bytes free on "
                f"the GPU, got {budget}"
            )

    def drop_table(self, name: str) -> None:
        """Delete a table and all its rows."""
        with self._lock:
            table = self.table(name)
            rows_family, buckets_family = self._families(name)
            table.close()
            del self._tables[name]
            self._db.drop_column_family(rows_family)
            if table.config.promote_after:
                self._db.drop_column_family(buckets_family)
            self._put(_CONFIG_PREFIX + name.encode(), None)
            self._put(_STEPS_PREFIX + name.encode(), None)
            self._put(_FAMILY_PREFIX + name.encode(), None)
            self._put(_GENERATION_PREFIX + name.encode(), None)

    # -- snapshot loads: stage a table's rows aside, then swap them in at once ----------

    def stage_table(self, config: TableConfig, source: str = "") -> StagedTable:
        """Empty column families for a table's rows (and bucket rows) that a snapshot load
        fills while the live table serves on, untouched; install_staged makes them live."""
        tag = uuid.uuid4().hex[:12]  # '@' is in no table name: never a live table's family
        where = f"{self._where(config.name)} (staged by a snapshot load)"
        rows_family = self._family(f"{_CF_PREFIX}{config.name}@{tag}")
        buckets_family = f"{_BUCKETS_CF_PREFIX}{config.name}@{tag}"
        staged = StagedTable(
            config,
            self._rocksdb_tier(rows_family, config.codec, where),
            None,
            (rows_family, buckets_family),
            source=source,
        )
        if config.promote_after:
            self._family(buckets_family)
            staged.buckets = self._rocksdb_tier(
                buckets_family, config.bucket_codec, f"{where} buckets"
            )
        return staged

    def install_staged(self, staged: list[StagedTable]) -> list[EmbeddingTable]:
        """Make staged tables live in one atomic, synced RocksDB write (every table's config,
        column families and step clock, or none of them), then drop the families they
        replace. A failure of that write (BackendError) changes nothing live; the caller
        still owns `staged`. Returns the new tables."""
        with self._lock:
            batch = WriteBatch(raw_mode=True)
            for table in staged:
                name = table.config.name.encode()
                batch.put(_CONFIG_PREFIX + name, json.dumps(table.config.to_dict()).encode())
                batch.put(_FAMILY_PREFIX + name, json.dumps(list(table.families)).encode())
                batch.put(_GENERATION_PREFIX + name, Generation.new(table.source).encoded())
                if table.config.steps_to_live:
                    batch.put(_STEPS_PREFIX + name, json.dumps(list(table.steps)).encode())
                else:
                    batch.delete(_STEPS_PREFIX + name)
            replaced = {
                table.config.name: (
                    self._tables[table.config.name],
                    self._families(table.config.name),
                )
                for table in staged
                if table.config.name in self._tables
            }
            sync = WriteOptions()
            sync.sync = True
            self.write_state.check()
            try:
                self._db.flush_wal(True)  # the staged rows are durable before they are live
                self._db.write(batch, sync)
            except Exception as error:  # the live tables are unchanged
                action = "install a snapshot load's tables"
                where = f"shard {self.shard_id}"
                raise self.write_state.failed(backend_error(action, where, error)) from error
            opened = []
            for table in staged:
                table.installed = True
            for table in staged:
                table.close()
                old = replaced.get(table.config.name)
                if old is not None:
                    live, families = old
                    live.close()
                    del self._tables[table.config.name]
                    self._drop_families(families[: 2 if live.config.promote_after else 1])
                opened.append(self._open_table(table.config))
            return opened

    def discard_staged(self, staged: StagedTable) -> None:
        """Drop a staged table's column families (a load that failed or was cancelled); a
        table installed already is left as it is."""
        staged.close()
        if staged.installed:
            return
        self._drop_families(staged.families[: 2 if staged.config.promote_after else 1])

    def _drop_families(self, families: tuple[str, ...]) -> None:
        for family in families:
            try:
                self._db.drop_column_family(family)
            except Exception as error:  # garbage left behind, nothing lost: say so
                log.warning(
                    "shard %d: could not drop column family %r: %s", self.shard_id, family, error
                )

    def table(self, name: str) -> EmbeddingTable:
        try:
            return self._tables[name]
        except KeyError:
            raise TableNotFoundError(
                f"shard {self.shard_id}: table {quoted(name)} not found; tables: "
                f"{sorted(self._tables)}",
                table=name,
                shard=self.shard_id,
            ) from None

    def tables(self) -> list[TableConfig]:
        return [table.config for table in self._tables.values()]

    def lookup(self, name: str, keys: Any, *, create: bool = True, out: Any = None) -> np.ndarray:
        """EmbeddingTable.lookup of table `name` (out: a writable C-contiguous float32
        array [len(keys), dim] the rows are written into, and returned)."""
        return self.table(name).lookup(keys, create=create, out=out)

    def apply_gradients(self, name: str, keys: Any, grads: Any, step: int) -> None:
        self.table(name).apply_gradients(keys, grads, step)

    def assign(self, name: str, keys: Any, values: Any) -> None:
        self.table(name).assign(keys, values)

    def flush(
        self,
        chunk_bytes: int = FLUSH_CHUNK_BYTES,
        pause_s: float = 0.0,
        stop: Callable[[], bool] | None = None,
    ) -> bool:
        """Write every dirty row of every table, and the steps of those with steps_to_live,
        to RocksDB, and fsync its log (so what was flushed survives a power loss too); True
        when done. Tables flush in chunks of about chunk_bytes, letting their locks go
        between chunks for pause_s; `stop` is asked between chunks, and if it says True the
        flush ends there and returns False (EmbeddingTable.flush). Raises a BackendError if
        a write fails; what was not written stays dirty in memory."""
        self.write_state.check()
        done = True
        for table in list(self._tables.values()):
            done = table.flush(chunk_bytes, pause_s, stop)
            if table.step_slots:
                steps = json.dumps(table.clock()).encode()
                self._put(_STEPS_PREFIX + table.config.name.encode(), steps)
            if not done:
                break
        try:
            self._db.flush_wal(True)
        except Exception as error:
            where = f"shard {self.shard_id}"
            raise self.write_state.failed(backend_error("sync its log", where, error)) from error
        return done

    def checkpoint(self, directory: str | os.PathLike[str]) -> Path:
        """Flush, then write a RocksDB checkpoint (hard links where possible) to a new
        directory, which EmbeddingStore can open as it is."""
        target = Path(directory)
        if target.exists():
            raise FailedPreconditionError(
                f"shard {self.shard_id}: checkpoint directory {target} already exists"
            )
        self.flush()
        try:
            Checkpoint(self._db).create_checkpoint(str(target))
        except Exception as error:
            raise BackendError(
                f"rocksdb backend failed to checkpoint shard {self.shard_id} to {target}: {error}"
            ) from error
        return target

    def close(self) -> None:
        """Flush dirty rows and release RocksDB. Idempotent. If the flush fails (a full disk)
        this raises and keeps the store open, rows in memory, so the caller can recover()
        and close again."""
        if self._db is None:
            return
        self.flush()
        for table in self._tables.values():
            table.close()
        self._tables.clear()
        self._db.close()
        self._db = None

    def __enter__(self) -> EmbeddingStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
