"""TableThreads: a call's per-table work, on the pool's threads or, for a small call, in
the calling thread; either way every item runs and the outcomes keep the call's order."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tierps.server.shard_threads import INLINE_VALUES, TableThreads


@pytest.fixture
def threads() -> Iterator[TableThreads]:
    pool = TableThreads("test-tables")
    yield pool
    pool.shutdown()


def _where(item: int) -> tuple[int, str]:
    return item, threading.current_thread().name


@pytest.mark.parametrize("values", [None, INLINE_VALUES + 1])
def test_a_large_call_spreads_its_tables_over_the_pool(
    threads: TableThreads, values: int | None
) -> None:
    both = threading.Barrier(2, timeout=10)  # met only by two items running at once

    def work(item: int) -> tuple[int, str]:
        both.wait()
        return _where(item)

    results = threads.each(work, [0, 1], values)
    assert results[0] == (0, threading.current_thread().name)
    assert results[1][0] == 1 and results[1][1].startswith("test-tables")


def test_a_small_call_runs_in_its_calling_thread(threads: TableThreads) -> None:
    results = threads.each(_where, list(range(5)), INLINE_VALUES)
    assert results == [(item, threading.current_thread().name) for item in range(5)]


@pytest.mark.parametrize("values", [INLINE_VALUES, INLINE_VALUES + 1])
def test_every_item_runs_and_the_first_failure_in_call_order_is_raised(
    threads: TableThreads, values: int
) -> None:
    ran: list[int] = []
    lock = threading.Lock()

    def work(item: int) -> int:
        with lock:
            ran.append(item)
        if item in (1, 3):
            raise ValueError(f"table {item}")
        return item

    outcomes = threads.outcomes(work, [0, 1, 2, 3], values)
    assert outcomes[0] == 0 and outcomes[2] == 2
    assert [str(outcomes[i]) for i in (1, 3)] == ["table 1", "table 3"]
    with pytest.raises(ValueError, match="table 1"):
        threads.each(work, [0, 1, 2, 3], values)
    assert sorted(ran) == [0, 0, 1, 1, 2, 2, 3, 3]
