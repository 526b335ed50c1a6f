"""The snapshot format on its own: two saves under one name never mix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierps.storage import FailedPreconditionError, InvalidArgumentError, TableConfig, optim
from tierps.storage.snapshot_reader import Snapshot
from tierps.storage.snapshot_writer import commit, write_part

CONFIG = TableConfig("t", 4, optimizer=optim.Adagrad())


def rows_of(keys: np.ndarray, fill: float) -> np.ndarray:
    return np.full((keys.size, CONFIG.row_width), fill, dtype=np.float32)


def export(keys: np.ndarray, fill: float) -> list[tuple[TableConfig, object]]:
    return [(CONFIG, iter([(keys, rows_of(keys, fill))]))]


def write(root: Path, save_id: str, shard: int, fill: float) -> None:
    keys = np.arange(shard, 40, 2, dtype=np.int64)
    list(write_part(root, "day1", save_id, shard, 2, export(keys, fill), keys.size))


def test_a_second_save_under_the_same_name_cannot_touch_the_first(tmp_path: Path) -> None:
    write(tmp_path, "A", 0, 1.0)
    write(tmp_path, "A", 1, 1.0)
    # B starts its part 0 before A commits (another cluster sharing the directory) ...
    keys = np.arange(0, 40, 2, dtype=np.int64)
    b_part = write_part(tmp_path, "day1", "B", 0, 2, export(keys, 9.0), keys.size)
    next(b_part)
    manifest = commit(tmp_path, "day1", "A")
    assert manifest["save_id"] == "A"
    list(b_part)  # ... and finishes after A committed, in its own directory
    with pytest.raises(FailedPreconditionError, match="already exists"):
        write(tmp_path, "B", 1, 9.0)  # a part started after the commit is refused
    with pytest.raises(FailedPreconditionError, match="already exists"):
        commit(tmp_path, "day1", "B")
    opened = Snapshot(tmp_path, "day1")
    opened.verify()
    for shard in range(2):
        for got_keys, got_rows, _ in opened.rows_for_shard("t", shard, 2):
            np.testing.assert_array_equal(got_keys % 2, shard)
            np.testing.assert_array_equal(got_rows, rows_of(got_keys, 1.0))  # A's rows only


def test_commit_refuses_a_save_with_a_missing_part(tmp_path: Path) -> None:
    write(tmp_path, "A", 0, 1.0)
    with pytest.raises(FailedPreconditionError, match=r"incomplete.*shards \[1\] of 2"):
        commit(tmp_path, "day1", "A")
    with pytest.raises(FailedPreconditionError, match="incomplete"):
        Snapshot(tmp_path, "day1")


@pytest.mark.parametrize("save_id", ["", "../x", "a/b", "x" * 65])
def test_a_save_id_that_is_not_one_directory_name_is_refused(tmp_path: Path, save_id: str) -> None:
    keys = np.arange(3, dtype=np.int64)
    with pytest.raises(InvalidArgumentError, match="save_id"):
        list(write_part(tmp_path, "day1", save_id, 0, 1, export(keys, 1.0), 3))
