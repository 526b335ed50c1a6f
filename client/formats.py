"""Batch formats of the client, and the one validator that turns each into bags.

A batch of bags (one bag per sample and feature; the keys of a bag are pooled into one row)
comes in one of three formats, the conventions of HugeCTR, TensorFlow and torch:

- dense: keys [..., nnz], each bag a row of the last axis, padded with -1 (any key < 0 is
  padding). The pooled output is [..., dim].
- CSR: (values [nnz], offsets) as torch.nn.EmbeddingBag takes them: offsets of length B
  (bag i is values[offsets[i]:offsets[i+1]], the last bag runs to the end), or of length
  B + 1 ending with len(values) when include_last_offset=True. The output is [B, dim].
- COO: `COO(rows, values, shape)` as a tf.SparseTensor of rank 2: values[j] belongs to bag
  rows[j] of shape[0] bags; rows need not be sorted. The output is [shape[0], dim].

Per-sample weights have the shape of the keys (dense) or of the values (CSR, COO).

Any of these arrays may be numpy, a list, a torch tensor, or a DLPack array on a GPU (cupy);
`array_device` says where one lives. Host batches are checked here; batches on a torch
device are checked where they are (tierps.client.device_pooling), which calls `to_bags` on
host copies only to word the refusal of a bad one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from tierps.core.errors import InvalidArgumentError
from tierps.core.validation import first_non_finite


class COO(NamedTuple):
    """A rank-2 sparse batch: values[j] is a key of bag rows[j]; shape = (bags, max keys per
    bag) as tf.SparseTensor's dense_shape (only shape[0] matters)."""

    rows: Any
    values: Any
    shape: tuple[int, int]


@dataclass(frozen=True)
class Bags:
    """A checked batch in CSR form: keys [nnz] int64 (< 0: padding), offsets [B + 1] int64
    (bag i is keys[offsets[i]:offsets[i+1]]), weights [nnz] float32 or None, and the leading
    shape of the pooled output (its last axis, dim, is the table's)."""

    keys: np.ndarray
    offsets: np.ndarray
    weights: np.ndarray | None
    shape: tuple[int, ...]

    @property
    def num_bags(self) -> int:
        return self.offsets.size - 1


# DLPack device types (dlpack.h's DLDeviceType) that torch can import, as torch device types.
_DLPACK_DEVICES = {1: "cpu", 2: "cuda", 3: "cpu", 10: "cuda", 13: "cuda"}


