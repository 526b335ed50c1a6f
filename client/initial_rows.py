"""Initial rows of a new table from a matrix (HugeCTR's init_value): given (keys, values),
or read from a file named on the admin's side:

- .npy: a float matrix [n, dim]; row i is the initial weights of key i.
- .npz: arrays "keys" (int, [n]) and "values" (float, [n, dim]).

The rows are checked whole (shape, dtype, finite values, distinct keys >= 0) before the
table is created, so a bad matrix creates nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tierps.client.formats import as_array, float_array
from tierps.core.config import TableConfig
from tierps.core.errors import InvalidArgumentError

InitialRows = tuple[Any, Any] | str | Path  # (keys, values), or a .npy / .npz file


def read_initial_rows(
    where: str, initial: InitialRows, config: TableConfig
) -> tuple[np.ndarray, np.ndarray]:
    """(keys int64 [n], values float32 [n, dim]) for a table of this config, checked; `where`
    names the table."""
    dim = config.dim
    if isinstance(initial, str | Path):
        keys, values = _read_file(where, Path(initial))
    elif isinstance(initial, tuple) and len(initial) == 2:
        keys, values = initial
    else:
        raise InvalidArgumentError(
            f"{where}: field 'initial' expected (keys, values) or the path of a .npy or .npz "
            f"file, got {type(initial).__name__}"
        )
    keys = as_array(where, "initial keys", keys)
    if keys.ndim != 1 or keys.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"{where}: field 'initial keys' expected a 1-D integer array, got dtype "
            f"{keys.dtype} of shape {keys.shape}"
        )
    keys = keys.astype(np.int64)
    values = float_array(
        where, "initial values", values, (keys.size, dim), "one row of the table's dim per key"
    )
    if keys.size and keys.min() < 0:
        index = int(np.argmax(keys < 0))
        raise InvalidArgumentError(
            f"{where}: field 'initial keys' expected keys >= 0, got {int(keys[index])} at "
            f"index {index}"
        )
    if not config.use_hashtable and keys.size and keys.max() >= config.capacity:
        index = int(np.argmax(keys >= config.capacity))
        raise InvalidArgumentError(
            f"{where}: field 'initial keys' expected keys in [0, {config.capacity}) (a "
            f"direct-index table's capacity), got {int(keys[index])} at index {index}"
        )
    unique, counts = np.unique(keys, return_counts=True)
    if (counts > 1).any():
        raise InvalidArgumentError(
            f"{where}: field 'initial keys' expected distinct keys, got key "
            f"{int(unique[np.argmax(counts > 1)])} {int(counts.max())} times"
        )
    return keys, values


def _read_file(where: str, path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        if path.suffix == ".npy":
            values = np.load(path, allow_pickle=False)
            return np.arange(values.shape[0] if values.ndim else 0, dtype=np.int64), values
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                missing = {"keys", "values"} - set(archive.files)
                if missing:
                    raise InvalidArgumentError(
                        f"{where}: initial rows file {path} expected arrays 'keys' and "
                        f"'values', got {sorted(archive.files)}"
                    )
                return archive["keys"], archive["values"]
    except (OSError, ValueError) as error:
        if isinstance(error, InvalidArgumentError):
            raise
        raise InvalidArgumentError(
            f"{where}: initial rows file {path} could not be read: {error}"
        ) from None
    raise InvalidArgumentError(
        f"{where}: initial rows file expected a .npy or .npz path, got {str(path)!r}"
    )
