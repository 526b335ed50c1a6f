"""The pipelined torch modules (tierps.client.torch, `staleness`) over two real in-process
shards: staleness 0 trains exactly as torch.nn.EmbeddingBag + torch.optim; staleness 1 as a
torch simulation of the one-step-stale schedule (the lookup of step t + 1 sees the rows after
step t - 1's push); a background push's failure surfaces once; the background threads end;
eval mode and no_grad push nothing."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tests.integration.test_client import rpc_count
from tierps.client import EmbeddingClient, Feature, ShardError, TableConfig, optim
from tierps.core.errors import InvalidArgumentError
from tierps.server.daemon import ShardServer

torch = pytest.importorskip("torch")
tierps_torch = pytest.importorskip("tierps.client.torch")
F = torch.nn.functional

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning"),
    pytest.mark.usefixtures("one_torch_thread"),
]

V = 12  # rows; batches draw from all of them, so consecutive steps share keys
DIM = 4
B = 4  # bags per feature and step
NNZ = 2  # keys per bag
STEPS = 6
KEYS = (np.arange(V, dtype=np.int64) * 7919 + 13) ** 2 % (1 << 40)  # spread over shards
FEATURES = [Feature("a", "t", "sum"), Feature("b", "t", "mean")]
ATOL = 1e-5  # as test_client_parity: float32 sums of a few O(1) terms, a few steps
U = 2.0**-24  # float32's unit roundoff
THREAD = "tierps-pipeline"


@pytest.fixture
def cluster(shard_server: Callable[..., ShardServer]) -> Iterator[tuple[EmbeddingClient, list]]:
    servers = [shard_server(shard_id=i, num_shards=2) for i in range(2)]
    with EmbeddingClient([s.address for s in servers], timeout_s=20.0) as client:
        yield client, servers


def make_steps(seed: int) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """Per step: (row indices [B, NNZ] per feature, a target [B, DIM] per feature)."""
    rng = np.random.default_rng(seed)
    return [
        (
            {f.name: rng.integers(0, V, (B, NNZ)) for f in FEATURES},
            {f.name: rng.standard_normal((B, DIM)).astype(np.float32) for f in FEATURES},
        )
        for _ in range(STEPS)
    ]


def loss_of(outputs: dict[str, Any], targets: dict[str, np.ndarray]) -> Any:
    """0.5 * |out - target|^2: its gradient depends on the rows looked up, so a stale
    lookup changes the update (a fixed output gradient would hide it)."""
    return sum(
        0.5 * ((outputs[name] - torch.from_numpy(target).to(outputs[name].dtype)) ** 2).sum()
        for name, target in targets.items()
    )


def torch_schedule(
    start: np.ndarray,
    steps: list,
    make_optimizer: Callable[[list[Any]], Any],
    *,
    stale: bool,
    dtype: Any = torch.float32,
) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """torch's embedding_bag + optimizer over the steps: each step's forward reads the
    weights after every earlier update (stale=False) or after all but the last one (stale:
    step t reads the weights after step t - 2's update). Returns each step's outputs and
    the weights after each update (the first: before any)."""
    weight = torch.nn.Parameter(torch.from_numpy(start).to(dtype))
    optimizer = make_optimizer([weight])
    history = [weight.detach().clone()]  # history[k]: the weights after k updates
    outputs = []
    for t, (rows, targets) in enumerate(steps):
        read = torch.nn.Parameter(history[max(t - 1, 0)].clone()) if stale else weight
        out = {
            f.name: F.embedding_bag(
                torch.from_numpy(rows[f.name]), read, mode=str(f.combiner), sparse=True
            )
            for f in FEATURES
        }
        loss_of(out, targets).backward()
        if stale:
            weight.grad = read.grad  # the gradient at the stale rows updates the current ones
        optimizer.step()
        optimizer.zero_grad()
        history.append(weight.detach().clone())
        outputs.append({name: value.detach().numpy() for name, value in out.items()})
    return outputs, [h.numpy() for h in history]


def tierps_schedule(
    client: EmbeddingClient, servers: list, steps: list, staleness: int
) -> tuple[list[dict[str, np.ndarray]], np.ndarray, int]:
    """The same steps through EmbeddingBagCollection.pipeline; returns each step's outputs,
    the final rows, and the lookup calls the shards answered."""
    module = tierps_torch.EmbeddingBagCollection(client, FEATURES, staleness=staleness)
    batches = [{name: KEYS[rows[name]] for name in rows} for rows, _ in steps]
    lookups = sum(lookups_served(server) for server in servers)
    outputs = []
    with module:
        for batch, (_, targets) in zip(module.pipeline(batches), steps, strict=True):
            out = module(batch)
            outputs.append({name: value.detach().numpy().copy() for name, value in out.items()})
            loss_of(out, targets).backward()  # staleness 1: the push runs in the background
    lookups = sum(lookups_served(server) for server in servers) - lookups
    return outputs, client.lookup("t", KEYS, create=False), lookups


def lookups_served(server: ShardServer) -> int:
    """Lookups the shard answered: alone, or after a push in one PushThenLookup call."""
    return rpc_count(server, "Lookup") + rpc_count(server, "PushThenLookup")


def assert_schedules_agree(
    got: list[dict[str, np.ndarray]],
    rows: np.ndarray,
    want: list[dict[str, Any]],
    weight: np.ndarray,
    output_tolerance: float,
    row_tolerance: float,
) -> None:
    """Each step's outputs and the final rows of tierps' schedule as the reference's."""
    for t, (have, expected) in enumerate(zip(got, want, strict=True)):
        for name in expected:
            np.testing.assert_allclose(
                have[name],
                expected[name],
                rtol=0,
                atol=output_tolerance,
                err_msg=f"step {t} {name}",
            )
    np.testing.assert_allclose(rows, weight, rtol=0, atol=row_tolerance, err_msg="final rows")


def new_table(client: EmbeddingClient, optimizer: Any, seed: int) -> np.ndarray:
    client.create_table(TableConfig("t", DIM, optimizer=optimizer))
    start = (0.5 * np.random.default_rng(seed).standard_normal((V, DIM))).astype(np.float32)
    client.assign("t", KEYS, start)
    return start


def test_staleness_0_trains_exactly_as_torch(cluster: tuple[EmbeddingClient, list]) -> None:
    """Adam (torch's SparseAdam) through the pipeline: every step's outputs and the final
    rows as torch's, and every batch looked up once (after its previous step's push)."""
    client, servers = cluster
    start = new_table(client, optim.Adam(lr=0.01, beta1=0.8, beta2=0.95, eps=1e-6), seed=1)
    steps = make_steps(seed=2)

    got, rows, lookups = tierps_schedule(client, servers, steps, staleness=0)
    want, history = torch_schedule(
        start,
        steps,
        lambda p: torch.optim.SparseAdam(p, lr=0.01, betas=(0.8, 0.95), eps=1e-6),
        stale=False,
    )

    assert lookups == len(servers) * STEPS  # no prefetched lookup was made twice
    assert_schedules_agree(got, rows, want, history[-1], ATOL, ATOL)


def test_staleness_1_trains_as_the_one_step_stale_schedule(
    cluster: tuple[EmbeddingClient, list],
) -> None:
    """SGD through the pipeline at staleness 1 against torch's stale schedule in float64,
    within a bound derived from float32 rounding; the synchronous schedule is far outside
    it, so the test tells the two apart."""
    client, servers = cluster
    lr = 0.1
    start = new_table(client, optim.SGD(lr=lr), seed=3)
    steps = make_steps(seed=4)

    got, rows, lookups = tierps_schedule(client, servers, steps, staleness=1)
    sgd = lambda p: torch.optim.SGD(p, lr=lr)  # noqa: E731
    want, history = torch_schedule(start, steps, sgd, stale=True, dtype=torch.float64)
    _, synchronous = torch_schedule(start, steps, sgd, stale=False, dtype=torch.float64)

    # float32 against the float64 schedule, to first order in U. A step reads rows off by
    # at most e; pools each bag (coefficients <= 1 summing to <= width, <= NNZ + 1
    # roundings); subtracts the target (1 rounding); sums each key's gradient over its
    # <= `entries` entries (coefficients <= 1, entries + 1 roundings, |g| <= G); and
    # subtracts lr times it (2 roundings of values <= M + lr G). So
    #   e' <= e (1 + lr entries width) + U rounding,
    #   rounding = lr entries ((NNZ + 1) width + width + 1) M + lr (entries + 3) G + 2 M,
    # with G = entries (width + 1) M and M bounding every row, output and target.
    entries = max(
        int(np.bincount(np.concatenate([r.ravel() for r in rows_by.values()])).max())
        for rows_by, _ in steps
    )
    width = float(NNZ)  # "a" sums its NNZ rows; "b" averages them
    magnitude = max(
        *(float(np.abs(h).max()) for h in history),
        *(float(np.abs(v).max()) for out in want for v in out.values()),
        *(float(np.abs(v).max()) for _, targets in steps for v in targets.values()),
    )
    gradient = entries * (width + 1) * magnitude
    rounding = (
        lr * entries * ((NNZ + 1) * width + width + 1) * magnitude
        + lr * (entries + 3) * gradient
        + 2 * magnitude
    )
    bound = 0.0
    for _ in range(STEPS):
        bound = bound * (1 + lr * entries * width) + U * rounding
    output_bound = width * bound + U * (NNZ + 1) * width * magnitude
    difference = float(np.abs(synchronous[-1] - history[-1]).max())
    assert difference > 10 * bound, (difference, bound)  # the schedules are told apart

    assert lookups == len(servers) * STEPS
    assert_schedules_agree(got, rows, want, history[-1], output_bound, bound)


def test_a_prefetch_older_than_the_staleness_is_looked_up_again(
    cluster: tuple[EmbeddingClient, list],
) -> None:
    client, servers = cluster
    new_table(client, optim.SGD(lr=0.5), seed=5)
    module = tierps_torch.EmbeddingBagCollection(client, FEATURES, staleness=1)
    batches = [{name: KEYS[rows[name]] for name in rows} for rows, _ in make_steps(seed=6)]
    with module:
        module.prefetch(batches[0])
        for batch in batches[1:3]:  # two pushes after the prefetch: one too many
            sum(out.sum() for out in module(batch).values()).backward()
        module.flush()
        lookups = sum(rpc_count(server, "Lookup") for server in servers)
        got = module(batches[0])
        assert sum(rpc_count(server, "Lookup") for server in servers) - lookups == 2
    want = client.lookup("t", batches[0]["a"], create=False).sum(axis=1)  # after both pushes
    np.testing.assert_allclose(got["a"].detach().numpy(), want, rtol=0, atol=ATOL)


def test_a_background_push_failure_surfaces_once(cluster: tuple[EmbeddingClient, list]) -> None:
    client, servers = cluster
    new_table(client, optim.SGD(lr=0.5), seed=7)
    module = tierps_torch.EmbeddingBagCollection(client, FEATURES, staleness=1)
    batch = {f.name: KEYS[: NNZ * B].reshape(B, NNZ) for f in FEATURES}
    out = module(batch)
    with EmbeddingClient(client.addresses) as other:
        other.drop_table("t")  # the push below finds no table on the shards
    sum(value.sum() for value in out.values()).backward()  # returns: the push is queued

    with pytest.raises(ShardError, match="NOT_FOUND") as raised:
        module.flush()
    assert any("background" in note for note in raised.value.__notes__)
    module.flush()  # raised once
    module.close()


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_bad_batch_or_gradient_is_refused_where_the_synchronous_call_refuses_it(
    cluster: tuple[EmbeddingClient, list], staleness: int
) -> None:
    """The trainer's thread prepares a prefetched lookup and computes a push's gradients:
    a bad batch given to prefetch is refused by its forward (not by prefetch), a non-finite
    gradient by backward; neither changes a row, and the module trains on."""
    client, servers = cluster
    start = new_table(client, optim.SGD(lr=0.5), seed=9)
    module = tierps_torch.EmbeddingBagCollection(client, FEATURES, staleness=staleness)
    good = {f.name: KEYS[: NNZ * B].reshape(B, NNZ) for f in FEATURES}
    bad = {"a": good["a"]}  # feature "b" missing
    with module:
        module.prefetch(bad)  # refused later, by the forward of this batch
        with pytest.raises(InvalidArgumentError, match=r"missing \['b'\]"):
            module(bad)
        out = module(good)
        with pytest.raises(InvalidArgumentError, match="feature 'a'.*expected finite"):
            (out["a"].sum() * float("nan") + out["b"].sum()).backward()
        module.flush()
        np.testing.assert_array_equal(client.lookup("t", KEYS, create=False), start)
        pushes = sum(rpc_count(server, "PushGradients") for server in servers)
        sum(value.sum() for value in module(good).values()).backward()
    assert sum(rpc_count(server, "PushGradients") for server in servers) > pushes
    assert not np.array_equal(client.lookup("t", KEYS, create=False), start)


def _pipeline_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD)]


