"""Where a shard's CPU goes in a DeepFM training step, at bench_deepfm's zipf_200k shape
(batch 2,048, 8 features of 200,000 ids, 4 ids a bag from Zipf(1.2), rows of 16 floats,
Adagrad, tierps' plain loop: one PushThenLookup call a shard a step):

    python -m tests.bench.profile_shard_step [--steps 200] [--no-profile] [--top 30] [--shards 2]

The shards are subprocesses of this script (`--serve`), each an in-process ShardServer whose
RPC threads run under cProfile with `time.thread_time_ns` as its clock (CPU, not waiting);
the trainer is bench_deepfm's tierps_adagrad_plain contender in this process. After a warm-up
chunk, the shards' profiles are reset, `--steps` steps run, and each shard prints:
- its process CPU a step (from /proc), and its RPC threads' CPU a step (cProfile's total);
- cProfile's top functions by own time and by cumulative time, per step.
cProfile slows Python calls (each call costs it ~1 us): read its ranks and shares.

Not part of the test run.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import json
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.bench.cpu_time import process_cpu_s, thread_cpu_s

# tierps' RPC and table pools, and gRPC's serve loop ("Thread-N (_serve)")
PROFILED_THREADS = ("tierps-rpc", "tierps-table", "tierps-push", "Thread-")


def serve(shard_id: int, num_shards: int, root: Path, top: int, profiled: bool) -> None:
    """A shard whose RPC threads are profiled; SIGUSR1 resets the profiles, SIGUSR2 prints
    them (divided by the step count written to root / 'steps') to root / 'shard-<i>.txt'."""
    from tierps.server.config import ServerConfig
    from tierps.server.daemon import create_server

    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()
    generation = [0]

    libc = ctypes.CDLL(None)

    def hook(frame: Any, event: str, arg: Any) -> None:
        sys.setprofile(None)
        # the OS thread's name, for /proc's per-thread CPU (Python names only its own)
        libc.prctl(15, threading.current_thread().name[:15].encode(), 0, 0, 0)  # PR_SET_NAME
        if profiled and threading.current_thread().name.startswith(PROFILED_THREADS):
            profile = cProfile.Profile(time.thread_time_ns, 1e-9)
            with lock:
                profiles.append(profile)
            profile.enable()

    threading.setprofile(hook)
    config = ServerConfig(
        shard_id=shard_id, num_shards=num_shards, data_dir=root / f"data-{shard_id}"
    )
    server, port = create_server(config)
    server.start()
    (root / f"port-{shard_id}").write_text(str(port))

    def reset(*_: Any) -> None:
        with lock:
            for profile in profiles:
                profile.clear()
            generation[0] += 1

    def report(*_: Any) -> None:
        steps = int((root / "steps").read_text())
        with lock:
            stats = pstats.Stats(profiles[0]) if profiles else None
            for profile in profiles[1:]:
                stats.add(profile)  # type: ignore[union-attr]
        text = io.StringIO("(not profiled)\n" if stats is None else "")
        if stats is not None:
            total = stats.total_tt  # type: ignore[attr-defined]
            text.write(f"RPC threads' CPU under cProfile: {1000 * total / steps:.2f} ms a step\n")
            for order in ("tottime", "cumulative"):
                stats.stream = text  # type: ignore[attr-defined]
                text.write(f"\n-- by {order} (seconds over {steps} steps) --\n")
                stats.sort_stats(order).print_stats(top)
        (root / f"shard-{shard_id}.txt").write_text(text.getvalue())

    signal.signal(signal.SIGUSR1, reset)
    signal.signal(signal.SIGUSR2, report)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    stopped.wait()
    server.stop(grace_s=0.5)


def _wait_for(path: Path, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise TimeoutError(f"no {path.name} after {timeout_s:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument(
        "--no-profile", action="store_true", help="no cProfile: the threads' CPU alone"
    )
    parser.add_argument("--serve", nargs=2, metavar=("SHARD_ID", "ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(int(args.serve[0]), args.shards, Path(args.serve[1]), args.top, not args.no_profile)
        return 0

    import torch

    from tests.bench import bench_deepfm as bench
    from tierps.client import EmbeddingClient
    from tierps.demo.deepfm import initial_weights

    torch.set_num_threads(1)  # as bench_deepfm trains
    root = Path(tempfile.mkdtemp(prefix="tierps-profile-shard-"))
    shards = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.bench.profile_shard_step", "--shards", str(args.shards)]
            + ["--top", str(args.top), "--serve", str(i), str(root)]
            + (["--no-profile"] if args.no_profile else [])
        )
        for i in range(args.shards)
    ]
    try:
        ports = [_wait_for(root / f"port-{i}") for i in range(args.shards)]
        client = EmbeddingClient([f"127.0.0.1:{port}" for port in ports])
        case = next(c for c in bench.CASES if c.name == "zipf_200k")
        dataset = bench.case_dataset(case)
        contender = next(c for c in bench.CONTENDERS if c.name == "tierps_adagrad_plain")
        weights = initial_weights(dataset.tables, bench.EMBEDDING_DIM, bench.SEED)
        trainer = bench.Trainer(contender, bench.build(contender, dataset, weights, client))
        trainer.chunk(dataset, case.batch_size, args.steps, seed=0)  # warm-up, rows made
        for shard in shards:
            shard.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        pids: list[int | None] = [shard.pid for shard in shards]
        before = process_cpu_s(pids)
        threads_before = [thread_cpu_s(shard.pid) for shard in shards]
        started = time.perf_counter()
        per_chunk = min(args.steps, dataset.num_batches("train", case.batch_size))
        chunks = max(1, round(args.steps / per_chunk))
        args.steps = chunks * per_chunk  # what ran, that the figures divide by
        rates, cpus = [], []
        for seed in range(1, chunks + 1):
            rate, cpu, _ = trainer.chunk(dataset, case.batch_size, per_chunk, seed=seed)
            rates.append(rate)
            cpus.append(cpu)
        wall = time.perf_counter() - started
        spent = process_cpu_s(pids) - before
        threads = [
            {
                name: round(1000 * (cpu - was.get(name, 0.0)) / args.steps, 2)
                for name, cpu in thread_cpu_s(shard.pid).items()
                if cpu - was.get(name, 0.0) > 0
            }
            for shard, was in zip(shards, threads_before, strict=True)
        ]
        (root / "steps").write_text(str(args.steps))
        for shard in shards:
            shard.send_signal(signal.SIGUSR2)
        texts = [_wait_for(root / f"shard-{i}.txt") for i in range(args.shards)]
        summary = {
            "steps": args.steps,
            "samples_per_s": statistics.median(rates),
            "wall_ms_per_step": 1000 * wall / args.steps,
            "trainer_cpu_ms_per_step": {
                part: statistics.median(cpu[part] for cpu in cpus) for part in cpus[0]
            },
            "shard_processes_cpu_ms_per_step": 1000 * spent / args.steps,
            "shard_threads_cpu_ms_per_step": threads,
        }
        print(json.dumps(summary, indent=2))
        for i, text in enumerate(texts):
            print(f"\n==== shard {i} ====\n{text}")
        client.close()
    finally:
        for shard in shards:
            shard.send_signal(signal.SIGTERM)
        for shard in shards:
            shard.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
