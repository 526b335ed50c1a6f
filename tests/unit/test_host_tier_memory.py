"""A host tier's memory follows the rows it holds, not its budget (storage/tiers.py).

host_cache_bytes is a cap: a table with a budget far above its rows takes what those rows
need - their arena rows, dirty flags and index, with the arena's growth step and one index
rebuild on top - measured three ways: the peak resident memory of a fresh process doing a
first touch (every page touched counts, whoever allocated it), tracemalloc's peak (every
numpy allocation, touched or not) and the arena's capacity (its mapping's address space,
which tracemalloc does not see). At a budget smaller than the keys, the arena stops
growing at the budget's rows and the rest goes to RocksDB.
"""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from tierps.core import optim
from tierps.core.config import TableConfig
from tierps.storage import EmbeddingStore
from tierps.storage.hash_table import HashTable
from tierps.storage.tiers import (
    ARENA_GROWTH,
    MADV_POPULATE_WRITE,
    CacheTier,
    MappedArena,
    Spill,
    host_rows_for_budget,
)
from tierps.storage.warm_up import warm_up

KEYS = 100_000
DIM = 16
BIG_BUDGET = 64 << 30  # far above the machine's memory: only a cap can be this large


def _first_touch(table, keys: np.ndarray, batch: int) -> None:
    for start in range(0, keys.size, batch):
        table.lookup(keys[start : start + batch])


def _kib(field: str) -> int:
    """A /proc/self/status figure in KiB (VmRSS, VmHWM)."""
    return int(Path("/proc/self/status").read_text().split(field + ":")[1].split()[0])


def _keys(n: int) -> np.ndarray:
    return np.random.default_rng(3).choice(2**40, n, replace=False).astype(np.int64)


def _bound(config: TableConfig, keys: int, batch: int) -> tuple[int, int]:
    """(what `keys` rows need: rows, flags and their index; the most a first touch of them
    in calls of `batch` keys may take at once: the arena and flags at ARENA_GROWTH times
    the rows (their capacity), the index and the one it rebuilds into, and a call's
    temporaries - a few copies of its rows (the initializer's, the lookup's output) and its
    keys' slots, row ids and masks)."""
    row = config.stored_bytes + 1  # a row and its dirty flag
    need = keys * row + HashTable.nbytes_for(keys)
    temporaries = batch * (4 * config.stored_bytes + 64)
    return need, ARENA_GROWTH * keys * row + 2 * HashTable.nbytes_for(keys) + temporaries


