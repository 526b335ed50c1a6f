"""The demo's data: MovieLens-100k and a Criteo-like synthetic set, as CTR datasets.

A dataset is a set of samples, each with one bag of int64 keys per sparse feature, optional
dense features and a 0/1 label, split at random into train and test rows. Batches come as

    batch.features = {"user_id": (values, offsets), ...}   # CSR with torch's offsets [B]
    batch.dense    = float32 [B, num_dense] or None
    batch.labels   = float32 [B]

which both tierps.client.torch.EmbeddingBagCollection and torch.nn.EmbeddingBag take.

MovieLens-100k is read from the recbole package (`recbole/dataset_example/ml-100k/`, atomic
files: tab-separated, with typed headers such as `user_id:token`); it is never copied into
this repository. Install it with `pip install --no-deps recbole==1.2.1`.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import importlib.resources
import importlib.util
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

CLICK_MIN_RATING = 4.0  # a rating >= 4 is a click
AGE_BUCKET_EDGES = (18, 25, 35, 45, 50, 56)  # MovieLens-1M's age groups, named below
AGE_BUCKET_NAMES = ("<18", "18-24", "25-34", "35-44", "45-49", "50-55", "56+")
ZIP_PREFIX_CHARS = 2  # zip codes keep their first two characters (a region of the US)
MOVIELENS_DIR = "dataset_example/ml-100k"
RECBOLE_INSTALL = "pip install --no-deps recbole==1.2.1"
TEST_FRACTION = 0.2
MOVIELENS_TABLE = "movielens"  # the features' shared table (or "movielens.<feature>" each)
MOVIELENS_FEATURES = (
    "user_id",
    "item_id",
    "age",
    "gender",
    "occupation",
    "zip_prefix",
    "release_year",
    "genres",
)
SYNTHETIC_TABLE = "synthetic.criteo"  # the one table all synthetic slots share

# Per-slot cardinalities of Criteo's 26 categorical features, as published with DLRM and
# TorchRec: the Kaggle Display Advertising Challenge set (33,762,577 ids in all) and the
# 1TB click logs (177,944,275).
CRITEO_KAGGLE_CARDINALITIES = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)
CRITEO_NUM_DENSE = 13


class DatasetUnavailableError(RuntimeError):
    """The dataset's source cannot be read (its package is not installed); says how to get it."""


@dataclass(frozen=True)
class SparseFeature:
    """A sparse feature: its keys are rows of `table`; a bag of several keys is pooled with
    `combiner` ("sum" or "mean")."""

    name: str
    table: str
    combiner: str = "sum"

    def __post_init__(self) -> None:
        if self.combiner not in ("sum", "mean"):
            raise ValueError(
                f"feature {self.name!r}: combiner expected 'sum' or 'mean', got {self.combiner!r}"
            )


@dataclass(frozen=True)
class TableSpec:
    """A table's key space: the sorted distinct keys its features use in the dataset.
    dense_keys: the keys are exactly 0..num_keys-1 (row i of a local table is key i)."""

    name: str
    keys: np.ndarray
    dense_keys: bool

    @property
    def num_keys(self) -> int:
        return int(self.keys.size)


