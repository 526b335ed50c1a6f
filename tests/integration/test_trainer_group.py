"""TrainerGroup in one process (a gloo group of one rank over a file store) and the tables'
step clock, against a real in-process shard: what a group refuses, where its step starts,
and that a client continues a table's clock from the cluster. The multi-rank behaviour runs
under real torchrun in test_distributed.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from tierps.client.distributed import TrainerGroup  # noqa: E402
from tierps.client.embedding import EmbeddingClient  # noqa: E402
from tierps.client.pooled_lookup import Feature  # noqa: E402
from tierps.client.torch import EmbeddingBagCollection  # noqa: E402
from tierps.core.config import TableConfig  # noqa: E402
from tierps.server.daemon import ShardServer  # noqa: E402
from tierps.storage import optim  # noqa: E402

DIM = 4


@pytest.fixture
def client(shard_server: Callable[..., ShardServer]) -> Iterator[EmbeddingClient]:
    server = shard_server()
    with EmbeddingClient([f"127.0.0.1:{server.port}"], timeout_s=30.0) as opened:
        opened.create_table(TableConfig("t", DIM, optimizer=optim.Adam(lr=0.1)))
        yield opened


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_group_needs_torch_distributed(client: EmbeddingClient) -> None:
    ebc = EmbeddingBagCollection(client, [Feature("f", "t")])
    with pytest.raises(RuntimeError, match="torch.distributed expected initialized"):
        TrainerGroup(client, [ebc])


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize(
    ("mode", "staleness", "expected"),
    [
        ("both", 0, r"mode expected one of \('sync', 'async'\), got 'both'"),
        ("sync", 1, "staleness expected 0 in sync mode"),
        ("async", 0, "staleness expected >= 1 in async mode"),
        ("async", True, "staleness expected an int, got True"),
    ],
)
def test_a_group_refuses_bad_modes(
    client: EmbeddingClient, mode: str, staleness: int, expected: str
) -> None:
    ebc = EmbeddingBagCollection(client, [Feature("f", "t")], staleness=1)
    with pytest.raises(ValueError, match=expected):
        TrainerGroup(client, [ebc], mode=mode, staleness=staleness)
    assert ebc.group is None and ebc.staleness == 1  # a refused group changed nothing


@pytest.mark.usefixtures("one_rank")
def test_a_module_is_in_one_group_on_its_client(client: EmbeddingClient) -> None:
    ebc = EmbeddingBagCollection(client, [Feature("f", "t")])
    TrainerGroup(client, [ebc])
    with pytest.raises(ValueError, match="expected in one group"):
        TrainerGroup(client, [ebc])
    with EmbeddingClient(client.addresses) as other:
        with pytest.raises(ValueError, match="expected on the group's client"):
            TrainerGroup(other, [EmbeddingBagCollection(client, [Feature("f", "t")])])


def test_a_client_continues_a_tables_clock_from_the_cluster(client: EmbeddingClient) -> None:
    keys = np.arange(3, dtype=np.int64)
    grads = np.ones((3, DIM), dtype=np.float32)
    for _ in range(2):
        client.push_gradients("t", keys, grads)
    assert client.table_step("t") == 2
    with EmbeddingClient(client.addresses) as restarted:  # a trainer started again
        restarted.push_gradients("t", keys, grads)
        assert restarted.table_step("t") == 3  # not 1: Adam's bias correction goes on


@pytest.mark.usefixtures("one_rank")
def test_a_group_starts_at_its_tables_clock_and_pushes_each_step_at_it(
    client: EmbeddingClient,
) -> None:
    client.push_gradients("t", np.arange(2), np.ones((2, DIM), np.float32), step=7)
    ebc = EmbeddingBagCollection(client, [Feature("f", "t")])
    group = TrainerGroup(client, [ebc])
    assert group.step == 7
    batches = [{"f": torch.tensor([[1, 2]])} for _ in range(3)]
    for batch in group.pipeline(batches, (ebc, lambda b: b)):
        ebc(batch)["f"].sum().backward()
        assert client.table_step("t") == group.step
    assert group.step == 10 and group.max_staleness_seen == 0
