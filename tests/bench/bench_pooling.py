"""Pooling benchmark: forward + backward of a batch of pooled sparse features, tierps' client
kernels against torch.nn.EmbeddingBag and fbgemm's CPU table-batched embedding, all measured
in this run on the same generated batches.

    python -m tests.bench.bench_pooling [--out bench-results/pooling.json] [--quick]

The shape: 4,096 samples x 26 features, 1 to 20 ids per bag (uniform), ids Zipf(1.05) over a
100,000-row vocabulary per feature (one table per feature), dim 16 and 64, combiner sum (and
mean). The contenders, one step = forward and backward of all 26 features:

- tierps (kernel): what EmbeddingClient.lookup_pooled_features and PooledLookup.push_gradients
  do with a batch minus the network: pooling_matrix, pool (forward) and unpool (backward) of
  tierps.client.pooling, the distinct keys (and their rows, which come from the shards in real
  use) given.
- tierps (with dedup): the same plus the per-table dedup (distinct_keys of tierps.client.pooling).
- torch.nn.EmbeddingBag, sparse=True and sparse=False: 26 modules, forward, then backward of
  the same output gradients (grads set to None before each step, as zero_grad does). Their
  forward also gathers the rows from the full tables, which tierps is handed. The ratio
  target is against the faster of the two. sparse=True's gradient is uncoalesced (one row
  per id, not per distinct id), so an extra row, sparse=True + coalesce(), gives the figure
  for the same result as unpool's (what torch's sparse optimizers compute first).
- fbgemm: SplitTableBatchedEmbeddingBagsCodegen, 26 tables on HOST / CPU, forward and
  backward. Its backward always applies a fused optimizer (CPU has no "none"): exact SGD, its
  cheapest (rowwise Adagrad is ~2x slower here), so its figure includes that update. Skipped,
  with a note, when fbgemm_gpu (pip install fbgemm-gpu-cpu==1.8.0 for torch 2.13) is absent.

Before timing, every contender's forward and the backward's per-row gradients are checked
against torch's. Steps of all contenders are interleaved (drift on a shared machine hits all
alike); each figure is the median over the repeats. A ratio is baseline time / tierps time:
above 1, tierps is faster; each row's "headline" holds tierps (with dedup) against the faster
torch and against fbgemm. Prints a table and writes the figures as JSON. Not part of the
test run.

tierps' kernels run on one core (numpy, scipy); torch and fbgemm use torch's intra-op threads
(--torch-threads, default torch's own). On a busy machine torch's spinning OpenMP threads can
make its figures 10x worse and erratic: measure on a quiet one, or pass --torch-threads 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy
import torch

from tierps.client.formats import Bags
from tierps.client.pooling import Combiner, distinct_keys, pool, pooling_matrix, unpool

BATCH = 4096
FEATURES = 26
MAX_IDS = 20  # ids per bag: uniform in [1, MAX_IDS]
VOCAB = 100_000  # rows per feature table
ZIPF_ALPHA = 1.05
DIMS = (16, 64)
COMBINERS = ("sum", "mean")
SEED = 0

TIERPS_KERNEL = "tierps (kernel)"
TIERPS_DEDUP = "tierps (with dedup)"
TORCH_SPARSE = "torch EmbeddingBag sparse=True"
TORCH_SPARSE_COALESCED = "torch EmbeddingBag sparse=True + coalesce"
TORCH_DENSE = "torch EmbeddingBag sparse=False"
FBGEMM = "fbgemm TBE CPU (exact SGD)"


@dataclass(frozen=True)
class Settings:
    """How much to run: the shapes and the repeats."""

    dims: tuple[int, ...]
    combiners: tuple[str, ...]
    batches: int  # distinct generated batches, cycled through by the repeats
    repeats: int  # timed steps per contender: at least this many...
    min_seconds: float  # ... and at least this long in all
    warmup: int  # untimed steps per contender before the timed ones


FULL = Settings(DIMS, COMBINERS, batches=3, repeats=9, min_seconds=1.0, warmup=2)
QUICK = Settings((64,), ("sum",), batches=1, repeats=3, min_seconds=0.0, warmup=1)


@dataclass(frozen=True)
class Batch:
    """One generated batch: per feature its bags (CSR), and for tierps the distinct keys and
    each key's index among them (what distinct_keys gives)."""

    bags: list[Bags]
    unique: list[np.ndarray]
    inverse: list[np.ndarray]

    @property
    def ids(self) -> int:
        return sum(b.keys.size for b in self.bags)


