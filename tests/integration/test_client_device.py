"""The client and the torch modules pooling on a torch device, through a real 2-shard cluster
(in-process servers, port 0): on CPU tensors in every run (device="cpu", the same code a GPU
runs), and on CUDA tensors where a GPU is usable (skipped otherwise).

References: the host path of the same client (numpy batches, the scipy kernels) run on twin
tables given the same initial rows and gradients, and torch.nn.EmbeddingBag + torch.optim.
A device call must give the host call's outputs and leave the tables as the host call's
pushes leave them; a torch module on the device pushes once per backward.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierps.client import COO, EmbeddingClient, Feature, TableConfig, optim
from tierps.core.errors import InvalidArgumentError
from tierps.server.config import ServerConfig
from tierps.server.daemon import create_server

torch = pytest.importorskip("torch")
tierps_torch = pytest.importorskip("tierps.client.torch")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available())")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
ATOL = 1e-6
V = 60  # keys 0..V-1 (spread over both shards)
_names = itertools.count()


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddingClient]:
    root: Path = tmp_path_factory.mktemp("device-cluster")
    servers, addresses = [], []
    for shard in range(2):
        server, port = create_server(ServerConfig(shard, 2, root / f"s{shard}", grace_s=0.5))
        server.start()
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    try:
        with EmbeddingClient(addresses, timeout_s=30.0) as opened:
            yield opened
    finally:
        for server in servers:
            server.stop()


def twin_tables(client: EmbeddingClient, dims: dict[str, int], seed: int) -> dict[str, str]:
    """For each table: a host twin and a device twin, Adagrad, the same initial rows.
    Returns table -> a fresh name prefix; the twins are prefix + '-host' / '-device'."""
    rng = np.random.default_rng(seed)
    prefixes: dict[str, str] = {}
    for table, dim in dims.items():
        prefix = f"{table}-{next(_names)}"
        start = rng.standard_normal((V, dim)).astype(np.float32)
        for side in ("host", "device"):
            name = f"{prefix}-{side}"
            client.create_table(TableConfig(name, dim, optimizer=optim.Adagrad(lr=0.1)))
            client.assign(name, np.arange(V), start)
        prefixes[table] = prefix
    return prefixes


def batch_pair(rng: np.random.Generator, device: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One step's batch of features a, b, c: (host numpy form, device tensor form)."""
    lengths = rng.integers(0, 6, 12)
    lengths[3] = 0
    keys = rng.integers(-1, V, int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    weights = rng.uniform(0.5, 1.5, keys.size).astype(np.float32)
    dense = rng.integers(-1, V, (4, 3, 5))
    rows, values = rng.integers(0, 9, 20), rng.integers(-1, V, 20)

    def to(array: np.ndarray) -> Any:
        return torch.from_numpy(array).to(device)

    host = {"a": (keys, offsets, weights), "b": dense, "c": COO(rows, values, (9, 4))}
    on_device = {
        "a": (to(keys), to(offsets), to(weights)),
        "b": to(dense),
        "c": COO(to(rows), to(values), (9, 4)),
    }
    return host, on_device


@pytest.mark.parametrize("device", DEVICES)
def test_a_device_call_pools_and_trains_as_the_host_call(
    client: EmbeddingClient, device: str
) -> None:
    """Three features over two tables of two dims; every step the same batch and gradients
    go to the host path (numpy) and to the device path (tensors on `device`, pooled there:
    device="cpu" on CPU tensors, inferred from CUDA tensors). The second step pushes the
    gradients of 'b' and 'c' only."""
    prefixes = twin_tables(client, {"t1": 4, "t2": 8}, seed=1)

    def features(side: str) -> list[Feature]:
        return [
            Feature("a", f"{prefixes['t1']}-{side}", "mean"),
            Feature("b", f"{prefixes['t2']}-{side}", "sqrtn"),
            Feature("c", f"{prefixes['t1']}-{side}", "sum"),
        ]

    rng = np.random.default_rng(2)
    for step in range(3):
        host_batch, device_batch = batch_pair(rng, device)
        host = client.lookup_pooled_features(host_batch, features("host"))
        pinned = "cpu" if device == "cpu" else None  # CUDA tensors need no device=
        pooled = client.lookup_pooled_features(device_batch, features("device"), device=pinned)
        assert host.device is None
        assert pooled.device == (
            "cpu" if device == "cpu" else f"cuda:{torch.cuda.current_device()}"
        )
        for name, want in host.outputs.items():
            got = pooled.outputs[name]
            assert isinstance(got, torch.Tensor) and got.device.type == device
            np.testing.assert_allclose(got.cpu().numpy(), want, atol=ATOL, err_msg=f"{step} {name}")
        names = ["b", "c"] if step == 1 else ["a", "b", "c"]
        grads = {n: rng.standard_normal(host.outputs[n].shape).astype(np.float32) for n in names}
        updated = host.push_gradients(grads)
        assert (
            pooled.push_gradients({n: torch.from_numpy(g).to(device) for n, g in grads.items()})
            == updated
        )

    for prefix in prefixes.values():
        want = client.lookup(f"{prefix}-host", np.arange(V), create=False)
        got = client.lookup(f"{prefix}-device", np.arange(V), create=False)
        np.testing.assert_allclose(got, want, atol=ATOL, err_msg=prefix)


def test_lookup_pooled_on_a_device_names_the_table(client: EmbeddingClient) -> None:
    prefix = twin_tables(client, {"t": 4}, seed=3)["t"]
    keys, offsets = np.array([3, 5, -1, 3, 7]), np.array([0, 2, 2])
    weights = np.array([1.0, 0.5, 2.0, 1.5, 1.0], np.float32)
    host = client.lookup_pooled(
        f"{prefix}-host", keys, offsets, combiner="mean", per_sample_weights=weights
    )
    pooled = client.lookup_pooled(
        f"{prefix}-device",
        torch.from_numpy(keys),
        torch.from_numpy(offsets),
        combiner="mean",
        per_sample_weights=torch.from_numpy(weights),
        device="cpu",
    )
    np.testing.assert_allclose(pooled.output.numpy(), host.output, atol=ATOL)
    with pytest.raises(
        InvalidArgumentError, match=r"^table '.*-device': offsets must not decrease"
    ):
        client.lookup_pooled(
            f"{prefix}-device", torch.from_numpy(keys), torch.tensor([0, 3, 2]), device="cpu"
        )
    dense = client.lookup_pooled(f"{prefix}-device", torch.tensor([[3, 5], [-1, -1]]), device="cpu")
    want = client.lookup(f"{prefix}-device", np.array([3, 5]), create=False).sum(axis=0)
    np.testing.assert_allclose(dense.output.numpy(), np.stack([want, np.zeros(4)]), atol=ATOL)


def test_mixed_devices_are_refused_before_anything_is_sent(client: EmbeddingClient) -> None:
    prefix = twin_tables(client, {"t": 4}, seed=4)["t"]
    name = f"{prefix}-device"
    features = [Feature("a", name), Feature("b", name)]
    before = sum(shard["created"] for shard in client.describe(name))
    meta = torch.tensor([1, 2], device="meta")
    with pytest.raises(InvalidArgumentError) as raised:
        client.lookup_pooled_features({"a": np.array([[100, 101]]), "b": meta}, features)
    message = str(raised.value)
    assert message.startswith("feature 'b': field 'keys' expected an array on cpu"), message
    assert "as feature 'a' field 'keys' is" in message and "got one on meta" in message
    with pytest.raises(InvalidArgumentError, match="feature 'a': field 'offsets' .* on cpu.* meta"):
        client.lookup_pooled_features({"a": (np.array([5]), meta), "b": np.array([[6]])}, features)
    with pytest.raises(InvalidArgumentError, match="feature 'a': field 'offsets' .* on cpu.* meta"):
        client.lookup_pooled_features(
            {"a": (torch.tensor([100, 101]), meta), "b": torch.tensor([[102]])},
            features,
            device="cpu",
        )
    assert sum(shard["created"] for shard in client.describe(name)) == before

    pooled = client.lookup_pooled_features(
        {"a": torch.tensor([[1, 2]]), "b": torch.tensor([[3]])}, features, device="cpu"
    )
    with pytest.raises(InvalidArgumentError, match="feature 'a': field 'grad_output' .* meta"):
        pooled.push_gradients({"a": torch.zeros(1, 4, device="meta")})
    with pytest.raises(InvalidArgumentError, match="feature 'b': field 'grad_output' .* finite"):
        pooled.push_gradients({"a": torch.zeros(1, 4), "b": torch.full((1, 4), float("nan"))})
    rows = client.lookup(name, np.array([1, 2, 3]), create=False)
    pooled.push_gradients(
        {"a": torch.zeros(1, 4)}
    )  # zero gradient: Adagrad leaves rows as they are
    np.testing.assert_array_equal(client.lookup(name, np.array([1, 2, 3]), create=False), rows)


# -- the torch modules ---------------------------------------------------------------------------


def count_pushes(client: EmbeddingClient, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one per push the client sends (its push_unique, still run)."""
    pushes: list[int] = []
    push = client.push_unique

    def counted(*args: Any, **kwargs: Any) -> int:
        pushes.append(1)
        return push(*args, **kwargs)

    monkeypatch.setattr(client, "push_unique", counted)
    return pushes


@pytest.mark.parametrize("device", DEVICES)
def test_module_on_a_device_matches_torch_embedding_bag_and_pushes_once_per_step(
    client: EmbeddingClient, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EmbeddingBagCollection with two features of one table (mean and weighted sum) against
    torch's functional embedding_bag over one weight trained by torch.optim.SGD: inputs on
    the device give outputs there, and each backward pushes once."""
    name = f"module-{next(_names)}"
    client.create_table(TableConfig(name, 4, optimizer=optim.SGD(lr=0.5)))
    rng = np.random.default_rng(6)
    start = rng.standard_normal((V, 4)).astype(np.float32)
    client.assign(name, np.arange(V), start)
    weight = torch.nn.Parameter(
        torch.from_numpy(np.vstack([start, np.zeros((1, 4), np.float32)])).to(device)
    )
    theirs = torch.optim.SGD([weight], lr=0.5)
    pinned = "cpu" if device == "cpu" else None
    ours = tierps_torch.EmbeddingBagCollection(
        client, [Feature("m", name, "mean"), Feature("w", name, "sum")], device=pinned
    )
    pushes = count_pushes(client, monkeypatch)
    for step in range(3):
        keys = rng.integers(-1, V, (8, 4))
        keys[2] = -1
        rows = torch.from_numpy(np.where(keys < 0, V, keys)).to(device)  # torch pads with row V
        values = rng.integers(0, V, 15)
        offsets = np.array([0, 4, 4, 9, 12])
        weights = rng.uniform(0.5, 1.5, 15).astype(np.float32)
        batch = {
            "m": torch.from_numpy(keys).to(device),
            "w": tuple(torch.from_numpy(a).to(device) for a in (values, offsets, weights)),
        }
        got = ours(batch)
        want = {
            "m": torch.nn.functional.embedding_bag(rows, weight, mode="mean", padding_idx=V),
            "w": torch.nn.functional.embedding_bag(
                batch["w"][0], weight, batch["w"][1], mode="sum", per_sample_weights=batch["w"][2]
            ),
        }
        for feature in ("m", "w"):
            assert got[feature].device == want[feature].device and got[feature].requires_grad
            np.testing.assert_allclose(
                got[feature].detach().cpu().numpy(),
                want[feature].detach().cpu().numpy(),
                atol=1e-5,
                err_msg=f"step {step} {feature}",
            )
        grad = {
            f: torch.from_numpy(rng.standard_normal((o.shape[0], 4), np.float32)).to(device)
            for f, o in got.items()
        }
        sum((got[f] * grad[f]).sum() for f in got).backward()
        assert len(pushes) == step + 1  # one push for both features
        theirs.zero_grad()
        sum((want[f] * grad[f]).sum() for f in want).backward()
        theirs.step()
    final = client.lookup(name, np.arange(V), create=False)
    np.testing.assert_allclose(final, weight.detach().cpu().numpy()[:V], atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_module_on_a_device_in_eval_and_no_grad_creates_and_pushes_nothing(
    client: EmbeddingClient, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"eval-{next(_names)}"
    client.create_table(TableConfig(name, 4, optimizer=optim.SGD(lr=1.0)))
    pinned = "cpu" if device == "cpu" else None
    module = tierps_torch.EmbeddingBag(client, name, combiner="sum", device=pinned)
    pushes = count_pushes(client, monkeypatch)
    keys = torch.arange(6).reshape(3, 2).to(device)
    with torch.no_grad():
        out = module(keys, per_sample_weights=torch.ones(3, 2, device=device))
    assert out.device.type == device and out.grad_fn is None
    module.eval()
    assert not module(keys).requires_grad
    assert sum(shard["created"] for shard in client.describe(name)) == 0 and not pushes


def test_module_prefetch_on_a_device_serves_the_forward(client: EmbeddingClient) -> None:
    name = f"prefetch-{next(_names)}"
    client.create_table(TableConfig(name, 4, optimizer=optim.SGD(lr=1.0)))
    module = tierps_torch.EmbeddingBagCollection(client, [Feature("f", name)], device="cpu")
    batch = {"f": torch.tensor([[1, 2], [3, -1]])}
    module.prefetch(batch)
    out = module(batch)["f"]
    want = client.lookup(name, np.array([[1, 2], [3, 3]]), create=False)
    want[1, 1] = 0.0
    np.testing.assert_allclose(out.detach().numpy(), want.sum(axis=1), atol=ATOL)
    out.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_module_outputs_on_a_device_take_in_place_ops(client: EmbeddingClient, device: str) -> None:
    """As the host path's and torch's outputs: out.relu_() or out += b before backward."""
    name = f"inplace-{next(_names)}"
    client.create_table(TableConfig(name, 4, optimizer=optim.SGD(lr=1.0)))
    pinned = "cpu" if device == "cpu" else None
    module = tierps_torch.EmbeddingBagCollection(
        client, [Feature("f", name), Feature("g", name)], device=pinned
    )
    keys = torch.tensor([[1, 2], [3, -1]]).to(device)
    before = client.lookup(name, np.arange(1, 4), create=False)
    out = module({"f": keys, "g": keys})
    out["f"].relu_()
    out["g"] += 1.0
    (out["f"].sum() + out["g"].sum()).backward()
    after = client.lookup(name, np.arange(1, 4), create=False)
    assert not np.allclose(after, before)  # the push arrived
