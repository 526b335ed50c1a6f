"""Sync mode's gradient exchange (tierps.client.distributed.exchange_gradients) on real gloo
process groups: 2 and 3 ranks spawned with torch.multiprocessing, init_process_group("gloo")
over a file store in tmp_path, each rank running the same cases in order.

The reference is the computation sync mode made before the exchange was partitioned by key
owner, kept here as numpy (`all_gathered_oracle`): every rank's pushes gathered whole (as
dist.all_gather_object gave them), each key's gradients summed in rank order, divided by the
world size. The ranks' owned sums together must equal it bit for bit; each key must come
back on its owner only; and a rank must pass the collectives its distinct keys' keys and
gradients once, plus the counts and padding.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as torch_mp  # noqa: E402

from tierps.client.distributed import exchange_gradients, key_owners  # noqa: E402

pytestmark = pytest.mark.slow  # spawned gloo ranks

Pushes = dict[str, tuple[np.ndarray, np.ndarray]]
TABLES = ("a", "b", "c")
DIMS = {"a": 1, "b": 4, "c": 16}  # several dims, one of them 1 (a column of one value)
SPAWN_TIMEOUT_S = 120


def gradients(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    """Gradients of magnitudes 1e-4 to 1e4: float32 sums of them depend on their order."""
    scale = 10.0 ** rng.uniform(-4, 4, (rows, 1))
    return (rng.normal(size=(rows, dim)) * scale).astype(np.float32)


def distinct_keys(rng: np.random.Generator, high: int, size: int) -> np.ndarray:
    """`size` distinct keys below `high`, shuffled (a push's keys need not be sorted)."""
    return rng.permutation(rng.choice(high, size=size, replace=False)).astype(np.int64)


def push(rng: np.random.Generator, tables: tuple[str, ...], high: int, size: int) -> Pushes:
    return {t: (distinct_keys(rng, high, size), gradients(rng, size, DIMS[t])) for t in tables}


def cases(world: int) -> dict[str, list[Pushes]]:
    """Per case: each rank's pushes of one step. Ranks draw from a small key range, so
    most keys are pushed by several ranks."""
    rng = np.random.default_rng(world)
    empty = {t: (np.empty(0, np.int64), np.empty((0, DIMS[t]), np.float32)) for t in TABLES}
    mostly_owned_by_0 = [  # every rank's keys, but the last rank's are all owned by rank 0
        *(push(rng, TABLES, 60, 25) for _ in range(world - 1)),
        {
            t: (np.arange(0, 60, world, dtype=np.int64), gradients(rng, 60 // world, DIMS[t]))
            for t in TABLES
        },
    ]
    return {
        "tables of different dims": [push(rng, TABLES, 60, 30) for _ in range(world)],
        "a table on rank 0 only": [
            push(rng, ("a", "b", "c") if rank == 0 else ("a", "c"), 40, 20) for rank in range(world)
        ],
        "a rank with no keys of its own": [
            *(push(rng, TABLES, 60, 30) for _ in range(world - 1)),
            {},
        ],
        "a table present without keys": [
            {**push(rng, ("a", "c"), 50, 20), "b": empty["b"]},
            *(push(rng, ("c",), 50, 20) for _ in range(world - 1)),
        ],
        "keys on rank 0 only": [push(rng, TABLES, 1000, 200), *({} for _ in range(world - 1))],
        "a rank whose keys others own": mostly_owned_by_0,
        "an empty step": [{} for _ in range(world)],
        "empty tables everywhere": [dict(empty) for _ in range(world)],
        "many keys": [push(rng, TABLES, 20_000, 5_000) for _ in range(world)],
    }


def dims_disagree(world: int) -> list[Pushes]:
    """Table b of dim 4 on rank 0 and of dim 5 on the others: every rank must refuse."""
    rng = np.random.default_rng(7)
    return [
        {"b": (distinct_keys(rng, 30, 10), gradients(rng, 10, 4 if rank == 0 else 5))}
        for rank in range(world)
    ]


def all_gathered_oracle(gathered: list[Pushes], world: int) -> Pushes:
    """The sums before the exchange was partitioned: every rank's pushes (as
    all_gather_object gave each rank), summed per key in rank order, / world; each rank
    pushed a contiguous slice of the sorted keys, and together they pushed all of this.
    Tables without a key on any rank are left out (that computation raised IndexError on
    them; the exchange sends nothing for them)."""
    share: Pushes = {}
    for table in sorted({table for part in gathered for table in part}):
        parts = [part[table] for part in gathered if table in part]
        keys = np.concatenate([keys for keys, _ in parts])
        if not keys.size:
            continue
        grads = np.concatenate([grads for _, grads in parts])
        order = np.argsort(keys, kind="stable")  # a key's gradients stay in rank order
        keys = keys[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        unique = keys[starts]
        summed = np.add.reduceat(grads[order], starts, axis=0)
        summed /= np.float32(world)
        share[table] = (unique, summed)
    return share


def run_rank(rank: int, world: int, store: str, out: str) -> None:
    """One spawned rank: every case's exchange in order, the results pickled to out."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results: dict[str, Any] = {}
        for name, pushes in cases(world).items():
            results[name] = exchange_gradients(pushes[rank], TABLES)
        try:
            exchange_gradients(dims_disagree(world)[rank], TABLES)
            results["dims disagree"] = None
        except ValueError as refused:
            results["dims disagree"] = str(refused)
        # the ranks are still in step after a refusal: one more exchange goes through
        results["after the refusal"] = exchange_gradients(cases(world)["many keys"][rank], TABLES)
        Path(out, f"rank-{rank}.pkl").write_bytes(pickle.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world: f"{world}-ranks")
def exchanged(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    """(world size, each rank's results) of one spawned job of every case."""
    world = request.param
    root = tmp_path_factory.mktemp(f"exchange-{world}")
    context = torch_mp.start_processes(
        run_rank,
        args=(world, str(root / "store"), str(root)),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    # join(timeout) returns False while ranks run; a failed rank raises with its traceback
    deadline = SPAWN_TIMEOUT_S
    while not context.join(timeout=1):
        deadline -= 1
        assert deadline > 0, f"the {world} ranks did not finish in {SPAWN_TIMEOUT_S} s"
    return world, [pickle.loads((root / f"rank-{r}.pkl").read_bytes()) for r in range(world)]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    )


def assert_owners_sums_are(owned: list[Pushes], expected: Pushes, world: int) -> None:
    """The ranks' owned sums, together, are `expected` bit for bit, each key on its owner."""
    assert sorted({t for share in owned for t in share}) == sorted(expected)
    for table, (keys, summed) in expected.items():
        parts = [share[table] for share in owned if table in share]
        got_keys = np.concatenate([k for k, _ in parts])
        got_sums = np.concatenate([g for _, g in parts])
        order = np.argsort(got_keys)
        np.testing.assert_array_equal(got_keys[order], keys)  # each key on one rank only
        assert same_bits(got_sums[order], summed), f"table {table!r}'s sums differ"
    for rank, share in enumerate(owned):
        for table, (keys, _) in share.items():
            np.testing.assert_array_equal(key_owners(keys, world), rank, err_msg=table)


@pytest.mark.parametrize("case", list(cases(2)))
def test_the_owners_sums_are_the_all_gathered_computations_bit_for_bit(
    exchanged: tuple[int, list[dict[str, Any]]], case: str
) -> None:
    world, results = exchanged
    expected = all_gathered_oracle(cases(world)[case], world)
    assert_owners_sums_are([results[rank][case][0] for rank in range(world)], expected, world)


def test_the_oracle_tells_summation_orders_apart() -> None:
    """The bit-for-bit comparison can fail: on 3 ranks' gradients, summing in the reverse
    rank order gives other float32 sums (on 2, a + b == b + a: any order gives the same)."""
    pushes = cases(3)["many keys"]
    forward = all_gathered_oracle(pushes, 3)
    backward = all_gathered_oracle(pushes[::-1], 3)
    assert any(not same_bits(forward[t][1], backward[t][1]) for t in forward)


@pytest.mark.parametrize("case", list(cases(2)))
def test_a_rank_sends_its_distinct_keys_and_gradients_once_plus_counts(
    exchanged: tuple[int, list[dict[str, Any]]], case: str
) -> None:
    """Once: the keys and gradient rows a rank has, 2 int64 counts per table and rank, and
    at most one 4-byte word of padding per rank (which keeps the keys 8-byte aligned)."""
    world, results = exchanged
    counts_bytes = 2 * len(TABLES) * world * 8
    for rank, pushes in enumerate(cases(world)[case]):
        payload = sum(keys.nbytes + grads.nbytes for keys, grads in pushes.values())
        passed = results[rank][case][1]
        assert payload + counts_bytes <= passed <= payload + counts_bytes + 4 * world, rank


def test_ranks_whose_dims_of_a_table_differ_all_refuse_and_stay_in_step(
    exchanged: tuple[int, list[dict[str, Any]]],
) -> None:
    world, results = exchanged
    by_rank = {0: 4, **{rank: 5 for rank in range(1, world)}}
    for rank in range(world):
        assert results[rank]["dims disagree"] == (
            f"exchange_gradients: table 'b''s gradients expected of one dim on every rank, "
            f"got dims by rank {by_rank}"
        )
    expected = all_gathered_oracle(cases(world)["many keys"], world)
    after = [results[rank]["after the refusal"][0] for rank in range(world)]
    assert_owners_sums_are(after, expected, world)


def test_a_push_of_a_table_outside_the_group_is_refused_before_any_collective() -> None:
    pushes = {"z": (np.arange(2, dtype=np.int64), np.ones((2, 4), np.float32))}
    with pytest.raises(
        ValueError,
        match=r"expected of the group's tables \['a', 'b', 'c'\], "
        r"got tables \['z'\] besides",
    ):
        exchange_gradients(pushes, TABLES)
