"""The DeepFM demo: tierps against local torch.nn.EmbeddingBag tables (same initial weights,
same data order, same optimizer), the `tierps demo` command end to end, and the MovieLens
loader against a direct reading of recbole's files.

MovieLens tests skip when recbole is not installed (`pip install --no-deps recbole==1.2.1`).
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tierps.client import EmbeddingClient  # noqa: E402
from tierps.client.distributed import CHECKPOINT_PREFIX  # noqa: E402
from tierps.demo import data, training  # noqa: E402
from tierps.demo import main as demo  # noqa: E402
from tierps.demo.deepfm import initial_weights  # noqa: E402
from tierps.server.cluster import LocalCluster  # noqa: E402

pytestmark = pytest.mark.slow  # the demo trains real models end to end: tens of seconds

DIM = 16
SEED = 0
PARITY_TRAIN_ROWS = 40_000  # half an epoch of MovieLens keeps the test well under a minute
AUC_TOLERANCE = 0.005
DEMO_TIMEOUT_S = 180

requires_recbole = pytest.mark.skipif(
    importlib.util.find_spec("recbole") is None,
    reason=f"MovieLens-100k is read from the recbole package: {data.RECBOLE_INSTALL}",
)


@pytest.fixture(scope="module")
def movielens() -> data.CTRDataset:
    return data.load_movielens(seed=SEED)


# -- (a) tierps vs local torch.nn.EmbeddingBag ----------------------------------------------------


@requires_recbole
def test_deepfm_through_tierps_matches_local_embedding_bags(
    movielens: data.CTRDataset, tmp_path: Path, one_torch_thread: None
) -> None:
    """One (partial) epoch of DeepFM, Adam on both sides (tierps optim.Adam on the shards,
    torch.optim.SparseAdam locally), from the same initial rows and dense weights, over the
    same batches: the same test AUC, and the same trained rows."""
    dataset = movielens.subset(train=PARITY_TRAIN_ROWS)
    weights = initial_weights(dataset.tables, DIM, SEED)
    local = training.build_local_model(dataset, dim=DIM, seed=SEED, weights=weights)
    (local_result,) = training.train(local, dataset, epochs=1, seed=SEED)
    with (
        LocalCluster(2, tmp_path / "cluster") as cluster,
        EmbeddingClient(cluster.addresses) as client,
    ):
        (table,) = training.create_tables(client, dataset, dim=DIM, seed=SEED)
        model = training.build_tierps_model(client, dataset, dim=DIM, seed=SEED, weights=weights)
        (tierps_result,) = training.train(model, dataset, epochs=1, seed=SEED)
        keys = dataset.tables[table].keys
        tierps_rows = client.lookup(table, keys, create=False)
    local_rows = local.embeddings.bags["table_" + table].weight.detach().numpy()

    assert local_result.test_auc > 0.70, f"the local model did not learn: {local_result}"
    assert abs(tierps_result.test_auc - local_result.test_auc) <= AUC_TOLERANCE, (
        f"test AUC through tierps {tierps_result.test_auc:.5f}, with local EmbeddingBag "
        f"{local_result.test_auc:.5f}: expected within {AUC_TOLERANCE}"
    )
    assert abs(tierps_result.test_logloss - local_result.test_logloss) <= 0.005
    # Adam amplifies float rounding where gradients are near zero: compare as a whole.
    assert _relative_difference(tierps_rows, local_rows) < 1e-2
    # The dense layers see pooled rows that differ from torch's in the last float bit
    # (mean: each row times 1/n, then summed, against sum then / n), and Adam's per-weight
    # normalisation amplifies that where gradients are tiny: 0.3% to 5% by the end of the
    # epoch depending on the kernel. This bound only catches gross divergence; the AUC, the
    # logloss and the rows above carry the parity.
    for name, local_param in local.named_parameters():
        if not name.startswith("embeddings."):
            tierps_param = model.get_parameter(name).detach().numpy()
            difference = _relative_difference(tierps_param, local_param.detach().numpy())
            assert difference < 0.1, f"dense parameter {name}: relative difference {difference}"


def _relative_difference(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-12))


# -- (b) the command ------------------------------------------------------------------------------


def _tierps(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierps.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


@requires_recbole
def test_demo_command_on_movielens_learns(tmp_path: Path) -> None:
    """The README's main job, one epoch: MovieLens through 2 shards reaches the AUC a local
    torch DeepFM reaches after one epoch (~0.76), and saves a snapshot."""
    result = _tierps("demo", "--epochs", "1", "--data-dir", str(tmp_path / "data"), cwd=tmp_path)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    match = re.search(r"epoch 1: .* test logloss [0-9.]+ AUC ([0-9.]+)", result.stdout)
    assert match is not None, result.stdout
    assert float(match.group(1)) > 0.74, result.stdout
    assert "staleness 1;" in result.stdout, result.stdout  # the demo's default
    assert "snapshot 'deepfm-movielens-" in result.stdout, result.stdout


def test_demo_command_on_synthetic_data_runs_twice_in_one_data_dir(tmp_path: Path) -> None:
    """`tierps demo --dataset synthetic` with tiny sizes: exit 0, per-epoch AUC and tier hit
    rates printed, a snapshot saved; a second run over the first one's data dir works (that
    one one step stale: --staleness 1)."""
    args = (
        "demo",
        "--dataset",
        "synthetic",
        "--samples",
        "3000",
        "--epochs",
        "2",
        "--batch-size",
        "256",
        "--data-dir",
        str(tmp_path / "data"),
    )
    for run, staleness in ((1, "0"), (2, "1")):
        result = _tierps(*args, "--staleness", staleness, cwd=tmp_path)
        assert result.returncode == 0, f"run {run}:\n{result.stdout}\n{result.stderr}"
        out = result.stdout
        for epoch in (1, 2):
            assert f"epoch {epoch}: train logloss" in out, out
        assert out.count("test logloss") == 2 and "AUC" in out, out
        assert "samples/s" in out, out
        assert "hit rates: host" in out and "rocksdb held" in out, out
        assert "snapshot 'deepfm-synthetic-" in out, out
        assert f"staleness {staleness};" in out, out
    # --keep-snapshots 1 (the default): the second run deleted the first one's snapshot
    saved = re.search(r"snapshot '(deepfm-synthetic-[^']+)'", out)
    assert saved is not None and "deleted 1 older demo snapshot(s)" in out, out
    snapshots = sorted(p.name for p in (tmp_path / "data" / "snapshots").iterdir())
    assert snapshots == [saved.group(1)], snapshots


def test_demo_serves_from_a_replica_while_it_trains(tmp_path: Path) -> None:
    """`tierps demo --serve`: a replica shard follows the cluster; after each epoch the test
    AUC computed from the replica's rows is printed beside the cluster's. The trainer's last
    push may still be on its way, so the two may differ a little: by less than a tenth of
    what an epoch of training moves the AUC (from 0.5 to ~0.6 on this set)."""
    args = ("demo", "--dataset", "synthetic", "--samples", "3000", "--epochs", "2")
    result = _tierps(*args, "--serve", "--data-dir", str(tmp_path / "data"), cwd=tmp_path)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    out = result.stdout
    assert "replica serving at 127.0.0.1:" in out, out
    served = re.findall(
        r"replica: test AUC ([0-9.]+) from its rows \(([0-9.]+) from the cluster's\), "
        r"lag ([0-9.]+) s",
        out,
    )
    assert len(served) == 2, out
    for replica_auc, cluster_auc, lag_s in served:
        assert abs(float(replica_auc) - float(cluster_auc)) < 0.01, out
        assert float(lag_s) >= 0.0
    refused = _tierps("demo", "--serve", "--trainers", "2", cwd=tmp_path)
    assert refused.returncode == 2
    assert "--serve expected with one trainer" in refused.stderr


def test_demo_command_explains_bad_flags(tmp_path: Path) -> None:
    result = _tierps("demo", "--epochs", "0", cwd=tmp_path)
    assert result.returncode == 2
    assert "--epochs expected >= 1, got 0" in result.stderr
    result = _tierps("demo", "--staleness", "2", cwd=tmp_path)
    assert result.returncode == 2
    assert "--staleness expected 0 or 1 with one trainer, got 2" in result.stderr
    result = _tierps("demo", "--trainers", "2", "--mode", "async", "--staleness", "0", cwd=tmp_path)
    assert result.returncode == 2
    assert "--staleness expected >= 1 in async mode, got 0" in result.stderr


def test_demo_with_two_trainers_in_sync_mode_learns_as_one(tmp_path: Path) -> None:
    """`tierps demo --trainers N` under real torchrun: 2 sync trainers, each on half of every
    batch, reach the test AUC and logloss of 1 trainer on the whole batches, epoch by epoch
    (the same training up to float summation order), with a job checkpoint at the start and
    per epoch, of which --keep-snapshots 2 keeps the newest two (the first run's deleted by
    the second), and the newest restores."""
    data_dir = tmp_path / "data"
    args = (
        "demo",
        "--dataset",
        "synthetic",
        "--samples",
        "3000",
        "--epochs",
        "2",
        "--batch-size",
        "256",
        "--data-dir",
        str(data_dir),
        "--keep-snapshots",
        "2",
    )
    figures = {}
    for trainers, deleted in ((1, 1), (2, 3)):  # 3 checkpoints a job: its start, 2 epochs
        result = _tierps(*args, "--trainers", str(trainers), cwd=tmp_path)
        assert result.returncode == 0, f"{trainers} trainers:\n{result.stdout}\n{result.stderr}"
        assert f"deleted {deleted} older job checkpoint(s)" in result.stdout, result.stdout
        found = re.findall(
            rf"epoch (\d): test logloss ([0-9.]+) AUC ([0-9.]+) \| [0-9,]+ samples/s over "
            rf"{trainers} trainer\(s\)",
            result.stdout,
        )
        assert [epoch for epoch, _, _ in found] == ["1", "2"], result.stdout
        figures[trainers] = np.array(found, dtype=np.float64)
    # the same model: AUC within 0.005, and logloss (which, unlike AUC on this
    # tiny set, moves a lot in 2 epochs) to within float summation's differences
    assert np.abs(figures[2][:, 2] - figures[1][:, 2]).max() <= 0.005, figures
    assert np.abs(figures[2][:, 1] - figures[1][:, 1]).max() <= 2e-3, figures
    (job,) = (data_dir / "checkpoints").iterdir()  # the first run's job had all its deleted
    kept = sorted(path.stem for path in job.glob("*.pt"))
    assert len(kept) == 2, kept
    snapshots = sorted(p.name for p in (data_dir / "snapshots").glob(f"{CHECKPOINT_PREFIX}*"))
    assert snapshots == kept
    latest = json.loads((job / "latest.json").read_text())
    assert latest["checkpoint"] == kept[-1]  # ids sort by step
    saved = torch.load(job / f"{kept[-1]}.pt", weights_only=False)
    assert saved["step"] == latest["step"] > 0 and saved["state"]["model"]
    with (
        LocalCluster(2, data_dir / "demo-cluster-2", data_dir / "snapshots") as cluster,
        EmbeddingClient(cluster.addresses) as client,
    ):
        assert client.load_snapshot(kept[-1])["rows"] > 0
        tables = [config.name for config in client.list_tables()]
        assert tables and all(client.table_step(name) == saved["step"] for name in tables)


def test_storage_demo_still_runs(tmp_path: Path) -> None:
    result = _tierps(
        "storage-demo",
        "--data-dir",
        str(tmp_path),
        "--steps",
        "2",
        "--batch",
        "512",
        "--host-mb",
        "1",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "host tier: hit rate" in result.stdout


def test_missing_recbole_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "recbole" else real_find_spec(name, *a),
    )
    with pytest.raises(data.DatasetUnavailableError) as raised:
        data.load_movielens()
    assert "pip install --no-deps recbole==1.2.1" in str(raised.value)
    assert "--dataset synthetic" in str(raised.value)


# -- (c) the MovieLens loader against the files -----------------------------------------------


def _raw_file(suffix: str) -> list[list[str]]:
    """Lines of recbole's ml-100k.<suffix>, header dropped, split on tabs."""
    path = importlib.resources.files("recbole").joinpath(
        f"dataset_example/ml-100k/ml-100k.{suffix}"
    )
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.split("\t") for line in lines[1:] if line]


