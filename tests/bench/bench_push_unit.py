"""What a push's unit and identity cost on a shard: the same pushes (8 tables, the shapes of
a DLRM-style step) applied table by table (each table all or nothing on its own, as
EmbeddingTable.apply_checked_gradients does) against the shard's one-unit path
(Shard._apply_push: every table's update computed and checked before any is stored), and
with a push id recorded in the ledger (Shard.push_gradients). Alternated in rounds in one
process; medians printed.

    python -m tests.bench.bench_push_unit [--tables 8] [--keys 8192] [--dim 16] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from tierps.server.config import ServerConfig
from tierps.server.ledger import PushId
from tierps.server.shard import PushBatch, Shard
from tierps.storage import TableConfig, optim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--keys", type=int, default=8192, help="distinct keys per table a push")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--pushes", type=int, default=50, help="pushes per contender a round")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        shard = Shard(ServerConfig(0, 1, Path(tmp) / "shard"))
        names = [f"t{i}" for i in range(args.tables)]
        for name in names:
            shard.admin.create_table(TableConfig(name, args.dim, optimizer=optim.Adagrad(lr=0.01)))
        universe = 200_000
        step = [0]
        sequence = iter(range(1, 1 << 62))

        def batches() -> list[PushBatch]:
            step[0] += 1
            return [
                PushBatch(
                    name,
                    args.dim,
                    rng.choice(universe, args.keys, replace=False),
                    rng.standard_normal((args.keys, args.dim), np.float32),
                    step[0],
                )
                for name in names
            ]

        def per_table(pushes: list[list[PushBatch]]) -> None:
            for push in pushes:
                checked = shard._checked_push(push)
                shard._table_threads.each(
                    lambda item: item[0].apply_checked_gradients(*item[1:]), checked
                )

        def one_unit(pushes: list[list[PushBatch]]) -> None:
            for push in pushes:
                shard._apply_push(shard._checked_push(push), {})

        def with_id(pushes: list[list[PushBatch]]) -> None:
            for push in pushes:
                shard.push_gradients(push, PushId("bench", next(sequence)))

        contenders = {"table by table": per_table, "one unit": one_unit, "one unit + id": with_id}
        for run in contenders.values():  # warm: every key has a row, kernels compiled
            run([batches() for _ in range(5)])
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, run in contenders.items():
                pushes = [batches() for _ in range(args.pushes)]
                started = time.perf_counter()
                run(pushes)
                times[name].append((time.perf_counter() - started) / args.pushes)
        shard.close()
    base = statistics.median(times["table by table"])
    print(
        f"{args.tables} tables x {args.keys} keys, dim {args.dim}, Adagrad; medians of "
        f"{args.rounds} rounds of {args.pushes} pushes"
    )
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:16s} {1e3 * median:8.3f} ms a push   {median / base:5.3f}x table by table")


if __name__ == "__main__":
    main()
