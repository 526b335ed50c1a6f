"""The RocksDB tier: every row of a table, durable, in one column family per table.

Keys are 8-byte big-endian int64 (so byte order is key order); values are rows as the
table's RowCodec encodes them (core/codec.py): weights and optimizer state together, in
float32 or a cold dtype, and with steps_to_live > 0 the row's last-update step as a
little-endian int64.
rocksdict only offers per-key puts and list gets, so batches cross into it as lists built by
numpy and iterated in C (map over the batch), never by a Python loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import islice, repeat
from operator import is_not
from typing import Any

import numpy as np
from rocksdict import Rdict, WriteBatch, WriteOptions

from tierps.core.codec import RowCodec
from tierps.core.errors import BackendError, DataLossError, StorageFullError
from tierps.storage.tiers import DurableTier, HandDown

KEY_DTYPE = np.dtype(">i8")
# RocksDB's words for a full file system or a space limit, and for corrupt data
_FULL_MARKS = ("No space left on device", "Space limit", "NoSpace")
_CORRUPT_MARKS = ("Corruption",)


def backend_error(action: str, where: str, error: Exception) -> BackendError:
    """The tierps error for a RocksDB failure: StorageFullError for a full file system,
    DataLossError for corruption, BackendError for anything else. rocksdict raises plain
    Exception with RocksDB's status text, so the text is what tells them apart."""
    text = str(error)
    kind: type[BackendError] = BackendError
    if any(mark in text for mark in _FULL_MARKS):
        kind = StorageFullError
    elif any(mark in text for mark in _CORRUPT_MARKS):
        kind = DataLossError
    return kind(f"rocksdb backend failed to {action} for {where}: {text}")


class WriteState:
    """Whether one store's RocksDB can write, shared by all its RocksDBTiers.

    After a failed write RocksDB keeps its writer in an error state ("Writer has previous
    error") until the database is reopened, so the first failure is remembered here and every
    later write is refused with that same cause at once, without touching RocksDB, until the
    store recovers (EmbeddingStore.recover) and clears it. Nothing is written meanwhile, and
    no tier lets go of a row that a refused write was to hold."""

    def __init__(self) -> None:
        self.failure: BackendError | None = None

    def check(self) -> None:
        if self.failure is not None:
            raise type(self.failure)(
                f"{self.failure} (the store has refused writes since; it recovers on its own "
                f"once the cause is gone)"
            )

    def failed(self, error: BackendError) -> BackendError:
        if self.failure is None:
            # a copy: the error raised gets a traceback, whose frames would keep RocksDB
            # handles alive (and its LOCK held, so that recover() could not reopen it)
            self.failure = type(error)(str(error))
        return error


def encode_keys(keys: np.ndarray) -> list[bytes]:
    return keys.astype(KEY_DTYPE).view("V8").tolist()


def decode_keys(raw: list[bytes] | tuple[bytes, ...]) -> np.ndarray:
    return np.frombuffer(b"".join(raw), dtype=KEY_DTYPE).astype(np.int64)


