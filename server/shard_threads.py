"""The threads that serve the tables of one data call at once: each table has its own lock
and the storage kernels release the GIL, so a call carrying several tables (an
EmbeddingBagCollection's features) uses more than one core."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

TABLE_THREADS = max(1, min(8, os.cpu_count() or 1))  # threads of one pool
Item = TypeVar("Item")
Result = TypeVar("Result")


class TableThreads:
    """A pool of TABLE_THREADS threads named `name_prefix`, running work per table."""

    def __init__(self, name_prefix: str) -> None:
        self._pool = ThreadPoolExecutor(TABLE_THREADS, thread_name_prefix=name_prefix)

    def each(self, work: Callable[[Item], Result], items: Sequence[Item]) -> list[Result]:
        """work(item) for each table's item of a call (a call names a table once): the first
        in this thread, the others at once on this pool's threads. Every item runs to its
        end; then the first failure, in the call's order, is raised."""
        outcomes = self.outcomes(work, items)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes

    def outcomes(self, work: Callable[[Item], Result], items: Sequence[Item]) -> list[Any]:
        """each's runs: each item's result, or the exception it raised."""
        if len(items) == 1:
            try:
                return [work(items[0])]
            except BaseException as error:  # noqa: BLE001 - the caller raises it
                return [error]
        futures = [self._pool.submit(work, item) for item in items[1:]]
        outcomes: list[Any] = []
        try:
            outcomes.append(work(items[0]))
        except BaseException as error:  # noqa: BLE001 - returned, in order
            outcomes.append(error)
        for future in futures:
            error = future.exception()
            outcomes.append(future.result() if error is None else error)
        return outcomes

    def shutdown(self) -> None:
        """Let the threads go once the work submitted has ended."""
        self._pool.shutdown()
