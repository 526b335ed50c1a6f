"""A shard's lives: whether its last process stopped cleanly, and telling the clients that
knew a life which ended without a clean stop.

Each start of a shard on a data dir is a new life, numbered 1, 2, ... in LIVES.json there.
The file says `running` from start until a clean stop has flushed every dirty row; a start
that finds `running` still set knows the previous life ended uncleanly (killed, crashed, or
the machine lost power) and records it, with that life's last successful flush, when the
store held write-back tables (whose acknowledged updates since that flush may be gone).

Clients send the data dir and the life they last talked to with every data call (metadata
LIFE_HEADER, "<data id>/<life>"); a call from a client that knew a life which has since
ended uncleanly, or another data dir of this shard (a wiped or replaced volume: the dir's
identity, made once when it was first used, differs), is refused with DATA_LOSS, naming the
shard and what may be lost. A new client (no header), or one that accepts the restart (it
forgets the life it knew), goes on.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from tierps.core.errors import DataLossError, InvalidArgumentError, Reason, quoted
from tierps.storage.snapshot_format import write_json_atomic

LIFE_HEADER = "tierps-life"  # gRPC metadata: the shard life a client last talked to
LIVES_FILE = "LIVES.json"
log = logging.getLogger("tierps.server")
KEPT_UNCLEAN = 64  # unclean ends remembered (a client older than all of them is refused too)


def _timestamp(seconds: float | None) -> str:
    if seconds is None:
        return "never (no flush completed in that life)"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


class Lives:
    """The life record of one shard's data dir (see the module docstring)."""

    def __init__(self, data_dir: Path, where: str, data_id: str = "") -> None:
        self.path = Path(data_dir) / LIVES_FILE
        self.where = where  # "shard 0 of 2"
        self.data_id = data_id  # the data dir's identity (Shard's SHARD.json)
        self._foreign_told: set[str] = set()  # other data ids clients came with, logged once
        self._lock = threading.Lock()
        record: dict[str, Any] = {"life": 0, "running": False, "last_flush": None}
        if self.path.exists():
            record = json.loads(self.path.read_text())
        self.previous: dict[str, Any] = record  # the record as the last life left it
        self.unclean: dict[int, float | None] = {
            int(life): flushed for life, flushed in record.get("unclean", {}).items()
        }
        self.life = int(record["life"]) + 1
        self.last_flush: float | None = None
        self.ended_cleanly = not record.get("running", False)

    def begin(self, at_risk: bool) -> None:
        """Start this life. `at_risk`: the store holds write-back tables, so an unclean end
        of the previous life may have lost acknowledged updates (write-through tables had
        each of theirs in RocksDB's log before acknowledging it)."""
        if not self.ended_cleanly and at_risk:
            self.unclean[self.life - 1] = self.previous.get("last_flush")
            while len(self.unclean) > KEPT_UNCLEAN:
                del self.unclean[min(self.unclean)]
        self._write(running=True)

    def flushed(self, when: float | None = None) -> None:
        """Record a completed flush of every dirty row (what an unclean end keeps)."""
        self.last_flush = time.time() if when is None else when
        self._write(running=True)

    def end_cleanly(self) -> None:
        """Record a clean stop: every dirty row was flushed just now."""
        self.last_flush = time.time()
        self._write(running=False)

    def _write(self, *, running: bool) -> None:
        record = {
            "life": self.life,
            "running": running,
            "last_flush": self.last_flush,
            "unclean": {str(life): flushed for life, flushed in sorted(self.unclean.items())},
        }
        with self._lock:  # one write at a time, in order
            write_json_atomic(self.path, record)

    def header(self) -> str:
        """The LIFE_HEADER value of a client that talks to this life now."""
        return f"{self.data_id}/{self.life}"

    def check(self, known: str | None) -> None:
        """Refuse (DataLossError) a client that last talked to `known` (a LIFE_HEADER value,
        "<data id>/<life>" or a bare life; None: a new client) if that was another data dir
        of this shard, or a life since which one ended uncleanly. A value of neither form is
        the caller's error (InvalidArgumentError)."""
        if known is None or known == str(self.life) or known == self.header():
            return
        data_id, _, life_text = known.rpartition("/")
        if not (life_text.isascii() and life_text.isdigit() and len(life_text) <= 19):
            raise InvalidArgumentError(
                f"metadata '{LIFE_HEADER}' expected '<data id>/<life>' (a life: a whole number "
                f">= 1, as Stats gives), got {quoted(known)}"
            )
        if data_id and self.data_id and data_id != self.data_id:
            self._tell_foreign(data_id)
            raise DataLossError(
                f"{self.where} holds another data dir (id {self.data_id}) than the one this "
                f"client talked to (id {data_id}): its volume was wiped or replaced, and every "
                f"update acknowledged before may be gone. Reload a snapshot, or accept the "
                f"restart (EmbeddingClient.accept_restart()) to go on with the rows as they are",
                reason=Reason.DATA_DIR_CHANGED,
                data_id=self.data_id,
            )
        life = int(life_text)
        lost = sorted(u for u in self.unclean if life <= u < self.life)
        if life < 1 or life > self.life:
            lost = lost or [life]
        if not lost:
            return  # only clean restarts since: nothing acknowledged can be missing
        first = lost[0]
        known = str(life)
        raise DataLossError(
            f"{self.where} restarted after an unclean stop (its life {first} ended without "
            f"a clean stop: killed, crashed or lost power; it is now in life {self.life}); "
            f"this client last talked to life {known}, so updates it had acknowledged after "
            f"that life's last flush at {_timestamp(self.unclean.get(first))} may be lost. "
            f"Reload a snapshot, or accept the restart (EmbeddingClient.accept_restart()) to "
            f"go on with the rows as they are",
            reason=Reason.SHARD_RESTARTED,
            life=self.life,
            lost_life=first,
        )

    def _tell_foreign(self, data_id: str) -> None:
        """Log once per other data dir a client came with: this shard's data was lost."""
        with self._lock:
            if data_id in self._foreign_told or len(self._foreign_told) > KEPT_UNCLEAN:
                return
            self._foreign_told.add(data_id)
        log.warning(
            "%s: a client knew another data dir of this shard (id %s; this one is %s): the "
            "data it held is not here, and the client is told (DATA_LOSS)",
            self.where,
            data_id,
            self.data_id,
        )
