"""Verify accuracy, as HugeCTR's TF plugin does: the client SDK through a real cluster against
torch.nn.EmbeddingBag + torch.optim, step for step.

For every combiner (sum, mean, weighted sum) x input format (dense -1-padded [B, nnz], CSR
values + torch's offsets, COO with shuffled entries) x shard count (1: an in-process server;
2 and 3: LocalCluster daemons) x optimizer (every registered one torch has: its
torch_reference, stepped lazily as tierps steps, tests/optimizers.py's TorchTwin), the same
random initial matrix is assigned to a table and given to torch; then every step pools a
batch (repeated keys within and across bags, empty bags, padding) and pushes the same random
gradient of the output. Each step's output and the final weights agree within 1e-5.

Also: the weighted mean and sqrtn combiners against a numpy oracle of pooling's formulas, and
the torch modules (tierps.client.torch) against torch.nn.EmbeddingBag, with eval mode and
torch.no_grad() creating no rows and pushing nothing.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from tests.optimizers import TorchTwin, each
from tierps.client import COO, EmbeddingClient, Feature, TableConfig, init, optim
from tierps.server.cluster import LocalCluster
from tierps.server.config import ServerConfig
from tierps.server.daemon import create_server

torch = pytest.importorskip("torch")
tierps_torch = pytest.importorskip("tierps.client.torch")
F = torch.nn.functional

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning"),
    pytest.mark.usefixtures("one_torch_thread"),
]

V = 40  # rows; torch row V is the padding row (padding_idx)
HOT = 16  # batches draw from the first HOT rows, so keys repeat within and across bags
DIM = 8
B = 10  # bags per batch
NNZ = 5  # dense width
STEPS = 5
ATOL = 1e-5
# Table keys are sparse and spread over the shards; torch addresses row i by position.
KEYS = (np.arange(V, dtype=np.int64) * 7919 + 13) ** 2 % (1 << 40)
TIMEOUT_S = 30.0

# Every registered optimizer with a torch reference, by kind.
OPTIMIZERS = {
    optimizer.kind: optimizer for optimizer in each() if optimizer.torch_reference is not None
}
COMBINERS = {"sum": ("sum", False), "mean": ("mean", False), "weighted-sum": ("sum", True)}
FORMATS = ("dense", "csr", "coo")
_names = itertools.count()


def table_name(*parts: object) -> str:
    """A fresh table name per case, so cases share a cluster."""
    return "-".join(str(p) for p in (*parts, next(_names)))


# 3 shards in the default run; the fast loop (-m "not slow") takes 1 and 2
@pytest.fixture(
    scope="module",
    params=[1, 2, pytest.param(3, marks=pytest.mark.slow)],
    ids=lambda n: f"{n}-shards",
)
def client(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddingClient]:
    """An EmbeddingClient of a real cluster: one in-process shard server (1 shard), or a
    LocalCluster of `tierps serve` subprocesses (2 and 3 shards)."""
    num_shards: int = request.param
    root = tmp_path_factory.mktemp(f"cluster-{num_shards}")
    if num_shards == 1:
        server, port = create_server(ServerConfig(0, 1, root / "data", grace_s=0.5))
        server.start()
        try:
            with EmbeddingClient([f"127.0.0.1:{port}"], timeout_s=TIMEOUT_S) as opened:
                yield opened
        finally:
            server.stop()
        return
    with (
        LocalCluster(num_shards, root / "data") as cluster,
        EmbeddingClient(cluster.addresses, timeout_s=TIMEOUT_S) as opened,
    ):
        opened.check_topology()
        yield opened


# -- batches ----------------------------------------------------------------------------------


@dataclass
class Batch:
    """One step's batch in both worlds: tierps' (keys, offsets, weights) with -1 padding and
    table keys; torch's (input, offsets, per_sample_weights) with row indices and V padding."""

    keys: Any
    offsets: Any
    weights: np.ndarray | None
    torch_input: Any
    torch_offsets: Any
    torch_weights: Any


