"""Checks shared by configs and batched calls. Every message names where the value came
from, the field, what was expected and what came instead."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tierps.core.errors import InvalidArgumentError


def check_finite(owner: str, field: str, value: Any, expected: str = "") -> None:
    """A real number (not bool, not NaN or infinite); `expected` adds the range wanted."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(
            f"{owner}: field '{field}' expected a finite number{expected}, got {value!r}"
        )


def check_positive(owner: str, field: str, value: Any) -> None:
    check_finite(owner, field, value, " > 0")
    if not value > 0:
        raise ValueError(f"{owner}: field '{field}' expected > 0, got {value!r}")


def check_range(
    owner: str,
    field: str,
    value: Any,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """low <= value <= high, with either end open on request."""
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    check_finite(owner, field, value, f" in {interval}")
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        raise ValueError(f"{owner}: field '{field}' expected in {interval}, got {value!r}")


def check_int(owner: str, field: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{owner}: field '{field}' expected an int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{owner}: field '{field}' expected in [{low}, {high}], got {value!r}")


MAX_STEP = 2**53 - 1
"""The largest step a push may carry. Steps count from 1, so [1, 2**53) holds any training
run (2**53 steps at a million a second take 285 years), and every place a step goes holds
it exactly: a table's step figures cross the wire as doubles (TableDescription.lifecycle,
exact below 2**53), the store keeps current_step in JSON (exact in every JSON reader below
2**53), and rows keep their last-update step as int64 bits (below 2**63). A larger step -
2**63 and up overflowed int64 and broke every later push of a steps_to_live table - is
refused before anything changes."""


DEFAULT_MAX_STEP_LEAP = 10**9
"""How far one push may move a table's clock (its largest step pushed) forward, by default
(ServerConfig.max_step_leap, `tierps serve --max-step-leap`; 0: no limit). A billion steps is
more than a trainer moves between two pushes of one table (about 12 days at 1,000 steps a
second), and far below the steps that a bug sends: 10**12, 2**53-1, a time in milliseconds
(~1.7e12). A table with no push yet (clock 0) takes its first push at any step: that is
where its trainer is (a resume from a checkpoint at step 1,000,000 into a new table, a shard
that gets the table's first keys late); a snapshot load sets the clock with the rows."""


def check_step_leap(where: str, step: int, clock: int, limit: int) -> None:
    """Refuse (InvalidArgumentError) a push at `step` more than `limit` steps past a table's
    clock; a clock of 0 (no push yet) or a limit of 0 (off) refuses nothing."""
    if clock and limit and step - clock > limit:
        raise InvalidArgumentError(
            f"{where}: field 'step' expected at most {clock + limit} (the table's clock, its "
            f"largest step pushed, is {clock}; max_step_leap {limit} is the most one push may "
            f"move it), got {step}, {step - clock} steps ahead; a trainer's step is off, or an "
            f"admin raises the limit with `tierps serve --max-step-leap N` "
            f"(ServerConfig.max_step_leap; 0: no limit)"
        )


def check_step(where: str, step: Any) -> int:
    """An optimizer step: an int in [1, MAX_STEP] (Adam's bias correction counts from 1)."""
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 1:
        raise InvalidArgumentError(
            f"{where}: field 'step' expected an int >= 1 and < 2**53, got {step!r}"
        )
    if step > MAX_STEP:
        expected = f"an int >= 1 and < 2**53 (<= {MAX_STEP})"
        raise InvalidArgumentError(f"{where}: field 'step' expected {expected}, got {step!r}")
    return int(step)


def as_keys(where: str, keys: Any) -> np.ndarray:
    """Keys as a 1-D int64 array; any integer dtype that fits is accepted."""
    if not isinstance(keys, np.ndarray):
        raise InvalidArgumentError(
            f"{where}: field 'keys' expected a 1-D numpy integer array, got {type(keys).__name__}"
        )
    if keys.ndim != 1:
        raise InvalidArgumentError(
            f"{where}: field 'keys' expected a 1-D array, got shape {keys.shape}"
        )
    if keys.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"{where}: field 'keys' expected an integer dtype (int64), got {keys.dtype}"
        )
    if keys.dtype == np.uint64 and keys.size and int(keys.max()) > np.iinfo(np.int64).max:
        raise InvalidArgumentError(
            f"{where}: field 'keys' expected values <= 2**63-1, got {int(keys.max())}"
        )
    return np.ascontiguousarray(keys, dtype=np.int64)


def as_rows(where: str, field: str, rows: Any, n: int, dim: int) -> np.ndarray:
    """A float32 [n, dim] array of finite values, matching n keys."""
    if not isinstance(rows, np.ndarray):
        raise InvalidArgumentError(
            f"{where}: field '{field}' expected a numpy float32 array, got {type(rows).__name__}"
        )
    if rows.dtype != np.float32:
        raise InvalidArgumentError(
            f"{where}: field '{field}' expected dtype float32, got {rows.dtype}"
        )
    if rows.shape != (n, dim):
        raise InvalidArgumentError(
            f"{where}: field '{field}' expected shape ({n}, {dim}) for {n} keys of dim {dim}, "
            f"got {rows.shape}"
        )
    bad = first_non_finite(rows)
    if bad is not None:
        raise InvalidArgumentError(
            f"{where}: field '{field}' expected finite values, got {rows[bad]} at [{bad[0]}, "
            f"{bad[1]}]"
        )
    return np.ascontiguousarray(rows)


def as_out(where: str, out: Any, n: int, dim: int) -> np.ndarray:
    """A caller's output for the rows of n keys: a writable C-contiguous float32 [n, dim]
    numpy array (a view of a bytearray is one), returned as it is, or InvalidArgumentError
    saying what was expected and what came."""
    expected = f"a writable C-contiguous float32 numpy array of shape ({n}, {dim})"
    if not isinstance(out, np.ndarray):
        got = type(out).__name__
    elif out.dtype != np.float32:
        got = f"dtype {out.dtype}"
    elif out.shape != (n, dim):
        got = f"shape {out.shape}"
    elif not out.flags.c_contiguous:
        got = "a non-contiguous array"
    elif not out.flags.writeable:
        got = "a read-only array"
    else:
        return out
    raise InvalidArgumentError(f"{where}: field 'out' expected {expected}, got {got}")


def first_non_finite(values: np.ndarray) -> tuple[int, ...] | None:
    """The index of the first inf or NaN in an array, in C order ((row, column) of a 2-D
    one), None if every value is finite: what every finiteness refusal names. Compiled for
    a C-contiguous float32 array (no [n] temporary), numpy's isfinite otherwise."""
    from tierps.core.compiled import first_non_finite_index  # imports numba

    if values.ndim and (flat := first_non_finite_index(values)) is not None:
        if flat < 0:
            return None
        return tuple(int(i) for i in np.unravel_index(flat, values.shape))
    finite = np.isfinite(values)
    if finite.all():
        return None
    return tuple(int(i) for i in np.argwhere(~finite)[0])
