"""The plain training loop (forward, backward, the next batch; no pipeline()) at staleness 0
over two real in-process shards: backward holds its push, the next forward sends it with its
lookup as one PushThenLookup call per shard, and training is the synchronous loop's bit for
bit and torch.nn.EmbeddingBag + torch.optim's; a push no forward follows is applied by
flush(), close(), the client's next call on its table, and at interpreter exit; a failed push
is raised once, by the module's next call, naming the backward and tables it came from."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tests.integration.test_client import rpc_count
from tests.integration.test_pipeline import (
    ATOL,
    DIM,
    FEATURES,
    KEYS,
    STEPS,
    loss_of,
    make_steps,
    new_table,
    torch_schedule,
)
from tierps.client import EmbeddingClient, ShardError, TableConfig, optim
from tierps.server.daemon import ShardServer

torch = pytest.importorskip("torch")
tierps_torch = pytest.importorskip("tierps.client.torch")

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning"),
    pytest.mark.usefixtures("one_torch_thread"),
]

Cluster = tuple[EmbeddingClient, list[ShardServer]]
ADAM = optim.Adam(lr=0.01, beta1=0.8, beta2=0.95, eps=1e-6)


@pytest.fixture
def cluster(shard_server: Callable[..., ShardServer]) -> Iterator[Cluster]:
    servers = [shard_server(shard_id=i, num_shards=2) for i in range(2)]
    with EmbeddingClient([s.address for s in servers], timeout_s=20.0) as client:
        yield client, servers


def torch_adam(params: list[Any]) -> Any:
    return torch.optim.SparseAdam(params, lr=0.01, betas=(0.8, 0.95), eps=1e-6)


def batches_of(steps: list) -> list[dict[str, np.ndarray]]:
    return [{name: KEYS[rows[name]] for name in rows} for rows, _ in steps]


def plain_loop(module: Any, steps: list, synchronous: bool = False) -> list[dict[str, np.ndarray]]:
    """The steps through the plain loop; `synchronous`: flush() after each backward, so
    that backward returns once its push is applied. Returns each step's outputs."""
    outputs = []
    for batch, (_, targets) in zip(batches_of(steps), steps, strict=True):
        out = module(batch)
        outputs.append({name: value.detach().numpy().copy() for name, value in out.items()})
        loss_of(out, targets).backward()
        if synchronous:
            module.flush()
    return outputs


def served(servers: list[ShardServer], method: str) -> list[int]:
    return [rpc_count(server, method) for server in servers]


def test_the_plain_loop_trains_as_torch_with_one_call_per_shard_a_step(cluster: Cluster) -> None:
    """Adam over keys repeated across steps: every step's outputs and the rows (read by the
    client right after the last backward, without a flush) as torch's SparseAdam, and bit
    for bit as the synchronous loop's; each step after the first makes one call per shard,
    its push with the next lookup."""
    client, servers = cluster
    start = new_table(client, ADAM, seed=1)
    steps = make_steps(seed=2)
    before = {m: served(servers, m) for m in ("Lookup", "PushGradients", "PushThenLookup")}

    module = tierps_torch.EmbeddingBagCollection(client, FEATURES)
    got = plain_loop(module, steps)
    rows = client.lookup("t", KEYS, create=False)  # sees the last push, still held till now

    made = {
        m: [n - b for n, b in zip(served(servers, m), was, strict=True)]
        for m, was in before.items()
    }
    # alone: the first forward's lookup, the last push (sent by the client's read) and the read
    assert made == {"Lookup": [2, 2], "PushGradients": [1, 1], "PushThenLookup": [STEPS - 1] * 2}
    want, history = torch_schedule(start, steps, torch_adam, stale=False)
    for t, (have, expected) in enumerate(zip(got, want, strict=True)):
        for name in expected:
            np.testing.assert_allclose(
                have[name], expected[name], rtol=0, atol=ATOL, err_msg=f"step {t} {name}"
            )
    np.testing.assert_allclose(rows, history[-1], rtol=0, atol=ATOL, err_msg="final rows")

    client.drop_table("t")  # again, through the synchronous loop
    new_table(client, ADAM, seed=1)
    synchronous = plain_loop(tierps_torch.EmbeddingBagCollection(client, FEATURES), steps, True)
    for t, (have, expected) in enumerate(zip(got, synchronous, strict=True)):
        for name in expected:
            np.testing.assert_array_equal(have[name], expected[name], err_msg=f"step {t} {name}")
    np.testing.assert_array_equal(rows, client.lookup("t", KEYS, create=False))


