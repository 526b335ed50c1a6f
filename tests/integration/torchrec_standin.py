"""A stand-in for torchrec's KeyedJaggedTensor, used because torchrec does not install here
without CUDA wheels (torchrec 1.9.2 requires fbgemm-gpu, the CUDA build; its CPU build is a
separate package torchrec does not accept). It reproduces the public methods
EmbeddingBagCollection reads, with torchrec's semantics (torchrec/sparse/jagged_tensor.py):

- KeyedJaggedTensor(keys, values, weights=None, lengths=None, offsets=None, stride=None):
  values of every key concatenated key-major (the `stride` bags of keys[0], then of
  keys[1], ...); lengths [len(keys) * stride] or offsets [len(keys) * stride + 1] (the
  other computed from it); stride = batch size, len(lengths) // len(keys) when not given.
- keys(), values(), weights() (raises when none), weights_or_none(), lengths(), offsets(),
  stride(), length_per_key() (values per key), variable_stride_per_key() (False here),
  KeyedJaggedTensor.from_lengths_sync(...).

It is not torchrec: where torchrec installs, the test runs against torchrec's own class.
"""

from __future__ import annotations

import torch


class KeyedJaggedTensor:
    def __init__(
        self,
        keys: list[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        stride: int | None = None,
    ) -> None:
        if (lengths is None) == (offsets is None):
            raise ValueError("KeyedJaggedTensor: exactly one of lengths and offsets")
        self._keys = list(keys)
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._offsets = offsets
        count = lengths.numel() if lengths is not None else offsets.numel() - 1
        self._stride = stride if stride is not None else (count // len(keys) if keys else 0)

    @staticmethod
    def from_lengths_sync(
        keys: list[str], values: torch.Tensor, lengths: torch.Tensor,
        weights: torch.Tensor | None = None, stride: int | None = None,
    ) -> KeyedJaggedTensor:  # fmt: skip
        return KeyedJaggedTensor(keys, values, weights, lengths=lengths, stride=stride)

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise AssertionError("weights() on a KeyedJaggedTensor without weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def lengths(self) -> torch.Tensor:
        if self._lengths is None:
            self._lengths = self._offsets[1:] - self._offsets[:-1]
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            zero = torch.zeros(1, dtype=self._lengths.dtype, device=self._lengths.device)
            self._offsets = torch.cat([zero, torch.cumsum(self._lengths, 0)])
        return self._offsets

    def stride(self) -> int:
        return self._stride

    def variable_stride_per_key(self) -> bool:
        return False

    def length_per_key(self) -> list[int]:
        per_bag = self.lengths().view(len(self._keys), self._stride)
        return [int(n) for n in per_bag.sum(dim=1)]