@dataclass(frozen=True)
class RaggedColumn:
    """One sparse feature over all samples: sample i's bag is values[starts[i]:starts[i+1]]."""

    values: np.ndarray  # int64 [nnz]
    starts: np.ndarray  # int64 [N + 1]

    def __post_init__(self) -> None:
        if self.starts.ndim != 1 or self.starts.size == 0 or self.starts[-1] != self.values.size:
            raise ValueError(
                f"RaggedColumn: starts expected [N + 1] ending at len(values)={self.values.size}, "
                f"got shape {self.starts.shape} ending at "
                f"{int(self.starts[-1]) if self.starts.size else 'none'}"
            )

    @classmethod
    def single(cls, keys: np.ndarray) -> RaggedColumn:
        """One key per sample."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        return cls(keys, np.arange(keys.size + 1, dtype=np.int64))

    @property
    def num_samples(self) -> int:
        return self.starts.size - 1

    @functools.cached_property
    def one_per_sample(self) -> bool:
        """Whether every sample's bag is one key (starts is 0, 1, ..., N)."""
        return self.values.size == self.num_samples and bool((np.diff(self.starts) == 1).all())

    def bag(self, sample: int) -> np.ndarray:
        return self.values[self.starts[sample] : self.starts[sample + 1]]

    def take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The bags of samples `rows` as (values, offsets): offsets [B] are torch's (bag i
        starts at offsets[i] and runs to the next one, or to the end)."""
        values, bounds = self.gather(rows)
        return values, bounds[:-1]

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The bags of samples `rows` as a RaggedColumn's arrays: (values, bounds [B + 1]),
        bag i being values[bounds[i]:bounds[i + 1]]."""
        if self.one_per_sample:  # most features: no bounds to look up
            return self.values[rows], np.arange(rows.size + 1, dtype=np.int64)
        begin, end = self.starts[rows], self.starts[rows + 1]
        lengths = end - begin
        bounds = np.zeros(rows.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=bounds[1:])
        if bounds[-1] == rows.size and (lengths == 1).all():
            return self.values[begin], bounds
        index = np.repeat(begin - bounds[:-1], lengths) + np.arange(bounds[-1], dtype=np.int64)
        return self.values[index], bounds


@dataclass
class Batch:
    """A batch of samples: sparse features as (values, offsets), dense features, labels."""

    features: dict[str, tuple[np.ndarray, np.ndarray]]
    dense: np.ndarray | None
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.size)