def test_two_modules_on_their_own_tables_train_as_torch(cluster: Cluster) -> None:
    """Two modules, a table each, in one loss: each holds its own push for its own next
    forward; both tables end as torch's."""
    client, _ = cluster
    starts = {}
    for table, seed in (("t", 3), ("u", 4)):
        client.create_table(TableConfig(table, DIM, optimizer=optim.SGD(lr=0.1)))
        starts[table] = (0.5 * np.random.default_rng(seed).standard_normal((12, DIM))).astype(
            np.float32
        )
        client.assign(table, KEYS, starts[table])
    first = tierps_torch.EmbeddingBag(client, "t", combiner="sum")
    second = tierps_torch.EmbeddingBag(client, "u", combiner="mean")
    weights = {t: torch.nn.Parameter(torch.from_numpy(s.copy())) for t, s in starts.items()}
    reference = torch.optim.SGD(list(weights.values()), lr=0.1)
    rng = np.random.default_rng(5)
    for step in range(STEPS):
        rows = rng.integers(0, 12, (4, 2))
        target = torch.from_numpy(rng.standard_normal((4, DIM)).astype(np.float32))
        ours = first(KEYS[rows]) * second(KEYS[rows[::-1]])
        theirs = torch.nn.functional.embedding_bag(
            torch.from_numpy(rows), weights["t"], mode="sum"
        ) * torch.nn.functional.embedding_bag(
            torch.from_numpy(rows[::-1].copy()), weights["u"], mode="mean"
        )
        np.testing.assert_allclose(
            ours.detach().numpy(),
            theirs.detach().numpy(),
            rtol=0,
            atol=ATOL,
            err_msg=f"step {step}",
        )
        ((ours - target) ** 2).sum().backward()
        ((theirs - target) ** 2).sum().backward()
        reference.step()
        reference.zero_grad()
    for table, weight in weights.items():
        np.testing.assert_allclose(
            client.lookup(table, KEYS, create=False), weight.detach().numpy(), rtol=0, atol=ATOL
        )


def test_eval_and_no_grad_between_steps_see_the_held_push(cluster: Cluster) -> None:
    """An evaluation forward after a training step (eval mode, or no_grad) sees that step's
    push, creates no rows and pushes nothing; training goes on as torch's."""
    client, _ = cluster
    start = new_table(client, ADAM, seed=6)
    steps = make_steps(seed=7)
    module = tierps_torch.EmbeddingBagCollection(client, FEATURES)
    _, history = torch_schedule(start, steps, torch_adam, stale=False)
    unseen = {f.name: np.array([[int(KEYS[-1]) + 1, int(KEYS[-1]) + 2]]) for f in FEATURES}
    for t, (batch, (_, targets)) in enumerate(zip(batches_of(steps), steps, strict=True)):
        loss_of(module(batch), targets).backward()  # held
        evaluated = batches_of(steps)[0]
        if t % 2:
            module.eval()
            out = module(evaluated)
            module(unseen)
            module.train()
        else:
            with torch.no_grad():
                out = module(evaluated)
                module(unseen)
        assert out["a"].grad_fn is None
        after = torch.nn.functional.embedding_bag(
            torch.from_numpy(steps[0][0]["a"]), torch.from_numpy(history[t + 1]), mode="sum"
        )
        np.testing.assert_allclose(
            out["a"].numpy(), after.numpy(), rtol=0, atol=ATOL, err_msg=f"after step {t}"
        )
    module.flush()
    np.testing.assert_allclose(
        client.lookup("t", KEYS, create=False), history[-1], rtol=0, atol=ATOL
    )
    assert sum(shard["created"] for shard in client.describe("t")) == 0  # none for `unseen`


def test_an_exception_in_a_step_leaves_the_other_steps_as_torch(cluster: Cluster) -> None:
    """A step that fails after its forward (no backward) pushes nothing; one that fails
    after its backward (the dense optimizer, say) keeps its push, which the next forward
    sends. The other steps train as torch's over the steps that reached backward."""
    client, _ = cluster
    start = new_table(client, ADAM, seed=8)
    steps = make_steps(seed=9)
    module = tierps_torch.EmbeddingBagCollection(client, FEATURES)
    outputs = []
    for t, (batch, (_, targets)) in enumerate(zip(batches_of(steps), steps, strict=True)):
        try:
            out = module(batch)
            outputs.append({name: v.detach().numpy().copy() for name, v in out.items()})
            if t == 1:
                raise RuntimeError("the model failed before backward")
            loss_of(out, targets).backward()
            if t == 3:
                raise RuntimeError("the dense optimizer failed after backward")
        except RuntimeError:
            continue
    kept = [step for t, step in enumerate(steps) if t != 1]
    want, history = torch_schedule(start, kept, torch_adam, stale=False)
    for t, (have, expected) in enumerate(zip(outputs[:1] + outputs[2:], want, strict=True)):
        for name in expected:
            np.testing.assert_allclose(
                have[name], expected[name], rtol=0, atol=ATOL, err_msg=f"step {t} {name}"
            )
    np.testing.assert_allclose(
        client.lookup("t", KEYS, create=False), history[-1], rtol=0, atol=ATOL
    )