@requires_recbole
def test_movielens_loader_matches_the_files(movielens: data.CTRDataset) -> None:
    inter = _raw_file("inter")  # user_id, item_id, rating, timestamp
    users = {fields[0]: fields[1:] for fields in _raw_file("user")}  # age gender occ zip
    items = {fields[0]: fields[1:] for fields in _raw_file("item")}  # title year class
    assert movielens.num_samples == len(inter) == 100_000
    ratings = np.array([float(fields[2]) for fields in inter])
    np.testing.assert_array_equal(movielens.labels, (ratings >= 4).astype(np.float32))

    samples = [0, 1, 2, 777, 12_345, 54_321, 99_999]
    batch = movielens.batch(np.array(samples))
    by_feature = {
        name: [
            movielens.decode(name, values[start:end]).tolist()
            for start, end in itertools.pairwise([*offsets.tolist(), values.size])
        ]
        for name, (values, offsets) in batch.features.items()
    }
    edges = [18, 25, 35, 45, 50, 56]
    for position, sample in enumerate(samples):
        user_id, item_id, rating, _ = inter[sample]
        age, gender, occupation, zip_code = users[user_id]
        _, year, genres = items[item_id]
        expected = {
            "user_id": [user_id],
            "item_id": [item_id],
            "age": [data.AGE_BUCKET_NAMES[sum(int(age) >= edge for edge in edges)]],
            "gender": [gender],
            "occupation": [occupation],
            "zip_prefix": [zip_code[:2]],
            "release_year": [year],
            "genres": genres.split(" "),
        }
        for name, tokens in expected.items():
            assert by_feature[name][position] == tokens, (name, sample)
        assert batch.labels[position] == float(float(rating) >= 4)

    combiners = {feature.name: feature.combiner for feature in movielens.features}
    assert combiners["genres"] == "mean"
    assert {c for name, c in combiners.items() if name != "genres"} == {"sum"}
    # Each feature has its own key range in the shared table.
    ranges = sorted(
        (int(movielens.columns[f.name].values.min()), int(movielens.columns[f.name].values.max()))
        for f in movielens.features
    )
    assert all(high < next_low for (_, high), (next_low, _) in itertools.pairwise(ranges))


