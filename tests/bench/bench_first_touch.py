"""First touch at several host budgets: the cost of lookup(create=True) of keys never seen
(RocksDB miss, initial rows, host-tier insert) should not grow with host_cache_bytes.

    python -m tests.bench.bench_first_touch [--out bench-results/first_touch.json]
        [--rounds 3] [--keys 1000000] [--dims 16 64] [--optimizers sgd adam]
        [--budgets-mib 64 464 2048 8192] [--batches 16384 131072 1000000]
        [--python PYTHON ...]

Each configuration (dim, optimizer, host budget, keys per call) runs in a fresh subprocess,
so that its peak RSS and its page faults are its own: a store in a temporary directory,
one table, the keys looked up in calls of `batch` keys as a trainer sends them. The same
subprocess then times the budget-independent work on the same keys in the same calls:

- the compiled host index insert (HashTable.insert) into an index made for all the keys
  (its allocation included; no growth: what an index that knew its size would pay), and
- the table's initializer (host_kernels.initial_rows) on each call's keys.

Reported per configuration (medians over rounds; rounds alternate the order of the
configurations, so drift on a shared machine hits each alike): first-touch seconds and
keys/s, the baseline's seconds, first touch / baseline, first touch / first touch at the
smallest budget of the same dim, optimizer and batch, and the same against the smallest
budget that holds every key (a smaller one evicts and writes to RocksDB: other work), peak
RSS growth over the process before the table was made, and what the rows need (their rows,
dirty flags and the index sized for them). --python runs the children with each given
interpreter (another checkout's environment, say) in turn, to compare builds in one run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KEYS = 1_000_000


def _vm_kib(field: str) -> int:
    """A /proc/self/status figure in KiB (VmRSS, VmHWM)."""
    text = Path("/proc/self/status").read_text()
    return int(text.split(f"{field}:")[1].split()[0])


def child(spec: dict) -> dict:
    """One configuration in this (fresh) process; returns its figures."""
    import numpy as np

    from tierps.storage import EmbeddingStore, TableConfig, host_kernels, optim
    from tierps.storage.hash_table import HashTable
    from tierps.storage.warm_up import warm_up

    warm_up()  # as a shard does at start: the kernels' compile time is not first touch
    n, batch, dim = spec["keys"], spec["batch"], spec["dim"]
    optimizer = {"sgd": optim.SGD, "adam": optim.Adam}[spec["optimizer"]]()
    budget = spec["budget_mib"] << 20
    keys = np.random.default_rng(4).choice(2**40, n, replace=False).astype(np.int64)
    calls = [keys[i : i + batch] for i in range(0, n, batch)]
    config = TableConfig("first", dim, optimizer=optimizer, host_cache_bytes=budget)
    with tempfile.TemporaryDirectory(prefix="tierps-first-touch-") as root:
        with EmbeddingStore(Path(root)) as store:
            rss_before = _vm_kib("VmRSS")
            table = store.create_table(config)
            started, cpu = time.perf_counter(), time.process_time()
            for call in calls:
                table.lookup(call)
            ours_s, ours_cpu_s = time.perf_counter() - started, time.process_time() - cpu
            peak_kib = _vm_kib("VmHWM")
            stats = table.stats()
            host = stats["tiers"].get("host", {})
            held = int(host.get("rows", 0))
            spilled = int(stats.get("spilled", n - held))
            store.drop_table(config.name)

    started, cpu = time.perf_counter(), time.process_time()
    index = HashTable(n)  # sized for every key: no growth, no rehash
    for call in calls:
        index.insert(call)
    index_s, index_cpu_s = time.perf_counter() - started, time.process_time() - cpu
    assert index.size == n
    started, cpu = time.perf_counter(), time.process_time()
    for call in calls:
        host_kernels.initial_rows(config, call)
    init_s, init_cpu_s = time.perf_counter() - started, time.process_time() - cpu
    need = n * (config.stored_bytes + 1) + HashTable.nbytes_for(n)
    return {
        **spec,
        "ours_s": ours_s,
        "index_insert_s": index_s,
        "initializer_s": init_s,
        "ours_cpu_s": ours_cpu_s,
        "index_insert_cpu_s": index_cpu_s,
        "initializer_cpu_s": init_cpu_s,
        "held_rows": held,
        "spilled_rows": spilled,
        "peak_rss_growth_mb": (peak_kib - rss_before) / 1024,
        "peak_rss_mb": peak_kib / 1024,
        "rows_need_mb": need / 2**20,
    }


def run_child(python: str, spec: dict) -> dict:
    done = subprocess.run(
        [python, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{python} {spec}: exit {done.returncode}\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def summarise(runs: list[dict]) -> dict:
    """Medians of one configuration's rounds."""
    out = dict(runs[0])
    for field in (
        *("ours_s", "index_insert_s", "initializer_s"),
        *("ours_cpu_s", "index_insert_cpu_s", "initializer_cpu_s", "peak_rss_growth_mb"),
    ):
        out[field] = statistics.median(r[field] for r in runs)
    out["peak_rss_mb"] = statistics.median(r["peak_rss_mb"] for r in runs)
    out["rounds"] = len(runs)
    out["ours_s_each"] = [r["ours_s"] for r in runs]
    out["ours_cpu_s_each"] = [r["ours_cpu_s"] for r in runs]
    out["ours_keys_per_s"] = out["keys"] / out["ours_s"]
    out["baseline_s"] = out["index_insert_s"] + out["initializer_s"]
    out["vs_baseline"] = out["ours_s"] / out["baseline_s"]
    out["baseline_cpu_s"] = out["index_insert_cpu_s"] + out["initializer_cpu_s"]
    out["vs_baseline_cpu"] = out["ours_cpu_s"] / out["baseline_cpu_s"]
    return out