@dataclass
class CTRDataset:
    """Samples with sparse features, optional dense features and 0/1 labels, split into
    train and test rows (indices into the samples). Where known, tokens[feature][i] is the
    source's token of the feature's key key_offsets[feature] + i (see `decode`)."""

    name: str
    features: tuple[SparseFeature, ...]
    tables: dict[str, TableSpec]
    columns: dict[str, RaggedColumn]
    dense: np.ndarray | None
    labels: np.ndarray
    train_rows: np.ndarray
    test_rows: np.ndarray
    tokens: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    key_offsets: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return int(self.labels.size)

    @property
    def num_dense(self) -> int:
        return 0 if self.dense is None else int(self.dense.shape[1])

    def rows(self, split: str) -> np.ndarray:
        """The sample indices of "train" or "test"."""
        if split == "train":
            return self.train_rows
        if split == "test":
            return self.test_rows
        raise ValueError(f"split expected 'train' or 'test', got {split!r}")

    def batch(self, rows: np.ndarray) -> Batch:
        """The samples `rows` as one batch."""
        rows = np.asarray(rows, dtype=np.int64)
        return Batch(
            {feature.name: self.columns[feature.name].take(rows) for feature in self.features},
            None if self.dense is None else self.dense[rows],
            self.labels[rows],
        )

    def batches(
        self,
        split: str,
        batch_size: int,
        *,
        shuffle_seed: int | None = None,
        share: tuple[int, int] = (0, 1),
    ) -> Iterator[Batch]:
        """Batches of `split` in order, or shuffled by shuffle_seed (the same seed gives the
        same order); the last batch may be smaller. share=(rank, ranks): data-parallel
        training's part of each batch for one of `ranks` trainers, its contiguous
        1/ranks of the samples (so the ranks' parts of a step make the one batch of
        batch_size); a last batch of fewer samples than ranks is left out."""
        if batch_size < 1:
            raise ValueError(f"batch_size expected >= 1, got {batch_size}")
        rank, ranks = share
        if not 0 <= rank < ranks <= batch_size:
            raise ValueError(
                f"share expected (rank, ranks) with 0 <= rank < ranks <= batch_size "
                f"({batch_size}), got {share}"
            )
        rows = self.rows(split)
        if shuffle_seed is not None:
            rows = np.random.default_rng(shuffle_seed).permutation(rows)
        # The whole pass gathered at once, each batch then a slice of it (views): a batch
        # costs a few slices, not a gather per feature (the step is a few ms).
        ordered = {
            feature.name: self.columns[feature.name].gather(rows) for feature in self.features
        }
        dense = None if self.dense is None else self.dense[rows]
        labels = self.labels[rows]
        for start in range(0, rows.size, batch_size):
            size = min(batch_size, rows.size - start)
            if size < ranks:
                break
            low, high = start + rank * size // ranks, start + (rank + 1) * size // ranks
            features = {}
            for name, (values, bounds) in ordered.items():
                first = bounds[low]
                features[name] = (values[first : bounds[high]], bounds[low:high] - first)
            yield Batch(features, None if dense is None else dense[low:high], labels[low:high])

    def num_batches(self, split: str, batch_size: int, ranks: int = 1) -> int:
        """How many batches `batches` gives (for each of `ranks` trainers)."""
        size = self.rows(split).size
        whole, rest = divmod(size, batch_size)
        return whole + (rest >= ranks)

    def subset(self, train: int | None = None, test: int | None = None) -> CTRDataset:
        """The same samples with only the first `train` train rows and `test` test rows."""
        return dataclasses.replace(
            self,
            train_rows=self.train_rows if train is None else self.train_rows[:train],
            test_rows=self.test_rows if test is None else self.test_rows[:test],
        )

    def decode(self, feature: str, keys: np.ndarray) -> np.ndarray:
        """The source's tokens of a feature's keys (MovieLens: occupation -> "educator")."""
        if feature not in self.tokens:
            raise KeyError(f"{self.name}: feature {feature!r} has no tokens recorded")
        return self.tokens[feature][np.asarray(keys) - self.key_offsets.get(feature, 0)]

    def describe(self) -> str:
        """One line: sizes, click rate, features and tables."""
        multi = [f.name for f in self.features if f.combiner != "sum"]
        keys = sum(table.num_keys for table in self.tables.values())
        return (
            f"{self.name}: {self.num_samples:,} samples ({self.train_rows.size:,} train, "
            f"{self.test_rows.size:,} test), click rate {self.labels.mean():.3f}; "
            f"{len(self.features)} sparse features"
            + (f" ({', '.join(multi)} pooled by mean)" if multi else "")
            + f" in {len(self.tables)} table(s) of {keys:,} keys; {self.num_dense} dense features"
        )


def split_rows(num_samples: int, seed: int, test_fraction: float = TEST_FRACTION) -> tuple:
    """A random (train, test) split of 0..num_samples-1, each sorted."""
    order = np.random.default_rng(seed).permutation(num_samples)
    num_test = int(round(num_samples * test_fraction))
    return np.sort(order[num_test:]), np.sort(order[:num_test])


# -- MovieLens-100k -------------------------------------------------------------------------------


def read_atomic_file(text: str, where: str) -> dict[str, list[str]]:
    """A RecBole atomic file (tab-separated, header fields `name:type`) as columns of strings
    by name (the type dropped)."""
    reader = csv.reader(io.StringIO(text), delimiter="\t", quoting=csv.QUOTE_NONE)
    try:
        header = next(reader)
    except StopIteration:
        raise ValueError(f"{where}: expected a header line, got an empty file") from None
    names = [field.split(":", 1)[0] for field in header]
    columns: list[list[str]] = [[] for _ in names]
    for line_number, row in enumerate(reader, start=2):
        if not row:
            continue
        if len(row) != len(names):
            raise ValueError(
                f"{where}: line {line_number} expected {len(names)} tab-separated fields "
                f"({', '.join(header)}), got {len(row)}"
            )
        for column, value in zip(columns, row, strict=True):
            column.append(value)
    return dict(zip(names, columns, strict=True))