class RocksDBTier(DurableTier):
    """Bottom tier: never evicts, keeps what it is given; writes only rows newer than its
    own copy (dirty ones)."""

    name = "rocksdb"

    def __init__(
        self,
        db: Rdict,
        column_family: str,
        codec: RowCodec,
        *,
        where: str,
        sync: bool = False,
        state: WriteState | None = None,
    ) -> None:
        self.column_family = column_family
        self._write_options = WriteOptions()
        self._write_options.sync = sync  # fsync the log on every write (survives power loss)
        self.state = WriteState() if state is None else state
        self.codec = codec  # the layout of a row and of its RocksDB value
        self.width = codec.width  # float32 slots of a row in memory
        self.where = where  # "table 'x' on shard 0", for error messages
        self.hits = 0
        self.misses = 0
        self.rows_written = 0
        self.bind(db)

    def bind(self, db: Rdict) -> None:
        """Use (reopened) database `db`: how a store that recovers hands its tiers the new
        handle."""
        self._db = db
        self._cf = db.get_column_family(self.column_family)
        self._handle = db.get_column_family_handle(self.column_family)
        self._key_range = self._stored_key_range()

    def _stored_key_range(self) -> tuple[int, int] | None:
        """(smallest, largest) key stored in the column family now, None when it is empty:
        its first and last keys (byte order is key order), two iterator seeks."""
        try:
            it = self._cf.iter()
            it.seek_to_first()
            if not it.valid():
                return None
            first = it.key()
            it.seek_to_last()
            last = it.key()
        except Exception as error:  # rocksdict raises plain Exception for I/O errors
            raise self._fail("read its key range", error) from error
        return int(decode_keys([first])[0]), int(decode_keys([last])[0])

    def _widen(self, keys: np.ndarray) -> None:
        """Keep the key range covering every key written (deletes never narrow it: a
        range too wide only costs a read, one too narrow would hide a row)."""
        if keys.size == 0:
            return
        low, high = int(keys.min()), int(keys.max())
        if self._key_range is not None:
            low, high = min(low, self._key_range[0]), max(high, self._key_range[1])
        self._key_range = low, high

    def may_hold(self, keys: np.ndarray) -> np.ndarray | None:
        """Which keys may be stored here: a superset of those that are, from the range of
        keys ever written (read at open, widened by every write through this tier, the only
        writer of its column family); None when every key may be."""
        if self._key_range is None:
            return np.zeros(keys.size, dtype=bool)
        low, high = self._key_range
        if keys.size and low <= int(keys.min()) and int(keys.max()) <= high:
            return None
        return (keys >= low) & (keys <= high)

    def holds_none(self, keys: np.ndarray) -> bool:
        """Tier.holds_none from may_hold: no key within the range of keys ever written (a
        new table's family holds none). False while the database is closed."""
        if self._cf is None:
            return False
        maybe = self.may_hold(keys)
        return maybe is not None and not maybe.any()

    def _fail(self, action: str, error: Exception) -> BackendError:
        return backend_error(action, self.where, error)

    def _family(self) -> Any:
        """The column family; while a recovering store has its database closed, the cause."""
        if self._cf is None:
            self.state.check()
            raise BackendError(f"rocksdb backend of {self.where} is closed")
        return self._cf

    def _write_batch(self, batch: WriteBatch, action: str) -> None:
        """Write one batch atomically (all of it or none), or raise and remember the cause."""
        self.state.check()
        try:
            self._db.write(batch, self._write_options)
        except Exception as error:  # rocksdict raises plain Exception for I/O errors
            raise self.state.failed(self._fail(action, error)) from error

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        hit, rows = self._get(keys)
        self.hits += hit.size
        self.misses += keys.size - hit.size
        return hit, rows, np.zeros(hit.size, dtype=bool)

    def _get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(indices of the keys stored, their rows). Keys outside the stored key range
        (may_hold) are not asked for: RocksDB would only answer None for them."""
        asked = self.may_hold(keys) if self._cf is not None else None
        if asked is not None:
            within = np.flatnonzero(asked)
            hit, rows = self._read(keys[within])
            return within[hit], rows
        return self._read(keys)

    def _read(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if keys.size == 0:
            return np.empty(0, np.int64), np.empty((0, self.width), np.float32)
        try:
            values = self._family().get(encode_keys(keys))
        except Exception as error:  # rocksdict raises plain Exception for I/O errors
            raise self._fail("read rows", error) from error
        if all(values):  # all stored (values are never empty): no mask to build
            hit = np.arange(keys.size)
        else:
            found = np.fromiter(map(is_not, values, repeat(None)), dtype=bool, count=keys.size)
            hit = np.flatnonzero(found)
        # one copy, into a writable array of one void item per value (numpy's fromiter:
        # 3x a bytearray join); it pads or cuts a value of another length, so the
        # lengths are summed first
        present = values if hit.size == keys.size else list(filter(None, values))
        self._check_size(sum(map(len, present)), hit.size)
        value = np.dtype((np.void, self.codec.value_bytes))
        blob = np.fromiter(present, dtype=value, count=hit.size)
        return hit, self.codec.decode(blob, hit.size)

    def _check_size(self, size: int, rows: int) -> None:
        if size != rows * self.codec.value_bytes:
            raise DataLossError(
                f"rocksdb backend holds corrupt rows for {self.where}: expected "
                f"{rows} rows of {self.codec.value_bytes} bytes ({self.codec}), got "
                f"{size} bytes"
            )

    def write(
        self,
        keys: np.ndarray,
        rows: np.ndarray,
        also: tuple[RocksDBTier, np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Put rows as one atomic write batch: after a failure none of them is written (a
        write-through push refused for a full disk is not half applied). also: (tier,
        keys, rows) of another column family of the same database, written in the same
        batch (a write-through push's rows and the bucket rows it trained). Callers bound
        the size: a flush and a snapshot load write chunks of a few MiB."""
        others = also is not None and also[1].size > 0
        if keys.size == 0 and not others:
            return
        batch = WriteBatch(raw_mode=True)
        deque(map(batch.put, encode_keys(keys), self.codec.encode(rows), repeat(self._handle)), 0)
        if others:
            tier, other_keys, other_rows = also  # type: ignore[misc]
            other = encode_keys(other_keys), tier.codec.encode(other_rows)
            deque(map(batch.put, *other, repeat(tier._handle)), 0)
        self._widen(keys)  # before the write: a failed batch may still have landed
        if others:
            tier._widen(other_keys)
        self._write_batch(batch, "write rows")
        self.rows_written += keys.size
        if others:
            tier.rows_written += other_keys.size

    def insert(
        self, keys: np.ndarray, rows: np.ndarray, dirty: np.ndarray, below: HandDown
    ) -> None:
        """Write the dirty rows (the others are RocksDB's already); nothing is below."""
        self.write(keys[dirty], rows[dirty])

    def remove(self, keys: np.ndarray) -> int:
        """Delete the rows of keys in one atomic write batch; returns how many were present."""
        gone = keys[self.contains(keys)]
        if gone.size:
            batch = WriteBatch(raw_mode=True)
            deque(map(batch.delete, encode_keys(gone), repeat(self._handle)), 0)
            self._write_batch(batch, "delete rows")
        return int(gone.size)

    def dirty_keys(self) -> np.ndarray:
        return np.empty(0, dtype=np.int64)  # RocksDB's rows are the durable copy

    def dirty_rows(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, Any]:
        return np.empty(0, np.int64), np.empty((0, self.width), np.float32), None

    def mark_clean(self, handle: Any) -> None:
        return None

    def export(self, chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Chunks in key order from a RocksDB iterator opened now (an implicit snapshot)."""
        return self._chunks(self._family().items(), chunk_rows)

    def _chunks(self, items: Iterator, chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        while chunk := list(islice(items, chunk_rows)):
            keys, values = zip(*chunk, strict=True)
            blob = bytearray().join(values)
            self._check_size(len(blob), len(keys))
            yield decode_keys(keys), self.codec.decode(blob, len(keys))

    def compact(self) -> None:
        """RocksDB's manual compaction of the whole column family: overwritten and deleted
        values are dropped from its files (for tools and measurements; RocksDB compacts on
        its own as it writes)."""
        try:
            self._family().compact_range(None, None)
        except Exception as error:  # rocksdict raises plain Exception for I/O errors
            raise self._fail("compact", error) from error

    def contains(self, keys: np.ndarray) -> np.ndarray:
        mask = np.zeros(keys.size, dtype=bool)
        mask[self._get(keys)[0]] = True
        return mask

    def stats(self) -> dict[str, int]:
        if self._cf is None:  # closed while the store recovers
            return {
                "rows": 0,
                "bytes": 0,
                "hits": self.hits,
                "misses": self.misses,
                "rows_written": self.rows_written,
            }
        return {
            "rows": int(self._cf.property_int_value("rocksdb.estimate-num-keys") or 0),
            "bytes": int(self._cf.property_int_value("rocksdb.total-sst-files-size") or 0)
            + int(self._cf.property_int_value("rocksdb.cur-size-all-mem-tables") or 0),
            "hits": self.hits,
            "misses": self.misses,
            "rows_written": self.rows_written,
        }

    def close(self) -> None:
        """Drop this tier's column-family references so the database can close."""
        if self._cf is not None:
            try:
                self._cf.close()
            except Exception:  # noqa: BLE001 - a failed writer says so again; released anyway
                pass
        self._cf = self._handle = None