@requires_recbole
def test_movielens_split_is_random_disjoint_and_seeded(movielens: data.CTRDataset) -> None:
    train, test = movielens.train_rows, movielens.test_rows
    assert (train.size, test.size) == (80_000, 20_000)
    assert np.intersect1d(train, test).size == 0
    assert np.union1d(train, test).size == 100_000
    again = data.load_movielens(seed=SEED)
    np.testing.assert_array_equal(again.test_rows, test)
    other = data.load_movielens(seed=SEED + 1)
    assert not np.array_equal(other.test_rows, test)


@requires_recbole
def test_movielens_per_feature_tables_hold_the_same_tokens(movielens: data.CTRDataset) -> None:
    split = data.load_movielens(seed=SEED, shared_table=False)
    assert sorted(split.tables) == sorted(f"movielens.{name}" for name in data.MOVIELENS_FEATURES)
    rows = np.arange(0, 100_000, 997)
    shared_batch, split_batch = movielens.batch(rows), split.batch(rows)
    for name in data.MOVIELENS_FEATURES:
        shared_values, shared_offsets = shared_batch.features[name]
        split_values, split_offsets = split_batch.features[name]
        np.testing.assert_array_equal(shared_offsets, split_offsets)
        np.testing.assert_array_equal(
            movielens.decode(name, shared_values), split.decode(name, split_values)
        )


