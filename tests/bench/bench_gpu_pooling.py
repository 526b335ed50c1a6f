"""GPU pooling benchmark: forward + backward of a batch of pooled sparse features on a CUDA
device, tierps' device pooling (tierps.client.device_pooling) against torch.nn.EmbeddingBag on
the same device, all measured in this run on the same generated batches.

    python -m tests.bench.bench_gpu_pooling [--out PATH] [--quick] [--device cuda|cpu]

Without a CUDA device it prints "no CUDA device: skipped" and exits 0; `--device cpu` runs the
same code on the host (a smoke run of the whole benchmark, not a GPU figure). Results go to
bench-results/gpu_pooling.json (bench-results/gpu_pooling-cpu.json with --device cpu).

The shape is tests/bench/bench_pooling.py's: 4,096 samples x 26 features, 1 to 20 ids per bag,
ids Zipf(1.05) over a 100,000-row table per feature, dim 16 and 64, combiner sum and mean,
offsets with include_last_offset. The contenders, one step = forward and backward of all 26:

- tierps device (with dedup): what lookup_pooled_features and push_gradients run on the
  device, minus the network: `plan` (checks, dedup, layout, and the sync that brings the
  distinct keys to the host for the RPC), the forward over the distinct keys' rows (handed on
  the device, where the shards' rows land after their one copy), and the backward to one
  gradient per distinct key, on the device. The 26 tables share a dim, so they pool as one
  group: one forward and one backward call for all 26 features.
- tierps device (+ host copies): the same plus the copies a training step makes around it,
  as the client makes them: the rows host -> device (from pinned memory, where the shards'
  replies land) and the per-key gradients device -> host (what the push sends).
- torch.nn.EmbeddingBag, sparse=True and sparse=False: 26 modules on the device (tables
  already there), forward, then backward of the same output gradients (grads set to None
  before each step, as zero_grad does). Their forward also gathers the rows from the full
  tables, which tierps is handed. sparse=True's gradient is uncoalesced (one row per id, not
  per distinct id), so a third row, sparse=True + coalesce(), gives the figure for the
  result tierps' backward gives (what torch's sparse optimizers compute first).

Before timing, tierps' outputs and per-key gradients are checked against torch's (sparse=False)
outputs and weight gradients at the distinct keys. Each step is timed alone, wall clock from a
synchronized device to a synchronized device (torch.cuda.synchronize), so a figure holds the
host's launch work and every sync as well as the kernels; steps of all contenders are
interleaved, and each figure is the median over the repeats. A ratio is baseline time /
tierps time: above 1, tierps is faster; a row's "headline" holds the faster torch
(sparse=True or sparse=False: the target, >= 1.0x) and the faster of those giving
per-key gradients (sparse=True + coalesce or sparse=False) against tierps device (with dedup).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.bench.bench_pooling import BATCH, FEATURES, MAX_IDS, VOCAB, ZIPF_ALPHA, Batch
from tests.bench.bench_pooling import make_batches as make_host_batches
from tierps.client.device_pooling import FeatureSpec, host_buffer, plan
from tierps.client.pooling import Combiner

DIMS = (16, 64)
COMBINERS = ("sum", "mean")
SEED = 0

TIERPS = "tierps device (with dedup)"
TIERPS_COPIES = "tierps device (+ host copies)"
TORCH_SPARSE = "torch EmbeddingBag sparse=True"
TORCH_SPARSE_COALESCED = "torch EmbeddingBag sparse=True + coalesce"
TORCH_DENSE = "torch EmbeddingBag sparse=False"
TORCH = (TORCH_SPARSE, TORCH_SPARSE_COALESCED, TORCH_DENSE)


@dataclass(frozen=True)
class Settings:
    """How much to run: the shapes and the repeats."""

    dims: tuple[int, ...]
    combiners: tuple[str, ...]
    batches: int  # distinct generated batches, cycled through by the repeats
    repeats: int  # timed steps per contender: at least this many...
    min_seconds: float  # ... and at least this long in all
    warmup: int  # untimed steps per contender before the timed ones


FULL = Settings(DIMS, COMBINERS, batches=3, repeats=20, min_seconds=1.0, warmup=3)
QUICK = Settings((64,), ("sum",), batches=1, repeats=3, min_seconds=0.0, warmup=1)

Step = Callable[[int], object]  # one forward + backward of batch i


class Shape:
    """One (dim, combiner) on a device: the tables, the batches' tensors, the output
    gradients, and the rows each batch's distinct keys get, laid out as tierps asks."""

    def __init__(self, batches: list[Batch], dim: int, combiner: str, device: torch.device):
        self.device, self.dim, self.combiner = device, dim, Combiner(combiner)
        rng = np.random.default_rng(SEED + dim)
        self.weights = [
            torch.from_numpy(rng.standard_normal((VOCAB, dim), dtype=np.float32)).to(device)
            for _ in range(FEATURES)
        ]
        self.inputs = [
            [
                (torch.from_numpy(b.keys).to(device), torch.from_numpy(b.offsets).to(device))
                for b in batch.bags
            ]
            for batch in batches
        ]
        self.grads = [
            [
                torch.from_numpy(rng.standard_normal((BATCH, dim), dtype=np.float32)).to(device)
                for _ in range(FEATURES)
            ]
            for _ in batches
        ]
        self.host_rows: list[torch.Tensor] = []  # pinned for a GPU, as the client's buffers
        self.device_rows: list[torch.Tensor] = []
        for i in range(len(batches)):
            (group,) = self.plan(i)
            rows = np.zeros((group.num_unique + 1, dim), np.float32)  # last: the zero row
            for table, (lo, hi) in group.spans.items():
                keys = torch.from_numpy(group.unique[table]).to(device)
                rows[lo:hi] = self.weights[int(table[1:])][keys].cpu().numpy()  # table "t<f>"
            pinned = host_buffer(rows.shape, device)
            pinned.numpy()[:] = rows
            self.host_rows.append(pinned)
            self.device_rows.append(torch.from_numpy(rows).to(device))

    def plan(self, i: int) -> list[Any]:
        specs = [
            FeatureSpec(f"f{f}", f"feature 'f{f}'", self.inputs[i][f], f"t{f}", self.combiner)
            for f in range(FEATURES)
        ]
        return plan(self.device, specs, lambda _: self.dim, include_last_offset=True)

    def tierps(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, Any]:
        (group,) = self.plan(i)
        outputs = group.forward(self.device_rows[i])
        grads = group.backward({f"f{f}": g for f, g in enumerate(self.grads[i])})
        return outputs, grads, group

    def tierps_copies(self, i: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        (group,) = self.plan(i)
        group.forward(self.host_rows[i].to(self.device, non_blocking=True))
        return group.host_gradients({f"f{f}": g for f, g in enumerate(self.grads[i])})

    def torch_step(
        self, sparse: bool, coalesce: bool = False
    ) -> tuple[Step, list[torch.nn.EmbeddingBag]]:
        modules = [
            torch.nn.EmbeddingBag.from_pretrained(
                w, freeze=False, mode=self.combiner.value, sparse=sparse, include_last_offset=True
            )
            for w in self.weights
        ]

        def step(i: int) -> list[torch.Tensor]:
            for module in modules:
                module.weight.grad = None
            outputs = [m(k, o) for m, (k, o) in zip(modules, self.inputs[i], strict=True)]
            torch.autograd.backward(outputs, self.grads[i])
            if coalesce:
                for module in modules:
                    module.weight.grad = module.weight.grad.coalesce()
            return outputs

        return step, modules


def check(shape: Shape, dense_step: Step, modules: list[torch.nn.EmbeddingBag]) -> None:
    """tierps' outputs match torch's, and its per-key gradients match torch's dense weight
    gradients at the distinct keys."""
    outputs, grads, group = shape.tierps(0)
    theirs = dense_step(0)

    def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
        # float32 sums in another order: a hot key's gradient sums thousands of rows
        expected = expected.detach().cpu()
        scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
        np.testing.assert_allclose(
            actual.detach().cpu().numpy(), expected.numpy(), rtol=1e-4, atol=1e-5 * scale
        )

    for f in range(FEATURES):
        close(outputs[f"f{f}"], theirs[f])
        lo, hi = group.spans[f"t{f}"]
        keys = torch.from_numpy(group.unique[f"t{f}"]).to(shape.device)
        close(grads[lo:hi], modules[f].weight.grad[keys])


def measure(
    steps: dict[str, Step], batches: int, settings: Settings, device: torch.device
) -> dict[str, float]:
    """Median seconds per step of each contender, after warmup steps: rounds of one step of
    each contender still running (interleaved, cycling through the batches), each timed from
    a synchronized device to a synchronized device; a contender stops once it has run
    `repeats` steps and `min_seconds` in all."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for step in steps.values():
        for i in range(settings.warmup):
            step(i % batches)
    sync()
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
            sync()
            started = time.perf_counter()
            steps[name](i % batches)
            sync()
            times[name].append(time.perf_counter() - started)
        i += 1
    return {name: statistics.median(t) for name, t in times.items()}


def bench_shape(
    batches: list[Batch], dim: int, combiner: str, settings: Settings, device: torch.device
) -> dict[str, Any]:
    """All contenders on one (dim, combiner): seconds per step, ids/s and the ratios."""
    shape = Shape(batches, dim, combiner, device)
    sparse_step, _ = shape.torch_step(sparse=True)
    coalesced_step, _ = shape.torch_step(sparse=True, coalesce=True)
    dense_step, dense_modules = shape.torch_step(sparse=False)
    check(shape, dense_step, dense_modules)
    steps: dict[str, Step] = {
        TIERPS: shape.tierps,
        TIERPS_COPIES: shape.tierps_copies,
        TORCH_SPARSE: sparse_step,
        TORCH_SPARSE_COALESCED: coalesced_step,
        TORCH_DENSE: dense_step,
    }
    seconds = measure(steps, len(batches), settings, device)
    ids = statistics.mean(b.ids for b in batches)
    torch_best = min((TORCH_SPARSE, TORCH_DENSE), key=seconds.__getitem__)
    contenders = {
        name: {"ms_per_step": s * 1e3, "ids_per_s": ids / s} for name, s in seconds.items()
    }
    for name in TORCH:
        contenders[name]["ratio_vs_tierps"] = seconds[name] / seconds[TIERPS]
        contenders[name]["ratio_vs_tierps_copies"] = seconds[name] / seconds[TIERPS_COPIES]
    return {
        "dim": dim,
        "combiner": combiner,
        "ids_per_step": ids,
        "distinct_keys_per_step": statistics.mean(sum(u.size for u in b.unique) for b in batches),
        "torch_best": torch_best,
        "headline": {  # a torch time / tierps device (with dedup)'s time; target >= 1.0
            "vs_torch_best": contenders[torch_best]["ratio_vs_tierps"],
            # the faster of the two that yield one gradient per distinct key, as tierps does
            "vs_torch_per_key_best": min(
                contenders[TORCH_SPARSE_COALESCED]["ratio_vs_tierps"],
                contenders[TORCH_DENSE]["ratio_vs_tierps"],
            ),
        },
        "contenders": contenders,
    }


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def print_table(results: dict[str, Any]) -> None:
    print(
        "| dim | combiner | contender | ms/step (fwd+bwd) | ids/s | x tierps | x tierps + copies |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in results["rows"]:
        for name, c in row["contenders"].items():
            best = " (faster torch)" if name == row["torch_best"] else ""
            ratios = (
                f"{c['ratio_vs_tierps']:.2f}x | {c['ratio_vs_tierps_copies']:.2f}x"
                if "ratio_vs_tierps" in c
                else "- | -"
            )
            print(
                f"| {row['dim']} | {row['combiner']} | {name}{best} | {c['ms_per_step']:.2f} | "
                f"{c['ids_per_s'] / 1e6:.1f}M | {ratios} |"
            )
    print(
        "ratio = torch time / tierps time (> 1: tierps is faster), on "
        f"{results['machine']['device']}"
        f" ({results['machine'].get('gpu', 'host')}). tierps is handed the distinct keys' rows "
        "(the shards send them); torch gathers them from its tables on the device."
    )


def run(settings: Settings, device: torch.device) -> dict[str, Any]:
    started = time.perf_counter()
    batches = make_host_batches(settings.batches)
    results: dict[str, Any] = {
        "machine": machine(device),
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
            "statistic": "median wall seconds per step, device synchronized before and after",
        },
        "rows": [],
    }
    for dim in settings.dims:
        for combiner in settings.combiners:
            row = bench_shape(batches, dim, combiner, settings, device)
            results["rows"].append(row)
            figures = ", ".join(
                f"{name} {c['ms_per_step']:.2f} ms" for name, c in row["contenders"].items()
            )
            print(f"dim={dim} combiner={combiner}: {figures}", flush=True)
    results["seconds"] = time.perf_counter() - started
    return results


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu")
    parser.add_argument(
        "--out", type=Path, default=None, help="default bench-results/gpu_pooling[-cpu].json"
    )
    parser.add_argument(
        "--quick", action="store_true", help="dim 64 sum only, 3 repeats: a smoke run"
    )
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="torch's intra-op threads (its default)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "no CUDA device: skipped (torch.cuda.is_available() is False; --device cpu runs the "
            "same code on the host)"
        )
        return 0
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    out = args.out or Path(
        "bench-results/gpu_pooling.json"
        if device.type == "cuda"
        else "bench-results/gpu_pooling-cpu.json"
    )
    results = run(QUICK if args.quick else FULL, device)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print_table(results)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
