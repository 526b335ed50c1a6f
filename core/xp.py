"""The array module (numpy on the host, cupy on the GPU) that storage code is written against,
and the one place that decides whether a usable GPU is there."""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


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


# A kernel of our own (what storage/kernels.py compiles through cupy.RawKernel / RawModule).
_PROOF_SOURCE = r"""
extern "C" __global__ void tierps_proof(long long* x, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1;
}
"""


def _prove_kernels(cupy: ModuleType) -> str:
    """ "" when cupy can compile and run kernels here, else why not. Both ways the GPU tier
    compiles code are tried on 4 numbers: a cupy ufunc (cupy's own elementwise kernels, built
    by NVRTC with cupy's headers: the generic array code runs on those) and a RawKernel (the
    fused kernels of storage/kernels.py). The result is read back, which synchronises, so a
    launch failure shows here too."""
    try:
        x = cupy.arange(4, dtype=cupy.int64) + 1
        kernel = cupy.RawKernel(_PROOF_SOURCE, "tierps_proof")
        kernel((1,), (4,), (x, np.int64(4)))
        got = [int(v) for v in cupy.asnumpy(x).tolist()]
    except Exception as error:  # NVRTC missing, CUDA headers missing, a driver error, ...
        return (
            f"cupy finds a GPU, but a 4-element test kernel failed to compile or run "
            f"({type(error).__name__}: {error}); check that NVRTC and the CUDA headers of "
            f"cupy's CUDA version are installed"
        )
    if got != [2, 3, 4, 5]:
        return f"cupy finds a GPU, but a test kernel adding 2 to [0, 1, 2, 3] gave {got}"
    return ""


@functools.cache
def gpu_module() -> tuple[ModuleType | None, str]:
    """(cupy, "") when cupy imports, finds a GPU and compiles and runs a tiny kernel there;
    else (None, why not), logged once as a warning where a GPU is found but kernels fail.

    `import cupy` succeeds on a machine without a GPU (or without a driver), so
    cupy.is_available() is asked; and a GPU without NVRTC or the CUDA headers passes that
    but fails every kernel compile, so a kernel is compiled and run as well. Cached: the
    answer does not change while the process runs."""
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
    why = _prove_kernels(cupy)
    if why:
        log.warning("no GPU tier: %s", why)
        return None, why
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
