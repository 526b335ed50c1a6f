"""The RocksDB tier: every row of a table, durable, in one column family per table.

Keys are 8-byte big-endian int64 (so byte order is key order); values are the raw
little-endian float32 row, weights and optimizer state together (with steps_to_live > 0, its
last 8 bytes are the row's last-update step, a little-endian int64: TableConfig.stored_width).
rocksdict only offers per-key puts and list gets, so batches cross into it as lists built by
numpy and iterated in C (map over the batch), never by a Python loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import islice, repeat
from operator import is_not

import numpy as np
from rocksdict import Rdict, WriteBatch, WriteOptions

from tierps.storage.errors import BackendError
from tierps.storage.tiers import Spill

KEY_DTYPE = np.dtype(">i8")
WRITE_BATCH_BYTES = 4 << 20  # a large write goes in batches of this size: each is copied
# about four times on its way in (rows, bytes objects, write batch, memtable)


def encode_keys(keys: np.ndarray) -> list[bytes]:
    return keys.astype(KEY_DTYPE).view("V8").tolist()


def decode_keys(raw: list[bytes] | tuple[bytes, ...]) -> np.ndarray:
    return np.frombuffer(b"".join(raw), dtype=KEY_DTYPE).astype(np.int64)


def encode_rows(rows: np.ndarray) -> list[bytes]:
    rows = np.ascontiguousarray(rows, dtype="<f4")
    return rows.view(np.dtype((np.void, rows.shape[1] * 4))).ravel().tolist()


class RocksDBTier:
    """Bottom tier: never evicts, keeps what it is given; writes only rows newer than its
    own copy (dirty ones)."""

    name = "rocksdb"

    def __init__(
        self, db: Rdict, column_family: str, width: int, *, where: str, sync: bool = False
    ) -> None:
        self._db = db
        self._cf = db.get_column_family(column_family)
        self._handle = db.get_column_family_handle(column_family)
        self._write_options = WriteOptions()
        self._write_options.sync = sync
        self.width = width
        self.where = where  # "table 'x' on shard 0", for error messages
        self.hits = 0
        self.misses = 0
        self.rows_written = 0

    def _fail(self, action: str, error: Exception) -> BackendError:
        return BackendError(f"rocksdb backend failed to {action} for {self.where}: {error}")

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        hit, rows = self._get(keys)
        self.hits += hit.size
        self.misses += keys.size - hit.size
        return hit, rows, np.zeros(hit.size, dtype=bool)

    def _get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if keys.size == 0:
            return np.empty(0, np.int64), np.empty((0, self.width), np.float32)
        try:
            values = self._cf.get(encode_keys(keys))
        except Exception as error:  # rocksdict raises plain Exception for I/O errors
            raise self._fail("read rows", error) from error
        found = np.fromiter(map(is_not, values, repeat(None)), dtype=bool, count=keys.size)
        hit = np.flatnonzero(found)
        blob = b"".join(filter(None, values))
        if len(blob) != hit.size * self.width * 4:
            raise BackendError(
                f"rocksdb backend holds corrupt rows for {self.where}: expected "
                f"{hit.size} rows of {self.width * 4} bytes, got {len(blob)} bytes"
            )
        rows = np.frombuffer(blob, dtype="<f4").reshape(hit.size, self.width).astype(np.float32)
        return hit, rows

    def write(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Put rows, in write batches of at most WRITE_BATCH_BYTES (each atomic)."""
        step = max(1, WRITE_BATCH_BYTES // (4 * self.width))
        for start in range(0, keys.size, step):
            end = start + step
            batch = WriteBatch(raw_mode=True)
            puts = map(
                batch.put,
                encode_keys(keys[start:end]),
                encode_rows(rows[start:end]),
                repeat(self._handle),
            )
            deque(puts, 0)
            try:
                self._db.write(batch, self._write_options)
            except Exception as error:
                raise self._fail("write rows", error) from error
            self.rows_written += min(end, keys.size) - start

    def insert(self, keys: np.ndarray, rows: np.ndarray, dirty: np.ndarray) -> Spill:
        self.write(keys[dirty], rows[dirty])
        return Spill.empty(self.width)

    def remove(self, keys: np.ndarray) -> int:
        """Delete the rows of keys, in atomic write batches; returns how many were present."""
        present = self.contains(keys)
        gone = keys[present]
        step = max(1, WRITE_BATCH_BYTES // 8)
        for start in range(0, gone.size, step):
            batch = WriteBatch(raw_mode=True)
            deque(map(batch.delete, encode_keys(gone[start : start + step]),
                      repeat(self._handle)), 0)  # fmt: skip
            try:
                self._db.write(batch, self._write_options)
            except Exception as error:
                raise self._fail("delete rows", error) from error
        return int(gone.size)

    def drain_dirty(self, chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return iter(())

    def export(self, chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Chunks in key order from a RocksDB iterator opened now (an implicit snapshot)."""
        return self._chunks(self._cf.items(), chunk_rows)

    def _chunks(self, items: Iterator, chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        while chunk := list(islice(items, chunk_rows)):
            keys, values = zip(*chunk, strict=True)
            rows = np.frombuffer(b"".join(values), dtype="<f4").reshape(len(keys), self.width)
            yield decode_keys(keys), rows.astype(np.float32)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        mask = np.zeros(keys.size, dtype=bool)
        mask[self._get(keys)[0]] = True
        return mask

    def stats(self) -> dict[str, int]:
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
        self._cf.close()
        del self._cf, self._handle
