"""Table-wise placement on its own: owner_shard (the one function every client, shard and
snapshot load calls), key_shards, and a snapshot's rows_for_shard of a table placed whole.

Oracles: zlib's CRC-32 and a plain-int transcription of splitmix64's finaliser (Steele et
al. 2014, as in Vigna's reference C), independent of the numpy code under test; a fresh
interpreter with another PYTHONHASHSEED for determinism across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from tierps.core.config import key_shards, owner_shard, single_shard
from tierps.storage import InvalidArgumentError, TableConfig, optim
from tierps.storage.snapshot_reader import Snapshot
from tierps.storage.snapshot_writer import commit, write_part

MASK = 2**64 - 1
NAMES = [f"feature_{i}" for i in range(12)] + ["items", "users", "ads", "country"]


def splitmix64_finaliser(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def placed(name: str, table_shard: int = -1, **fields: object) -> TableConfig:
    return TableConfig(name, 4, placement="table", table_shard=table_shard, **fields)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7, 64])
def test_name_chosen_owner_is_splitmix64_of_the_crc32_of_the_name(num_shards: int) -> None:
    for name in NAMES:
        expected = splitmix64_finaliser(zlib.crc32(name.encode("utf-8"))) % num_shards
        assert owner_shard(placed(name), num_shards) == expected, name


def test_name_chosen_owner_depends_on_the_name_only() -> None:
    """Not on the rest of the config, the call, or the process (no salted hash())."""
    base = placed("items")
    other = placed("items", optimizer=optim.Adam(), seed=9, host_cache_bytes=1 << 10)
    for num_shards in (2, 3, 5):
        owners = {owner_shard(base, num_shards) for _ in range(3)}
        assert owners == {owner_shard(other, num_shards)}
    script = (
        "import json; from tierps.core.config import TableConfig, owner_shard; "
        f"print(json.dumps([[owner_shard(TableConfig(n, 4, placement='table'), m) "
        f"for m in (2, 3, 5)] for n in {NAMES!r}]))"
    )
    here = [[owner_shard(placed(name), m) for m in (2, 3, 5)] for name in NAMES]
    for hash_seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        )
        assert json.loads(out.stdout) == here


@pytest.mark.parametrize("num_shards", [2, 3, 4])
def test_name_chosen_owners_spread_tables_over_the_shards(num_shards: int) -> None:
    owners = [owner_shard(placed(name), num_shards) for name in NAMES]
    assert set(owners) == set(range(num_shards)), owners
    # Over many names, every shard gets its fair share within 10%.
    many = 1000 * num_shards
    counts = np.bincount(
        [owner_shard(placed(f"t{i}"), num_shards) for i in range(many)], minlength=num_shards
    )
    assert np.all(np.abs(counts - 1000) <= 100), counts


def test_table_shard_given_is_the_owner_and_must_be_in_the_cluster() -> None:
    assert [owner_shard(placed("items", 2), m) for m in (3, 4, 100)] == [2, 2, 2]
    with pytest.raises(InvalidArgumentError) as refused:
        owner_shard(placed("items", 2), 2)
    message = str(refused.value)
    for part in ("'items'", "'table_shard'", "[0, 1]", "2 shards", "got 2"):
        assert part in message, message
    with pytest.raises(ValueError, match=r"'rows'.*owner_shard expected placement='table'"):
        owner_shard(TableConfig("rows", 4), 2)


def test_key_shards_of_row_and_table_placement() -> None:
    keys = np.array([0, 1, 5, 10**12 + 3, 2**62], dtype=np.int64)
    np.testing.assert_array_equal(key_shards(TableConfig("rows", 4), keys, 3), keys % 3)
    table = placed("items")
    np.testing.assert_array_equal(key_shards(table, keys, 3), owner_shard(table, 3))
    np.testing.assert_array_equal(key_shards(placed("items", 1), keys, 3), 1)
    # single_shard, the shortcut: the one shard every key goes to, else None
    assert single_shard(TableConfig("rows", 4), 3) is None
    assert single_shard(TableConfig("rows", 4), 1) == 0
    assert single_shard(table, 3) == owner_shard(table, 3)
    assert single_shard(placed("items", 1), 3) == 1


# -- snapshots ----------------------------------------------------------------------------------


def write_snapshot(root: Path, config: TableConfig, parts: list[np.ndarray]) -> np.ndarray:
    """A committed snapshot 'snap' of one table written by len(parts) shards, part i holding
    the keys parts[i]; returns the rows, column c of key k's row holding k + c / 10."""
    for shard, keys in enumerate(parts):
        rows = keys[:, None] + np.arange(config.row_width)[None, :] / 10
        chunks = iter([(keys, rows.astype(np.float32))] if keys.size else [])
        list(write_part(root, "snap", "A", shard, len(parts), [(config, chunks)], keys.size))
    commit(root, "snap", "A")
    keys = np.concatenate(parts)
    return (keys[:, None] + np.arange(config.row_width)[None, :] / 10).astype(np.float32)


@pytest.mark.parametrize("target_shards", [1, 2, 3, 5])
def test_rows_for_shard_gives_a_placed_table_whole_to_its_new_owner(
    tmp_path: Path, target_shards: int
) -> None:
    config = placed("ads", optimizer=optim.Adam())
    # Rows in both parts, as a loader must take them from wherever they were written.
    parts = [np.arange(0, 300, 3, dtype=np.int64), np.arange(1000, 1250, dtype=np.int64)]
    rows = write_snapshot(tmp_path, config, parts)
    opened = Snapshot(tmp_path, "snap")
    owner = owner_shard(config, target_shards)
    for shard in range(target_shards):
        chunks = list(opened.rows_for_shard("ads", shard, target_shards, chunk_rows=64))
        assert sum(scanned for _, _, scanned in chunks) == rows.shape[0]  # progress completes
        keys = np.concatenate([k for k, _, _ in chunks])
        got = np.concatenate([r for _, r, _ in chunks])
        assert got.shape == (keys.size, config.row_width) and got.dtype == np.float32
        if shard == owner:
            np.testing.assert_array_equal(keys, np.concatenate(parts))
            assert got.tobytes() == rows.tobytes()
        else:
            assert keys.size == 0, (shard, owner)


def test_rows_for_shard_refuses_a_table_shard_outside_the_cluster(tmp_path: Path) -> None:
    config = placed("ads", table_shard=2)
    write_snapshot(tmp_path, config, [np.empty(0, np.int64)] * 2 + [np.arange(10)])
    opened = Snapshot(tmp_path, "snap")
    assert sum(k.size for k, _, _ in opened.rows_for_shard("ads", 2, 3)) == 10
    with pytest.raises(InvalidArgumentError, match=r"'ads'.*'table_shard'.*got 2"):
        list(opened.rows_for_shard("ads", 0, 2))
