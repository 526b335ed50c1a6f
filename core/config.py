"""Table configuration: one frozen, self-checking dataclass per table (as TorchRec's
EmbeddingBagConfig), with string enums for the modes."""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from tierps.core import init, optim
from tierps.core.codec import COLD_DTYPES, RowCodec
from tierps.core.errors import InvalidArgumentError
from tierps.core.hashing import mix64
from tierps.core.validation import check_finite, check_int, check_range
from tierps.core.xp import array_module

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_DIM = 65536


class Eviction(StrEnum):
    """Which rows a full cache tier pushes down first."""

    LRU = "lru"  # evict the row touched longest ago
    LFU = "lfu"  # evict the row touched the fewest times


class WritePolicy(StrEnum):
    """When an updated row reaches RocksDB."""

    WRITE_BACK = "write_back"  # when it is evicted, flushed or checkpointed (fast)
    WRITE_THROUGH = "write_through"  # before every update returns (durable)


class Placement(StrEnum):
    """Where a table's rows live in a cluster."""

    ROW = "row"  # spread over every shard: key k lives on shard k % num_shards
    TABLE = "table"  # whole on one shard: table_shard, or one chosen from the table's name


class Admission(StrEnum):
    """How the sightings of a key not yet admitted are counted (admit_after > 0)."""

    COUNTER = "counter"  # an exact count per key, of max_elements keys at most (0: 2**18)
    BLOOM = "bloom"  # a counting Bloom filter: memory bounded by max_elements and the rate


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    name: [A-Za-z0-9][A-Za-z0-9_.-]{0,63}. dim: values per row (1..65536). dtype: "float32"
    only. initializer / optimizer: configs from `init` and `optim`; the optimizer's state is
    stored beside each row. seed: makes initial rows a pure function of (seed, key).
    host_cache_bytes / gpu_cache_bytes: per-shard budget of each cache tier (rows, their
    optimizer state and the index); rows beyond it live in RocksDB only.

    Feature lifecycle (each off at its default):
    - use_hashtable=False with capacity=N: N rows addressed by key in [0, N), no hash table
      (SOK's use_hashtable=False); other keys are refused. The host tier is then an arena of
      all N rows on every shard: host_cache_bytes does not apply.
    - placement="table": the whole table on one shard, table_shard (-1: chosen from the
      name), instead of key % num_shards (HugeCTR's localized embedding); see owner_shard.
    - hash_bucket_size and promote_after (adaptive embedding, DeepRec): a key seen fewer
      than promote_after times reads and trains the shared row of bucket
      hash(key) % hash_bucket_size; then it gets its own row, from that row's weights.
    - admit_after (admission, DeepRec): a key gets a row only once seen admit_after times;
      until then it looks up as default_value and its gradients are dropped and counted.
      admission="bloom" counts in a counting Bloom filter of max_elements at
      false_positive_rate instead of exactly. The exact counter (admission="counter") holds
      at most max_elements keys (0: 2**18); when full it forgets the counts of the least
      recently sighted keys, which then start over (storage/admission.py).
    - steps_to_live and min_l2_norm (eviction, DeepRec and Monolith): rows not updated for
      steps_to_live steps, or whose weights' L2 norm is below min_l2_norm, are removed by an
      admin evict call, and before each snapshot when evict_before_snapshot.

    Cold rows: cold_dtype is the type of the weights in RocksDB, "float32" (default),
    "float16" or "bfloat16" (half the bytes); cold_state_dtype that of the optimizer state
    ("": as cold_dtype). The host and GPU tiers keep float32, the step stamp stays exact. A
    row is rounded each time it is written to RocksDB (spilled, flushed, written through),
    so a row whose only copy is on disk, and a snapshot of it, holds the rounded values
    (core/codec.py). float16 state is refused for the optimizers whose state sums squared
    gradients (their squares_state: Adagrad's accumulator, Adam's and RMSprop's v, FTRL's
    n): it overflows above 65,504 and underflows below 6e-8; take float16 weights with
    cold_state_dtype="float32" (or "bfloat16", float32's range) there.
    """

    name: str
    dim: int
    dtype: str = "float32"
    initializer: init.Initializer = field(default_factory=init.Uniform)
    optimizer: optim.Optimizer = field(default_factory=optim.Adagrad)
    seed: int = 0
    host_cache_bytes: int = 256 << 20
    gpu_cache_bytes: int = 0
    eviction: Eviction = Eviction.LRU
    write_policy: WritePolicy = WritePolicy.WRITE_BACK
    use_hashtable: bool = True
    capacity: int = 0
    placement: Placement = Placement.ROW
    table_shard: int = -1
    hash_bucket_size: int = 0
    promote_after: int = 0
    admit_after: int = 0
    admission: Admission = Admission.COUNTER
    max_elements: int = 0
    false_positive_rate: float = 0.01
    default_value: float = 0.0
    steps_to_live: int = 0
    min_l2_norm: float = 0.0
    evict_before_snapshot: bool = False
    cold_dtype: str = "float32"
    cold_state_dtype: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(
                f"TableConfig: field 'name' expected to match {_NAME.pattern}, got {self.name!r}"
            )
        owner = f"TableConfig '{self.name}'"
        check_int(owner, "dim", self.dim, 1, MAX_DIM)
        if self.dtype != "float32":
            raise ValueError(f"{owner}: field 'dtype' expected 'float32', got {self.dtype!r}")
        if not isinstance(self.initializer, tuple(init.INITIALIZERS.values())):
            raise ValueError(
                f"{owner}: field 'initializer' expected one of init."
                f"{{{', '.join(c.__name__ for c in init.INITIALIZERS.values())}}}, "
                f"got {self.initializer!r}"
            )
        if not isinstance(self.optimizer, tuple(optim.OPTIMIZERS.values())):
            raise ValueError(
                f"{owner}: field 'optimizer' expected one of optim."
                f"{{{', '.join(c.__name__ for c in optim.OPTIMIZERS.values())}}}, "
                f"got {self.optimizer!r}"
            )
        check_int(owner, "seed", self.seed, 0, 2**64 - 1)
        check_int(owner, "host_cache_bytes", self.host_cache_bytes, 0, 2**62)
        check_int(owner, "gpu_cache_bytes", self.gpu_cache_bytes, 0, 2**62)
        for name, enum in (
            ("eviction", Eviction),
            ("write_policy", WritePolicy),
            ("placement", Placement),
            ("admission", Admission),
        ):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum(value))
            except ValueError:
                raise ValueError(
                    f"{owner}: field '{name}' expected one of "
                    f"{[member.value for member in enum]}, got {value!r}"
                ) from None
        self._check_lifecycle(owner)

    def _check_lifecycle(self, owner: str) -> None:
        for name in ("use_hashtable", "evict_before_snapshot"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{owner}: field '{name}' expected a bool, got {getattr(self, name)!r}"
                )
        check_int(owner, "capacity", self.capacity, 0, 2**40)
        if self.use_hashtable and self.capacity:
            raise ValueError(
                f"{owner}: field 'capacity' expected 0 with use_hashtable=True (a hashed table "
                f"grows as keys come), got {self.capacity}"
            )
        if not self.use_hashtable and not self.capacity:
            raise ValueError(
                f"{owner}: field 'capacity' expected >= 1 with use_hashtable=False (rows are "
                f"addressed by key in [0, capacity)), got 0"
            )
        check_int(owner, "table_shard", self.table_shard, -1, 2**31)
        if self.table_shard != -1 and self.placement is not Placement.TABLE:
            raise ValueError(
                f"{owner}: field 'table_shard' expected -1 unless placement='table', got "
                f"{self.table_shard} with placement={str(self.placement)!r}"
            )
        for name in (
            "hash_bucket_size",
            "promote_after",
            "admit_after",
            "max_elements",
            "steps_to_live",
        ):
            check_int(owner, name, getattr(self, name), 0, 2**62)
        if bool(self.hash_bucket_size) != bool(self.promote_after):
            raise ValueError(
                f"{owner}: fields 'hash_bucket_size' and 'promote_after' expected both > 0 "
                f"(adaptive embedding) or both 0, got {self.hash_bucket_size} and "
                f"{self.promote_after}"
            )
        if self.promote_after and self.admit_after:
            raise ValueError(
                f"{owner}: adaptive embedding (promote_after={self.promote_after}) and "
                f"admission (admit_after={self.admit_after}) expected one at most: both "
                f"decide when a key gets its own row"
            )
        if self.admission is Admission.BLOOM and self.admit_after and not (self.max_elements):
            raise ValueError(
                f"{owner}: field 'max_elements' expected >= 1 with admission='bloom', got 0"
            )
        check_range(
            owner,
            "false_positive_rate",
            self.false_positive_rate,
            0.0,
            1.0,
            low_open=True,
            high_open=True,
        )
        check_finite(owner, "default_value", self.default_value)
        check_range(owner, "min_l2_norm", self.min_l2_norm, 0.0, float("inf"))
        self._check_cold(owner)

    def _check_cold(self, owner: str) -> None:
        for name, allowed in (
            ("cold_dtype", COLD_DTYPES),
            ("cold_state_dtype", ("", *COLD_DTYPES)),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{owner}: field '{name}' expected one of {list(allowed)}, got "
                    f"{getattr(self, name)!r}"
                )
        kind, squares = self.optimizer.kind, self.optimizer.squares_state
        if self.cold_state == "float16" and squares:
            raise ValueError(
                f"{owner}: field 'cold_state_dtype' expected 'float32' or 'bfloat16' with "
                f"{kind} (its {squares} outgrows float16's 65,504 or falls below its "
                f"6e-8), got float16 (from cold_dtype={self.cold_dtype!r}, "
                f"cold_state_dtype={self.cold_state_dtype!r}); for half-size weights keep the "
                f"state wider: cold_dtype='float16', cold_state_dtype='float32'"
            )

    @property
    def cold_state(self) -> str:
        """The type of the optimizer state in RocksDB: cold_state_dtype, or cold_dtype."""
        return self.cold_state_dtype or self.cold_dtype

    @functools.cached_property
    def codec(self) -> RowCodec:
        """The layout of this table's stored rows (core/codec.py): in memory, float32
        weights, optimizer state and, with steps_to_live > 0, the last-update step; in
        RocksDB, the same in the cold dtypes."""
        return RowCodec(
            self.dim,
            self.optimizer.size_factor,
            steps=bool(self.steps_to_live),
            weights_dtype=self.cold_dtype,
            state_dtype=self.cold_state,
        )

    @functools.cached_property
    def bucket_codec(self) -> RowCodec:
        """The layout of adaptive bucket rows (storage/adaptive.py): weights and optimizer
        state in float32, no step, in memory and in RocksDB alike."""
        return RowCodec(self.dim, self.optimizer.size_factor)

    @property
    def row_width(self) -> int:
        """float32 values of weights and optimizer state per row (what a snapshot holds)."""
        return self.dim * self.optimizer.size_factor

    @property
    def row_bytes(self) -> int:
        """Bytes of a row's weights and state as float32 (RowCodec.row_bytes)."""
        return self.codec.row_bytes

    @property
    def stored_width(self) -> int:
        """float32 slots every cache tier stores per row (RowCodec.width): row_width, then
        the last-update step with steps_to_live > 0."""
        return self.codec.width

    @property
    def stored_bytes(self) -> int:
        """Bytes of a row in a cache tier (RowCodec.memory_bytes)."""
        return self.codec.memory_bytes

    def initial_rows(self, keys: Any, weights: Any = None) -> Any:
        """[n, row_width] rows of int64 keys with fresh optimizer state; the weights are the
        initializer's (a pure function of seed and key) unless given. The reference: a
        shard makes them through storage.host_kernels.initial_rows, compiled where it can
        be, with the same bits."""
        xp = array_module(keys)
        rows = xp.empty((keys.shape[0], self.row_width), dtype=xp.float32)
        if weights is None:
            weights = self.initializer.generate(keys, self.dim, self.seed)
        rows[:, : self.dim] = weights
        for slot, value in enumerate(self.optimizer.state_fill(), start=1):
            rows[:, slot * self.dim : (slot + 1) * self.dim] = value
        return rows

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description; `from_dict` reverses it."""
        out = dataclasses.asdict(self)
        out["initializer"] = {"kind": self.initializer.kind, **out["initializer"]}
        out["optimizer"] = {"kind": self.optimizer.kind, **out["optimizer"]}
        for name in ("eviction", "write_policy", "placement", "admission"):
            out[name] = getattr(self, name).value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableConfig:
        data = dict(data)
        for name, registry in (("initializer", init.INITIALIZERS), ("optimizer", optim.OPTIMIZERS)):
            if name in data:  # left out: the field's default
                data[name] = _from_kind(name, registry, data[name])
        return cls(**data)


def config_differences(existing: TableConfig, requested: TableConfig) -> str:
    """The fields in which two table configs differ, as "field 'dim' expected 16 (the
    table's), got 32; ..." (nested fields dotted: 'optimizer.lr'); "" when they agree."""

    def flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in data.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    have, want = flat(existing.to_dict()), flat(requested.to_dict())
    return "; ".join(
        f"field {name!r} expected {have.get(name, '(none)')!r} (the table's), got "
        f"{want.get(name, '(none)')!r}"
        for name in [*have, *(n for n in want if n not in have)]
        if have.get(name) != want.get(name)
    )


def _from_kind(field_name: str, registry: dict[str, type], data: dict[str, Any]) -> Any:
    params = dict(data)
    kind = params.pop("kind", None)
    if kind not in registry:
        raise ValueError(
            f"TableConfig: field '{field_name}.kind' expected one of {sorted(registry)}, "
            f"got {kind!r}"
        )
    return registry[kind](**params)


def owner_shard(config: TableConfig, num_shards: int) -> int:
    """The one shard of num_shards that holds a table placed whole (placement="table"):
    table_shard when it is >= 0, else splitmix64(CRC-32 of the name's UTF-8) % num_shards,
    a pure function of (name, num_shards) that every client, shard and snapshot load agrees
    on. Raises InvalidArgumentError naming the table when table_shard >= num_shards, and
    ValueError for a row-placed table (it has no owner: key k lives on shard k % num_shards).
    """
    if config.placement is not Placement.TABLE:
        raise ValueError(
            f"table {config.name!r}: owner_shard expected placement='table', got "
            f"{str(config.placement)!r} (its keys spread over every shard)"
        )
    check_int("owner_shard", "num_shards", num_shards, 1, 2**31)
    if config.table_shard >= 0:
        if config.table_shard >= num_shards:
            raise InvalidArgumentError(
                f"table {config.name!r}: field 'table_shard' expected -1 or a shard in "
                f"[0, {num_shards - 1}] of this cluster of {num_shards} shards, got "
                f"{config.table_shard}"
            )
        return config.table_shard
    crc = np.array([zlib.crc32(config.name.encode("utf-8"))], dtype=np.uint64)
    return int(mix64(crc)[0] % np.uint64(num_shards))


def key_shards(config: TableConfig, keys: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard of each int64 key >= 0 of a table in a cluster of num_shards: k % num_shards
    (placement="row"), or the table's owner_shard for every key (placement="table"). The one
    owner of key placement: the client's routing, a shard's check of the keys it is sent
    and a snapshot load's share of each shard all ask it (or single_shard, its shortcut;
    core/ownership's compiled routing and key check compute the same k % num_shards in
    their pass, and ask it where single_shard answers)."""
    single = single_shard(config, num_shards)
    if single is not None:
        return np.full(keys.shape, single, dtype=np.int64)
    return keys % num_shards


def single_shard(config: TableConfig, num_shards: int) -> int | None:
    """The one shard that holds every key of the table (a table placed whole: its
    owner_shard; a cluster of one shard: 0), or None when its keys spread (key_shards)."""
    if config.placement is Placement.TABLE:
        return owner_shard(config, num_shards)
    return 0 if num_shards == 1 else None