def movielens_text(suffix: str) -> str:
    """The text of recbole's ml-100k.<suffix> (inter, user, item)."""
    if importlib.util.find_spec("recbole") is None:
        raise DatasetUnavailableError(
            "MovieLens-100k is read from the recbole package, which is not installed: "
            f"{RECBOLE_INSTALL} (or use --dataset synthetic)"
        )
    resource = importlib.resources.files("recbole").joinpath(f"{MOVIELENS_DIR}/ml-100k.{suffix}")
    try:
        return resource.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatasetUnavailableError(
            f"recbole is installed but has no {MOVIELENS_DIR}/ml-100k.{suffix}: expected "
            f"recbole 1.2.1 ({RECBOLE_INSTALL})"
        ) from None


def age_bucket(ages: np.ndarray) -> np.ndarray:
    """MovieLens-1M's age group index: 0 (<18), 1 (18-24), ..., 6 (56+)."""
    return np.digitize(ages, AGE_BUCKET_EDGES).astype(np.int64)


def _index(tokens: Sequence[str] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct tokens (sorted) and each token's index among them."""
    vocabulary, inverse = np.unique(np.asarray(tokens, dtype=str), return_inverse=True)
    return vocabulary, inverse.reshape(-1).astype(np.int64)


def _lookup(where: str, ids: list[str], known: np.ndarray) -> np.ndarray:
    """The index in `known` (sorted ids) of each id; every id must be known."""
    ids_array = np.asarray(ids, dtype=str)
    at = np.minimum(np.searchsorted(known, ids_array), known.size - 1)
    missing = known[at] != ids_array
    if missing.any():
        first = int(np.argmax(missing))
        raise ValueError(f"{where}: id {ids_array[first]!r} (row {first}) is not described")
    return at.astype(np.int64)


def load_movielens(
    seed: int = 0, *, shared_table: bool = True, test_fraction: float = TEST_FRACTION
) -> CTRDataset:
    """MovieLens-100k as a CTR set: a click is a rating >= 4; features user_id, item_id,
    age (bucket), gender, occupation, zip_prefix, release_year and genres (the item's
    genres as a bag pooled by mean). Feature f's tokens (sorted, distinct) are numbered
    0..V-1; its key space is those numbers plus key_offsets[f]. shared_table: all features
    in one table "movielens", each in its own key range (one table per call is cheaper on
    the wire); otherwise one table "movielens.<f>" per feature, keys 0..V-1. Split 80/20
    at random by `seed`."""
    inter = read_atomic_file(movielens_text("inter"), "ml-100k.inter")
    users = read_atomic_file(movielens_text("user"), "ml-100k.user")
    items = read_atomic_file(movielens_text("item"), "ml-100k.item")

    user_ids, user_index = _index(users["user_id"])
    if user_ids.size != len(users["user_id"]):
        raise ValueError("ml-100k.user: expected one line per user_id, got repeated ids")
    item_ids, item_index = _index(items["item_id"])
    if item_ids.size != len(items["item_id"]):
        raise ValueError("ml-100k.item: expected one line per item_id, got repeated ids")
    user_row = np.empty(user_ids.size, np.int64)
    user_row[user_index] = np.arange(user_ids.size)  # line of each sorted user id
    item_row = np.empty(item_ids.size, np.int64)
    item_row[item_index] = np.arange(item_ids.size)

    sample_user = _lookup("ml-100k.inter user_id", inter["user_id"], user_ids)
    sample_item = _lookup("ml-100k.inter item_id", inter["item_id"], item_ids)
    labels = (np.asarray(inter["rating"], dtype=np.float64) >= CLICK_MIN_RATING).astype(np.float32)

    # Per-user and per-item tokens, indexed over the user and item lines.
    ages = np.asarray(users["age"], dtype=np.int64)
    per_user = {
        "age": np.asarray(AGE_BUCKET_NAMES)[age_bucket(ages)],
        "gender": np.asarray(users["gender"], dtype=str),
        "occupation": np.asarray(users["occupation"], dtype=str),
        "zip_prefix": np.asarray([z[:ZIP_PREFIX_CHARS] for z in users["zip_code"]], dtype=str),
    }
    per_item = {"release_year": np.asarray(items["release_year"], dtype=str)}
    genre_lists = [genres.split() for genres in items["class"]]
    genre_vocabulary, genre_keys = _index([g for genres in genre_lists for g in genres])
    genre_starts = np.zeros(len(genre_lists) + 1, dtype=np.int64)
    np.cumsum([len(genres) for genres in genre_lists], out=genre_starts[1:])
    genres_by_item_line = RaggedColumn(genre_keys, genre_starts)

    # Each feature's keys are its token indices 0..V-1, shifted into its own key range when
    # the features share one table.
    keys_of: dict[str, np.ndarray] = {"user_id": sample_user, "item_id": sample_item}
    vocabularies: dict[str, np.ndarray] = {"user_id": user_ids, "item_id": item_ids}
    for name, tokens in per_user.items():
        vocabularies[name], keys = _index(tokens)
        keys_of[name] = keys[user_row[sample_user]]
    for name, tokens in per_item.items():
        vocabularies[name], keys = _index(tokens)
        keys_of[name] = keys[item_row[sample_item]]
    vocabularies["genres"] = genre_vocabulary
    genre_values, genre_offsets = genres_by_item_line.take(item_row[sample_item])

    columns: dict[str, RaggedColumn] = {}
    tables: dict[str, TableSpec] = {}
    key_offsets: dict[str, int] = {}
    features = []
    next_key = 0
    for name in MOVIELENS_FEATURES:
        size = vocabularies[name].size
        table = MOVIELENS_TABLE if shared_table else f"{MOVIELENS_TABLE}.{name}"
        key_offsets[name] = next_key if shared_table else 0
        if name == "genres":
            starts = np.append(genre_offsets, genre_values.size)
            columns[name] = RaggedColumn(genre_values + key_offsets[name], starts)
            features.append(SparseFeature(name, table, "mean"))
        else:
            columns[name] = RaggedColumn.single(keys_of[name] + key_offsets[name])
            features.append(SparseFeature(name, table))
        if shared_table:
            next_key += size
        else:
            tables[table] = TableSpec(table, np.arange(size, dtype=np.int64), dense_keys=True)
    if shared_table:
        tables[MOVIELENS_TABLE] = TableSpec(
            MOVIELENS_TABLE, np.arange(next_key, dtype=np.int64), dense_keys=True
        )
    train, test = split_rows(labels.size, seed, test_fraction)
    return CTRDataset(
        "movielens-100k",
        tuple(features),
        tables,
        columns,
        None,
        labels,
        train,
        test,
        vocabularies,
        key_offsets,
    )


# -- Criteo-like synthetic set --------------------------------------------------------------------

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijection of uint64 that scatters nearby inputs."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _hash_uniform(keys: np.ndarray, salt: int) -> np.ndarray:
    """A float64 in [-1, 1) per key, a pure function of (key, salt)."""
    with np.errstate(over="ignore"):
        bits = mix64(keys.astype(np.uint64) + np.uint64(salt) * np.uint64(0x9E3779B97F4A7C15))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-52 - 1.0


def slot_keys(slot: int, ids: np.ndarray) -> np.ndarray:
    """Sparse int64 keys (>= 0, spread over 63 bits) of a slot's ids: distinct slots never
    share a key, so all slots can share one table."""
    packed = (np.uint64(slot + 1) << np.uint64(40)) | ids.astype(np.uint64)
    return (mix64(packed) >> np.uint64(1)).astype(np.int64)


def load_synthetic(
    samples: int = 200_000,
    *,
    seed: int = 0,
    cardinalities: Sequence[int] = CRITEO_KAGGLE_CARDINALITIES,
    zipf_a: float = 1.1,
    num_dense: int = CRITEO_NUM_DENSE,
    hidden_dim: int = 4,
    click_rate: float = 0.25,
    test_fraction: float = TEST_FRACTION,
) -> CTRDataset:
    """A Criteo-like CTR set: len(cardinalities) categorical slots C1.. (one id each, drawn
    from a Zipf(zipf_a) law over the slot's vocabulary, rank r -> a scattered id), keyed
    by slot_keys into one shared table SYNTHETIC_TABLE; num_dense dense features (log1p of
    log-normal counts, as Criteo's integer features are usually fed); and labels drawn
    from a hidden FM model over hashed per-key weights, so the AUC is learnable."""
    if samples < 2:
        raise ValueError(f"synthetic: samples expected >= 2, got {samples}")
    if zipf_a <= 1.0:
        raise ValueError(f"synthetic: zipf_a expected > 1, got {zipf_a}")
    rng = np.random.default_rng(seed)
    first_order = np.zeros(samples)
    hidden_sum = np.zeros((samples, hidden_dim))
    hidden_squares = np.zeros(samples)
    columns: dict[str, RaggedColumn] = {}
    features = []
    for slot, cardinality in enumerate(cardinalities):
        ranks = rng.zipf(zipf_a, samples).astype(np.uint64) - np.uint64(1)
        ids = mix64(ranks) % np.uint64(cardinality)  # tail ranks wrap; hot ranks scattered
        keys = slot_keys(slot, ids)
        name = f"C{slot + 1}"
        columns[name] = RaggedColumn.single(keys)
        features.append(SparseFeature(name, SYNTHETIC_TABLE))
        first_order += _hash_uniform(keys, 0)
        for k in range(hidden_dim):
            value = _hash_uniform(keys, k + 1)
            hidden_sum[:, k] += value
            hidden_squares += value * value
    num_slots = len(cardinalities)
    interactions = 0.5 * ((hidden_sum**2).sum(1) - hidden_squares)
    raw_counts = np.floor(
        rng.lognormal(rng.uniform(0.0, 3.0, num_dense), 1.0, (samples, num_dense))
    )
    dense = np.log1p(raw_counts).astype(np.float32)
    dense_weights = rng.normal(0.0, 0.3, num_dense)
    centred = dense - dense.mean(0)
    logits = (
        1.5 * first_order / np.sqrt(num_slots)
        + 1.5 * interactions / (num_slots * np.sqrt(hidden_dim))
        + centred @ dense_weights
    )
    logits += _bias_for_rate(logits, click_rate)
    labels = (rng.random(samples) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    all_keys = np.unique(np.concatenate([column.values for column in columns.values()]))
    tables = {SYNTHETIC_TABLE: TableSpec(SYNTHETIC_TABLE, all_keys, dense_keys=False)}
    train, test = split_rows(samples, seed, test_fraction)
    return CTRDataset(
        f"synthetic-criteo ({num_slots} slots, Zipf {zipf_a})",
        tuple(features),
        tables,
        columns,
        dense,
        labels,
        train,
        test,
    )


def _bias_for_rate(logits: np.ndarray, rate: float) -> float:
    """The bias b for which mean(sigmoid(logits + b)) is `rate` (bisection)."""
    low, high = -20.0, 20.0
    for _ in range(60):
        middle = 0.5 * (low + high)
        if np.mean(1.0 / (1.0 + np.exp(-(logits + middle)))) < rate:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


def load_dataset(name: str, *, seed: int = 0, samples: int = 200_000) -> CTRDataset:
    """`movielens` or `synthetic` (with `samples` samples)."""
    if name == "movielens":
        return load_movielens(seed)
    if name == "synthetic":
        return load_synthetic(samples, seed=seed)
    raise ValueError(f"dataset expected 'movielens' or 'synthetic', got {name!r}")
