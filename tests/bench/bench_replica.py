"""A replica following a training cluster: its freshness, and what following costs training.

    python -m tests.bench.bench_replica [--out docs/perf/replica.json] [--rounds 5]

A training cluster of 2 shards and a replica cluster of 1 shard, each a LocalCluster of
`tierps serve` subprocesses on this machine. Trainer threads push gradients of batches of
keys (uniform over 1,000,000, dim 16, SGD).

- Training throughput: rounds alternate two contenders, each `--seconds` of pushing as fast
  as the shards take it: the replica paused (without: SIGSTOP, its streams wait) and the
  replica following (with: SIGCONT, caught up before the round starts).
  Reported: each contender's median key-updates/s and their ratio (with / without).
- Training samples/s: the same alternation around one epoch of the demo's DeepFM on its
  Criteo-like synthetic set (`--samples` rows, 26 sparse features, dim 16, Adam, batch
  1,024, staleness 1, one torch thread), as `tierps demo` trains it: the figure the replica
  must keep at >= 0.9x. The rounds above push as fast as the shards take it, the worst case
  for a follower, which must read and apply every row trained. Also reported: the training
  shards' CPU per 1,000 samples, what following costs them where a replica has a machine
  of its own.
- Freshness: then, the replica following, the trainers paced at `--rate` key-updates/s for
  `--fresh-seconds` while a probe assigns a new value to a probe key, every 50 ms, and
  times from the assign's acknowledgement to the replica's lookup (create=false) first
  answering it (polled every 2 ms): p50 and p99, and the rate the trainers reached.

Prints the figures and writes JSON. Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.bench.cpu_time import process_cpu_s
from tierps.client import EmbeddingClient
from tierps.server.cluster import LocalCluster
from tierps.storage import TableConfig, optim

DIM = 16
KEY_SPACE = 1_000_000
PROBE_KEYS = np.arange(KEY_SPACE, KEY_SPACE + 64)  # outside the trainers' keys
TABLE = TableConfig("bench", DIM, optimizer=optim.SGD(lr=0.01))


def push_for(
    addresses: list[str], seconds: float, threads: int, batch: int, rate: float = 0.0
) -> float:
    """Key-updates/s of `threads` trainers pushing batches for `seconds`, as fast as the
    shards take them, or paced at `rate` key-updates/s in all (0: unpaced)."""
    counts = [0] * threads
    stop = threading.Event()

    def trainer(index: int) -> None:
        rng = np.random.default_rng(index + int(time.time()))
        grads = rng.normal(size=(batch, DIM)).astype(np.float32)
        interval = batch * threads / rate if rate else 0.0
        due = time.perf_counter()
        with EmbeddingClient(addresses) as client:
            while not stop.is_set():
                keys = rng.integers(0, KEY_SPACE, batch)
                counts[index] += client.push_gradients(TABLE.name, keys, grads)
                due += interval
                if interval and due > time.perf_counter():
                    time.sleep(due - time.perf_counter())

    workers = [threading.Thread(target=trainer, args=(i,)) for i in range(threads)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    time.sleep(seconds)
    stop.set()
    for worker in workers:
        worker.join()
    return sum(counts) / (time.perf_counter() - started)


def probe_while(
    training: list[str], replica: list[str], busy: threading.Event, seconds_out: list[float]
) -> None:
    """Assign a new value to a probe key, then poll the replica until it serves it; the
    seconds from the assign's acknowledgement to the first such answer, until busy clears."""
    with EmbeddingClient(training) as writer, EmbeddingClient(replica) as reader:
        value = 0.0
        while busy.is_set():
            value += 1.0
            key = PROBE_KEYS[int(value) % PROBE_KEYS.size : int(value) % PROBE_KEYS.size + 1]
            writer.assign(TABLE.name, key, np.full((1, DIM), value, np.float32))
            acknowledged = time.perf_counter()
            while busy.is_set():
                if reader.lookup(TABLE.name, key, create=False)[0, 0] == value:
                    seconds_out.append(time.perf_counter() - acknowledged)
                    break
                time.sleep(0.002)
            time.sleep(0.05)


