"""PyTorch modules over an EmbeddingClient (needs the `torch` extra).

`EmbeddingBag` follows torch.nn.EmbeddingBag's forward signature; `EmbeddingBagCollection`
pools many features at once, like torchrec's. Their tables live on the shards: forward
looks the bags up and pools them (one RPC per shard for every feature), and backward pushes
the gradients of the distinct keys, on which the shards run each table's optimizer: the
backward and the optimizer step are one fused call, as in fbgemm's table-batched
embeddings. The dense part of the model trains with any torch optimizer; the embeddings
need none.

In eval mode, or under torch.no_grad(), lookups create no rows and nothing is pushed.

On a CUDA model: given a batch on a GPU (CUDA tensors or cupy arrays), the modules pool it
there (tierps.client.device_pooling) and return tensors on that device; backward runs there
too and sends only the distinct keys' gradients to the host for the push. Given a batch on
the host, they pool on the host and return CPU tensors, as before. `device` pins the device
to pool on instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import nn

from tierps.client.embedding import EmbeddingClient, Feature, FeatureBatch, PooledLookup
from tierps.client.pooling import Combiner

MAX_PREFETCHED = 4  # prefetched batches kept for their forward; older ones are dropped


def _outputs(pooled: PooledLookup, names: list[str]) -> tuple[torch.Tensor, ...]:
    """The outputs as tensors: a host lookup's numpy arrays without a copy; a device
    lookup's are views of one pooled block, copied apart (B x dim each) so that, as with
    torch's own modules, an in-place op on one output (relu_, +=) neither hits a view made
    inside a Function nor moves the version counter autograd checks on the others."""
    if pooled.device is None:
        return tuple(torch.from_numpy(pooled.outputs[name]) for name in names)
    return tuple(pooled.outputs[name].clone() for name in names)


class _Pooled(torch.autograd.Function):
    """Outputs of a PooledLookup as tensors; backward pushes all their gradients at once."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, pooled: PooledLookup, names: list[str]) -> Any:
        ctx.pooled, ctx.names = pooled, names
        return _outputs(pooled, names)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        if ctx.pooled.device is None:
            given: dict[str, Any] = {
                name: grad.detach().cpu().numpy()
                for name, grad in zip(ctx.names, grads, strict=True)
            }
        else:  # the gradients stay on the device: the backward runs there
            given = {name: grad.detach() for name, grad in zip(ctx.names, grads, strict=True)}
        ctx.pooled.push_gradients(given)
        return None, None, None


class EmbeddingBagCollection(nn.Module):
    """Pooled embeddings of several features, each bound to a table of the cluster.

    forward(batch) takes a dict feature name -> that feature's bags (a dense -1-padded
    tensor [..., nnz], (values, offsets), (values, offsets, per_sample_weights), or a COO;
    tensors or numpy arrays) and returns a dict feature name -> pooled tensor.

    prefetch(batch) starts the lookup of a later batch in the background; the forward of
    that same batch object then uses it. Rows prefetched before the current step's backward
    miss that step's update of the keys both batches share (one step stale, as pipelined
    embedding caches are).

    A batch on a GPU is pooled there and gives tensors there; one on the host gives CPU
    tensors. `device` ("cuda:0", "cpu"; None: where the batch is) pools on that torch
    device, whose arrays the batch must be on (host arrays count as "cpu").
    """

    def __init__(
        self,
        client: EmbeddingClient,
        features: Sequence[Feature],
        *,
        include_last_offset: bool = False,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.features = list(features)
        self.include_last_offset = include_last_offset
        self.device = device
        for feature in self.features:
            client.table_config(feature.table)  # an unknown table fails here, not mid-step
        self._prefetcher: ThreadPoolExecutor | None = None
        # Lookups started by prefetch, oldest first: (the batch itself, create, the lookup).
        self._prefetched: list[tuple[Mapping[str, FeatureBatch], bool, Future[PooledLookup]]] = []

    def _trains(self) -> bool:
        """Training mode with autograd on: lookups create rows and backward pushes."""
        return self.training and torch.is_grad_enabled()

    def _lookup(self, batch: Mapping[str, FeatureBatch], create: bool) -> PooledLookup:
        return self.client.lookup_pooled_features(
            batch,
            self.features,
            create=create,
            include_last_offset=self.include_last_offset,
            device=self.device,
        )

    def _lookup_on(
        self, batch: Mapping[str, FeatureBatch], create: bool, stream: Any
    ) -> PooledLookup:
        """_lookup in the prefetch thread, on the CUDA stream the caller was on: a device
        batch's kernels then queue behind the work that made the batch."""
        if stream is None:
            return self._lookup(batch, create)
        with torch.cuda.stream(stream):
            return self._lookup(batch, create)

    def prefetch(self, batch: Mapping[str, FeatureBatch]) -> None:
        """Start looking up `batch` now, for a later forward(batch) of the same object."""
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="tierps-prefetch")
        create = self._trains()  # grad mode is per thread: read it here
        # A thread starts on the default stream; the caller may be on another.
        stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None
        future = self._prefetcher.submit(self._lookup_on, batch, create, stream)
        self._prefetched = [*self._prefetched[-(MAX_PREFETCHED - 1) :], (batch, create, future)]

    def forward(self, batch: Mapping[str, FeatureBatch]) -> dict[str, torch.Tensor]:
        trains = self._trains()
        pooled = None
        for index, (pending, create, future) in enumerate(self._prefetched):
            if pending is batch and create == trains:
                # Entries prefetched before this one were skipped: drop them, so that no
                # later forward of a reused batch object takes rows older than one step.
                del self._prefetched[: index + 1]
                pooled = future.result()  # a failed prefetch raises here, at its forward
                break
        self._prefetched = [entry for entry in self._prefetched if entry[1] == trains]
        if pooled is None:
            pooled = self._lookup(batch, create=trains)
        names = [feature.name for feature in self.features]
        if trains:
            anchor = torch.empty(0, requires_grad=True)  # makes autograd call backward
            outputs = _Pooled.apply(anchor, pooled, names)
        else:
            outputs = _outputs(pooled, names)
        return dict(zip(names, outputs, strict=True))


class EmbeddingBag(nn.Module):
    """torch.nn.EmbeddingBag over a table of the cluster: forward(input, offsets=None,
    per_sample_weights=None) as torch's (input 2-D [B, N] without offsets, with keys < 0 as
    padding; or 1-D values with offsets), returning [B, dim]. combiner: "sum", "mean" or
    "sqrtn"; per_sample_weights work with all three (tierps.client.pooling). Input on a GPU
    is pooled there; `device` as in EmbeddingBagCollection."""

    def __init__(
        self,
        client: EmbeddingClient,
        table: str,
        *,
        combiner: Combiner | str = Combiner.SUM,
        include_last_offset: bool = False,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        self.table = table
        self.bags = EmbeddingBagCollection(
            client,
            [Feature(table, table, combiner)],
            include_last_offset=include_last_offset,
            device=device,
        )

    def forward(
        self,
        input: torch.Tensor | np.ndarray,
        offsets: torch.Tensor | np.ndarray | None = None,
        per_sample_weights: torch.Tensor | np.ndarray | None = None,
    ) -> torch.Tensor:
        if offsets is None and per_sample_weights is None:
            value: FeatureBatch = input
        else:  # dense keys with weights too: (keys, None, weights)
            value = (input, offsets, per_sample_weights)
        return self.bags({self.table: value})[self.table]
