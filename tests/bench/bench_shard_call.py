"""One data call's server CPU at a bench_service shape, without gRPC: the request tierps'
client would send (one table's keys, and for a push their gradients; SGD, every row in the
host tier) handed straight to a shard's servicer (a push with a new push id each call),
against the raw numpy server's call (tests/bench/echo_server.py) on the same keys and
gradients. The table is hashed, or with --direct a direct table (use_hashtable=False: row k
of an arena holds key k, the raw server's layout). Calls alternate; each one's CPU is
measured in its thread; medians printed.

    python -m tests.bench.bench_shard_call [--call push|lookup] [--direct] [--dim 16]
        [--keys 16384] [--calls 200] [--profile]

--profile then runs tierps' calls once more under cProfile (a CPU clock) and prints where
their time goes by function: the compiled kernels against the glue.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.bench.bench_service import LR, TABLE_KEYS
from tests.bench.echo_server import RawNumpy, initial_rows
from tierps.proto import wire
from tierps.server import servicers
from tierps.server.config import ServerConfig
from tierps.server.ledger import PUSH_ID_HEADER
from tierps.server.shard import Shard
from tierps.storage import TableConfig, optim


class _Context:
    """The little of a gRPC context a data call reads: its metadata."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--keys", type=int, default=16384)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--call", choices=("push", "lookup"), default="push")
    parser.add_argument("--direct", action="store_true", help="a direct table, not a hashed one")
    parser.add_argument("--profile", action="store_true", help="cProfile tierps' calls after")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tierps-shard-call-"))
    index = {"use_hashtable": False, "capacity": TABLE_KEYS} if args.direct else {}
    config = TableConfig(
        "t",
        args.dim,
        optimizer=optim.SGD(lr=LR),
        host_cache_bytes=TABLE_KEYS * args.dim * 8,
        **index,
    )
    shard = Shard(ServerConfig(shard_id=0, num_shards=1, data_dir=root / "data", tables=[config]))
    try:
        every = np.arange(TABLE_KEYS, dtype=np.int64)
        shard.store.table("t").assign(every, initial_rows(TABLE_KEYS, args.dim))
        servicer = servicers.EmbeddingServicer(shard, lambda *_: None)
        rng = np.random.default_rng(0)
        keys = rng.choice(TABLE_KEYS, args.keys, replace=False).astype(np.int64)
        grads = rng.standard_normal((args.keys, args.dim), dtype=np.float32) * 1e-3
        pushes = args.call == "push"
        bulk = (keys.tobytes(), grads.tobytes()) if pushes else (keys.tobytes(),)
        request = wire.encode_batches([("t", args.dim, 1 if pushes else 0, bulk)])
        raw = RawNumpy()
        shape = {"table_rows": TABLE_KEYS, "dim": args.dim, "lr": LR, "seed": 0}
        raw.fill(json.dumps(shape).encode(), None)
        raw_request = keys.tobytes() + (grads.tobytes() if pushes else b"")
        sequence = 0

        def tierps() -> Any:
            nonlocal sequence
            if not pushes:
                return servicer.LookupUnary(wire.decode_lookup_batches(request), _Context(()))
            sequence += 1
            context = _Context(((PUSH_ID_HEADER, f"bench:{sequence}"),))
            return servicer.PushGradientsUnary(wire.decode_push_batches(request), context)

        raw_call = raw.push if pushes else raw.lookup
        calls = {"tierps": tierps, "raw": lambda: raw_call(raw_request, None)}
        for call in calls.values():  # warm
            for _ in range(20):
                call()
        spent: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.calls):
            for name, call in calls.items():
                started = time.thread_time_ns()
                call()
                spent[name].append((time.thread_time_ns() - started) / 1e3)
        median = {name: statistics.median(times) for name, times in spent.items()}
        print(
            f"dim {args.dim}, {args.keys} keys a {args.call}, "
            f"{'direct' if args.direct else 'hashed'} table: tierps {median['tierps']:.0f} us "
            f"of CPU a call, raw numpy server {median['raw']:.0f} us "
            f"({median['raw'] / median['tierps']:.2f}x tierps' time)"
        )
        if args.profile:
            profile = cProfile.Profile(time.thread_time_ns, 1e-9)
            profile.enable()
            for _ in range(args.calls):
                tierps()
            profile.disable()
            print(f"-- tierps' {args.calls} calls by own CPU (profiled: slower) --")
            pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    finally:
        shard.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
