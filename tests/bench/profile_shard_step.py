"""Where a shard's CPU goes in a DeepFM training step, at bench_deepfm's zipf_200k shape
(batch 2,048, 8 features of 200,000 ids, 4 ids a bag from Zipf(1.2), rows of 16 floats,
Adagrad, tierps' plain loop: one PushThenLookup call a shard a step):

    python -m tests.bench.profile_shard_step [--steps 200] [--no-profile] [--top 30] [--shards 2]
    python -m tests.bench.profile_shard_step --replay [--rounds 5] [--no-profile] [--direct]
    python -m tests.bench.profile_shard_step --replica [--seconds 10] [--rate 100000]

The shards are subprocesses of this script (`--serve`), each an in-process ShardServer whose
RPC threads run under cProfile with `time.thread_time_ns` as its clock (CPU, not waiting);
the trainer is bench_deepfm's tierps_adagrad_plain contender in this process (--direct:
tierps_adagrad_direct_plain's, over direct tables). After a warm-up
chunk, the shards' profiles are reset, `--steps` steps run, and each shard prints:
- its process CPU a step (from /proc), and its RPC threads' CPU a step (cProfile's total);
- cProfile's top functions by own time and by cumulative time, per step.
cProfile slows Python calls (each call costs it ~1 us): read its ranks and shares.

--replay measures the shard's own work apart from gRPC and the other processes: the
trainer's calls to shard 0 (in-process shards this time) are recorded over chunks of steps,
then sent again, straight to the servicer of a new shard 0 holding the same rows, warm,
--rounds times: the CPU of each call (decoding included) by round, median, and with
cProfile (unless --no-profile) a round's top functions. A steadier figure than the loop's,
which shares 2 cores with the trainer and the other shard: read it for the shard's code.

--replica profiles a replica instead: a 1-shard replica (every thread named and profiled)
following a 2-shard LocalCluster while bench_replica's trainer threads push at --rate; it
prints the replica's CPU by thread (% of a core) and where it goes, per second.

Not part of the test run.
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.bench.cpu_time import process_cpu_s, thread_cpu_s

# tierps' RPC and table pools, and gRPC's serve loop ("Thread-N (_serve)")
PROFILED_THREADS = ("tierps-rpc", "tierps-table", "tierps-push", "Thread-")


def serve(
    shard_id: int,
    num_shards: int,
    root: Path,
    top: int,
    profiled: bool,
    follow: tuple[str, ...] = (),
) -> None:
    """A shard whose RPC threads (a replica's: every thread; `follow`: the training shards
    it follows) are profiled; SIGUSR1 resets the profiles, SIGUSR2 prints them (divided by
    the count written to root / 'steps', of the unit in root / 'unit') to
    root / 'shard-<i>.txt'."""
    threads = ("",) if follow else PROFILED_THREADS
    from tierps.server.config import ServerConfig
    from tierps.server.daemon import create_server

    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()

    libc = ctypes.CDLL(None)

    def hook(frame: Any, event: str, arg: Any) -> None:
        sys.setprofile(None)
        # the OS thread's name, for /proc's per-thread CPU (Python names only its own)
        libc.prctl(15, threading.current_thread().name[:15].encode(), 0, 0, 0)  # PR_SET_NAME
        if profiled and threading.current_thread().name.startswith(threads):
            profile = cProfile.Profile(time.thread_time_ns, 1e-9)
            with lock:
                profiles.append(profile)
            profile.enable()

    threading.setprofile(hook)
    config = ServerConfig(
        shard_id=shard_id, num_shards=num_shards, data_dir=root / f"data-{shard_id}", follow=follow
    )
    server, port = create_server(config)
    server.start()
    (root / f"port-{shard_id}").write_text(str(port))

    def reset(*_: Any) -> None:
        with lock:
            for profile in profiles:
                profile.clear()

    def report(*_: Any) -> None:
        steps = float((root / "steps").read_text())
        unit = (root / "unit").read_text() if (root / "unit").exists() else "step"
        stats = None
        with lock:
            for profile in profiles:
                profile.create_stats()
                if not profile.stats:  # type: ignore[attr-defined]  # a thread that ran nothing
                    continue
                if stats is None:
                    stats = pstats.Stats(profile)
                else:
                    stats.add(profile)
        text = io.StringIO("(not profiled)\n" if stats is None else "")
        if stats is not None:
            # no total: a thread blocked in a wait reads as CPU in "acquire" (its clock
            # is CPU time, yet cProfile counts the wait), so the threads' CPU is /proc's
            for order in ("tottime", "cumulative"):
                stats.stream = text  # type: ignore[attr-defined]
                text.write(f"\n-- by {order} (seconds over {steps:g} {unit}s) --\n")
                stats.sort_stats(order).print_stats(top)
        (root / f"shard-{shard_id}.txt").write_text(text.getvalue())

    signal.signal(signal.SIGUSR1, reset)
    signal.signal(signal.SIGUSR2, report)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    stopped.wait()
    server.stop(grace_s=0.5)


@contextlib.contextmanager
def timed_calls() -> Iterator[list[tuple[float, float]]]:
    """(wall ms, the calling thread's CPU ms) of each fused call a shard gets from this
    process's trainer (PushThenLookup._fused_call), while the block runs."""
    from tierps.client.push_then_lookup import PushThenLookup

    calls: list[tuple[float, float]] = []
    fused = PushThenLookup._fused_call

    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fused(*args, **kwargs)
        finally:
            calls.append((1000 * (time.perf_counter() - wall), 1000 * (time.thread_time() - cpu)))

    PushThenLookup._fused_call = timed  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        PushThenLookup._fused_call = fused  # type: ignore[method-assign]


def _wait_for(path: Path, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise TimeoutError(f"no {path.name} after {timeout_s:.0f} s")


def profile_replica(args: argparse.Namespace) -> int:
    """A 1-shard replica (a subprocess, every thread named and profiled) following a 2-shard
    LocalCluster while bench_replica's trainer threads push at `--rate` key-updates/s for
    `--seconds` (after as long a warm-up): its CPU by thread, and where it goes."""
    from tests.bench import bench_replica
    from tierps.client import EmbeddingClient
    from tierps.server.cluster import LocalCluster

    root = Path(tempfile.mkdtemp(prefix="tierps-profile-replica-"))
    with LocalCluster(2, root / "training") as training:
        with EmbeddingClient(training.addresses) as client:
            client.create_table(bench_replica.TABLE)
        replica = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.profile_shard_step", "--shards", "1"]
            + ["--top", str(args.top), "--serve", "0", str(root)]
            + ["--follow", ",".join(training.addresses)]
            + (["--no-profile"] if args.no_profile else [])
        )
        try:
            _wait_for(root / "port-0")

            def push() -> float:
                return bench_replica.push_for(training.addresses, args.seconds, 2, 4096, args.rate)

            push()  # the replica's resync and its first rows
            replica.send_signal(signal.SIGUSR1)
            time.sleep(0.3)
            before, trained = thread_cpu_s(replica.pid), process_cpu_s(training.pids)
            started = time.perf_counter()
            rate = push()
            after = thread_cpu_s(replica.pid)
            seconds = time.perf_counter() - started  # the span the CPU figures cover
            trained = process_cpu_s(training.pids) - trained
            (root / "unit").write_text("second")
            (root / "steps").write_text(repr(seconds))
            replica.send_signal(signal.SIGUSR2)
            threads = {
                name: round(100 * (cpu - before.get(name, 0.0)) / seconds, 1)
                for name, cpu in after.items()
                if cpu - before.get(name, 0.0) > 0
            }
            print(
                f"{rate:,.0f} key-updates/s over {seconds:.1f} s; the training shards' CPU "
                f"{100 * trained / seconds:.0f}% of a core; the replica's Python and C threads "
                f"by name, % of a core: {threads}"
            )
            print(_wait_for(root / "shard-0.txt"))
        finally:
            replica.send_signal(signal.SIGTERM)
            replica.wait(30)
    return 0


def _deepfm_trainer(client: Any, direct: bool = False) -> tuple[Any, Any, Any]:
    """bench_deepfm's tierps_adagrad_plain trainer (direct: tierps_adagrad_direct_plain's,
    over direct tables) on zipf_200k over `client`: (trainer, dataset, case)."""
    import torch

    from tests.bench import bench_deepfm as bench
    from tierps.demo.deepfm import initial_weights

    torch.set_num_threads(1)  # as bench_deepfm trains
    case = next(c for c in bench.CASES if c.name == "zipf_200k")
    dataset = bench.case_dataset(case)
    name = "tierps_adagrad_direct_plain" if direct else "tierps_adagrad_plain"
    contender = next(c for c in bench.CONTENDERS if c.name == name)
    weights = initial_weights(dataset.tables, bench.EMBEDDING_DIM, bench.SEED)
    return bench.Trainer(contender, bench.build(contender, dataset, weights, client)), dataset, case


def replay(args: argparse.Namespace) -> int:
    """Record shard 0's PushThenLookup calls (their bytes; at least --steps / 2 of them,
    chunks of the DeepFM loop after a warm-up chunk) over 2 in-process shards; then send
    them again to the servicer of a new shard 0 whose rows the calls made (one pass
    unmeasured), --rounds times, each call's CPU measured in its thread. Each call gets a
    push id of its own and the new tables' generations."""
    from tierps.client import EmbeddingClient
    from tierps.proto import wire
    from tierps.server import servicers
    from tierps.server.config import ServerConfig
    from tierps.server.daemon import create_server
    from tierps.server.ledger import GENERATIONS_HEADER, PUSH_ID_HEADER
    from tierps.server.shard import Shard

    recorded: list[bytes] = []
    fused = servicers.EmbeddingServicer.PushThenLookup

    def recording(servicer: Any, request: Any, context: Any) -> Any:
        if servicer.shard.shard_id == 0:
            recorded.append(bytes(request.data))
        return fused(servicer, request, context)

    root = Path(tempfile.mkdtemp(prefix="tierps-replay-"))
    servicers.EmbeddingServicer.PushThenLookup = recording  # type: ignore[method-assign]
    try:
        servers = [
            create_server(ServerConfig(shard_id=i, num_shards=2, data_dir=root / f"data-{i}"))
            for i in range(2)
        ]
        for server, _ in servers:
            server.start()
        with EmbeddingClient([f"127.0.0.1:{port}" for _, port in servers]) as client:
            trainer, dataset, case = _deepfm_trainer(client, args.direct)
            trainer.chunk(dataset, case.batch_size, args.steps, seed=0)  # rows made
            recorded.clear()
            for seed in range(1, 11):  # a call a step, but for steps the client sends apart
                if len(recorded) >= args.steps // 2:
                    break
                trainer.chunk(dataset, case.batch_size, args.steps, seed=seed)
        configs = list(servers[0][0].shard.store.tables())
        for server, _ in servers:
            server.stop(grace_s=0.5)
    finally:
        servicers.EmbeddingServicer.PushThenLookup = fused  # type: ignore[method-assign]
    shard = Shard(
        ServerConfig(shard_id=0, num_shards=2, data_dir=root / "replayed", tables=configs)
    )
    servicer = servicers.EmbeddingServicer(shard, lambda *_: None)
    generations = {c.name: str(shard.store.table(c.name).generation.id) for c in configs}

    class Context:
        """The little of a gRPC context the call reads: its metadata."""

        def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
            self.metadata = metadata

        def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
            return self.metadata

        def is_active(self) -> bool:
            return True

    sequence = 0

    def context_of(data: bytes) -> Context:
        nonlocal sequence
        sequence += 1
        tables = [batch.table for batch in wire.decode_push_then_lookup(data).push.batches]
        return Context(
            (
                (PUSH_ID_HEADER, f"replay:{sequence}"),
                (GENERATIONS_HEADER, ",".join(generations[table] for table in tables)),
            )
        )

    def call(data: bytes, context: Context) -> None:
        reply = servicer.PushThenLookup(wire.decode_push_then_lookup(data), context)
        assert isinstance(reply, bytes), "a replayed call was refused"

    for data in recorded:  # warm: the rows in the host tier, as in the loop
        call(data, context_of(data))
    profile = None if args.no_profile else cProfile.Profile(time.thread_time_ns, 1e-9)
    rounds = []
    for round_index in range(args.rounds):
        spent = []
        for data in recorded:
            context = context_of(data)
            if profile is not None and round_index == args.rounds - 1:
                profile.enable()
            started = time.thread_time_ns()
            call(data, context)
            spent.append((time.thread_time_ns() - started) / 1e6)
            if profile is not None:
                profile.disable()
        rounds.append(statistics.median(spent))
    shard.close()
    summary = {
        "calls": len(recorded),
        "rounds": args.rounds,
        # the last round runs under cProfile (unless --no-profile): left out of the best
        "call_cpu_ms_by_round": [round(ms, 3) for ms in rounds],
        "call_cpu_ms_best": round(min(rounds[:-1] if profile and len(rounds) > 1 else rounds), 3),
    }
    print(json.dumps(summary, indent=2))
    if profile is not None:
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        for order in ("tottime", "cumulative"):
            text.write(f"\n-- by {order} (seconds over {len(recorded)} calls, profiled) --\n")
            stats.sort_stats(order).print_stats(args.top)
        print(text.getvalue())
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument(
        "--no-profile", action="store_true", help="no cProfile: the threads' CPU alone"
    )
    parser.add_argument("--direct", action="store_true", help="direct tables, not hashed")
    parser.add_argument(
        "--replica",
        action="store_true",
        help="profile a replica following 2 training shards instead (bench_replica's pushes)",
    )
    parser.add_argument(
        "--replay",
        action="store_true",
        help="record shard 0's calls, then replay them to an in-process servicer: CPU a call",
    )
    parser.add_argument("--rounds", type=int, default=5, help="--replay: passes over the calls")
    parser.add_argument("--seconds", type=float, default=10.0, help="--replica: of pushing")
    parser.add_argument("--rate", type=float, default=100_000, help="--replica: key-updates/s")
    parser.add_argument("--serve", nargs=2, metavar=("SHARD_ID", "ROOT"), help=argparse.SUPPRESS)
    parser.add_argument("--follow", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        follow = tuple(args.follow.split(",")) if args.follow else ()
        profiled = not args.no_profile
        serve(int(args.serve[0]), args.shards, Path(args.serve[1]), args.top, profiled, follow)
        return 0
    if args.replica:
        return profile_replica(args)
    if args.replay:
        return replay(args)

    from tierps.client import EmbeddingClient

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
        trainer, dataset, case = _deepfm_trainer(client, args.direct)
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
        with timed_calls() as calls:
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
            # each PushThenLookup the trainer made: its wall time and the calling thread's
            # CPU in it (encode, gRPC, placing the reply), medians
            "trainer_call_ms": {
                "calls": len(calls),
                "wall": statistics.median(wall for wall, _ in calls) if calls else None,
                "cpu": statistics.median(cpu for _, cpu in calls) if calls else None,
            },
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