# -- the pieces -----------------------------------------------------------------------------------


def test_synthetic_set_is_criteo_shaped() -> None:
    dataset = data.load_synthetic(2_000, seed=3)
    assert [f.name for f in dataset.features] == [f"C{i}" for i in range(1, 27)]
    assert dataset.dense is not None and dataset.dense.shape == (2_000, 13)
    assert dataset.dense.dtype == np.float32 and np.isfinite(dataset.dense).all()
    keys = np.concatenate([column.values for column in dataset.columns.values()])
    assert keys.dtype == np.int64 and keys.min() >= 0 and keys.max() > 2**40  # sparse keys
    for slot, (name, column) in enumerate(dataset.columns.items()):
        assert column.values.size == 2_000, name  # one id per sample and slot
        distinct = np.unique(column.values).size
        assert distinct <= data.CRITEO_KAGGLE_CARDINALITIES[slot], name
    assert 0.15 < dataset.labels.mean() < 0.35
    again = data.load_synthetic(2_000, seed=3)
    np.testing.assert_array_equal(again.labels, dataset.labels)


@pytest.mark.parametrize("most_keys", [3, 1], ids=["ragged", "one-per-sample"])
def test_ragged_take_matches_a_loop(most_keys: int) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(0 if most_keys > 1 else 1, most_keys + 1, 50)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    column = data.RaggedColumn(rng.integers(0, 100, starts[-1]).astype(np.int64), starts)
    assert column.one_per_sample == (most_keys == 1)  # its gather's shortcut, or not
    rows = rng.integers(0, 50, 30)
    values, offsets = column.take(rows)
    assert values.dtype == offsets.dtype == np.int64
    bounds = [*offsets.tolist(), values.size]
    for i, row in enumerate(rows):
        np.testing.assert_array_equal(values[bounds[i] : bounds[i + 1]], column.bag(int(row)))