def test_the_background_threads_end_on_close_and_with_the_module(
    cluster: tuple[EmbeddingClient, list],
) -> None:
    client, _ = cluster
    new_table(client, optim.SGD(lr=0.5), seed=8)
    batches = [{name: KEYS[rows[name]] for name in rows} for rows, _ in make_steps(seed=9)]

    def train(module: Any) -> None:
        for batch in module.pipeline(batches):
            sum(out.sum() for out in module(batch).values()).backward()

    with tierps_torch.EmbeddingBagCollection(client, FEATURES, staleness=1) as module:
        train(module)
        assert len(_pipeline_threads()) == 1
    assert _pipeline_threads() == []

    dropped = tierps_torch.EmbeddingBagCollection(client, FEATURES, staleness=1)
    train(dropped)
    del dropped  # never closed: its finalizer stops the threads
    gc.collect()
    deadline = time.monotonic() + 10.0
    while _pipeline_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _pipeline_threads() == []


def test_a_table_is_pipelined_by_one_module_at_a_time(
    cluster: tuple[EmbeddingClient, list],
) -> None:
    """Two modules pipelining one table would each order their lookups after their own
    pushes only, missing the other's: the second one's training prefetch is refused (and
    changes nothing), until the first is closed."""
    client, _ = cluster
    new_table(client, optim.SGD(lr=0.5), seed=10)
    table = FEATURES[0].table
    first = tierps_torch.EmbeddingBag(client, table)
    second = tierps_torch.EmbeddingBag(client, table, staleness=1)
    keys = torch.tensor([[int(KEYS[0]), int(KEYS[1])]])
    first.prefetch(keys)
    before = client.lookup(table, KEYS, create=False)
    with pytest.raises(ValueError, match=f"table '{table}': expected one module"):
        second.prefetch(keys)
    with torch.no_grad():
        second.prefetch(keys)  # an evaluation lookup pushes nothing: it may overlap
    first.close()
    second.prefetch(keys)
    second(keys).sum().backward()
    second.close()
    np.testing.assert_array_equal(client.lookup(table, KEYS[2:], create=False), before[2:])
    assert not np.array_equal(client.lookup(table, KEYS[:2], create=False), before[:2])