def make_batch(rng: np.random.Generator, fmt: str, weighted: bool) -> Batch:
    if fmt == "dense":
        index = rng.integers(0, HOT, size=(B, NNZ))
        padding = rng.random((B, NNZ)) < 0.3
        padding[0] = False
        index[0, 1] = index[0, 0]  # a key twice in one bag
        padding[[3, 7]] = True  # bags of padding only
        shape: tuple[int, ...] = (B, NNZ)
        offsets = None
    else:
        lengths = rng.integers(0, 6, size=B)
        lengths[0], lengths[[3, 7]] = 3, 0  # empty bags
        index = rng.integers(0, HOT, size=int(lengths.sum()))
        index[1] = index[0]
        padding = rng.random(index.size) < 0.15
        padding[:2] = False
        shape = (index.size,)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    keys = np.where(padding, -1, KEYS[index])
    rows = np.where(padding, V, index)
    weights = rng.uniform(0.5, 1.5, size=shape).astype(np.float32) if weighted else None
    torch_weights = None if weights is None else torch.from_numpy(weights)
    torch_offsets = None if offsets is None else torch.from_numpy(offsets)
    batch = Batch(keys, offsets, weights, torch.from_numpy(rows), torch_offsets, torch_weights)
    if fmt == "coo":  # the same bags, entries shuffled
        bag_of = np.repeat(np.arange(B), lengths)
        order = rng.permutation(index.size)
        batch.keys = COO(bag_of[order], keys[order], (B, int(lengths.max())))
        batch.offsets = None
        batch.weights = None if weights is None else weights[order]
    return batch


def torch_bag(weights: np.ndarray, mode: str) -> Any:
    """torch.nn.EmbeddingBag over `weights` plus a zero padding row V."""
    module = torch.nn.EmbeddingBag(V + 1, DIM, mode=mode, sparse=True, padding_idx=V)
    with torch.no_grad():
        module.weight[:V] = torch.from_numpy(weights)
        module.weight[V] = 0.0
    return module


def initial_weights(rng: np.random.Generator, rows: int = V) -> np.ndarray:
    return (0.5 * rng.standard_normal((rows, DIM))).astype(np.float32)


