"""Pushes of gradients already summed per distinct key: the step each push takes per table
(reserved before it is sent, so that concurrent pushes to a table get distinct steps), its
calls, and what a failed push says: on which shards and tables it was applied, so that the
caller sends only the failed part again, or nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from tierps.client.admin import ShardError
from tierps.client.routing import Router
from tierps.client.transport import Transport
from tierps.core.errors import Reason
from tierps.core.validation import check_step


class Pushes:
    """The pushes of an EmbeddingClient, and each table's step clock as this client knows
    it: `table_step(table)` asks the cluster for a table this client has not pushed to."""

    def __init__(
        self, transport: Transport, router: Router, table_step: Callable[[str], int]
    ) -> None:
        self.transport = transport
        self.router = router
        self.table_step = table_step
        self._steps: dict[str, int] = {}  # the step of this client's last push, per table
        self._lock = threading.Lock()

    def push_unique(
        self, pushes: dict[str, tuple[np.ndarray, np.ndarray]], step: int | None
    ) -> int:
        """EmbeddingClient.push_unique: per table, distinct keys >= 0 and their gradients,
        one call per shard for all tables; the number of keys updated."""
        pushes = {t: (keys, grads) for t, (keys, grads) in pushes.items() if keys.size}
        steps = self.reserve(list(pushes), step)
        calls = self.router.push_calls(pushes)
        try:
            replies = self.transport.fan_out(
                calls, lambda i, b: self.transport.push_call(i, b, steps, pushes)
            )
        except ShardError as error:
            raise self.failure(error, steps, step) from None
        self.done(steps, step)
        return sum(reply.num_keys for reply in replies)

    def reserve(self, tables: list[str], step: int | None) -> dict[str, int]:
        """The step of a push to each table: the one given, or one more than the last push's
        (reserved at once, so concurrent pushes to a table get distinct steps). A table this
        client has not pushed to yet continues from its clock on the cluster (table_step)."""
        if step is not None:
            for table in tables:
                check_step(f"table {table!r}", step)
            return dict.fromkeys(tables, int(step))
        with self._lock:
            unknown = [table for table in tables if table not in self._steps]
        learned = {table: self.table_step(table) for table in unknown}
        with self._lock:
            for table in tables:
                self._steps[table] = self._steps.get(table, learned.get(table, 0)) + 1
            return {table: self._steps[table] for table in tables}

    def release(self, steps: dict[str, int]) -> None:
        """Give back the steps of a failed push, where no later push took one since."""
        with self._lock:
            for table, step in steps.items():
                if self._steps.get(table) == step:
                    self._steps[table] = step - 1

    def done(self, steps: dict[str, int], step: int | None) -> None:
        """A push at `steps` was applied: where its caller gave the step, later pushes
        without one count on from it."""
        if step is not None:
            with self._lock:
                for table, given in steps.items():
                    self._steps[table] = max(self._steps.get(table, 0), given)

    def last_step(self, table: str) -> int | None:
        """The step of this client's last push to the table (None: none since the client
        started, the table was dropped or a snapshot was loaded)."""
        with self._lock:
            return self._steps.get(table)

    def forget(self, table: str | None = None) -> None:
        """Forget a table's step (None: every table's), to learn it from the cluster again:
        the table was dropped, or a snapshot load set the tables' clocks."""
        with self._lock:
            if table is None:
                self._steps.clear()
            else:
                self._steps.pop(table, None)

    def failure(self, error: ShardError, steps: dict[str, int], step: int | None) -> ShardError:
        """The error a failed push raises: where it was applied on no shard, its steps are
        given back (unless the caller chose the step); where on some, it says which shards
        and tables. A push refused for rows replaced under it (TABLE_REPLACED) has this client
        learn the tables' generations again: the next push goes on the new rows."""
        if error.reason is Reason.TABLE_REPLACED:
            for shard in range(self.router.num_shards):
                self.transport.link.relearn_generations(shard)
        if not error.succeeded and not error.applied_tables:
            if step is None:
                self.release(steps)
            return error
        failed = error.failed or [error.shard_id]
        in_part = (
            f"; shard {error.shard_id} applied its part of tables {error.applied_tables} and "
            f"not of the others"
            if error.applied_tables
            else ""
        )
        partial = ShardError(  # part of the push is in: its step stays taken; say where
            error.shard_id,
            error.address,
            error.code,
            f"{error.details} (this push of tables {sorted(steps)} was applied on shards "
            f"{error.succeeded}, and not on shards {failed}{in_part}; send only the failed "
            f"shards' part again, or nothing)",
            error.reason,
            error.facts,
        )
        partial.succeeded, partial.failed = error.succeeded, error.failed
        partial.applied_tables = error.applied_tables
        return partial
