"""The array module (numpy on the host, cupy on the GPU) that storage code is written against."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np


def array_module(array: Any) -> ModuleType:
    """numpy for numpy arrays, cupy for cupy arrays (without importing cupy when unused)."""
    if isinstance(array, np.ndarray):
        return np
    module = type(array).__module__
    if module.startswith("cupy"):
        import cupy

        return cupy
    return np


def to_host(array: Any) -> np.ndarray:
    """A numpy copy (or the array itself) of a numpy or cupy array."""
    if isinstance(array, np.ndarray):
        return array
    return array.get()
