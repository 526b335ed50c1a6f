"""How close the host tier's lookup is to the least work any hash lookup must do.

    python -m tests.bench.bench_lookup_bound [--keys 1000000] [--dims 16 64 128]
        [--out docs/perf/lookup_bound.json]

`np.take(arena, ids)` with precomputed row ids (bench_storage's baseline) reads one row a
key. A lookup by key must also read the key's index slot (one more random cache line),
learn the row id from it (so the row's address waits for the slot) and find the slot by
hashing and probing. This benchmark adds those costs one at a time, each contender writing
into its own reused cache-line-aligned output, on the same arena and index:

- `np_take`: `np.take(arena, ids, out=, mode="clip")`, the baseline;
- `take_and_slot_line`: a compiled copy of the same rows by the same precomputed ids that
  also reads each key's own index slot, located in advance: the memory traffic of a hash
  lookup, with no dependency between slot and row and no hashing or probing;
- `row_id_from_slot`: the same, with each row id read from its slot as a lookup must (the
  slot prefetched ahead, then its row: k_lookup's schedule), still no hashing or probing;
- `lookup`: `EmbeddingTable.lookup(keys, out=)`, the whole hash lookup (k_lookup).

Each step's ratio against np.take shows what that step costs on this machine. Not part of
the test run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from tierps.core.compiled import jit_kernel, numba
from tierps.storage import EmbeddingStore, TableConfig, host_kernels, optim
from tierps.storage.warm_up import warm_up

if numba is None:  # pragma: no cover - numba is a dependency
    raise SystemExit("bench_lookup_bound needs numba (host_kernels unavailable)")

hk = host_kernels


RING = 64  # a power of two > 2 * AHEAD: the row ids in flight (as k_lookup's ring)


@jit_kernel
def take_with_slot_line(index_keys, values, slots, arena, ids, out, dependent):  # noqa: ANN001, ANN201
    """out[i] = arena[ids[i]], reading each key's index slot (located in advance) too.
    dependent=False: the row ids are given (ids), the slot's key is read and summed (so
    it is not optimised away): two independent random reads a key. dependent=True: the
    row id is read from the slot (values[slots[i]]) as a lookup must, the slot prefetched
    2 * AHEAD keys before use and its row AHEAD before (k_lookup's schedule), with no
    hashing or probing. Rows are copied as k_lookup copies them."""
    n = ids.shape[0]
    width = out.shape[1]
    size = width * 4
    stream = hk._streams(out, width)
    arena_at, arena_stride = np.int64(arena.ctypes.data), arena.strides[0]
    out_at, out_stride = np.int64(out.ctypes.data), out.strides[0]
    ring = np.empty(RING, dtype=np.int64)
    seen = np.int64(0)
    for i in range(-2 * hk.AHEAD, n):
        ahead = i + 2 * hk.AHEAD
        if dependent and ahead < n:
            hk._prefetch(index_keys, hk._at(index_keys, slots[ahead]))
        ahead = i + hk.AHEAD
        if 0 <= ahead < n:
            if dependent:
                r = values[slots[ahead]]
                ring[ahead & (RING - 1)] = r
            else:
                hk._prefetch(index_keys, hk._at(index_keys, slots[ahead]))
                r = ids[ahead]
            hk._prefetch_span(arena_at + r * arena_stride, size)
        if i < 0:
            continue
        if dependent:
            r = ring[i & (RING - 1)]
        else:
            seen += index_keys[slots[i]]
            r = ids[i]
        if stream:
            hk._stream_row(out_at + i * out_stride, arena_at + r * arena_stride, size)
        else:
            for c in range(width):
                out[i, c] = arena[r, c]
    if stream:
        hk._store_fence()
    return seen


def bench_bound(root: Path, n: int, dim: int, repeats: int) -> dict:
    """The four contenders on one table of n resident keys, run round-robin `repeats`
    times; each round's ratio is np.take's time in that round over the contender's, and
    the median ratio is reported (neighbouring calls see the same machine load)."""
    rng = np.random.default_rng(0)
    config = TableConfig(
        "host", dim, optimizer=optim.SGD(), host_cache_bytes=n * (dim * 4 + 144) + (64 << 20)
    )
    with EmbeddingStore(root / f"dim{dim}") as store:
        table = store.create_table(config)
        keys = rng.choice(2**40, n, replace=False).astype(np.int64)
        table.assign(keys, rng.standard_normal((n, dim), dtype=np.float32))
        host = table.tiers[0]
        probe = rng.permutation(keys)
        index = host.index
        slots = index.find(probe)
        ids = index.values[slots]
        index_keys = index._keys  # the slots' key column: the line a probe reads
        assert (index_keys[slots] == probe).all()
        outs = [host_kernels.aligned_empty(n, dim) for _ in range(4)]
        contenders = {
            "np_take": lambda: np.take(host.arena, ids, axis=0, out=outs[0], mode="clip"),
            "take_and_slot_line": lambda: take_with_slot_line(
                index_keys, index.values, slots, host.arena, ids, outs[1], False
            ),
            "row_id_from_slot": lambda: take_with_slot_line(
                index_keys, index.values, slots, host.arena, ids, outs[2], True
            ),
            "lookup": lambda: table.lookup(probe, out=outs[3]),
        }
        for run in contenders.values():
            run()  # compiles, and pages every output in
        for out in outs[1:]:
            np.testing.assert_array_equal(out, outs[0])
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(repeats):
            for name, run in contenders.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
        index_bytes, arena_bytes = int(index.nbytes), int(host.arena.nbytes)
    base = times["np_take"]
    return {
        "keys": n,
        "dim": dim,
        "repeats": repeats,
        "index_bytes": index_bytes,
        "arena_bytes": arena_bytes,
        "median_s": {name: statistics.median(t) for name, t in times.items()},
        "ratio_vs_np_take": {
            name: statistics.median(b / t for b, t in zip(base, ts, strict=True))
            for name, ts in times.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("docs/perf/lookup_bound.json"))
    args = parser.parse_args()
    warm_up()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for dim in args.dims:
            r = bench_bound(Path(tmp), args.keys, dim, args.repeats)
            results.append(r)
            print(f"{r['keys']:,} keys, dim {dim}, {r['repeats']} rounds:", flush=True)
            for name, seconds in r["median_s"].items():
                ratio = r["ratio_vs_np_take"][name]
                print(f"  {name:20s} {seconds * 1e3:7.1f} ms   {ratio:.2f}x np.take", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
