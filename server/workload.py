"""Synthetic key traces shared by the storage demo and the benchmarks."""

from __future__ import annotations

import numpy as np


class ZipfTrace:
    """Keys of a bounded Zipf(a) law over `universe` keys: key rank r has probability
    proportional to r**-a. Ranks map to keys through a fixed random permutation, so hot keys
    are spread over the key space (and over shards, later) rather than being 0, 1, 2..."""

    def __init__(self, universe: int, a: float = 1.05, seed: int = 0) -> None:
        if universe < 1:
            raise ValueError(f"ZipfTrace: field 'universe' expected >= 1, got {universe}")
        self.rng = np.random.default_rng(seed)
        weights = np.arange(1, universe + 1, dtype=np.float64) ** -a
        self._cdf = np.cumsum(weights)
        self._cdf /= self._cdf[-1]
        self._keys = self.rng.permutation(universe).astype(np.int64)

    def batch(self, size: int) -> np.ndarray:
        ranks = np.searchsorted(self._cdf, self.rng.random(size), side="right")
        return self._keys[np.minimum(ranks, self._keys.size - 1)]
