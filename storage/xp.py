"""The array module (numpy on the host, cupy on the GPU) that storage code is written against,
and the one place that decides whether a usable GPU is there."""

from __future__ import annotations

import functools
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


@functools.cache
def gpu_module() -> tuple[ModuleType | None, str]:
    """(cupy, "") when cupy imports and can allocate on a GPU, else (None, why not).

    `import cupy` succeeds on a machine without a GPU (or without a driver); only
    cupy.is_available() tells, so both are asked. Cached: the answer does not change while
    the process runs."""
    try:
        import cupy
    except Exception as error:  # ImportError, or a CUDA library that fails to load
        return None, (
            f"cupy is not installed or does not import ({type(error).__name__}: {error}); "
            f"install the 'gpu' extra, e.g. pip install 'tierps[gpu]'"
        )
    try:
        usable = bool(cupy.is_available())
    except Exception as error:
        return None, f"cupy.is_available() failed ({type(error).__name__}: {error})"
    if not usable:
        return None, "cupy.is_available() is False: no CUDA device or driver on this machine"
    return cupy, ""


GPU_ARRAYS = ("auto", "numpy")  # the choices of a shard's gpu_arrays setting (see gpu_arrays)


def gpu_arrays(choice: str) -> tuple[ModuleType | None, str]:
    """The array module of GPU cache tiers for a shard's `gpu_arrays` setting: "auto" gives
    gpu_module(); "numpy" runs the GPU tier's own code on host arrays (for tests, and to try
    a GPU deployment's configuration on a machine without one)."""
    if choice == "numpy":
        return np, ""
    if choice == "auto":
        return gpu_module()
    raise ValueError(f"field 'gpu_arrays' expected one of {GPU_ARRAYS}, got {choice!r}")
