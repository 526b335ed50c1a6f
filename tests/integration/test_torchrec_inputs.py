"""EmbeddingBagCollection with torchrec's conventions: torchrec's KeyedJaggedTensor in, its
KeyedTensor out, against torch.nn.functional.embedding_bag and a torch SGD step as the
oracle, on two real in-process shards; and the lighter KeyedPooled output where torchrec is
not installed."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tierps.client import EmbeddingClient, Feature, TableConfig, optim
from tierps.client import torch as tierps_torch
from tierps.client.torch import EmbeddingBagCollection, KeyedPooled
from tierps.server.daemon import ShardServer

pytest.importorskip("torchrec", reason="the batches are torchrec's KeyedJaggedTensors")
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor  # noqa: E402

DIMS = {"users": 4, "genres": 3}
ROWS = 10
LR = 0.5


def test_kjt_in_keyed_tensor_out_matches_torch(
    shard_server: Callable[..., ShardServer],
) -> None:
    servers = [shard_server(i, 2) for i in range(2)]
    rng = np.random.default_rng(7)
    initial = {t: rng.standard_normal((ROWS, d)).astype(np.float32) for t, d in DIMS.items()}
    # the user's bags (one id each), then the genres' (2, 0 and 3 ids): key-major, B = 3
    values = torch.tensor([7, 2, 7, 1, 4, 9, 1, 3])
    lengths = torch.tensor([1, 1, 1, 2, 0, 3])
    weights = torch.tensor([1.0, 0.5, 2.0, 0.25, 1.5, 1.0, -0.5, 2.0])
    kjt = KeyedJaggedTensor(["user", "genres"], values, weights, lengths=lengths)
    with EmbeddingClient([f"127.0.0.1:{s.port}" for s in servers]) as client:
        for table, dim in DIMS.items():
            client.create_table(TableConfig(table, dim, optimizer=optim.SGD(lr=LR)))
            client.assign(table, np.arange(ROWS), initial[table])
        ebc = EmbeddingBagCollection(
            client, [Feature("user", "users"), Feature("genres", "genres")]
        )
        out = ebc(kjt)
        assert isinstance(out, KeyedTensor)
        assert out.keys() == ["user", "genres"] and out.length_per_key() == [4, 3]
        assert out.offset_per_key() == [0, 4, 7] and out.key_dim() == 1

        # the oracle: torch's embedding_bag over the same rows, weighted sums
        params = {t: torch.tensor(w, requires_grad=True) for t, w in initial.items()}
        starts = {"user": 0, "genres": 3}
        want = {}
        for feature, table in (("user", "users"), ("genres", "genres")):
            begin = int(lengths[: starts[feature]].sum())
            count = lengths[starts[feature] : starts[feature] + 3]
            end = begin + int(count.sum())
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(count, 0)[:-1]])
            want[feature] = torch.nn.functional.embedding_bag(
                values[begin:end],
                params[table],
                offsets,
                mode="sum",
                per_sample_weights=weights[begin:end],
            )
        for feature, tensor in out.to_dict().items():
            torch.testing.assert_close(tensor, want[feature], rtol=0, atol=1e-6)
        torch.testing.assert_close(out.values(), torch.cat([want["user"], want["genres"]], 1))
        torch.testing.assert_close(out["genres"], want["genres"])

        # backward through values(): the shards take one SGD step; torch's is the oracle
        grad = torch.tensor(rng.standard_normal((3, 7)).astype(np.float32))
        (out.values() * grad).sum().backward()
        (torch.cat([want["user"], want["genres"]], 1) * grad).sum().backward()
        for table, param in params.items():
            expected = (param - LR * param.grad).detach().numpy()
            got = client.lookup(table, np.arange(ROWS), create=False)
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5, err_msg=table)

        # KeyedTensor's own methods: a key in two groups, a move, the size
        with torch.no_grad():
            kept = ebc(kjt)
        groups = KeyedTensor.regroup([kept], [["user", "genres"], ["genres"]])
        torch.testing.assert_close(groups[1], kept["genres"], rtol=0, atol=0)
        torch.testing.assert_close(groups[0], kept.values(), rtol=0, atol=0)
        assert kept.to(torch.device("cpu")).device() == kept.device() == torch.device("cpu")
        assert kept.size_in_bytes() == kept.values().numel() * 4

        # made from offsets instead of lengths: the same bags; no grad: nothing pushed
        again = KeyedJaggedTensor(["user", "genres"], values, weights, offsets=kjt.offsets())
        with torch.no_grad():
            first, second = ebc(kjt), ebc(again)
        torch.testing.assert_close(first.values(), second.values(), rtol=0, atol=0)


def test_a_kjt_with_a_key_not_a_feature_or_the_wrong_offsets_is_refused(
    shard_server: Callable[..., ShardServer],
) -> None:
    server = shard_server()
    with EmbeddingClient([f"127.0.0.1:{server.port}"]) as client:
        client.create_table(TableConfig("users", 4))
        ebc = EmbeddingBagCollection(client, [Feature("user", "users")])
        stray = KeyedJaggedTensor(["items"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
        with pytest.raises(ValueError, match="items"), torch.no_grad():
            ebc(stray)
        with pytest.raises(TypeError, match="KeyedJaggedTensor"):
            ebc([torch.tensor([1])])


def test_without_torchrec_a_kjt_gives_a_keyed_pooled(
    shard_server: Callable[..., ShardServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrec made unimportable (None for its modules in sys.modules: importing them then
    raises ModuleNotFoundError, as where it is not installed): the output is a KeyedPooled, and
    asking for TorchRec's configs says torchrec is missing."""
    server = shard_server()
    kjt = KeyedJaggedTensor(["user"], torch.tensor([3, 1, 2]), lengths=torch.tensor([2, 1]))
    with EmbeddingClient([f"127.0.0.1:{server.port}"]) as client:
        client.create_table(TableConfig("users", 4))
        ebc = EmbeddingBagCollection(client, [Feature("user", "users", "mean")])
        with torch.no_grad():
            want = ebc(kjt)
        for name in [name for name in sys.modules if name.split(".")[0] == "torchrec"]:
            monkeypatch.setitem(sys.modules, name, None)
        tierps_torch._torchrec.cache_clear()
        try:
            with torch.no_grad():
                out = ebc(kjt)
            with pytest.raises(ImportError, match="expected torchrec to be installed"):
                ebc.embedding_bag_configs()
        finally:
            monkeypatch.undo()
            tierps_torch._torchrec.cache_clear()
        assert isinstance(out, KeyedPooled) and out.keys() == ["user"]
        assert out.length_per_key() == [4] and out.offset_per_key() == [0, 4]
        torch.testing.assert_close(out.values(), want.values(), rtol=0, atol=0)
        torch.testing.assert_close(out["user"], want["user"], rtol=0, atol=0)


@pytest.mark.slow  # a subprocess
def test_importing_the_client_does_not_import_torchrec() -> None:
    code = (
        "import sys, tierps.client, tierps.client.torch; "
        "assert 'torchrec' not in sys.modules, 'torchrec imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
