"""Data-parallel training throughput: `tierps demo --trainers N` (MovieLens-100k DeepFM, batch
256 in all, dim 16, a LocalCluster of 2 shards) for N = 1 and 2 in sync mode and N = 2 in
async mode (staleness 2), against the same model over local torch.nn.EmbeddingBag(sparse=True)
tables with SparseAdam in one process (the best a user could do without a parameter server),
measured in the same run. Each demo run is a subprocess (its cluster, torchrun and ranks);
the runs alternate, `--repeats` rounds, so drift on a shared machine hits all alike.

    python -m tests.bench.bench_trainers [--out docs/perf/trainers.json] [--repeats 2]
        [--baseline-python OTHER/.venv/bin/python]

--baseline-python adds the sync runs (N = 1 and 2) made with another checkout's interpreter
(its environment's editable install: the main branch's, say), alternating with this
checkout's in the same rounds: a same-run comparison of a change to the trainers' code.

Per run: the samples/s of the last epoch (all ranks' samples over the slowest rank's time)
and its test AUC. The ratios: each against N = 1 (scaling) and against the local baseline.
On a machine with fewer cores than shards + trainers, the ranks and the shards share the
cores: N = 2 then measures the cost of coordination, not a speed-up. Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tierps.demo import data, training

EPOCHS = 2
RUNS = {  # name: demo flags
    "n1_sync": ("--trainers", "1"),
    "n2_sync": ("--trainers", "2"),
    "n2_async_k2": ("--trainers", "2", "--mode", "async", "--staleness", "2"),
}
EPOCH_LINE = re.compile(r"epoch (\d+): test logloss [0-9.]+ AUC ([0-9.]+) \| ([0-9,]+) samples/s")


def demo_run(flags: tuple[str, ...], data_dir: Path, python: str) -> tuple[float, float]:
    """(samples/s, test AUC) of the last epoch of one `tierps demo` run by `python`."""
    command = [
        python,
        "-m",
        "tierps.server.cli",
        "demo",
        "--epochs",
        str(EPOCHS),
        "--data-dir",
        str(data_dir),
        *flags,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    epochs = EPOCH_LINE.findall(done.stdout)
    if len(epochs) != EPOCHS:
        raise RuntimeError(f"expected {EPOCHS} epoch lines, got:\n{done.stdout}")
    _, test_auc, rate = epochs[-1]
    return float(rate.replace(",", "")), float(test_auc)


def local_run() -> tuple[float, float]:
    """(samples/s, test AUC) of the last epoch of the local torch DeepFM, one thread."""
    torch.set_num_threads(1)
    dataset = data.load_dataset("movielens")
    model = training.build_local_model(dataset, dim=training.DEFAULT_DIM)
    results = training.train(model, dataset, epochs=EPOCHS, batch_size=training.DEFAULT_BATCH_SIZE)
    return results[-1].samples_per_s, results[-1].test_auc


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/perf/trainers.json"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--baseline-python", help="another checkout's interpreter (see above)")
    args = parser.parse_args()
    contenders = {name: (flags, sys.executable) for name, flags in RUNS.items()}
    if args.baseline_python:
        for name in ("n1_sync", "n2_sync"):
            contenders[f"baseline_{name}"] = (RUNS[name], args.baseline_python)
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in [*contenders, "local"]}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeats):
            for name, (flags, python) in contenders.items():
                figures[name].append(demo_run(flags, Path(tmp) / f"{name}-{round_}", python))
                print(f"round {round_ + 1}: {name} {figures[name][-1]}", flush=True)
            figures["local"].append(local_run())
            print(f"round {round_ + 1}: local {figures['local'][-1]}", flush=True)
    rates = {name: statistics.median(r for r, _ in runs) for name, runs in figures.items()}

    def n1_of(name: str) -> str:  # a baseline run against the baseline's N = 1
        return "baseline_n1_sync" if name.startswith("baseline_") else "n1_sync"

    aucs = {name: runs[-1][1] for name, runs in figures.items()}
    result = {
        "benchmark": "bench_trainers",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "shape": {
            "dataset": "movielens-100k",
            "batch": training.DEFAULT_BATCH_SIZE,
            "dim": training.DEFAULT_DIM,
            "epochs": EPOCHS,
            "shards": 2,
        },
        "samples_per_s": rates,
        "test_auc": aucs,
        "vs_n1": {name: rates[name] / rates[n1_of(name)] for name in rates},
        "vs_local": {name: rates[name] / rates["local"] for name in rates},
        "runs": figures,
    }
    print(
        json.dumps(
            {k: result[k] for k in ("samples_per_s", "test_auc", "vs_n1", "vs_local")}, indent=1
        )
    )
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
