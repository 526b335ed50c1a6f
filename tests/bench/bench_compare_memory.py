"""Memory of an incremental save's compare path, measured.

    python -m tests.bench.bench_compare_memory [--out bench-results/compare_memory.json]
        [--rows 1000000] [--shards 2]

A chain on disk - a full snapshot of `rows` rows (dim 16, Adagrad: 128 bytes a row, keys and
step stamps 16 more) saved by `shards` shards, and an incremental over it of 1% of the rows
with 0.1% tombstones - is compared, in a fresh child process, with an export of the same
table in 65,536-row chunks whose rows differ from the chain's in 1% of the keys, as shard 0
of one shard would (every row its own). Reported: the child's peak RSS above its RSS just
before the comparison, next to the table's bytes (keys, rows and stamps), and the ratio.
Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tierps.storage import TableConfig, optim
from tierps.storage.snapshot_chain import CHAIN_CHUNK_ROWS
from tierps.storage.snapshot_format import CHECKSUM, DIFF_JOURNAL
from tierps.storage.snapshot_writer import BaseLink, TableCut, commit, write_part

DIM = 16
TABLE = TableConfig("t", DIM, optimizer=optim.Adagrad(lr=0.05), steps_to_live=1000)
CHUNK = 65536

CHILD = """
import resource, sys, time
from pathlib import Path
import numpy as np
from tests.bench.bench_compare_memory import TABLE, CHUNK, rows_of, rss_bytes
from tierps.storage.snapshot_chain import Comparison, open_chain, shard_rows
root, rows = Path(sys.argv[1]), int(sys.argv[2])
chain = open_chain(root, "inc")
def export():
    for start in range(0, rows, CHUNK):
        keys = np.arange(start, min(rows, start + CHUNK), dtype=np.int64)
        values = rows_of(keys, 0)
        values[keys % 100 == 7] += 1.0  # 1% changed since the chain
        yield keys, values, np.ones(keys.size, np.int64)
before = rss_bytes()
started = time.perf_counter()
comparison = Comparison(lambda: shard_rows(chain, "t", 0, 1, int(sys.argv[3])))
changed = sum(keys.size for keys, _, _ in comparison.changed(export()))
seconds = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(before, peak, changed, comparison.tombstones().size, seconds)
"""


def rss_bytes() -> int:
    """This process's resident set now (Linux /proc)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def rows_of(keys: np.ndarray, version: int) -> np.ndarray:
    """Rows [n, row_width] that are a function of key and version."""
    column = np.arange(TABLE.row_width, dtype=np.float32)
    return (keys[:, None].astype(np.float32) * 1e-3 + column + version).astype(np.float32)


def save(
    root: Path,
    name: str,
    shards: int,
    keys: np.ndarray,
    version: int,
    base: str = "",
    gone: np.ndarray | None = None,
) -> None:
    link = None
    if base:
        from tierps.storage.snapshot_reader import Snapshot

        opened = Snapshot(root, base)
        link = BaseLink(base, opened.save_id, opened.manifest[CHECKSUM])
    gone = np.empty(0, np.int64) if gone is None else gone
    for shard in range(shards):
        mine, dead = keys[keys % shards == shard], gone[gone % shards == shard]

        def chunks(mine: np.ndarray = mine) -> object:
            for start in range(0, mine.size, CHUNK):
                part = mine[start : start + CHUNK]
                yield part, rows_of(part, version), np.ones(part.size, np.int64)

        cut = TableCut(
            TABLE,
            chunks(),
            cursor="journal:1",
            diff=DIFF_JOURNAL if base else "",
            tombstones=lambda dead=dead: dead,
        )
        list(write_part(root, name, f"{name}0", shard, shards, [cut], mine.size, link))
    commit(root, name, f"{name}0")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/compare_memory.json"))
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--chain-chunk", type=int, default=CHAIN_CHUNK_ROWS)
    args = parser.parse_args()
    keys = np.arange(args.rows, dtype=np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        save(root, "full", args.shards, keys, 0)
        save(root, "inc", args.shards, keys[keys % 100 == 3], 0, "full", keys[keys % 1000 == 5])
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(root), str(args.rows), str(args.chain_chunk)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
    before, peak, changed, tombstones, seconds = (
        int(out[0]),
        int(out[1]),
        int(out[2]),
        int(out[3]),
        float(out[4]),
    )
    table_bytes = args.rows * (TABLE.codec.row_bytes + 8 + 8)
    results = {
        "rows": args.rows,
        "table_bytes": table_bytes,
        "peak_rss_above_start_bytes": peak - before,
        "ratio_to_table": (peak - before) / table_bytes,
        "changed_rows": changed,
        "tombstones": tombstones,
        "seconds": seconds,
    }
    print(
        f"compare path, {args.rows} rows dim {DIM} Adagrad ({table_bytes / 2**20:.0f} MiB): peak "
        f"RSS {(peak - before) / 2**20:.0f} MiB above the start = "
        f"{results['ratio_to_table']:.2f}x the table; {changed} rows changed, {tombstones} "
        f"tombstones, {seconds:.2f} s"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