_RSS_CHILD = """
import json, sys, tempfile
from pathlib import Path
import numpy as np
from tierps.core import optim
from tierps.core.config import TableConfig
from tierps.storage import EmbeddingStore
from tierps.storage.warm_up import warm_up

def kib(field):
    return int(Path("/proc/self/status").read_text().split(field + ":")[1].split()[0])

n, batch, dim, budget = (int(a) for a in sys.argv[1:5])
keys = np.random.default_rng(3).choice(2**40, n, replace=False).astype(np.int64)
warm_up()
with tempfile.TemporaryDirectory() as root, EmbeddingStore(Path(root)) as store:
    config = TableConfig("t", dim, optimizer=optim.SGD(), host_cache_bytes=budget)
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from here
    before = kib("VmRSS")
    table = store.create_table(config)
    for start in range(0, n, batch):
        table.lookup(keys[start : start + batch])
    grown = (kib("VmHWM") - before) * 1024
    print(json.dumps({"grown": grown, "rows": table.stats()["tiers"]["host"]["rows"]}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("batch", [16_384, KEYS])
def test_a_first_touch_takes_the_memory_its_rows_need_whatever_the_budget(batch: int) -> None:
    """In a fresh process, a table with a 64 GiB budget first touching KEYS keys grows the
    peak resident memory by no more than the bound derived from its rows (_bound), which
    is a fraction of a percent of the budget: a budget-sized allocation that is touched
    (an index, zeroed flags) fails here; tracemalloc (below) catches untouched ones."""
    config = TableConfig("t", DIM, optimizer=optim.SGD(), host_cache_bytes=BIG_BUDGET)
    _, bound = _bound(config, KEYS, batch)
    assert bound < BIG_BUDGET / 500
    done = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(KEYS), str(batch), str(DIM), str(BIG_BUDGET)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["rows"] == KEYS
    assert 0 < figures["grown"] <= bound, f"peak RSS grew {figures['grown']} bytes, bound {bound}"


@pytest.mark.parametrize("batch", [16_384, KEYS])
def test_first_touch_allocates_what_the_rows_need_whatever_the_budget(
    tmp_path: Path, batch: int
) -> None:
    """Under a 64 GiB budget, what a first touch of KEYS keys allocates through numpy
    (tracemalloc's peak: index, flags, temporaries) and the arena's mapped capacity stay
    within the bound derived from the rows, and the tier's own accounting reports the
    rows written and the index, not the capacity. The kernels are compiled first: numba's
    compiler keeps Python objects that tracemalloc would count."""
    config = TableConfig("t", DIM, optimizer=optim.SGD(), host_cache_bytes=BIG_BUDGET)
    need, bound = _bound(config, KEYS, batch)
    keys = _keys(KEYS)
    warm_up()
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        tracemalloc.start()
        try:
            _first_touch(table, keys, batch)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        tier = table.tiers[0]
        host = table.stats()["tiers"]["host"]
        assert host["rows"] == KEYS
        assert host["capacity_rows"] == host_rows_for_budget(BIG_BUDGET, config.stored_bytes)
        assert tier.arena.shape[0] <= ARENA_GROWTH * KEYS
        row = config.stored_bytes + 1
        assert host["bytes"] == KEYS * row + tier.index.nbytes <= 2 * need
    assert peak <= bound, f"first touch allocated {peak} bytes at peak, bound {bound}"


def test_the_arena_grows_only_to_the_budget_and_the_rest_goes_to_rocksdb(
    tmp_path: Path,
) -> None:
    """A budget for fewer rows than the keys: the arena's growth steps stop at the
    budget's rows, the host tier holds that many, the others are in RocksDB, and every
    key reads back its initial row."""
    probe = TableConfig("t", DIM, optimizer=optim.SGD())
    budget = 3 * 1024 * (probe.stored_bytes + 100)  # about 3,000 rows: between two steps
    config = TableConfig("t", DIM, optimizer=optim.SGD(), host_cache_bytes=budget)
    max_rows = host_rows_for_budget(budget, config.stored_bytes)
    keys = _keys(10_000)
    with EmbeddingStore(tmp_path / "db") as store:
        table = store.create_table(config)
        first = np.concatenate([table.lookup(part) for part in np.array_split(keys, 10)])
        host = table.tiers[0]
        assert host.arena.shape[0] == max_rows, "the arena should stop at the budget's rows"
        assert host.rows <= max_rows and table.stats()["spilled"] >= keys.size - max_rows
        np.testing.assert_array_equal(table.lookup(keys, create=False), first)
        np.testing.assert_array_equal(first, table.config.initial_rows(keys)[:, :DIM])


def _no_spill(spill: Spill) -> None:
    raise AssertionError(f"nothing should spill, got {spill.keys.size} rows")


def test_a_growth_while_the_arena_is_viewed_copies_the_rows_instead() -> None:
    """The arena's mapping grows in place only while no array views it; with a view alive
    (held by a caller), a growth copies the rows in use to a new mapping: every row is kept,
    and the old view still reads what it saw."""
    config = TableConfig("t", 4, optimizer=optim.SGD())
    tier = CacheTier(config, 1 << 24)
    rng = np.random.default_rng(2)
    keys = rng.choice(2**40, 5000, replace=False).astype(np.int64)
    rows = rng.standard_normal((5000, config.stored_width), dtype=np.float32)
    tier.insert(keys[:1000], rows[:1000], np.ones(1000, bool), _no_spill)
    held = tier.arena[:1000]
    seen = held.copy()
    capacity = tier.arena.shape[0]
    tier.insert(keys[1000:], rows[1000:], np.ones(4000, bool), _no_spill)
    assert tier.arena.shape[0] > capacity, "the insert should have grown the arena"
    np.testing.assert_array_equal(held, seen)
    hit, found, dirty = tier.find(keys)
    assert hit.size == keys.size and dirty.all()
    np.testing.assert_array_equal(found, rows)


def test_a_mapped_arena_grows_in_place_keeping_its_rows() -> None:
    """Without views, MappedArena grows by remapping: the rows in use are kept, the new
    rows read zero until written, and the view has the new shape."""
    arena = MappedArena(1000, 8)
    view = arena.view()
    view[:] = np.arange(8000, dtype=np.float32).reshape(1000, 8)
    del view
    arena.grow(50_000, used=1000)
    grown = arena.view()
    assert grown.shape == (50_000, 8) and grown.flags.writeable
    np.testing.assert_array_equal(grown[:1000].ravel(), np.arange(8000, dtype=np.float32))
    assert not grown[1000:].any()


def _advice_taken() -> bool:
    """Whether this kernel takes MADV_POPULATE_WRITE (Linux 5.14+)."""
    mapping = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(MADV_POPULATE_WRITE, 0, mmap.PAGESIZE)
        return True
    except OSError:
        return False
    finally:
        mapping.close()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_populate_faults_in_the_rows_asked_for_and_no_others() -> None:
    """MappedArena.populate takes memory for rows [start, stop) before they are written
    (resident memory grows by their bytes, within a page at each end), they still read
    zero, and a stop past the mapping is clipped to it. Without the advice it changes
    nothing (a hint)."""
    width, rows = 64, 8192  # 2 MiB of rows
    arena = MappedArena(4 * rows, width)
    start, stop = rows, 3 * rows  # 4 MiB in the middle
    before = _kib("VmRSS") * 1024
    arena.populate(start, stop)
    grown = _kib("VmRSS") * 1024 - before
    view = arena.view()
    expected = (stop - start) * width * 4
    if _advice_taken():
        assert expected - mmap.PAGESIZE <= grown <= expected + 64 * mmap.PAGESIZE, grown
    else:
        assert grown < expected / 2, grown
    assert not view[start:stop].any()
    arena.populate(3 * rows, 10 * rows)  # past the end: clipped, no error
    assert view.shape == (4 * rows, width) and not view.any()
