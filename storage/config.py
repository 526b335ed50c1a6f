"""Table configuration: one frozen, self-checking dataclass per table (as TorchRec's
EmbeddingBagConfig), with string enums for the modes."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tierps.storage import init, optim
from tierps.storage.validation import check_int
from tierps.storage.xp import array_module

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


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    name: [A-Za-z0-9][A-Za-z0-9_.-]{0,63}. dim: values per row (1..65536). dtype: "float32"
    only. initializer / optimizer: configs from `init` and `optim`; the optimizer's state is
    stored beside each row. seed: makes initial rows a pure function of (seed, key).
    host_cache_bytes / gpu_cache_bytes: per-shard budget of each cache tier (rows, their
    optimizer state and the index); rows beyond it live in RocksDB only.
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
        for name, enum in (("eviction", Eviction), ("write_policy", WritePolicy)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum(value))
            except ValueError:
                raise ValueError(
                    f"{owner}: field '{name}' expected one of "
                    f"{[member.value for member in enum]}, got {value!r}"
                ) from None

    @property
    def row_width(self) -> int:
        """float32 values per stored row: weights and optimizer state side by side."""
        return self.dim * self.optimizer.size_factor

    @property
    def row_bytes(self) -> int:
        return 4 * self.row_width

    def initial_rows(self, keys: Any, weights: Any = None) -> Any:
        """[n, row_width] rows of int64 keys with fresh optimizer state; the weights are the
        initializer's (a pure function of seed and key) unless given."""
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
        out["eviction"] = self.eviction.value
        out["write_policy"] = self.write_policy.value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TableConfig:
        data = dict(data)
        for name, registry in (("initializer", init.INITIALIZERS), ("optimizer", optim.OPTIMIZERS)):
            if name in data:  # left out: the field's default
                data[name] = _from_kind(name, registry, data[name])
        return cls(**data)


def _from_kind(field_name: str, registry: dict[str, type], data: dict[str, Any]) -> Any:
    params = dict(data)
    kind = params.pop("kind", None)
    if kind not in registry:
        raise ValueError(
            f"TableConfig: field '{field_name}.kind' expected one of {sorted(registry)}, "
            f"got {kind!r}"
        )
    return registry[kind](**params)
