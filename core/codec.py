"""The layout of a stored row, in one place: RowCodec.

In memory (every cache tier, the cascade, the optimizers) a row is `width` float32 slots:

    [ weights: dim | optimizer state: (size_factor - 1) * dim | step: STEP_SLOTS ]

the step slots (steps_to_live > 0 only) holding the row's last-update step as one
little-endian int64, bit for bit. In RocksDB (the value of the row's key) the same row is
`value_bytes` bytes: the weights as `weights_dtype`, the state as `state_dtype`, then the step
as 8 little-endian bytes, exact whatever the dtypes. float32 is the default and stores the
memory layout as it is; float16 and bfloat16 halve the cold rows (TableConfig.cold_dtype,
cold_state_dtype): a row is rounded (to nearest, ties to even) each time it is written to
RocksDB, so a row whose only copy is on disk holds the rounded values, and so does a
snapshot taken from it. Rounding saturates at the type's largest finite value instead of
becoming inf (a stored value is always finite). Snapshots hold rows as float32 [n, row_width]
(`row_bytes` each), which represents every rounded value exactly.

bfloat16 has no numpy dtype: it is the upper half of a float32's bits, rounded with integer
operations (round to nearest even) - the same result as torch's float32 -> bfloat16.

Example::

    codec = RowCodec(dim=4, size_factor=2, steps=True, weights_dtype="bfloat16")
    rows = np.zeros((3, codec.width), np.float32)   # [3, 4 + 4 + 2]
    codec.stamp(rows, 7)
    values = codec.encode(rows)                     # 3 bytes objects of 4*2 + 4*4 + 8 bytes
    back = codec.decode(b"".join(values), 3)        # float32 [3, 10]; codec.steps(back) == 7
"""

from __future__ import annotations

from typing import Any

import numpy as np

STEP_SLOTS = 2  # float32 slots after a stored row that hold its last-update step (steps_to_live)
SLOT_BYTES = 4  # one float32 slot in memory
STEP_BYTES = 8  # the step in RocksDB: a little-endian int64
COLD_DTYPES = ("float32", "float16", "bfloat16")
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
FLOAT16_MAX = float(np.finfo(np.float16).max)  # 65504
FLOAT16_TINY = float(np.finfo(np.float16).smallest_subnormal)  # 5.96e-8
BFLOAT16_MAX_BITS = 0x7F7F  # the largest finite bfloat16, 3.39e38


WIRE_DTYPE = np.dtype("<f4")  # weights and gradients on the wire: little-endian float32


def wire_row_bytes(dim: int) -> int:
    """Bytes of one row of weights or gradients on the wire (a lookup's reply, a push)."""
    return WIRE_DTYPE.itemsize * dim


def step_bits(step: int) -> np.ndarray:
    """The STEP_SLOTS float32 slots that hold `step` as a row's last-update step: its int64
    bits, copied bit for bit (steps_to_live > 0)."""
    return np.array([step], dtype="<i8").view(np.float32)


def to_bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bits of float32 values: the upper 16 bits of each float32, rounded to
    nearest with ties to even; finite values beyond bfloat16's range saturate at its largest
    finite value (never inf); NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> 16
    half = rounded.astype(np.uint16)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    finite = magnitude < np.uint32(0x7F800000)
    overflow = finite & ((half & np.uint16(0x7FFF)) > np.uint16(BFLOAT16_MAX_BITS))
    if overflow.any():
        sign = (bits[overflow] >> np.uint32(16)).astype(np.uint16) & np.uint16(0x8000)
        half[overflow] = sign | np.uint16(BFLOAT16_MAX_BITS)
    nan = magnitude > np.uint32(0x7F800000)
    if nan.any():
        half[nan] = (bits[nan] >> np.uint32(16)).astype(np.uint16) | np.uint16(0x0040)
    return half


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """float32 values of uint16 bfloat16 bits (exact: every bfloat16 is a float32)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _encode_part(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values [n, k] as uint8 [n, k * bytes of dtype], little-endian."""
    if dtype == "float32":
        out = np.ascontiguousarray(values, dtype="<f4")
    elif dtype == "float16":
        clipped = np.clip(values, -FLOAT16_MAX, FLOAT16_MAX)  # saturate, never inf
        out = np.ascontiguousarray(clipped.astype("<f2"))
    else:
        out = to_bfloat16_bits(values).astype("<u2")
    return out.view(np.uint8).reshape(values.shape[0], -1)


def _decode_part(raw: np.ndarray, dtype: str) -> np.ndarray:
    """uint8 [n, k * bytes] back to float32 [n, k]."""
    raw = np.ascontiguousarray(raw)
    if dtype == "float32":
        return raw.view("<f4").astype(np.float32, copy=False)
    if dtype == "float16":
        return raw.view("<f2").astype(np.float32)
    return from_bfloat16_bits(raw.view("<u2"))


