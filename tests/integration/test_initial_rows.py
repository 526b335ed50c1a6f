"""A table created with its initial rows from a matrix (HugeCTR's
init_value): given (keys, values), or a .npy / .npz file read on the admin's side; through
the client and `tierps admin create`, against real in-process shards."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierps.client import EmbeddingClient, TableConfig, optim
from tierps.core.errors import FailedPreconditionError, InvalidArgumentError
from tierps.server.daemon import ShardServer

ServerFactory = Callable[..., ShardServer]
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
DIM = 4


@pytest.fixture
def cluster(shard_server: ServerFactory) -> Iterator[tuple[list[ShardServer], EmbeddingClient]]:
    servers = [shard_server(shard_id=i, num_shards=2) for i in range(2)]
    with EmbeddingClient([s.address for s in servers], timeout_s=10.0) as client:
        yield servers, client


def matrix(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


def test_rows_given_as_keys_and_values_are_the_tables_first_rows(
    cluster: tuple[list[ShardServer], EmbeddingClient],
) -> None:
    _, client = cluster
    keys, values = np.array([10, 3, 7, 22, 5]), matrix(5)
    lr = 0.1
    assert client.create_table(
        TableConfig("t", DIM, optimizer=optim.Adam(lr=lr)), initial=(keys, values)
    )
    np.testing.assert_array_equal(client.lookup("t", keys, create=False), values)
    # The optimizer state is fresh: one Adam step matches torch's SparseAdam from these rows.
    grads = matrix(5, seed=1)
    client.push_gradients("t", keys, grads)
    weight = torch.nn.Parameter(torch.from_numpy(values.copy()))
    adam = torch.optim.SparseAdam([weight], lr=lr)
    weight.grad = torch.sparse_coo_tensor(torch.arange(5)[None], torch.from_numpy(grads), (5, DIM))
    adam.step()
    np.testing.assert_allclose(client.lookup("t", keys), weight.detach().numpy(), atol=1e-6)


@pytest.mark.parametrize("suffix", [".npy", ".npz"])
def test_rows_read_from_a_file(
    cluster: tuple[list[ShardServer], EmbeddingClient], tmp_path: Path, suffix: str
) -> None:
    _, client = cluster
    values = matrix(6)
    path = tmp_path / f"rows{suffix}"
    keys = np.arange(6) if suffix == ".npy" else np.array([9, 8, 7, 6, 5, 4])
    if suffix == ".npy":
        np.save(path, values)
    else:
        np.savez(path, keys=keys, values=values)
    client.create_table(TableConfig("t", DIM), initial=path)
    np.testing.assert_array_equal(client.lookup("t", keys, create=False), values)
    rows = sum(
        next(t["rows"] for t in shard["tiers"] if t["name"] == "rocksdb")
        + next(t["rows"] for t in shard["tiers"] if t["name"] == "host")
        for shard in client.describe("t")
    )
    assert rows >= 6


BAD: dict[str, tuple[Callable[[Path], Any], list[str]]] = {
    "wrong dim": (
        lambda p: (np.arange(3), np.zeros((3, DIM + 1), np.float32)),
        ["'initial values'", f"(3, {DIM})", f"(3, {DIM + 1})"],
    ),
    "NaN": (
        lambda p: (np.arange(2), np.array([[0, 0, np.nan, 0], [0] * 4], np.float32)),
        ["'initial values'", "finite", "nan"],
    ),
    "repeated key": (
        lambda p: (np.array([4, 1, 4]), np.zeros((3, DIM), np.float32)),
        ["distinct", "key 4 2 times"],
    ),
    "negative key": (
        lambda p: (np.array([1, -3]), np.zeros((2, DIM), np.float32)),
        [">= 0", "-3 at index 1"],
    ),
    "missing file": (lambda p: p / "none.npy", ["could not be read", "none.npy"]),
    "other suffix": (lambda p: p / "rows.csv", ["expected a .npy or .npz path", "rows.csv"]),
    "beyond a direct table": (
        lambda p: (np.array([0, 8]), np.zeros((2, DIM), np.float32)),
        ["[0, 8)", "capacity", "got 8 at index 1"],
    ),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_initial_rows_are_refused_and_create_nothing(
    cluster: tuple[list[ShardServer], EmbeddingClient], tmp_path: Path, case: str
) -> None:
    _, client = cluster
    make, needles = BAD[case]
    direct = {"use_hashtable": False, "capacity": 8} if "direct" in case else {}
    with pytest.raises(InvalidArgumentError) as raised:
        client.create_table(TableConfig("t", DIM, **direct), initial=make(tmp_path))
    message = str(raised.value)
    assert message.startswith("table 't'"), message
    for needle in needles:
        assert needle in message, (needle, message)
    assert [c.name for c in client.list_tables()] == []


def test_initial_rows_for_a_table_that_exists_are_refused_and_change_nothing(
    cluster: tuple[list[ShardServer], EmbeddingClient],
) -> None:
    _, client = cluster
    config = TableConfig("t", DIM)
    client.create_table(config, initial=(np.array([1, 2]), matrix(2)))
    with pytest.raises(FailedPreconditionError) as raised:
        client.create_table(config, initial=(np.array([1, 2]), matrix(2, seed=5)))
    assert "exists" in str(raised.value) and "assign" in str(raised.value)
    np.testing.assert_array_equal(client.lookup("t", np.array([1, 2]), create=False), matrix(2))


@pytest.mark.slow  # real subprocesses: seconds
def test_the_admin_command_creates_a_table_from_a_file_read_on_its_side(
    cluster: tuple[list[ShardServer], EmbeddingClient], tmp_path: Path
) -> None:
    servers, client = cluster
    config = TableConfig("items", DIM, optimizer=optim.SGD(lr=0.5))
    (tmp_path / "items.json").write_text(json.dumps(config.to_dict()))
    np.save(tmp_path / "items.npy", matrix(9))
    command = [
        sys.executable,
        "-m",
        "tierps.server.cli",
        "admin",
        "--addresses",
        ",".join(s.address for s in servers),
        "create",
        "--config",
        str(tmp_path / "items.json"),
        "--init",
        str(tmp_path / "items.npy"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "table 'items' created on 2 shards, initial rows from" in done.stdout
    assert client.list_tables() == [config]
    np.testing.assert_array_equal(client.lookup("items", np.arange(9), create=False), matrix(9))
    again = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "exists" in again.stderr, again.stderr
