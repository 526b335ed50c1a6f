"""Eviction (steps_to_live, min_l2_norm) through two real in-process shard
servers (port 0, RocksDB in tmp_path) and EmbeddingClient: the Evict rpc per shard, summed by
ClusterAdmin.evict; eviction before a snapshot's cut (evict_before_snapshot); and
`tierps admin evict` as a subprocess. Oracles: last-update steps and L2 norms in plain Python,
TableConfig.initial_rows for keys read after their rows were removed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from tierps.client import EmbeddingClient, ShardError, TableConfig, init, optim
from tierps.core.validation import DEFAULT_MAX_STEP_LEAP, MAX_STEP
from tierps.server.daemon import ShardServer

ServerFactory = Callable[..., ShardServer]
DIM = 4
STALE = TableConfig(
    "clicks",
    DIM,
    initializer=init.Normal(0.0, 0.1),
    optimizer=optim.SGD(lr=0.1),
    seed=3,
    steps_to_live=5,
    host_cache_bytes=1024,  # a few rows in the cache, the rest in RocksDB
)
SMALL = TableConfig(
    "views", DIM, optimizer=optim.SGD(lr=0.1), min_l2_norm=0.5, evict_before_snapshot=True
)


@pytest.fixture
def cluster(shard_server: ServerFactory) -> Iterator[tuple[list[ShardServer], EmbeddingClient]]:
    servers = [shard_server(shard_id=i, num_shards=2) for i in range(2)]
    with EmbeddingClient([s.address for s in servers], timeout_s=10.0) as client:
        yield servers, client


def push_steps(client: EmbeddingClient) -> tuple[dict[int, int], int]:
    """Pushes at steps 1, 4 and 7 (each reaching both shards); the last-update step of every
    key and the current step, kept in plain Python."""
    last: dict[int, int] = {}
    for step, keys in ((1, np.arange(40)), (4, np.arange(20)), (7, np.arange(6))):
        client.push_gradients("clicks", keys, np.ones((keys.size, DIM), np.float32), step=step)
        last.update(dict.fromkeys(keys.tolist(), step))
    return last, 7


def lifecycle_sum(client: EmbeddingClient, table: str, name: str) -> float:
    return sum(shard["lifecycle"][name] for shard in client.describe(table))


def test_evict_removes_stale_rows_on_every_shard_and_sums_them(
    cluster: tuple[list[ShardServer], EmbeddingClient],
) -> None:
    _, client = cluster
    client.create_table(STALE)
    last, current = push_steps(client)
    gone = sorted(k for k, step in last.items() if current - step >= STALE.steps_to_live)
    assert gone == list(range(20, 40))
    result = client.evict("clicks")
    per_shard = [sum(1 for k in gone if k % 2 == shard) for shard in range(2)]
    assert result == {
        "table": "clicks",
        "removed": len(gone),
        "per_shard": per_shard,
        "current_step": [current, current],
    }
    keys = np.array(gone)
    np.testing.assert_array_equal(
        client.lookup("clicks", keys, create=False), STALE.initial_rows(keys)[:, :DIM]
    )
    kept = np.arange(20)
    assert not np.array_equal(  # survivors keep their trained weights
        client.lookup("clicks", kept, create=False), STALE.initial_rows(kept)[:, :DIM]
    )
    assert lifecycle_sum(client, "clicks", "eviction.removed_total") == len(gone)
    assert [s["lifecycle"]["eviction.current_step"] for s in client.describe("clicks")] == [7, 7]
    assert client.evict("clicks")["removed"] == 0
    # a table without eviction options: a no-op
    client.create_table(TableConfig("plain", DIM))
    client.push_gradients("plain", np.arange(4), np.ones((4, DIM), np.float32), step=100)
    assert client.evict("plain") == {
        "table": "plain",
        "removed": 0,
        "per_shard": [0, 0],
        "current_step": [100, 100],
    }
    assert client.describe("plain")[0]["lifecycle"] == {}


def test_a_snapshot_of_a_table_with_evict_before_snapshot_lacks_the_evicted_rows(
    cluster: tuple[list[ShardServer], EmbeddingClient],
) -> None:
    _, client = cluster
    client.create_table(SMALL)
    rng = np.random.default_rng(5)
    keys = np.arange(60)
    values = (rng.standard_normal((60, DIM)) * 0.4).astype(np.float32)
    client.assign("views", keys, values)
    small = sorted(int(k) for k in keys if math.sqrt(sum(float(x) ** 2 for x in values[k])) < 0.5)
    assert 0 < len(small) < 60
    saved = client.save_snapshot("day1")
    assert saved["evicted"] == len(small)
    assert saved["rows"] == 60 - len(small)
    (info,) = client.list_snapshots()
    assert info["table_rows"] == {"views": 60 - len(small)}
    assert lifecycle_sum(client, "views", "eviction.last_removed") == len(small)
    client.assign("views", keys, np.zeros((60, DIM), np.float32))  # changed after the save
    assert client.load_snapshot("day1")["rows"] == 60 - len(small)
    got = client.lookup("views", keys, create=False)
    kept = np.setdiff1d(keys, small)
    np.testing.assert_array_equal(got[kept], values[kept])
    np.testing.assert_array_equal(got[small], SMALL.initial_rows(np.array(small))[:, :DIM])


@pytest.mark.slow  # real subprocesses: seconds
def test_the_admin_command_evicts_a_table(
    cluster: tuple[list[ShardServer], EmbeddingClient],
) -> None:
    servers, client = cluster
    client.create_table(STALE)
    push_steps(client)
    command = [
        sys.executable,
        "-m",
        "tierps.server.cli",
        "admin",
        "--addresses",
        ",".join(s.address for s in servers),
    ]
    done = subprocess.run([*command, "evict", "clicks"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "table 'clicks': evicted 20 rows (shard 0: 10 (step 7), shard 1: 10 (step 7))" in (
        done.stdout
    )
    again = subprocess.run(
        [*command, "--json", "evict", "clicks"], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["removed"] == 0
    described = subprocess.run(
        [*command, "describe", "clicks"], capture_output=True, text=True, timeout=60
    )
    assert described.returncode == 0, described.stderr
    assert "eviction: steps_to_live 5" in described.stdout
    assert any(line.split() == ["0", "7", "2", "0", "10"] for line in described.stdout.splitlines())
    missing = subprocess.run(
        [*command, "evict", "nope"], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr, missing.stderr


def test_a_refused_save_evicts_nothing(
    cluster: tuple[list[ShardServer], EmbeddingClient],
) -> None:
    """evict_before_snapshot runs only for a save that may go ahead: saving a name that is
    already a snapshot is refused before any row is removed."""
    _, client = cluster
    client.create_table(SMALL)
    client.save_snapshot("day1")
    keys = np.arange(10)
    client.assign("views", keys, np.full((10, DIM), 0.01, np.float32))  # all below 0.5
    before = client.lookup("views", keys, create=False)
    with pytest.raises(Exception, match="already exists"):
        client.save_snapshot("day1")
    np.testing.assert_array_equal(client.lookup("views", keys, create=False), before)
    assert lifecycle_sum(client, "views", "eviction.removed_total") == 0


def test_a_push_with_an_older_step_still_marks_its_rows_fresh(
    cluster: tuple[list[ShardServer], EmbeddingClient],
) -> None:
    """A trainer restarted with its step counter at 1, against a table whose clock is at 100:
    the rows it trains now are fresh, not 99 steps stale."""
    _, client = cluster
    client.create_table(STALE)
    client.push_gradients("clicks", np.arange(8), np.ones((8, DIM), np.float32), step=100)
    client.push_gradients("clicks", np.arange(4), np.ones((4, DIM), np.float32), step=1)
    removed = client.evict("clicks")["removed"]
    assert removed == 0, removed
    # 110 leaps steps_to_live (5) or more past the clock: held back until the next push
    # leaps too (the eviction guard, EmbeddingTable._advance_clock)
    client.push_gradients("clicks", np.arange(2), np.ones((2, DIM), np.float32), step=110)
    assert client.evict("clicks")["removed"] == 0
    client.push_gradients("clicks", np.arange(2), np.ones((2, DIM), np.float32), step=111)
    assert client.evict("clicks")["removed"] == 6  # keys 2..7: last updated at the clock's 100


def test_a_key_pushed_twice_at_the_largest_step_is_refused_and_a_save_keeps_every_row(
    cluster: tuple[list[ShardServer], EmbeddingClient],
) -> None:
    """1,001 rows trained at steps 1 and 2, then one key pushed twice at 2**53-1 (a step
    2**53-3 past the clock): each push is refused with INVALID_ARGUMENT naming the table,
    the shard, the step, the clock and the limit, and the save that evicts before its cut
    (evict_before_snapshot) keeps all 1,001 rows."""
    _, client = cluster
    guarded = TableConfig(
        "guarded", DIM, optimizer=optim.SGD(lr=0.1), steps_to_live=5, evict_before_snapshot=True
    )
    client.create_table(guarded)
    keys = np.arange(1001)
    for step in (1, 2):
        client.push_gradients("guarded", keys, np.ones((keys.size, DIM), np.float32), step=step)
    for _ in range(2):
        with pytest.raises(ShardError) as refused:
            client.push_gradients(
                "guarded", np.array([7]), np.ones((1, DIM), np.float32), step=MAX_STEP
            )
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        for needle in (
            "'guarded'",
            "shard 1",
            f"got {MAX_STEP}",
            "clock",
            "is 2",
            f"max_step_leap {DEFAULT_MAX_STEP_LEAP}",
            "--max-step-leap",
        ):
            assert needle in refused.value.details, (needle, refused.value.details)
    assert [shard["current_step"] for shard in client.describe("guarded")] == [2, 2]
    saved = client.save_snapshot("kept")
    assert (saved["rows"], saved["evicted"]) == (1001, 0)
    rows = client.lookup("guarded", keys, create=False)
    assert np.allclose(rows, guarded.initial_rows(keys)[:, :DIM] - 0.2)  # two SGD steps of 1
