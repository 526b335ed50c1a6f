"""How a snapshot's training state goes to the shards of a load
(storage/snapshot_reader.py, Snapshot.state_for_shard), on real files without shards: by
key where state is keyed, by the rules in CARRIES where it cannot be split, and whole to
its owner for a table placed whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tierps.core.config import Admission, Placement
from tierps.storage import TableConfig, optim
from tierps.storage.admission import bloom_size
from tierps.storage.snapshot_reader import Snapshot
from tierps.storage.snapshot_writer import commit, write_part

ADAPT = TableConfig(
    "a", 2, optimizer=optim.SGD(), hash_bucket_size=3, promote_after=4, steps_to_live=9
)
WHOLE = TableConfig(
    "w",
    2,
    optimizer=optim.SGD(),
    placement=Placement.TABLE,
    table_shard=1,
    admit_after=3,
    admission=Admission.BLOOM,
    max_elements=64,
)


def save(root: Path, config: TableConfig, states: list[dict]) -> Snapshot:
    for shard, state in enumerate(states):
        empty = iter([(np.empty(0, np.int64), np.empty((0, config.row_width), np.float32))])
        exports = [(config, empty, state)]
        list(write_part(root, "s", "sid", shard, len(states), exports, 0))
    commit(root, "s", "sid")
    return Snapshot(root, "s")


def test_keyed_counts_go_by_key_and_the_rest_by_the_documented_rules(tmp_path: Path) -> None:
    buckets = [np.full((3, 2), 1.0, np.float32), np.full((3, 2), 2.5, np.float32)]
    promotion = [
        np.array([[0, 1, 2], [4, 3, 5]], np.int64),  # keys 0, 4 on shard 0 of 2
        np.array([[1, 2, 7], [3, 1, 1]], np.int64),  # keys 1, 3 on shard 1 of 2
    ]
    states = [
        {
            "current_step": 7,
            "first_step": 2,
            "buckets": buckets[i],
            "promotion": promotion[i],
            "promotion_calls": 7 + i,
        }
        for i in range(2)
    ]
    states[1].update(current_step=9, first_step=3)
    opened = save(tmp_path, ADAPT, states)
    for i in range(2):  # the same shard count: each part's own state, as it was
        got = opened.state_for_shard("a", i, 2)
        assert (got["current_step"], got["first_step"]) == (
            states[i]["current_step"],
            states[i]["first_step"],
        )
        assert np.array_equal(got["buckets"], buckets[i])
        assert np.array_equal(got["promotion"], promotion[i])
    got = [opened.state_for_shard("a", i, 3) for i in range(3)]
    for i, state in enumerate(got):  # 2 -> 3: counts by key % 3, clock merged, buckets mean
        assert (state["current_step"], state["first_step"]) == (9, 2)
        assert np.array_equal(state["buckets"], np.full((3, 2), 1.75, np.float32))
        assert state["promotion_calls"] == 8
        assert set(state["promotion"][:, 0] % 3) <= {i}
    keys = np.concatenate([s["promotion"][:, 0] for s in got])
    assert sorted(keys.tolist()) == [0, 1, 3, 4]


def test_a_table_placed_whole_takes_its_old_owners_state_on_its_new_owner(
    tmp_path: Path,
) -> None:
    size, _ = bloom_size(WHOLE.max_elements, WHOLE.false_positive_rate)
    counters = np.arange(size, dtype=np.uint8) % 4
    opened = save(tmp_path, WHOLE, [{}, {"admission": counters, "current_step": 5}])
    # table_shard=1: the owner of 2 shards and of 3; the other shards take nothing
    assert np.array_equal(opened.state_for_shard("w", 1, 3)["admission"], counters)
    assert opened.state_for_shard("w", 0, 3) == {} == opened.state_for_shard("w", 2, 3)
