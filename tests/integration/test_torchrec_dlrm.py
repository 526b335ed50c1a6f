"""tierps' EmbeddingBagCollection in TorchRec's own models, against TorchRec itself: made
from TorchRec's EmbeddingBagConfigs, described back as them, and TorchRec's DLRM trained
with it in place of TorchRec's module equals TorchRec's unsharded DLRM, step by step, on
two real in-process shards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tierps.client import EmbeddingClient, Feature, TableConfig, init, optim
from tierps.client.torch import HASHED_NUM_EMBEDDINGS, EmbeddingBagCollection
from tierps.server.daemon import ShardServer

torchrec = pytest.importorskip("torchrec", reason="TorchRec's models are the reference here")
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor  # noqa: E402

LR = 0.1
DIM = 4
BATCH = 6
FEATURES = ["user", "item", "genre"]


def _configs() -> list[EmbeddingBagConfig]:
    """Two tables, one shared by two features (summed), one averaged."""
    return [
        EmbeddingBagConfig(
            num_embeddings=20,
            embedding_dim=DIM,
            name="users_items",
            feature_names=["user", "item"],
            pooling=PoolingType.SUM,
        ),
        EmbeddingBagConfig(
            num_embeddings=7,
            embedding_dim=DIM,
            name="genres",
            feature_names=["genre"],
            pooling=PoolingType.MEAN,
        ),
    ]


def _batch(rng: np.random.Generator) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """Dense features, a KJT (bags of 0 to 3 ids, repeats and empty bags included) and
    labels."""
    sizes = {"user": 20, "item": 20, "genre": 7}
    lengths = rng.integers(0, 4, size=(len(FEATURES), BATCH))
    values = np.concatenate(
        [rng.integers(0, sizes[f], size=int(lengths[i].sum())) for i, f in enumerate(FEATURES)]
    )
    kjt = KeyedJaggedTensor(
        keys=FEATURES,
        values=torch.tensor(values, dtype=torch.long),
        lengths=torch.tensor(lengths.reshape(-1), dtype=torch.long),
    )
    dense = torch.tensor(rng.standard_normal((BATCH, 3)), dtype=torch.float32)
    labels = torch.tensor(rng.integers(0, 2, BATCH), dtype=torch.float32)
    return dense, kjt, labels


def _dlrm(ebc: Any) -> DLRM:
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=3,
        dense_arch_layer_sizes=[5, DIM],
        over_arch_layer_sizes=[6, 1],
    )


def test_dlrm_with_tierps_module_trains_as_torchrec_dlrm(
    shard_server: Callable[..., ShardServer],
) -> None:
    servers = [shard_server(i, 2) for i in range(2)]
    torch.manual_seed(3)
    reference = _dlrm(torchrec.EmbeddingBagCollection(tables=_configs()))
    weights = {
        name: bag.weight
        for name, bag in reference.sparse_arch.embedding_bag_collection.embedding_bags.items()
    }
    with EmbeddingClient([f"127.0.0.1:{s.port}" for s in servers]) as client:
        # the one-line swap: tierps' module from the same configs, its rows TorchRec's
        ebc = EmbeddingBagCollection.from_torchrec(
            client, _configs(), optimizer=optim.SGD(lr=LR), initial=weights
        )
        model = _dlrm(ebc)
        missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
        assert missing == []  # every dense parameter is TorchRec's
        assert sorted(unexpected) == sorted(
            f"sparse_arch.embedding_bag_collection.embedding_bags.{name}.weight" for name in weights
        )
        pooled: dict[str, KeyedTensor] = {}
        reference.sparse_arch.embedding_bag_collection.register_forward_hook(
            lambda _m, _i, out: pooled.__setitem__("torchrec", out)
        )
        ebc.register_forward_hook(lambda _m, _i, out: pooled.__setitem__("tierps", out))

        ours = torch.optim.SGD(model.parameters(), lr=LR)
        theirs = torch.optim.SGD(reference.parameters(), lr=LR)
        rng = np.random.default_rng(11)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        for step in range(3):
            dense, kjt, labels = _batch(rng)
            for net, opt in ((model, ours), (reference, theirs)):
                opt.zero_grad()
                loss_fn(net(dense, kjt).squeeze(-1), labels).backward()
                opt.step()
            got, want = pooled["tierps"], pooled["torchrec"]
            assert isinstance(got, KeyedTensor) and got.keys() == want.keys() == FEATURES
            torch.testing.assert_close(
                got.values(), want.values(), rtol=0, atol=1e-5, msg=f"pooled, step {step}"
            )
            dense_params = dict(reference.named_parameters())
            for name, param in model.named_parameters():
                torch.testing.assert_close(
                    param, dense_params[name], rtol=0, atol=1e-5, msg=f"{name}, step {step}"
                )
            for name, weight in weights.items():
                rows = client.lookup(name, np.arange(weight.shape[0]), create=False)
                np.testing.assert_allclose(
                    rows,
                    weight.detach().numpy(),
                    rtol=0,
                    atol=1e-5,
                    err_msg=f"table {name}, step {step}",
                )
        assert [p for p, _ in model.named_parameters() if "sparse_arch" in p] == []


def test_configs_make_tables_and_the_tables_describe_themselves_as_configs(
    shard_server: Callable[..., ShardServer],
) -> None:
    server = shard_server()
    with EmbeddingClient([f"127.0.0.1:{server.port}"]) as client:
        ebc = EmbeddingBagCollection.from_torchrec(
            client, _configs(), optimizer=optim.Adagrad(lr=0.05), initializer=init.Zeros()
        )
        assert [(f.name, f.table, str(f.combiner)) for f in ebc.features] == [
            ("user", "users_items", "sum"),
            ("item", "users_items", "sum"),
            ("genre", "genres", "mean"),
        ]
        made = client.table_config("genres")
        assert (made.dim, made.optimizer, made.initializer) == (
            DIM,
            optim.Adagrad(lr=0.05),
            init.Zeros(),
        )
        # no initializer given: TorchRec's default range for the table's num_embeddings
        default = EmbeddingBagConfig(num_embeddings=16, embedding_dim=2, name="plain")
        EmbeddingBagCollection.from_torchrec(client, [default], optimizer=optim.SGD(lr=1.0))
        assert client.table_config("plain").initializer == init.Uniform(-0.25, 0.25)

        configs = ebc.embedding_bag_configs()
        assert [(c.name, c.embedding_dim, c.feature_names, c.pooling) for c in configs] == [
            ("users_items", DIM, ["user", "item"], PoolingType.SUM),
            ("genres", DIM, ["genre"], PoolingType.MEAN),
        ]
        assert {c.num_embeddings for c in configs} == {HASHED_NUM_EMBEDDINGS}

        # a table addressed by key has num_embeddings rows; sqrtn has no TorchRec pooling
        client.create_table(TableConfig("ids", 3, use_hashtable=False, capacity=50))
        client.create_table(TableConfig("words", 3))
        by_key = EmbeddingBagCollection(client, [Feature("id", "ids", "mean")])
        assert [(c.num_embeddings, c.pooling) for c in by_key.embedding_bag_configs()] == [
            (50, PoolingType.MEAN)
        ]
        sqrtn = EmbeddingBagCollection(client, [Feature("word", "words", "sqrtn")])
        with pytest.raises(ValueError, match=r"table 'words'.*'word': 'sqrtn'"):
            sqrtn.embedding_bag_configs()


def test_configs_tierps_cannot_train_are_refused_before_any_table_is_made(
    shard_server: Callable[..., ShardServer],
) -> None:
    server = shard_server()
    sgd = optim.SGD(lr=0.1)
    good = EmbeddingBagConfig(num_embeddings=4, embedding_dim=2, name="good")
    with EmbeddingClient([f"127.0.0.1:{server.port}"]) as client:
        unpooled = EmbeddingBagConfig(
            num_embeddings=4, embedding_dim=2, name="bad", pooling=PoolingType.NONE
        )
        with pytest.raises(ValueError, match=r"table 'bad': pooling expected .* got .*NONE"):
            EmbeddingBagCollection.from_torchrec(client, [good, unpooled], optimizer=sgd)
        half = EmbeddingBagConfig(
            num_embeddings=4, embedding_dim=2, name="bad", data_type=torchrec.DataType.FP16
        )
        with pytest.raises(ValueError, match=r"table 'bad': data_type expected .*FP32.*FP16"):
            EmbeddingBagCollection.from_torchrec(client, [good, half], optimizer=sgd)
        twice = EmbeddingBagConfig(
            num_embeddings=4, embedding_dim=2, name="other", feature_names=["good"]
        )
        with pytest.raises(ValueError, match=r"feature 'good' expected in one table"):
            EmbeddingBagCollection.from_torchrec(client, [good, twice], optimizer=sgd)
        with pytest.raises(ValueError, match=r"initial expected rows of the tables \['good'\]"):
            EmbeddingBagCollection.from_torchrec(
                client, [good], optimizer=sgd, initial={"goods": np.zeros((4, 2))}
            )
        assert client.list_tables() == []


def test_features_whose_tables_interleave_come_out_in_torchrecs_order(
    shard_server: Callable[..., ShardServer],
) -> None:
    """TorchRec's module outputs its tables' features table by table: tierps' module, given
    features whose tables interleave, gives the KeyedTensor keys and values in that order,
    the order of its embedding_bag_configs()."""
    server = shard_server()
    with EmbeddingClient([f"127.0.0.1:{server.port}"]) as client:
        for name in ("a", "c"):
            client.create_table(TableConfig(name, DIM, initializer=init.Normal(0, 0.1)))
        features = [Feature("x", "a"), Feature("y", "c"), Feature("z", "a")]
        ebc = EmbeddingBagCollection(client, features)
        configs = [  # the same tables, with rows TorchRec can allocate
            EmbeddingBagConfig(
                num_embeddings=10,
                embedding_dim=c.embedding_dim,
                name=c.name,
                feature_names=c.feature_names,
                pooling=c.pooling,
            )
            for c in ebc.embedding_bag_configs()
        ]
        reference = torchrec.EmbeddingBagCollection(tables=configs)
        kjt = KeyedJaggedTensor(
            keys=["x", "y", "z"],
            values=torch.tensor([1, 2, 3, 4, 5, 6]),
            lengths=torch.tensor([1, 1, 1, 1, 1, 1]),
        )
        with torch.no_grad():
            ours, theirs = ebc(kjt), reference(kjt)
        assert isinstance(ours, KeyedTensor)
        assert ours.keys() == theirs.keys() == ["x", "z", "y"]
        rows = client.lookup("a", np.array([1, 2, 5, 6]), create=False)
        np.testing.assert_allclose(ours["z"].numpy(), rows[2:], atol=0)  # z: keys 5, 6
        assert ours.values().shape == theirs.values().shape == (2, 3 * DIM)