def zipf_ids(rng: np.random.Generator, count: int, order: np.ndarray) -> np.ndarray:
    """count ids of a Zipf(ZIPF_ALPHA) law over VOCAB ranks; rank r is id order[r] (hot ids
    spread over the table, as hashed ids are)."""
    weights = np.arange(1, VOCAB + 1, dtype=np.float64) ** -ZIPF_ALPHA
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    ranks = np.minimum(np.searchsorted(cdf, rng.random(count)), VOCAB - 1)
    return order[ranks].astype(np.int64)


def make_batches(count: int) -> list[Batch]:
    """`count` batches of FEATURES x BATCH bags, the same for every contender."""
    rng = np.random.default_rng(SEED)
    orders = [rng.permutation(VOCAB) for _ in range(FEATURES)]
    batches = []
    for _ in range(count):
        bags, unique, inverse = [], [], []
        for feature in range(FEATURES):
            lengths = rng.integers(1, MAX_IDS + 1, BATCH)
            offsets = np.zeros(BATCH + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            keys = zipf_ids(rng, int(offsets[-1]), orders[feature])
            bags.append(Bags(keys, offsets, None, (BATCH,)))
            u, inv = distinct_keys(keys)
            unique.append(u)
            inverse.append(inv)
        batches.append(Batch(bags, unique, inverse))
    return batches


Step = Callable[[int], object]  # one forward + backward of batch i


def tierps_steps(
    batches: list[Batch],
    weights: list[np.ndarray],
    grads: list[list[np.ndarray]],
    dim: int,
    combiner: str,
) -> tuple[Step, Step]:
    """The tierps steps: kernel only (it returns batch i's outputs and per-distinct-key
    gradients, for the check), and with dedup."""
    mode = Combiner(combiner)
    rows = [[w[u] for w, u in zip(weights, b.unique, strict=True)] for b in batches]

    def kernel(i: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        batch, outputs, key_grads = batches[i], [], []
        for f, bags in enumerate(batch.bags):
            matrix = pooling_matrix(bags, batch.inverse[f], batch.unique[f].size, mode)
            outputs.append(pool(matrix, rows[i][f]).reshape(*bags.shape, dim))
            key_grads.append(unpool(matrix, grads[i][f]))
        return outputs, key_grads

    def with_dedup(i: int) -> None:
        batch = batches[i]
        for f, bags in enumerate(batch.bags):
            unique, inverse = distinct_keys(bags.keys)
            matrix = pooling_matrix(bags, inverse, unique.size, mode)
            pool(matrix, rows[i][f]).reshape(*bags.shape, dim)
            unpool(matrix, grads[i][f])

    return kernel, with_dedup


def torch_step(
    batches: list[Batch],
    weights: list[np.ndarray],
    grads: list[list[np.ndarray]],
    combiner: str,
    sparse: bool,
    coalesce: bool = False,
) -> tuple[Step, list[torch.nn.EmbeddingBag]]:
    """26 nn.EmbeddingBag (sharing the numpy weights), forward and backward of batch i; with
    coalesce, the sparse gradients are coalesced (one summed row per distinct id, what
    unpool gives and what a sparse optimizer does first)."""
    modules = [
        torch.nn.EmbeddingBag.from_pretrained(
            torch.from_numpy(w),
            freeze=False,
            mode=combiner,
            sparse=sparse,
            include_last_offset=True,
        )
        for w in weights
    ]
    inputs = [
        [(torch.from_numpy(b.keys), torch.from_numpy(b.offsets)) for b in batch.bags]
        for batch in batches
    ]
    grad_tensors = [[torch.from_numpy(g) for g in per_batch] for per_batch in grads]

    def step(i: int) -> list[torch.Tensor]:
        for module in modules:
            module.weight.grad = None
        outputs = [m(keys, offsets) for m, (keys, offsets) in zip(modules, inputs[i], strict=True)]
        torch.autograd.backward(outputs, grad_tensors[i])
        if coalesce:
            for module in modules:
                module.weight.grad = module.weight.grad.coalesce()
        return outputs

    return step, modules


def fbgemm_step(
    batches: list[Batch],
    weights: list[np.ndarray],
    grads: list[list[np.ndarray]],
    dim: int,
    combiner: str,
) -> Step | None:
    """fbgemm's table-batched embedding over 26 tables (a copy of the weights) with fused
    exact SGD (lr 0: the weights stay those of the check), forward and backward of batch i;
    None when fbgemm_gpu is not installed."""
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except ImportError:
        return None
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(VOCAB, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * FEATURES,
        optimizer=EmbOptimType.EXACT_SGD,
        learning_rate=0.0,
        pooling_mode=PoolingMode.SUM if combiner == "sum" else PoolingMode.MEAN,
    )
    with torch.no_grad():
        for table, w in zip(tbe.split_embedding_weights(), weights, strict=True):
            table.copy_(torch.from_numpy(w))
    inputs = []
    for batch in batches:
        indices = np.concatenate([b.keys for b in batch.bags])
        lengths = np.concatenate([np.diff(b.offsets) for b in batch.bags])
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        inputs.append((torch.from_numpy(indices), torch.from_numpy(offsets)))
    grad_tensors = [torch.from_numpy(np.concatenate(per_batch, axis=1)) for per_batch in grads]

    def step(i: int) -> torch.Tensor:
        output = tbe(*inputs[i])
        output.backward(grad_tensors[i])
        return output

    return step


def check(
    tierps_result: tuple[list[np.ndarray], list[np.ndarray]],
    torch_outputs: list[torch.Tensor],
    torch_modules: list[torch.nn.EmbeddingBag],
    batch: Batch,
    fbgemm_output: torch.Tensor | None,
) -> None:
    """tierps' (and fbgemm's) outputs match torch's, and tierps' per-key gradients match
    torch's dense gradients at the distinct keys."""
    outputs, key_grads = tierps_result

    def close(actual: np.ndarray, expected: np.ndarray) -> None:
        # float32 sums in another order: a hot key's gradient sums thousands of rows
        scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5 * scale)

    for f, (ours, theirs) in enumerate(zip(outputs, torch_outputs, strict=True)):
        close(ours, theirs.detach().numpy())
        close(key_grads[f], torch_modules[f].weight.grad.numpy()[batch.unique[f]])
    if fbgemm_output is not None:
        close(
            fbgemm_output.detach().numpy(),
            torch.cat([o.detach() for o in torch_outputs], dim=1).numpy(),
        )


def measure(steps: dict[str, Step], batches: int, settings: Settings) -> dict[str, float]:
    """Median seconds per step of each contender, after warmup steps: rounds of one step of
    each contender still running (steps interleaved, cycling through the batches); a
    contender stops once it has run `repeats` steps and `min_seconds` in all."""
    for step in steps.values():
        for i in range(settings.warmup):
            step(i % batches)
    times: dict[str, list[float]] = {name: [] for name in steps}

    def running() -> list[str]:
        return [
            name
            for name, t in times.items()
            if len(t) < settings.repeats or sum(t) < settings.min_seconds
        ]

    i = 0
    while names := running():
        for name in names:
            started = time.perf_counter()
            steps[name](i % batches)
            times[name].append(time.perf_counter() - started)
        i += 1
    return {name: statistics.median(t) for name, t in times.items()}


def bench_shape(
    batches: list[Batch], dim: int, combiner: str, settings: Settings, with_fbgemm: bool
) -> dict[str, Any]:
    """All contenders on one (dim, combiner): seconds per step, ids/s and the ratios."""
    rng = np.random.default_rng(SEED + dim)
    weights = [rng.standard_normal((VOCAB, dim), dtype=np.float32) for _ in range(FEATURES)]
    grads = [
        [rng.standard_normal((BATCH, dim), dtype=np.float32) for _ in range(FEATURES)]
        for _ in batches
    ]
    kernel, with_dedup = tierps_steps(batches, weights, grads, dim, combiner)
    steps: dict[str, Step] = {TIERPS_KERNEL: kernel, TIERPS_DEDUP: with_dedup}
    sparse_step, _ = torch_step(batches, weights, grads, combiner, sparse=True)
    dense_step, dense_modules = torch_step(batches, weights, grads, combiner, sparse=False)
    coalesced_step, _ = torch_step(batches, weights, grads, combiner, sparse=True, coalesce=True)
    steps[TORCH_SPARSE] = sparse_step
    steps[TORCH_SPARSE_COALESCED] = coalesced_step
    steps[TORCH_DENSE] = dense_step
    fbgemm = fbgemm_step(batches, weights, grads, dim, combiner) if with_fbgemm else None
    if fbgemm is not None:
        steps[FBGEMM] = fbgemm
    check(
        kernel(0),
        dense_step(0),
        dense_modules,
        batches[0],
        None if fbgemm is None else fbgemm(0),
    )
    seconds = measure(steps, len(batches), settings)
    ids = statistics.mean(b.ids for b in batches)
    torch_best = min((TORCH_SPARSE, TORCH_DENSE), key=seconds.__getitem__)
    contenders = {
        name: {"ms_per_step": s * 1e3, "ids_per_s": ids / s} for name, s in seconds.items()
    }
    for name in contenders:
        if name not in (TIERPS_KERNEL, TIERPS_DEDUP):
            contenders[name]["ratio_vs_tierps_dedup"] = seconds[name] / seconds[TIERPS_DEDUP]
            contenders[name]["ratio_vs_tierps_kernel"] = seconds[name] / seconds[TIERPS_KERNEL]
    return {
        "dim": dim,
        "combiner": combiner,
        "ids_per_step": ids,
        "distinct_keys_per_step": statistics.mean(sum(u.size for u in b.unique) for b in batches),
        "torch_best": torch_best,
        "headline": {  # baseline time / tierps (with dedup) time
            "vs_torch_best": contenders[torch_best]["ratio_vs_tierps_dedup"],
            "vs_fbgemm": contenders[FBGEMM]["ratio_vs_tierps_dedup"] if fbgemm else None,
        },
        "contenders": contenders,
    }


def machine() -> dict[str, Any]:
    try:
        import fbgemm_gpu

        fbgemm_version = getattr(fbgemm_gpu, "__version__", "unknown")
    except ImportError:
        fbgemm_version = None
    return {
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "fbgemm_gpu": fbgemm_version,
    }


def print_table(results: dict[str, Any]) -> None:
    print(
        "| dim | combiner | contender | ms/step (fwd+bwd) | ids/s | "
        "x tierps with dedup | x tierps kernel |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in results["rows"]:
        for name, c in row["contenders"].items():
            best = " (faster torch)" if name == row["torch_best"] else ""
            ratios = (
                f"{c['ratio_vs_tierps_dedup']:.2f}x | {c['ratio_vs_tierps_kernel']:.2f}x"
                if "ratio_vs_tierps_dedup" in c
                else "- | -"
            )
            print(
                f"| {row['dim']} | {row['combiner']} | {name}{best} | {c['ms_per_step']:.1f} | "
                f"{c['ids_per_s'] / 1e6:.2f}M | {ratios} |"
            )
    print(
        "ratio = baseline time / tierps time (> 1: tierps is faster). tierps is handed the "
        "distinct keys' rows (the shards send them); torch gathers them from its tables; "
        "fbgemm's backward includes its fused SGD update. torch threads: "
        f"{results['machine']['torch_threads']}."
    )


def run(settings: Settings) -> dict[str, Any]:
    info = machine()
    with_fbgemm = info["fbgemm_gpu"] is not None
    if not with_fbgemm:
        print(
            "fbgemm_gpu is not installed (pip install fbgemm-gpu-cpu==1.8.0, the version "
            "for torch 2.13): no fbgemm baseline"
        )
    started = time.perf_counter()
    batches = make_batches(settings.batches)
    results: dict[str, Any] = {
        "machine": info,
        "shape": {
            "batch": BATCH,
            "features": FEATURES,
            "ids_per_bag": [1, MAX_IDS],
            "vocab": VOCAB,
            "zipf_alpha": ZIPF_ALPHA,
            "generated_batches": settings.batches,
        },
        "settings": {
            "repeats": settings.repeats,
            "min_seconds": settings.min_seconds,
            "warmup": settings.warmup,
            "statistic": "median seconds per step",
        },
        "fbgemm_optimizer": "exact_sgd (fused into backward)" if with_fbgemm else None,
        "rows": [],
    }
    for dim in settings.dims:
        for combiner in settings.combiners:
            row = bench_shape(batches, dim, combiner, settings, with_fbgemm)
            results["rows"].append(row)
            figures = ", ".join(
                f"{name} {c['ms_per_step']:.0f} ms" for name, c in row["contenders"].items()
            )
            print(f"dim={dim} combiner={combiner}: {figures}", flush=True)
    results["seconds"] = time.perf_counter() - started
    return results


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/pooling.json"))
    parser.add_argument(
        "--quick", action="store_true", help="dim 64 sum only, 3 repeats: a smoke run"
    )
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="torch's intra-op threads (its default)"
    )
    args = parser.parse_args()
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    results = run(QUICK if args.quick else FULL)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print_table(results)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
