"""The threads that serve the tables of one data call at once: each table has its own lock
and the storage kernels release the GIL, so a call carrying several tables (an
EmbeddingBagCollection's features) uses more than one core. A small call runs in its
calling thread: handing a table's work to another thread costs tens of microseconds of CPU
(a future, a queue, two wake-ups), more than the work itself below INLINE_VALUES."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

TABLE_THREADS = max(1, min(8, os.cpu_count() or 1))  # threads of one pool
# A call of up to this many values (keys x dim, over its tables) runs in its calling thread:
# a DeepFM step's 9,600 keys of dim 16 a shard spent 0.8 ms a step in hand-offs, twice the
# lookup kernels' time (tests/bench/profile_shard_step.py).
INLINE_VALUES = 1 << 18
Item = TypeVar("Item")
Result = TypeVar("Result")


class TableThreads:
    """A pool of TABLE_THREADS threads named `name_prefix`, running work per table."""

    def __init__(self, name_prefix: str) -> None:
        self._pool = ThreadPoolExecutor(TABLE_THREADS, thread_name_prefix=name_prefix)

    def each(
        self, work: Callable[[Item], Result], items: Sequence[Item], values: int | None = None
    ) -> list[Result]:
        """work(item) for each table's item of a call (a call names a table once): the first
        in this thread, the others at once on this pool's threads, or all in this thread
        where the call's `values` (keys x dim over its tables) are at most INLINE_VALUES.
        Every item runs to its end; then the first failure, in the call's order, is
        raised."""
        outcomes = self.outcomes(work, items, values)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes

    def outcomes(
        self, work: Callable[[Item], Result], items: Sequence[Item], values: int | None = None
    ) -> list[Any]:
        """each's runs: each item's result, or the exception it raised."""
        if len(items) == 1 or (values is not None and values <= INLINE_VALUES):
            return [_outcome(work, item) for item in items]
        futures = [self._pool.submit(work, item) for item in items[1:]]
        outcomes = [_outcome(work, items[0])]
        for future in futures:
            error = future.exception()
            outcomes.append(future.result() if error is None else error)
        return outcomes

    def shutdown(self) -> None:
        """Let the threads go once the work submitted has ended."""
        self._pool.shutdown()


def _outcome(work: Callable[[Item], Result], item: Item) -> Any:
    """work(item), or the exception it raised."""
    try:
        return work(item)
    except BaseException as error:  # noqa: BLE001 - returned, in order, for the caller
        return error