@pytest.mark.parametrize("share", [(0, 1), (2, 3)])
def test_batches_hold_each_chunks_samples_bag_by_bag(share: tuple[int, int]) -> None:
    """batches() gathers a whole pass at once and slices it: each batch must still be its
    chunk's share of the shuffled rows, bag by bag (a loop over RaggedColumn.bag), with
    their dense features and labels; a last chunk smaller than the ranks is left out."""
    rng = np.random.default_rng(4)
    samples, batch_size = 23, 5
    lengths = rng.integers(0, 4, samples)  # empty bags too
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    columns = {
        "multi": data.RaggedColumn(rng.integers(0, 50, starts[-1]).astype(np.int64), starts),
        "single": data.RaggedColumn.single(rng.integers(0, 50, samples)),
    }
    features = tuple(data.SparseFeature(name, "t") for name in columns)
    dataset = data.CTRDataset(
        "tiny",
        features,
        {},
        columns,
        rng.random((samples, 2)).astype(np.float32),
        rng.integers(0, 2, samples).astype(np.float32),
        np.arange(samples),
        np.arange(0),
    )
    order = np.random.default_rng(9).permutation(samples)
    rank, ranks = share
    chunks = [order[i : i + batch_size] for i in range(0, samples, batch_size)]
    expected = [c[rank * c.size // ranks : (rank + 1) * c.size // ranks] for c in chunks]
    expected = [rows for rows, c in zip(expected, chunks, strict=True) if c.size >= ranks]
    batches = list(dataset.batches("train", batch_size, shuffle_seed=9, share=share))
    assert len(batches) == len(expected) == dataset.num_batches("train", batch_size, ranks)
    for batch, rows in zip(batches, expected, strict=True):
        np.testing.assert_array_equal(batch.labels, dataset.labels[rows])
        np.testing.assert_array_equal(batch.dense, dataset.dense[rows])
        for name, column in columns.items():
            values, offsets = batch.features[name]
            assert values.dtype == offsets.dtype == np.int64 and offsets.size == rows.size
            bounds = [*offsets.tolist(), values.size]
            for i, row in enumerate(rows):
                np.testing.assert_array_equal(
                    values[bounds[i] : bounds[i + 1]], column.bag(int(row))
                )


def test_auc_matches_pairwise_counting() -> None:
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, 300)
    scores = np.round(rng.normal(labels * 0.5, 1.0), 1)  # rounded: many ties
    positive, negative = scores[labels == 1], scores[labels == 0]
    wins = (positive[:, None] > negative[None, :]).sum()
    ties = (positive[:, None] == negative[None, :]).sum()
    expected = (wins + 0.5 * ties) / (positive.size * negative.size)
    assert training.auc(labels, scores) == pytest.approx(expected, abs=1e-12)
    assert np.isnan(training.auc(np.ones(4), np.arange(4.0)))
    assert training.logloss(np.array([1.0, 0.0]), np.array([0.0, 0.0])) == pytest.approx(np.log(2))


def test_job_checkpoint_pruning_touches_only_this_datasets_local_checkpoints(
    tmp_path: Path,
) -> None:
    """prune_job_checkpoints deletes the oldest of one dataset's job checkpoints whose
    snapshots are in the demo's snapshot directory, and nothing else: not another
    dataset's, not one whose snapshot lives on another cluster (--addresses), not a folder
    of the user's, not the job directory of a checkpoint still being written."""
    import os

    checkpoints, snapshots = tmp_path / "checkpoints", tmp_path / "snapshots"

    def checkpoint(job: str, step: int, local: bool = True) -> Path:
        name = f"{CHECKPOINT_PREFIX}{step:010d}-abcd1234"
        (checkpoints / job).mkdir(parents=True, exist_ok=True)
        pt = checkpoints / job / f"{name}.pt"
        pt.write_bytes(b"state")
        os.utime(pt, ns=(step * 10**9, step * 10**9))  # modification time orders them
        if local:
            (snapshots / name).mkdir(parents=True)
        return pt

    job = demo.job_prefix("synthetic")
    old = [checkpoint(f"{job}1", 1), checkpoint(f"{job}1", 2)]
    kept = [checkpoint(f"{job}2", 3), checkpoint(f"{job}2", 4)]
    remote = checkpoint(f"{job}3", 5, local=False)  # made against a cluster given by address
    other_dataset = checkpoint(f"{demo.job_prefix('movielens')}1", 0)
    (snapshots / f"{CHECKPOINT_PREFIX}0000000009-being-saved").mkdir()  # its .pt not yet
    (checkpoints / f"{job}4").mkdir()  # the job directory of that checkpoint
    (checkpoints / "my-notes").mkdir()

    deleted = demo.prune_job_checkpoints(checkpoints, snapshots, "synthetic", keep=2)

    assert deleted == [path.stem for path in old]
    assert not any(path.exists() or (snapshots / path.stem).exists() for path in old)
    assert not (checkpoints / f"{job}1").exists()  # emptied by the pruning: removed
    survivors = [*kept, remote, other_dataset]
    assert all(path.exists() for path in survivors)
    assert all((snapshots / path.stem).is_dir() for path in [*kept, other_dataset])
    assert (checkpoints / f"{job}4").is_dir() and (checkpoints / "my-notes").is_dir()
    assert (snapshots / f"{CHECKPOINT_PREFIX}0000000009-being-saved").is_dir()
