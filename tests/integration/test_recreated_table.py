"""A table dropped and created again with another dim under a client that knew it: the
client's next call is refused saying so (or, for rows it is given, checked against the new
dim), and the call after works on the new table, with no new client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tests.integration.test_client import rpc_count
from tierps.client import EmbeddingClient, Feature, Reason, ShardError
from tierps.core import optim
from tierps.core.config import TableConfig
from tierps.core.errors import InvalidArgumentError

KEYS = np.arange(-1, 40, dtype=np.int64)  # -1: padding, a zero row
LR = 0.5


SHARDS: dict[int, list[Any]] = {}  # the servers of each test's cluster, by client id


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}-shards")
def clients(
    request: pytest.FixtureRequest, shard_server: Callable[..., Any]
) -> Iterator[tuple[EmbeddingClient, EmbeddingClient]]:
    """Two clients of one cluster: the one that knew the table, and the one that makes it
    again."""
    shards = [shard_server(shard_id=i, num_shards=request.param) for i in range(request.param)]
    SHARDS.clear()
    addresses = [f"127.0.0.1:{shard.port}" for shard in shards]
    knew, maker = EmbeddingClient(addresses), EmbeddingClient(addresses)
    knew.create_table(TableConfig(name="t", dim=8, optimizer=optim.SGD(lr=LR)))
    knew.push_gradients("t", KEYS, np.ones((KEYS.size, 8), np.float32))  # config, step known
    maker.drop_table("t")
    maker.create_table(TableConfig(name="t", dim=16, optimizer=optim.SGD(lr=LR), seed=3))
    SHARDS[id(maker)] = shards
    yield knew, maker
    knew.close()
    maker.close()


def test_a_lookup_is_refused_saying_the_table_changed_and_the_next_one_reads_it(
    clients: tuple[EmbeddingClient, EmbeddingClient],
) -> None:
    knew, maker = clients
    expected = maker.lookup("t", KEYS)  # the new table's rows, made by the other client
    assert expected.shape == (KEYS.size, 16)
    with pytest.raises(ShardError) as refused:
        knew.lookup("t", KEYS)
    assert refused.value.reason is Reason.INVALID_ARGUMENT
    facts = refused.value.facts
    assert (facts["table"], facts["field"], facts["expected"]) == ("t", "dim", "16")
    assert "created again with dim 16" in str(refused.value)
    np.testing.assert_array_equal(knew.lookup("t", KEYS), expected)
    pooled = knew.lookup_pooled("t", KEYS.reshape(-1, 1), create=False).output
    np.testing.assert_array_equal(pooled, expected)


def test_gradients_of_the_new_dim_are_pushed_without_a_refusal_first(
    clients: tuple[EmbeddingClient, EmbeddingClient],
) -> None:
    knew, maker = clients
    before = maker.lookup("t", KEYS)
    grads = np.random.default_rng(0).normal(size=(KEYS.size, 16)).astype(np.float32)
    assert knew.push_gradients("t", KEYS, grads) == KEYS.size - 1  # the padding key: none
    expected = before - np.float32(LR) * grads  # torch.optim.SGD's step, in float32
    expected[KEYS < 0] = 0.0
    np.testing.assert_array_equal(maker.lookup("t", KEYS, create=False), expected)
    # the new table's clock, not the old one's: its first push is its step 1 (the client's
    # own count, had it kept it, would have made it step 2)
    assert maker.table_step("t") == 1


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")
@pytest.mark.usefixtures("one_torch_thread")
def test_the_plain_loops_held_push_is_refused_saying_so_and_the_next_step_reads_the_table(
    clients: tuple[EmbeddingClient, EmbeddingClient],
) -> None:
    """An EmbeddingBagCollection's plain loop: backward holds its push for the next
    forward's lookup (one PushThenLookup a shard). The table is created again with another
    dim in between: that forward is refused as a whole, saying so (nothing applied), and the
    one after looks the new table up."""
    pytest.importorskip("torch")
    tierps_torch = pytest.importorskip("tierps.client.torch")
    knew, maker = clients
    maker.drop_table("t")
    knew.create_table(TableConfig(name="t", dim=8, optimizer=optim.SGD(lr=LR)))
    module = tierps_torch.EmbeddingBagCollection(knew, [Feature("a", "t", "sum")])
    batch = {"a": KEYS[1:].reshape(-1, 2)}  # bags of 2 keys
    sum(value.sum() for value in module(batch).values()).backward()  # the push is held
    maker.drop_table("t")
    maker.create_table(TableConfig(name="t", dim=16, optimizer=optim.SGD(lr=LR), seed=3))
    expected = maker.lookup("t", KEYS[1:]).reshape(-1, 2, 16).sum(axis=1)
    with pytest.raises(ShardError, match="created again with dim 16") as refused:
        module(batch)
    assert "not applied" in " ".join(refused.value.__notes__)
    assert maker.table_step("t") == 0  # nothing applied
    np.testing.assert_allclose(module(batch)["a"].detach().numpy(), expected, rtol=1e-6)
    module.close()


def test_a_callers_own_wrong_dim_is_refused_as_it_is_and_nothing_is_forgotten(
    clients: tuple[EmbeddingClient, EmbeddingClient],
) -> None:
    _, maker = clients
    maker.push_gradients("t", KEYS, np.ones((KEYS.size, 16), np.float32))  # step 1

    def asked() -> int:  # the calls that learn a table's config, generations or step
        methods = ("ListTables", "Stats", "DescribeTable")
        return sum(rpc_count(shard, m) for shard in SHARDS[id(maker)] for m in methods)

    before = asked()
    with pytest.raises(ShardError) as refused:  # push_unique: the dim is the rows' own
        maker.push_unique({"t": (KEYS[1:], np.ones((KEYS.size - 1, 4), np.float32))}, None)
    assert refused.value.facts["expected"] == "16"
    assert "created again" not in str(refused.value)
    assert maker.push_gradients("t", KEYS, np.ones((KEYS.size, 16), np.float32)) == KEYS.size - 1
    assert asked() == before  # nothing learned again: nothing was forgotten
    assert maker.table_step("t") == 2


def test_rows_of_another_dim_than_an_unchanged_tables_are_refused_and_nothing_is_forgotten(
    clients: tuple[EmbeddingClient, EmbeddingClient],
) -> None:
    _, maker = clients
    with pytest.raises(InvalidArgumentError, match=r"expected shape \(41, 16\)"):
        maker.push_gradients("t", KEYS, np.ones((KEYS.size, 8), np.float32))
    assert maker.table_config("t").dim == 16
    assert maker.push_gradients("t", KEYS, np.ones((KEYS.size, 16), np.float32)) == KEYS.size - 1