class RowCodec:
    """The layout of one table's stored rows (see the module docstring): in memory float32
    [n, width]; in RocksDB `value_bytes` bytes a row. Immutable; compare with ==."""

    def __init__(
        self,
        dim: int,
        size_factor: int,
        *,
        steps: bool = False,
        weights_dtype: str = "float32",
        state_dtype: str = "float32",
    ) -> None:
        for field, dtype in (("weights_dtype", weights_dtype), ("state_dtype", state_dtype)):
            if dtype not in COLD_DTYPES:
                raise ValueError(f"RowCodec: {field} expected one of {COLD_DTYPES}, got {dtype!r}")
        self.dim = dim
        self.size_factor = size_factor
        self.step_slots = STEP_SLOTS if steps else 0
        self.weights_dtype = weights_dtype
        self.state_dtype = state_dtype

    def _key(self) -> tuple[Any, ...]:
        return self.dim, self.size_factor, self.step_slots, self.weights_dtype, self.state_dtype

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowCodec) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"RowCodec(dim={self.dim}, size_factor={self.size_factor}, "
            f"steps={bool(self.step_slots)}, weights_dtype={self.weights_dtype!r}, "
            f"state_dtype={self.state_dtype!r})"
        )

    @property
    def row_width(self) -> int:
        """float32 slots of weights and optimizer state (what a snapshot holds per row)."""
        return self.dim * self.size_factor

    @property
    def width(self) -> int:
        """float32 slots per row in memory: row_width, then the step slots if any."""
        return self.row_width + self.step_slots

    @property
    def row_bytes(self) -> int:
        """Bytes of a row's weights and state as float32 (a snapshot's row, a bucket row)."""
        return SLOT_BYTES * self.row_width

    @property
    def memory_bytes(self) -> int:
        """Bytes of a row in a cache tier's arena."""
        return SLOT_BYTES * self.width

    @property
    def value_bytes(self) -> int:
        """Bytes of a row's RocksDB value."""
        state = (self.size_factor - 1) * self.dim
        steps = STEP_BYTES if self.step_slots else 0
        return (
            _DTYPE_BYTES[self.weights_dtype] * self.dim
            + _DTYPE_BYTES[self.state_dtype] * state
            + steps
        )

    @property
    def exact(self) -> bool:
        """Whether RocksDB holds the float32 memory layout as it is (no rounding)."""
        return self.weights_dtype == "float32" and self.state_dtype == "float32"

    # -- the parts of rows in memory -----------------------------------------------------

    def weights(self, rows: np.ndarray) -> np.ndarray:
        """The weights [n, dim] of rows [n, >= dim] (a view)."""
        return rows[:, : self.dim]

    def stamp(self, rows: np.ndarray, step: int) -> None:
        """Write `step` as the last-update step of rows [n, width] (steps only)."""
        rows[:, self.row_width :] = step_bits(step)

    def steps(self, rows: np.ndarray) -> np.ndarray:
        """The last-update step (int64 [n]) of rows [n, width] (steps only)."""
        tail = np.ascontiguousarray(rows[:, self.row_width :])
        return tail.view("<i8").reshape(-1).astype(np.int64)

    def widen(self, rows: np.ndarray, steps: np.ndarray | int | None = None) -> np.ndarray:
        """Rows [n, row_width] as stored, [n, width]: with step slots, each row's step from
        `steps` (int64 [n], or one int for all; None: 0). Without, rows as they are."""
        if not self.step_slots:
            return rows
        out = np.zeros((rows.shape[0], self.width), dtype=np.float32)
        out[:, : self.row_width] = rows
        if isinstance(steps, int):
            self.stamp(out, steps)
        elif steps is not None:
            bits = np.asarray(steps).astype("<i8").view(np.float32)
            out[:, self.row_width :] = bits.reshape(-1, STEP_SLOTS)
        return out

    # -- RocksDB values ------------------------------------------------------------------

    def encode(self, rows: np.ndarray) -> list[bytes]:
        """One RocksDB value per row of rows [n, width] (float32 weights and state rounded
        to the cold dtypes; the step copied exactly)."""
        if self.exact:
            raw = np.ascontiguousarray(rows, dtype="<f4").view(np.uint8)
        else:
            n, row_width, dim = rows.shape[0], self.row_width, self.dim
            parts = [
                _encode_part(rows[:, :dim], self.weights_dtype),
                _encode_part(rows[:, dim:row_width], self.state_dtype),
            ]
            if self.step_slots:
                parts.append(np.ascontiguousarray(rows[:, row_width:]).view(np.uint8))
            raw = np.concatenate(parts, axis=1) if n else np.empty((0, self.value_bytes), np.uint8)
        return raw.view(np.dtype((np.void, self.value_bytes))).ravel().tolist()

    def decode(self, blob: bytes | bytearray | memoryview | np.ndarray, n: int) -> np.ndarray:
        """Rows float32 [n, width] of n RocksDB values joined into one buffer (its length
        checked by the caller: n * value_bytes). A writable array: a view of a writable
        bytearray or numpy array given (float32 values need no conversion), else new."""
        if self.exact:
            rows = np.frombuffer(blob, dtype="<f4").reshape(n, self.width)
            owned = isinstance(blob, bytearray) or (
                isinstance(blob, np.ndarray) and blob.flags.writeable
            )
            return rows.astype(np.float32, copy=not owned)
        raw = np.frombuffer(blob, dtype=np.uint8).reshape(n, self.value_bytes)
        out = np.empty((n, self.width), dtype=np.float32)
        dim, row_width = self.dim, self.row_width
        split = _DTYPE_BYTES[self.weights_dtype] * dim
        state_end = split + _DTYPE_BYTES[self.state_dtype] * (row_width - dim)
        out[:, :dim] = _decode_part(raw[:, :split], self.weights_dtype)
        out[:, dim:row_width] = _decode_part(raw[:, split:state_end], self.state_dtype)
        if self.step_slots:
            out[:, row_width:] = np.ascontiguousarray(raw[:, state_end:]).view(np.float32)
        return out

    def round(self, rows: np.ndarray) -> np.ndarray:
        """rows [n, width] as RocksDB gives them back (decode of encode): what a row whose
        only copy is on disk holds."""
        if self.exact:
            return rows
        return self.decode(b"".join(self.encode(rows)), rows.shape[0])