def add_budget_ratios(results: list[dict]) -> None:
    """first touch / first touch at the smallest budget (and at the smallest that holds
    every key) of the same interpreter, dim, optimizer and batch."""

    def group(r: dict) -> tuple:
        return r["python"], r["dim"], r["optimizer"], r["batch"]

    for _, members in itertools.groupby(sorted(results, key=group), key=group):
        members = sorted(members, key=lambda r: r["budget_mib"])
        holding = [r for r in members if r["spilled_rows"] == 0]
        for r in members:
            for clock in ("", "_cpu"):
                ours = r[f"ours{clock}_s"]
                r[f"vs_smallest_budget{clock}"] = ours / members[0][f"ours{clock}_s"]
                r[f"vs_smallest_holding_budget{clock}"] = (
                    ours / holding[0][f"ours{clock}_s"]
                    if holding and r["spilled_rows"] == 0
                    else None
                )


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("bench-results/first_touch.json"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keys", type=int, default=KEYS)
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "adam"])
    parser.add_argument("--budgets-mib", type=int, nargs="+", default=[64, 464, 2048, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[16_384, 131_072, KEYS])
    parser.add_argument("--python", nargs="+", default=[sys.executable])
    args = parser.parse_args()
    if args.child:
        print("RESULT" + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    specs = [
        {"dim": d, "optimizer": o, "budget_mib": b, "batch": min(c, args.keys), "keys": args.keys}
        for d, o, c, b in itertools.product(
            args.dims, args.optimizers, args.batches, args.budgets_mib
        )
    ]
    runs: dict[tuple, list[dict]] = {}
    for round_ in range(args.rounds):
        order = specs if round_ % 2 == 0 else specs[::-1]
        for spec in order:
            pythons = args.python if round_ % 2 == 0 else args.python[::-1]
            for python in pythons:
                result = run_child(python, spec)
                # an interpreter is named only where several are compared
                result["python"] = python if len(args.python) > 1 else "python"
                runs.setdefault((python, *spec.values()), []).append(result)
                print(
                    f"round {round_ + 1}: {python} dim {spec['dim']} {spec['optimizer']} "
                    f"batch {spec['batch']} budget {spec['budget_mib']} MiB: "
                    f"{result['ours_s'] * 1e3:.0f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    results = [summarise(r) for r in runs.values()]
    add_budget_ratios(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"configurations": results}, indent=2))
    print(
        "| python | dim | optimizer | keys a call | budget | first touch wall (CPU) | keys/s | "
        "index insert + initializer wall (CPU) | vs baseline wall (CPU) | vs smallest budget "
        "holding all, wall (CPU) | peak RSS growth (rows need) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    for r in results:
        print(
            f"| {r['python']} | {r['dim']} | {r['optimizer']} | {r['batch']:,} | "
            f"{r['budget_mib']} MiB{' (spills)' if r['spilled_rows'] else ''} | "
            f"{r['ours_s'] * 1e3:.0f} ({r['ours_cpu_s'] * 1e3:.0f}) ms | "
            f"{r['ours_keys_per_s'] / 1e6:.2f}M | {r['baseline_s'] * 1e3:.0f} "
            f"({r['baseline_cpu_s'] * 1e3:.0f}) ms | {ratio(r['vs_baseline'])} "
            f"({ratio(r['vs_baseline_cpu'])}) | {ratio(r['vs_smallest_holding_budget'])} "
            f"({ratio(r['vs_smallest_holding_budget_cpu'])}) | "
            f"{r['peak_rss_growth_mb']:.0f} MB ({r['rows_need_mb']:.0f} MB) |"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
