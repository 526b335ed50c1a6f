"""Initialiser configs, and the rows they generate.

Every initial value is a pure function of (table seed, key, column): the bits come from
`hashing.counter_bits`, never from a stateful generator, so a key gets the same initial row
whatever the shard count, tier, batch or order of arrival.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from tierps.core.hashing import counter_bits
from tierps.core.validation import check_finite, check_positive
from tierps.core.xp import array_module

_TWO_POW_M24 = 2.0**-24
_TWO_POW_M32 = 2.0**-32


def _uniform01(bits: Any) -> Any:
    """float64 in [0, 1) from the top 24 bits (float32 keeps exactly 24)."""
    xp = array_module(bits)
    return (bits >> 40).astype(xp.float64) * _TWO_POW_M24


def _standard_normal(keys: Any, dim: int, seed: int, salt: int) -> Any:
    """Box-Muller: two 32-bit uniforms from one 64-bit counter value."""
    xp = array_module(keys)
    bits = counter_bits(keys, dim, seed, salt)
    u1 = ((bits >> 32).astype(xp.float64) + 0.5) * _TWO_POW_M32  # (0, 1): log is finite
    u2 = (bits & 0xFFFFFFFF).astype(xp.float64) * _TWO_POW_M32
    return xp.sqrt(-2.0 * xp.log(u1)) * xp.cos(2.0 * math.pi * u2)


@dataclass(frozen=True)
class Uniform:
    """U(low, high), as torch.nn.init.uniform_. Default range as Keras' RandomUniform."""

    low: float = -0.05
    high: float = 0.05
    kind: ClassVar[str] = "uniform"

    def __post_init__(self) -> None:
        check_finite("init.Uniform", "low", self.low)
        check_finite("init.Uniform", "high", self.high)
        if not self.low < self.high:
            raise ValueError(
                f"init.Uniform: expected low < high, got low={self.low}, high={self.high}"
            )

    def generate(self, keys: Any, dim: int, seed: int) -> Any:
        xp = array_module(keys)
        u = _uniform01(counter_bits(keys, dim, seed))
        values = (self.low + (self.high - self.low) * u).astype(xp.float32)
        # Rounding to float32 can reach `high` itself when the range is narrow for its
        # magnitude; keep the interval half-open.
        below_high = np.nextafter(np.float32(self.high), np.float32(self.low))
        return xp.minimum(values, below_high)


@dataclass(frozen=True)
class Normal:
    """N(mean, std**2), as torch.nn.init.normal_ (same defaults)."""

    mean: float = 0.0
    std: float = 1.0
    kind: ClassVar[str] = "normal"

    def __post_init__(self) -> None:
        check_finite("init.Normal", "mean", self.mean)
        check_positive("init.Normal", "std", self.std)

    def generate(self, keys: Any, dim: int, seed: int) -> Any:
        xp = array_module(keys)
        return (self.mean + self.std * _standard_normal(keys, dim, seed, 0)).astype(xp.float32)


@dataclass(frozen=True)
class TruncatedNormal:
    """N(mean, std**2) cut at mean +- 2 std, resampled outside (as TensorFlow's
    truncated_normal initialiser). Each resampling round draws from a new counter stream, so
    the result is still a pure function of (seed, key, column)."""

    mean: float = 0.0
    std: float = 1.0
    kind: ClassVar[str] = "truncated_normal"
    max_rounds: ClassVar[int] = 64  # P(|z| > 2) = 4.6%, so 64 rounds leave ~1e-85 unresolved

    def __post_init__(self) -> None:
        check_finite("init.TruncatedNormal", "mean", self.mean)
        check_positive("init.TruncatedNormal", "std", self.std)

    def generate(self, keys: Any, dim: int, seed: int) -> Any:
        xp = array_module(keys)
        z = _standard_normal(keys, dim, seed, 0)
        for round_ in range(1, self.max_rounds + 1):
            rows, cols = xp.nonzero(xp.abs(z) > 2.0)
            if rows.size == 0:
                break
            redraw = _standard_normal(keys[rows], dim, seed, round_)
            z[rows, cols] = redraw[xp.arange(rows.size), cols]
        z = xp.clip(z, -2.0, 2.0)
        return (self.mean + self.std * z).astype(xp.float32)


@dataclass(frozen=True)
class Constant:
    """Every value equal to `value`, as torch.nn.init.constant_."""

    value: float = 0.0
    kind: ClassVar[str] = "constant"

    def __post_init__(self) -> None:
        check_finite("init.Constant", "value", self.value)

    def generate(self, keys: Any, dim: int, seed: int) -> Any:
        xp = array_module(keys)
        return xp.full((keys.shape[0], dim), self.value, dtype=xp.float32)


@dataclass(frozen=True)
class Zeros:
    """All zeros, as torch.nn.init.zeros_."""

    kind: ClassVar[str] = "zeros"

    def generate(self, keys: Any, dim: int, seed: int) -> Any:
        xp = array_module(keys)
        return xp.zeros((keys.shape[0], dim), dtype=xp.float32)


Initializer = Uniform | Normal | TruncatedNormal | Constant | Zeros
INITIALIZERS: dict[str, type] = {
    cls.kind: cls for cls in (Uniform, Normal, TruncatedNormal, Constant, Zeros)
}