def assert_close(got: Any, want: Any, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = float(np.abs(got - want).max()) if got.size else 0.0
    assert diff <= ATOL, f"{what}: max abs diff {diff} > {ATOL}"


# -- parity against torch.nn.EmbeddingBag + torch.optim ----------------------------------------


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("combiner", list(COMBINERS))
def test_lookup_pooled_and_push_match_torch_embedding_bag_and_optimizer(
    client: EmbeddingClient, combiner: str, fmt: str, optimizer: str
) -> None:
    mode, weighted = COMBINERS[combiner]
    ours = OPTIMIZERS[optimizer]
    name = table_name("parity", combiner, fmt, optimizer)
    rng = np.random.default_rng(zlib.crc32(f"{combiner} {fmt} {optimizer}".encode()))
    assert client.create_table(TableConfig(name, DIM, optimizer=ours)) is True
    start = initial_weights(rng)
    assert client.assign(name, KEYS, start) == V
    reference = torch_bag(start, mode)
    theirs = TorchTwin(ours, reference.weight)

    for step in range(STEPS):
        batch = make_batch(rng, fmt, weighted)
        grad = rng.standard_normal((B, DIM)).astype(np.float32)

        pooled = client.lookup_pooled(
            name, batch.keys, batch.offsets, combiner=mode, per_sample_weights=batch.weights
        )
        expected = reference(batch.torch_input, batch.torch_offsets, batch.torch_weights)
        assert_close(pooled.output, expected.detach(), f"step {step} output")
        rows = batch.torch_input.numpy().reshape(-1)
        assert pooled.push_gradients(grad) == np.unique(rows[rows < V]).size
        theirs.zero_grad()
        expected.backward(torch.from_numpy(grad))
        theirs.step(rows[rows < V])

    final = client.lookup(name, KEYS, create=False)
    assert_close(final, reference.weight.detach()[:V], "final weights")


# -- weighted mean and sqrtn against the docstring's formulas -------------------------------------


def oracle_pooled(
    table: np.ndarray, rows: np.ndarray, offsets: np.ndarray, weights: np.ndarray, combiner: str
) -> tuple[np.ndarray, np.ndarray]:
    """float64 (output [B, DIM], coefficient matrix [B, V]) of pooling's docstring: mean
    divides by sum_i w_i, sqrtn by sqrt(sum_i w_i**2); rows < 0 take no part; an empty bag or
    a zero divisor gives zeros."""
    bounds = np.append(offsets, rows.size)
    coefficients = np.zeros((bounds.size - 1, V))
    for b in range(bounds.size - 1):
        r, w = rows[bounds[b] : bounds[b + 1]], weights[bounds[b] : bounds[b + 1]]
        w = w[r >= 0].astype(np.float64)
        r = r[r >= 0]
        divisor = w.sum() if combiner == "mean" else np.sqrt((w * w).sum())
        for row, weight in zip(r, w, strict=True):
            coefficients[b, row] += weight / divisor if divisor != 0 else 0.0
    return coefficients @ table.astype(np.float64), coefficients


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_weighted_mean_and_sqrtn_match_the_numpy_oracle(
    client: EmbeddingClient, combiner: str
) -> None:
    lr = 0.5
    name = table_name("weighted", combiner)
    client.create_table(TableConfig(name, DIM, optimizer=optim.SGD(lr=lr)))
    rng = np.random.default_rng(7)
    table = initial_weights(rng)
    client.assign(name, KEYS, table)
    rows = rng.integers(0, HOT, size=30)
    rows[[4, 9, 20]] = -1
    rows[1] = rows[0]
    offsets = np.array([0, 3, 3, 8, 9, 9, 15, 22, 25, 26])  # bags 1 and 4 are empty
    rows[offsets[8] : offsets[9]] = -1  # bag 8: padding only
    weights = rng.uniform(0.25, 2.0, size=rows.size).astype(np.float32)
    weights[offsets[6]] = -weights[offsets[6] + 1]  # a negative weight
    keys = np.where(rows >= 0, KEYS[rows % V], -1)

    pooled = client.lookup_pooled(
        name, keys, offsets, combiner=combiner, per_sample_weights=weights
    )

    want, coefficients = oracle_pooled(table, rows, offsets, weights, combiner)
    assert_close(pooled.output, want, "pooled output")
    grad = rng.standard_normal((offsets.size, DIM)).astype(np.float32)
    pooled.push_gradients(grad)
    expected = table - lr * (coefficients.T @ grad.astype(np.float64))
    assert_close(client.lookup(name, KEYS, create=False), expected, "weights after SGD")


# -- the torch modules ----------------------------------------------------------------------------


def created(client: EmbeddingClient, name: str) -> int:
    """Rows the shards created for the table (lookups with create, pushes, assigns)."""
    return sum(shard["created"] for shard in client.describe(name))


@pytest.mark.parametrize("fmt", ["dense", "csr-last"])
def test_torch_embedding_bag_module_matches_torch_nn_embedding_bag(
    client: EmbeddingClient, fmt: str
) -> None:
    name = table_name("module", fmt)
    client.create_table(TableConfig(name, DIM, optimizer=OPTIMIZERS["adam"]))
    rng = np.random.default_rng(3)
    start = initial_weights(rng)
    client.assign(name, KEYS, start)
    include_last = fmt == "csr-last"
    ours = tierps_torch.EmbeddingBag(
        client, name, combiner="mean", include_last_offset=include_last
    )
    reference = torch_bag(start, "mean")
    theirs = TorchTwin(OPTIMIZERS["adam"], reference.weight)
    assert ours.training

    for step in range(3):
        batch = make_batch(rng, "dense" if fmt == "dense" else "csr", weighted=False)
        grad = torch.from_numpy(rng.standard_normal((B, DIM)).astype(np.float32))
        if include_last:
            last = torch.tensor([batch.keys.size])
            got = ours(torch.from_numpy(batch.keys), torch.cat([batch.torch_offsets, last]))
        elif batch.offsets is None:
            got = ours(torch.from_numpy(batch.keys))
        else:
            got = ours(torch.from_numpy(batch.keys), batch.torch_offsets)
        want = reference(batch.torch_input, batch.torch_offsets)
        assert got.requires_grad and got.shape == (B, DIM)
        assert_close(got.detach(), want.detach(), f"step {step} output")
        (got * grad).sum().backward()  # pushes: the shards run Adam
        theirs.zero_grad()
        (want * grad).sum().backward()
        rows = batch.torch_input.numpy().reshape(-1)
        theirs.step(rows[rows < V])

    assert_close(client.lookup(name, KEYS, create=False), reference.weight.detach()[:V], "final")


def test_torch_embedding_bag_collection_matches_functional_embedding_bags(
    client: EmbeddingClient,
) -> None:
    """Three features over two tables ('a' and 'c' share one), each pooled as torch's
    functional embedding_bag over that table's weight; the tables train with Adagrad and
    SGD, as torch.optim.Adagrad and SGD train theirs."""
    first, second = table_name("ebc-adagrad"), table_name("ebc-sgd")
    client.create_table(TableConfig(first, DIM, optimizer=OPTIMIZERS["adagrad"]))
    client.create_table(TableConfig(second, DIM, optimizer=OPTIMIZERS["sgd"]))
    rng = np.random.default_rng(5)
    starts = {first: initial_weights(rng), second: initial_weights(rng)}
    for name, start in starts.items():
        client.assign(name, KEYS, start)
    features = [
        Feature("a", first, "sum"),
        Feature("b", second, "mean"),
        Feature("c", first, "mean"),
    ]
    ours = tierps_torch.EmbeddingBagCollection(client, features)
    weights = {
        name: torch.nn.Parameter(torch.from_numpy(np.vstack([s, np.zeros((1, DIM), np.float32)])))
        for name, s in starts.items()
    }
    theirs = {
        first: TorchTwin(OPTIMIZERS["adagrad"], weights[first]),
        second: TorchTwin(OPTIMIZERS["sgd"], weights[second]),
    }

    for step in range(3):
        batches = {
            "a": make_batch(rng, "dense", weighted=True),
            "b": make_batch(rng, "csr", weighted=False),
            "c": make_batch(rng, "csr", weighted=False),
        }
        grads = {
            f: torch.from_numpy(rng.standard_normal((B, DIM)).astype(np.float32)) for f in "abc"
        }
        got = ours(
            {
                "a": (batches["a"].keys, None, batches["a"].weights),
                "b": (torch.from_numpy(batches["b"].keys), batches["b"].torch_offsets),
                "c": (batches["c"].keys, batches["c"].offsets),
            }
        )
        touched: dict[str, list[np.ndarray]] = {first: [], second: []}
        for feature in features:
            batch = batches[feature.name]
            rows = batch.torch_input.numpy().reshape(-1)
            touched[feature.table].append(rows[rows < V])
            want = F.embedding_bag(
                batch.torch_input.reshape(-1) if batch.offsets is None else batch.torch_input,
                weights[feature.table],
                torch.arange(0, B * NNZ, NNZ) if batch.offsets is None else batch.torch_offsets,
                mode=str(feature.combiner),
                sparse=True,
                per_sample_weights=(
                    None if batch.torch_weights is None else batch.torch_weights.reshape(-1)
                ),
                padding_idx=V,
            )
            assert_close(got[feature.name].detach(), want.detach(), f"step {step} {feature.name}")
            (want * grads[feature.name]).sum().backward()
        sum((got[f] * grads[f]).sum() for f in "abc").backward()  # one push for all three
        for name, twin in theirs.items():
            twin.step(np.concatenate(touched[name]))
            twin.zero_grad()

    for name, weight in weights.items():
        assert_close(client.lookup(name, KEYS, create=False), weight.detach()[:V], name)


def test_torch_module_in_eval_mode_creates_no_rows_and_pushes_nothing(
    client: EmbeddingClient,
) -> None:
    config = TableConfig(
        table_name("eval"), DIM, initializer=init.Normal(std=0.1), optimizer=optim.SGD(lr=1.0)
    )
    client.create_table(config)
    seen, unseen = KEYS[:10], KEYS[10:20]
    module = tierps_torch.EmbeddingBag(client, config.name, combiner="sum")
    module(torch.from_numpy(seen.reshape(5, 2)))  # training mode: creates the rows of `seen`
    assert created(client, config.name) == seen.size
    before = client.lookup(config.name, seen, create=False)

    module.eval()
    keys = np.concatenate([seen, unseen]).reshape(10, 2)
    out = module(torch.from_numpy(keys))

    assert not out.requires_grad
    initial = config.initial_rows(unseen)[:, :DIM].reshape(5, 2, DIM).sum(axis=1)
    assert_close(out[5:], initial, "unseen keys pool their initial rows")
    assert_close(out[:5], before.reshape(5, 2, DIM).sum(axis=1), "seen keys pool their rows")
    assert created(client, config.name) == seen.size  # no row for `unseen`
    np.testing.assert_array_equal(client.lookup(config.name, seen, create=False), before)


def test_torch_module_under_no_grad_pushes_nothing(client: EmbeddingClient) -> None:
    name = table_name("nograd")
    client.create_table(TableConfig(name, DIM, optimizer=optim.SGD(lr=1.0)))
    client.assign(name, KEYS, initial_weights(np.random.default_rng(9)))
    before = client.lookup(name, KEYS, create=False)
    module = tierps_torch.EmbeddingBag(client, name, combiner="mean")
    assert module.training
    with torch.no_grad():
        out = module(torch.from_numpy(KEYS[:12].reshape(4, 3)))
    assert not out.requires_grad and out.grad_fn is None
    np.testing.assert_array_equal(client.lookup(name, KEYS, create=False), before)


def test_torch_module_under_no_grad_creates_no_rows(client: EmbeddingClient) -> None:
    name = table_name("nograd-rows")
    client.create_table(TableConfig(name, DIM, optimizer=optim.SGD(lr=1.0)))
    module = tierps_torch.EmbeddingBag(client, name, combiner="sum")
    with torch.no_grad():
        module(torch.from_numpy(KEYS[:6].reshape(3, 2)))
    assert created(client, name) == 0


def test_parity_fixture_shards_really_hold_the_keys(client: EmbeddingClient) -> None:
    """The cluster is what it says: every shard holds only its keys (k % N), so the parity
    above went through routing and fan-out, not one shard."""
    name = table_name("routing")
    client.create_table(TableConfig(name, DIM, optimizer=optim.SGD(lr=0.1)))
    client.lookup(name, KEYS)
    per_shard = [shard["created"] for shard in client.describe(name)]
    want = np.bincount(KEYS % client.num_shards, minlength=client.num_shards)
    assert per_shard == want.tolist()
