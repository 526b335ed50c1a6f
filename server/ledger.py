"""Exactly-once pushes: what a shard remembers of the pushes it applied, by the pushing
client's id and the call's sequence number (as Kafka's idempotent producer does).

Every push call of an EmbeddingClient carries `PUSH_ID_HEADER: <client id>:<sequence>`
(a new sequence number per call, the same on every retry of it). The shard records, per
push id, the tables of the call it applied and how many keys each updated; a call that
arrives again (a retry after a lost reply or an UNAVAILABLE) is acknowledged with the
recorded counts and its recorded tables are not applied again - only the tables it did not
apply the first time (a storage failure between two tables of one call) are.

The record is bounded (RECENT_PER_CLIENT calls per client, RECENT_CLIENTS clients) and kept
in the store's metadata, written after the rows and before the acknowledgement, so that it
survives a restart wherever the rows do (a write-through table's rows are in RocksDB's log
before the call returns; a write-back table's after a flush or a clean stop, and an unclean
stop is told to every client that knew the shard, lives.py).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tierps.core.errors import InvalidArgumentError, quoted
from tierps.proto.wire import GENERATIONS_HEADER, PUSH_ID_HEADER

__all__ = [
    "GENERATIONS_HEADER",
    "PUSH_ID_HEADER",
    "PushId",
    "PushLedger",
    "parse_generations",
    "parse_push_id",
]

# Calls remembered per client: a client has a few calls in flight to a shard (two lanes of
# a fan-out, a prefetch), and retries one within seconds. At most 64 x 1,024 records (about
# 20 MB) in memory, as many small keys in RocksDB.
RECENT_PER_CLIENT = 64
RECENT_CLIENTS = 1024  # clients remembered: the least recently pushing is forgotten first
# Table entries of every record together (a call may name up to 1,024 tables): the oldest
# records of the least recently pushing clients go first beyond it.
RECENT_TABLE_ENTRIES = 1 << 16
KEY_PREFIX = b"tierps/pushes/"
_MAX_CLIENT_ID = 64
log = logging.getLogger("tierps.server")


@dataclass(frozen=True)
class PushId:
    client: str
    sequence: int

    def __str__(self) -> str:
        return f"{self.client}:{self.sequence}"


def parse_push_id(value: str | None) -> PushId | None:
    """The push id of a call's metadata value (None: the call carries none, as an older
    client's or a raw call's; it is applied as it comes). A malformed one is the caller's
    error: nothing is applied."""
    if value is None:
        return None
    client, _, sequence = value.rpartition(":")
    if not (
        0 < len(client) <= _MAX_CLIENT_ID
        and client.isascii()
        and client.replace("-", "").isalnum()
        and sequence.isascii()
        and sequence.isdigit()
        and len(sequence) <= 19
    ):
        raise InvalidArgumentError(
            f"metadata '{PUSH_ID_HEADER}' expected '<client id>:<sequence>' (an id of at most "
            f"{_MAX_CLIENT_ID} letters, digits or '-', and a decimal sequence number), got "
            f"{quoted(value)}"
        )
    return PushId(client, int(sequence))


Applied = dict[str, int]  # table -> distinct keys the call updated there


class PushLedger:
    """The recent pushes a shard applied (see the module docstring). `write(writes)` keeps
    records durable in one atomic write, (key, value) each (value None: removes it): a
    call's record and the records it makes the ledger forget land together or not at all,
    so a crash never leaves a record without its deletes (records of calls running at once
    may land out of order; the next start trims the store to the bounds again). `stored` is
    what was kept before."""

    def __init__(
        self,
        write: Callable[[list[tuple[bytes, bytes | None]]], None],
        stored: list[tuple[bytes, bytes]],
        where: str,
    ) -> None:
        self._write = write
        self._where = where
        self._cond = threading.Condition()
        # client -> {sequence: applied}, clients in least recently used order
        self._clients: collections.OrderedDict[str, collections.OrderedDict[int, Applied]] = (
            collections.OrderedDict()
        )
        self._running: set[PushId] = set()
        self._entries = 0  # table entries over every record
        forgotten: list[PushId] = []
        for key, value in stored:
            try:
                client, sequence = key[len(KEY_PREFIX) :].decode().rsplit("/", 1)
                applied = {str(t): int(n) for t, n in json.loads(value).items()}
                forgotten += self._remember(PushId(client, int(sequence)), applied)
            except (ValueError, TypeError, AttributeError, UnicodeDecodeError):
                log.warning("%s: an unreadable push record %r was skipped", where, key[:80])
        if forgotten:  # kept by a process with larger bounds
            self._persist(None, {}, forgotten)

    @staticmethod
    def key(push_id: PushId) -> bytes:
        return KEY_PREFIX + f"{push_id.client}/{push_id.sequence:020d}".encode()

    def begin(self, push_id: PushId) -> Applied:
        """What this push applied already (empty: nothing; a repeat returns its record).
        Waits while the same push id runs in another call; end() must follow."""
        with self._cond:
            while push_id in self._running:
                self._cond.wait()
            self._running.add(push_id)
            calls = self._clients.get(push_id.client)
            return dict(calls.get(push_id.sequence, {})) if calls else {}

    def end(self, push_id: PushId, applied: Applied) -> None:
        """Record what the push has applied now (all its tables so far); then the next call
        of the same id may run. A record that cannot be written is logged: the rows are
        applied, and this process still knows."""
        forgotten: list[PushId] = []
        with self._cond:  # memory first: a repeat arriving now finds the record
            if applied:
                forgotten = self._remember(push_id, applied)
            self._running.discard(push_id)
            self._cond.notify_all()
        if applied:  # outside the lock: other pushes do not wait for this write
            self._persist(push_id, applied, forgotten)

    def _remember(self, push_id: PushId, applied: Applied) -> list[PushId]:
        calls = self._clients.setdefault(push_id.client, collections.OrderedDict())
        self._clients.move_to_end(push_id.client)
        self._entries -= len(calls.get(push_id.sequence, ()))
        calls[push_id.sequence] = dict(applied)
        self._entries += len(applied)
        forgotten = []
        while len(calls) > RECENT_PER_CLIENT:
            sequence, old = calls.popitem(last=False)
            self._entries -= len(old)
            forgotten.append(PushId(push_id.client, sequence))
        while len(self._clients) > RECENT_CLIENTS or (
            self._entries > RECENT_TABLE_ENTRIES and len(self._clients) > 1
        ):
            client, records = next(iter(self._clients.items()))
            sequence, old = records.popitem(last=False)
            self._entries -= len(old)
            forgotten.append(PushId(client, sequence))
            if not records:
                del self._clients[client]
        return forgotten

    def _persist(self, push_id: PushId | None, applied: Applied, forgotten: list[PushId]) -> None:
        writes: list[tuple[bytes, bytes | None]] = [(self.key(old), None) for old in forgotten]
        if push_id is not None:
            writes.append((self.key(push_id), json.dumps(applied).encode()))
        try:
            self._write(writes)
        except Exception as error:  # noqa: BLE001 - the rows are in; say it, do not fail
            log.warning("%s: could not keep the record of push %s: %s", self._where, push_id, error)

    @property
    def size(self) -> int:
        with self._cond:
            return sum(len(calls) for calls in self._clients.values())


def parse_generations(value: str) -> list[int]:
    """The generations of a GENERATIONS_HEADER value; a malformed one is the caller's error."""
    parts = value.split(",") if value else []
    if not all(p.isascii() and p.isdigit() and len(p) <= 20 for p in parts):
        raise InvalidArgumentError(
            f"metadata '{GENERATIONS_HEADER}' expected comma-separated whole numbers (one "
            f"generation per table batch, 0: not known), got {quoted(value)}"
        )
    return [int(p) for p in parts]