def replica_current(replica: list[str], tables: list[str], timeout_s: float = 120.0) -> None:
    """Until every table of the replica says it is at its training shards' heads."""
    deadline = time.monotonic() + timeout_s
    with EmbeddingClient(replica) as reader:
        while time.monotonic() < deadline:
            try:
                lags = [
                    shard["lifecycle"].get("replica.lag_positions", 1.0)
                    for table in tables
                    for shard in reader.describe(table)
                ]
            except Exception:  # noqa: BLE001 - the replica starting, its tables not there yet
                lags = [1.0]
            if not any(lags):
                return
            time.sleep(0.05)
    raise TimeoutError("the replica did not catch up")


def follow(replica: LocalCluster, on: bool) -> None:
    """Let the replica follow (SIGCONT), or pause it (SIGSTOP): its streams then wait, as a
    replica on another machine costs the training shards nothing but their journals, and
    it resumes warm, without a restart's cold caches and RocksDB open."""
    for pid in replica.pids:
        if pid is not None:
            os.kill(pid, signal.SIGCONT if on else signal.SIGSTOP)


def deepfm_samples_per_s(addresses: list[str], dataset: Any, epoch: int) -> tuple[float, int]:
    """(samples/s, samples) of one epoch of the demo's DeepFM trained through the cluster."""
    from tierps.demo.training import build_tierps_model, dense_optimizer_for, train_epoch

    with EmbeddingClient(addresses) as client:
        model = build_tierps_model(client, dataset, dim=DIM, seed=0, staleness=1)
        try:
            _, _, seconds, samples = train_epoch(
                model,
                dataset,
                dense_optimizer_for(model),
                model.embeddings.sparse_optimizer(),
                batch_size=1024,
                shuffle_seed=epoch,
            )
        finally:
            model.embeddings.close()
    return samples / seconds, samples