def test_a_failed_push_is_raised_once_by_the_next_call_naming_its_backward_and_tables(
    cluster: Cluster,
) -> None:
    client, _ = cluster
    new_table(client, optim.SGD(lr=0.5), seed=10)
    module = tierps_torch.EmbeddingBagCollection(client, FEATURES)
    batch = batches_of(make_steps(seed=11))[0]
    sum(value.sum() for value in module(batch).values()).backward()
    out = module(batch)  # sends the first push with its lookup
    with EmbeddingClient(client.addresses) as other:
        other.drop_table("t")  # the second push finds no table on the shards
    sum(value.sum() for value in out.values()).backward()  # held: returns

    with pytest.raises(ShardError, match="NOT_FOUND") as raised:
        module(batch)
    notes = " ".join(raised.value.__notes__)
    assert "backward 2 of this module (tables ['t'])" in notes and "not applied" in notes
    module.flush()  # raised once
    module.close()


def test_a_push_no_forward_follows_is_applied_by_flush_close_or_the_client(
    cluster: Cluster,
) -> None:
    """After the last backward: flush(), close(), or the client's own call on the table
    sends the held push and waits for it; a call on another table does not need to."""
    client, servers = cluster
    rows = np.arange(8).reshape(4, 2) % 5
    for finish in ("flush", "close", "lookup"):
        client.create_table(TableConfig(finish, DIM, optimizer=optim.SGD(lr=0.5)))
        start = client.lookup(finish, KEYS[:5])
        module = tierps_torch.EmbeddingBag(client, finish)
        module(KEYS[rows]).sum().backward()  # held
        pushes = sum(served(servers, "PushGradients"))
        if finish != "lookup":
            getattr(module, finish)()
            assert sum(served(servers, "PushGradients")) > pushes
        counts = np.bincount(rows.ravel(), minlength=5).astype(np.float32)
        np.testing.assert_array_equal(
            client.lookup(finish, KEYS[:5], create=False),
            start - np.float32(0.5) * counts[:, None],
            err_msg=finish,
        )


def test_modules_sharing_a_table_see_each_others_pushes(cluster: Cluster) -> None:
    """Two modules over one table in the plain loop: each one's lookup is sent after the
    other's held push, as when backward applied it."""
    client, _ = cluster
    client.create_table(TableConfig("t", DIM, optimizer=optim.SGD(lr=0.5)))
    start = client.lookup("t", KEYS[:3])
    first, second = tierps_torch.EmbeddingBag(client, "t"), tierps_torch.EmbeddingBag(client, "t")
    keys = KEYS[[[0, 1], [1, 2]]]
    first(keys).sum().backward()  # held by first: keys 0 and 2 once, key 1 twice
    seen = second(keys).detach().numpy()
    after = start - np.float32(0.5) * np.array([1, 2, 1], np.float32)[:, None]
    np.testing.assert_array_equal(seen, after[[0, 1]] + after[[1, 2]])


AT_EXIT = """
import sys
import numpy as np
from tierps.client import EmbeddingClient
from tierps.client.torch import EmbeddingBag

client = EmbeddingClient([sys.argv[1]], timeout_s=20.0)
module = EmbeddingBag(client, "t")
module(np.arange(8).reshape(4, 2) % 5).sum().backward()  # held for the next forward
assert module.bags._held is not None
sys.exit(0)  # the module unclosed
"""


@pytest.mark.slow  # a subprocess
def test_a_push_no_forward_follows_is_applied_at_interpreter_exit(
    shard_server: Callable[..., ShardServer],
) -> None:
    server = shard_server()
    with EmbeddingClient([server.address], timeout_s=20.0) as client:
        client.create_table(TableConfig("t", DIM, optimizer=optim.SGD(lr=0.5)))
        keys = np.arange(5, dtype=np.int64)
        start = client.lookup("t", keys)
        done = subprocess.run(
            [sys.executable, "-c", AT_EXIT, server.address],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        counts = np.bincount(np.arange(8) % 5, minlength=5).astype(np.float32)
        np.testing.assert_array_equal(
            client.lookup("t", keys, create=False), start - np.float32(0.5) * counts[:, None]
        )