def array_device(value: Any) -> str:
    """Where an array-like lives, as a torch device string: "cpu" for numpy arrays, lists,
    scalars and CPU tensors; "cuda:0" for a CUDA torch tensor or a DLPack array on GPU 0
    (cupy). Imports neither torch nor cupy: a torch tensor can only come from a loaded torch."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return str(value.device)
    if isinstance(value, np.ndarray) or not hasattr(value, "__dlpack_device__"):
        return "cpu"
    kind, index = value.__dlpack_device__()
    name = _DLPACK_DEVICES.get(int(kind))
    if name is None:
        return f"DLPack device type {int(kind)}"
    return name if name == "cpu" else f"{name}:{int(index)}"


def batch_arrays(value: Any) -> list[tuple[str, Any]]:
    """(field, array) of each array of a feature's batch in any format, its keys first
    ('keys', or a COO's 'values' and 'rows'; then 'offsets', 'per_sample_weights'); none for
    checked Bags, which live on the host."""
    if isinstance(value, Bags):
        return []
    if isinstance(value, tuple) and not isinstance(value, COO):
        keys, *rest = value or (None,)
        # A tuple of a bad length is refused where it is read; here, name what it holds.
        named = zip(("offsets", "per_sample_weights"), rest, strict=False)
        arrays = [] if keys is None else batch_arrays(keys)
        return arrays + [(name, array) for name, array in named if array is not None]
    if isinstance(value, COO):
        return [("values", value.values), ("rows", value.rows)]
    return [("keys", value)]


def as_array(where: str, field: str, value: Any) -> np.ndarray:
    """A numpy view of an array-like (numpy, torch CPU tensors, lists)."""
    if hasattr(value, "detach"):  # a torch tensor: no copy for a CPU tensor
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(
            f"{where}: field '{field}' expected an array, got {error}"
        ) from None


def _keys(where: str, field: str, value: Any) -> np.ndarray:
    keys = as_array(where, field, value)
    if keys.dtype.kind not in "iu" and not (keys.dtype.kind == "f" and keys.size == 0):
        raise InvalidArgumentError(
            f"{where}: field '{field}' expected an integer array (int64 keys), got dtype "
            f"{keys.dtype}"
        )
    if keys.dtype == np.uint64 and keys.size and int(keys.max()) > np.iinfo(np.int64).max:
        raise InvalidArgumentError(
            f"{where}: field '{field}' expected keys <= 2**63-1, got {int(keys.max())}"
        )
    return keys.astype(np.int64, copy=False)


def float_array(
    where: str, field: str, value: Any, shape: tuple[int, ...], of: str, *, kinds: str = "f"
) -> np.ndarray:
    """A finite, contiguous float32 array of exactly `shape` (`of` says what fixes it), from
    an array-like whose dtype kind is in `kinds`."""
    array = as_array(where, field, value)
    if array.shape != shape:
        raise InvalidArgumentError(
            f"{where}: field '{field}' expected shape {shape} ({of}), got {array.shape}"
        )
    if array.dtype.kind not in kinds:
        raise InvalidArgumentError(
            f"{where}: field '{field}' expected a float array, got dtype {array.dtype}"
        )
    array = np.ascontiguousarray(array, dtype=np.float32)
    index = first_non_finite(array)
    if index is not None:
        at = index[0] if len(index) == 1 else list(index)
        raise InvalidArgumentError(
            f"{where}: field '{field}' expected finite values, got {array[index]} at "
            f"{'index ' if len(index) == 1 else ''}{at}"
        )
    return array


def _weights(where: str, value: Any, shape: tuple[int, ...], of: str) -> np.ndarray | None:
    if value is None:
        return None
    weights = float_array(where, "per_sample_weights", value, shape, f"that of {of}", kinds="fiu")
    return weights.reshape(-1)


def _offsets(where: str, value: Any, nnz: int, include_last_offset: bool) -> np.ndarray:
    offsets = _keys(where, "offsets", value)
    if offsets.ndim != 1:
        raise InvalidArgumentError(
            f"{where}: field 'offsets' expected a 1-D array, got shape {offsets.shape}"
        )
    if offsets.size and offsets[0] != 0:
        raise InvalidArgumentError(
            f"{where}: field 'offsets' expected offsets[0] = 0, got {int(offsets[0])}"
        )
    # One comparison pass for a good batch: offsets that never fall and end within the
    # values are all within them; only other offsets are searched for one beyond.
    falls = offsets[1:] < offsets[:-1]
    rises = not falls.any()
    if not rises or (offsets.size and offsets[-1] > nnz):
        beyond = offsets > nnz
        if beyond.any():
            i = int(np.argmax(beyond))
            raise InvalidArgumentError(
                f"{where}: field 'offsets' expected values <= len(values)={nnz}, got "
                f"offsets[{i}]={int(offsets[i])}"
            )
    if include_last_offset:
        if offsets.size == 0 or offsets[-1] != nnz:
            last = int(offsets[-1]) if offsets.size else "none"
            raise InvalidArgumentError(
                f"{where}: field 'offsets' with include_last_offset expected the last offset "
                f"to equal len(values)={nnz}, got {last}"
            )
    else:
        if offsets.size == 0 and nnz:
            raise InvalidArgumentError(
                f"{where}: field 'offsets' expected at least one bag for {nnz} values, got "
                f"no offsets"
            )
        bounds = np.empty(offsets.size + 1, np.int64)
        bounds[:-1] = offsets
        bounds[-1] = nnz  # >= offsets[-1]: no offset is beyond nnz
        offsets = bounds
    if not rises:
        i = int(np.argmax(falls))
        raise InvalidArgumentError(
            f"{where}: offsets must not decrease, but offsets[{i + 1}]={int(offsets[i + 1])} "
            f"< offsets[{i}]={int(offsets[i])}"
        )
    return offsets


def to_bags(
    where: str,
    keys: Any,
    offsets: Any = None,
    per_sample_weights: Any = None,
    *,
    include_last_offset: bool = False,
) -> Bags:
    """Check a batch in any of the three formats and return it as Bags. `where` names the
    table or feature in the messages: "table 'item': offsets must not decrease, ..."."""
    if isinstance(keys, COO):
        if offsets is not None:
            raise InvalidArgumentError(
                f"{where}: a COO batch expected offsets=None (its rows say the bags), got "
                f"offsets of type {type(offsets).__name__}"
            )
        return _coo_bags(where, keys, per_sample_weights)
    values = _keys(where, "keys", keys)
    if offsets is None:  # dense [..., nnz], -1 padded
        if values.ndim == 0:
            raise InvalidArgumentError(
                f"{where}: field 'keys' expected dense keys [..., nnz] (or values with "
                f"offsets), got a scalar"
            )
        weights = _weights(where, per_sample_weights, values.shape, "the keys")
        bags, width = int(np.prod(values.shape[:-1])), values.shape[-1]
        starts = np.arange(0, bags * width + 1, max(width, 1), dtype=np.int64)
        if width == 0:
            starts = np.zeros(bags + 1, dtype=np.int64)
        return Bags(values.reshape(-1), starts, weights, values.shape[:-1])
    if values.ndim != 1:
        raise InvalidArgumentError(
            f"{where}: field 'keys' with offsets expected 1-D values, got shape {values.shape}"
        )
    weights = _weights(where, per_sample_weights, values.shape, "the values")
    checked = _offsets(where, offsets, values.size, include_last_offset)
    return Bags(values, checked, weights, (checked.size - 1,))


def _coo_bags(where: str, batch: COO, per_sample_weights: Any) -> Bags:
    rows = _keys(where, "rows", batch.rows)
    values = _keys(where, "values", batch.values)
    shape = tuple(batch.shape)
    if len(shape) != 2 or any(
        isinstance(s, bool) or not isinstance(s, int | np.integer) or s < 0 for s in shape
    ):
        raise InvalidArgumentError(
            f"{where}: COO field 'shape' expected (bags, max keys per bag) of ints >= 0, got "
            f"{batch.shape!r}"
        )
    if rows.ndim != 1 or rows.shape != values.shape:
        raise InvalidArgumentError(
            f"{where}: COO fields 'rows' and 'values' expected two 1-D arrays of one length, "
            f"got shapes {rows.shape} and {values.shape}"
        )
    weights = _weights(where, per_sample_weights, values.shape, "the values")
    bags = int(shape[0])
    if rows.size and (rows.min() < 0 or rows.max() >= bags):
        bad = int(np.argmax((rows < 0) | (rows >= bags)))
        raise InvalidArgumentError(
            f"{where}: COO field 'rows' expected values in [0, {bags}), got rows[{bad}]="
            f"{int(rows[bad])}"
        )
    order = np.argsort(rows, kind="stable")  # bags in row order, keys in their given order
    offsets = np.zeros(bags + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=bags), out=offsets[1:])
    return Bags(values[order], offsets, None if weights is None else weights[order], (bags,))