def caught_up(training: list[str], replica: list[str], timeout_s: float = 120.0) -> None:
    """Until the replica serves the training cluster's probe rows and says it is at the head."""
    with EmbeddingClient(training) as writer, EmbeddingClient(replica) as reader:
        marker = np.full((1, DIM), -1.0, np.float32)
        writer.assign(TABLE.name, PROBE_KEYS[:1], marker)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if reader.lookup(TABLE.name, PROBE_KEYS[:1], create=False)[0, 0] == -1.0:
                    return
            except Exception:  # noqa: BLE001 - the replica starting, its table not there yet
                pass
            time.sleep(0.05)
    raise TimeoutError("the replica did not catch up")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/replica.json"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=8.0, help="of pushing per contender")
    parser.add_argument("--threads", type=int, default=2, help="trainer threads")
    parser.add_argument("--batch", type=int, default=4096, help="keys per push")
    parser.add_argument(
        "--rate", type=float, default=100_000, help="key-updates/s of the freshness phase"
    )
    parser.add_argument("--fresh-seconds", type=float, default=30.0, help="of the freshness phase")
    parser.add_argument("--samples", type=int, default=200_000, help="DeepFM rounds' dataset")
    args = parser.parse_args()
    import torch

    from tierps.demo.data import load_dataset
    from tierps.demo.training import create_tables

    torch.set_num_threads(1)
    dataset = load_dataset("synthetic", samples=args.samples)

    with tempfile.TemporaryDirectory() as root:
        training = LocalCluster(2, Path(root) / "training").start()
        replica = None
        try:
            with EmbeddingClient(training.addresses) as admin:
                admin.create_table(TABLE)
            replica = LocalCluster(1, Path(root) / "replica", follow=training.addresses).start()
            caught_up(training.addresses, replica.addresses)
            rates: dict[str, list[float]] = {"without": [], "with": []}
            for round_index in range(args.rounds):  # throughput: unpaced, alternated
                for contender in ("without", "with"):
                    follow(replica, contender == "with")
                    if contender == "with":
                        caught_up(training.addresses, replica.addresses)
                    rate = push_for(training.addresses, args.seconds, args.threads, args.batch)
                    rates[contender].append(rate)
                    print(f"round {round_index} {contender} replica: {rate:,.0f} key-updates/s")
            with EmbeddingClient(training.addresses) as admin:
                tables = create_tables(admin, dataset, dim=DIM)
            samples_per_s: dict[str, list[float]] = {"without": [], "with": []}
            # the training shards' CPU per 1,000 samples: what following costs them where the
            # replica runs on a machine of its own
            shard_cpu_ms: dict[str, list[float]] = {"without": [], "with": []}
            for round_index in range(args.rounds):  # DeepFM training, alternated
                for contender in ("without", "with"):
                    follow(replica, contender == "with")
                    if contender == "with":
                        replica_current(replica.addresses, tables)
                    cpu_before = process_cpu_s(training.pids)
                    speed, samples = deepfm_samples_per_s(training.addresses, dataset, round_index)
                    cpu_ms = (process_cpu_s(training.pids) - cpu_before) * 1e6 / samples
                    samples_per_s[contender].append(speed)
                    shard_cpu_ms[contender].append(cpu_ms)
                    print(
                        f"round {round_index} {contender} replica: DeepFM {speed:,.0f} samples/s, "
                        f"training shards {cpu_ms:.1f} CPU ms per 1,000 samples"
                    )
            follow(replica, True)
            # freshness: trainers paced at --rate, a probe timing the replica's answers
            freshness: list[float] = []
            busy = threading.Event()
            busy.set()
            prober = threading.Thread(
                target=probe_while, args=(training.addresses, replica.addresses, busy, freshness)
            )
            prober.start()
            paced = push_for(
                training.addresses, args.fresh_seconds, args.threads, args.batch, args.rate
            )
            busy.clear()
            prober.join()
            print(f"paced at {args.rate:,.0f}: {paced:,.0f} key-updates/s reached")
        finally:
            if replica is not None:
                replica.stop()
            training.stop()

    without = statistics.median(rates["without"])
    with_replica = statistics.median(rates["with"])
    deepfm_without = statistics.median(samples_per_s["without"])
    deepfm_with = statistics.median(samples_per_s["with"])
    results: dict[str, Any] = {
        "machine": platform.node(),
        "cores": len(os.sched_getaffinity(0)),
        "rounds": args.rounds,
        "seconds": args.seconds,
        "threads": args.threads,
        "batch": args.batch,
        "dim": DIM,
        "key_updates_per_s_without": without,
        "key_updates_per_s_with": with_replica,
        "ratio_with_over_without": with_replica / without,
        "deepfm_samples": args.samples,
        "deepfm_samples_per_s_without": deepfm_without,
        "deepfm_samples_per_s_with": deepfm_with,
        "deepfm_ratio_with_over_without": deepfm_with / deepfm_without,
        "deepfm_per_round": samples_per_s,
        "training_shards_cpu_ms_per_1000_samples_without": statistics.median(
            shard_cpu_ms["without"]
        ),
        "training_shards_cpu_ms_per_1000_samples_with": statistics.median(shard_cpu_ms["with"]),
        "training_shards_cpu_ms_per_round": shard_cpu_ms,
        "freshness_rate_asked": args.rate,
        "freshness_rate_reached": paced,
        "freshness_probes": len(freshness),
        "freshness_p50_s": float(np.percentile(freshness, 50)) if freshness else None,
        "freshness_p99_s": float(np.percentile(freshness, 99)) if freshness else None,
        "per_round": rates,
    }
    print(
        f"training key-updates/s, medians of {args.rounds} rounds: {without:,.0f} without a "
        f"replica, {with_replica:,.0f} with one following ({with_replica / without:.2f}x)"
    )
    print(
        f"DeepFM training samples/s, medians of {args.rounds} rounds: {deepfm_without:,.0f} "
        f"without a replica, {deepfm_with:,.0f} with one following "
        f"({deepfm_with / deepfm_without:.2f}x); the training shards' CPU per 1,000 samples: "
        f"{results['training_shards_cpu_ms_per_1000_samples_without']:.1f} ms without, "
        f"{results['training_shards_cpu_ms_per_1000_samples_with']:.1f} ms with"
    )
    if freshness:
        print(
            f"freshness over {len(freshness)} probes: p50 {results['freshness_p50_s'] * 1e3:.0f}"
            f" ms, p99 {results['freshness_p99_s'] * 1e3:.0f} ms"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