def test_eval_mode_and_no_grad_push_nothing_and_create_no_rows(
    cluster: tuple[EmbeddingClient, list],
) -> None:
    client, servers = cluster
    client.create_table(TableConfig("t", DIM, optimizer=optim.SGD(lr=0.5)))
    batches = [{name: KEYS[rows[name]] for name in rows} for rows, _ in make_steps(seed=10)]
    module = tierps_torch.EmbeddingBagCollection(client, FEATURES, staleness=1)
    pushes = sum(rpc_count(server, "PushGradients") for server in servers)
    with module:
        module.eval()
        for batch in module.pipeline(batches):
            assert not module(batch)["a"].requires_grad
        module.train()
        with torch.no_grad():
            for batch in module.pipeline(batches):
                assert module(batch)["b"].grad_fn is None
    assert sum(rpc_count(server, "PushGradients") for server in servers) == pushes
    assert sum(shard["created"] for shard in client.describe("t")) == 0


def test_staleness_other_than_0_or_1_is_refused(cluster: tuple[EmbeddingClient, list]) -> None:
    client, _ = cluster
    client.create_table(TableConfig("t", DIM))
    for bad in (2, -1, True, 0.5):
        with pytest.raises(ValueError, match=r"staleness expected 0 .* or 1 .*got"):
            tierps_torch.EmbeddingBagCollection(client, FEATURES, staleness=bad)
        with pytest.raises(ValueError, match="staleness expected"):
            tierps_torch.EmbeddingBag(client, "t", staleness=bad)
