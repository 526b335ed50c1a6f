"""`tierps admin top`: a live view of a cluster, from the shards' own Stats and metrics.

Per shard: calls/s and p50/p99 latency per RPC (its Prometheus histogram
tierps_rpc_seconds, read from the /metrics port Stats names: shards started with --metrics
or --metrics-port), rows and bytes per tier and each tier's hit rate. Per table: rows, keys
looked up and pushed per second, and on a replica cluster its lag (LAG: the largest
replica.lag_s of its shards and the changes not applied, summed). Rates and latencies are
over the last interval; a hit rate over the interval where the tier was asked anything,
else since the shard started.
"""

from __future__ import annotations

import math
import sys
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tierps.client.admin import ClusterAdmin

RPC_HISTOGRAM = "tierps_rpc_seconds"
Histogram = dict[float, float]  # upper bound (le) -> cumulative count


@dataclass
class Sample:
    """One look at every shard: its Stats and, where it serves metrics, each RPC method's
    latency histogram (codes summed)."""

    at: float
    stats: list[dict[str, Any]]
    rpcs: list[dict[str, Histogram] | None]  # per shard; None: no metrics served


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def read_rpc_histograms(url: str, timeout_s: float) -> dict[str, Histogram]:
    """Method -> cumulative bucket counts of tierps_rpc_seconds at a /metrics URL."""
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 - http only
        text = reply.read().decode()
    methods: dict[str, Histogram] = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(text):
        if family.name != RPC_HISTOGRAM:
            continue
        for sample in family.samples:
            if sample.name == f"{RPC_HISTOGRAM}_bucket":
                methods[sample.labels["method"]][float(sample.labels["le"])] += sample.value
    return {method: dict(buckets) for method, buckets in methods.items()}


def take_sample(admin: ClusterAdmin) -> Sample:
    stats = admin.stats()
    rpcs: list[dict[str, Histogram] | None] = []
    for shard, address in zip(stats, admin.addresses, strict=True):
        port = shard.get("metrics_port", 0)
        if not port:
            rpcs.append(None)
            continue
        url = f"http://{_host(address)}:{port}/metrics"
        try:
            rpcs.append(read_rpc_histograms(url, admin.timeout_s))
        except OSError:
            rpcs.append(None)
    return Sample(time.monotonic(), stats, rpcs)


def quantile(buckets: Histogram, q: float) -> float | None:
    """The q-quantile of a cumulative histogram, interpolated linearly inside its bucket
    (as Prometheus' histogram_quantile); None when it counts nothing. Past the last finite
    bound: that bound."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def _delta(now: Histogram, before: Histogram | None) -> Histogram:
    return {le: count - (before or {}).get(le, 0.0) for le, count in now.items()}


def frame(previous: Sample, current: Sample, addresses: list[str]) -> dict[str, Any]:
    """The figures one view shows: what changed from `previous` to `current`."""
    seconds = max(current.at - previous.at, 1e-9)
    shards = []
    tables: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    lags: dict[str, dict[str, float]] = {}  # a replica's tables: lag_s (largest), positions
    for index, shard in enumerate(current.stats):
        before = {t["config"]["name"]: t for t in previous.stats[index]["tables"]}
        rpcs = None
        if current.rpcs[index] is not None:
            rpcs = {}
            for method, buckets in sorted(current.rpcs[index].items()):
                earlier = (previous.rpcs[index] or {}).get(method)
                delta = _delta(buckets, earlier)
                calls = delta.get(math.inf, 0.0)
                rpcs[method] = {
                    "calls_per_s": calls / seconds,
                    "p50_s": quantile(delta, 0.5),
                    "p99_s": quantile(delta, 0.99),
                }
        tiers: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for table in shard["tables"]:
            name = table["config"]["name"]
            old = before.get(name)
            figures = tables[name]
            figures["rows"] += max((tier["rows"] for tier in table["tiers"]), default=0)
            lifecycle = table.get("lifecycle", {})
            if "replica.lag_s" in lifecycle:
                lag = lags.setdefault(name, {"lag_s": 0.0, "lag_positions": 0})
                lag["lag_s"] = max(lag["lag_s"], lifecycle["replica.lag_s"])
                lag["lag_positions"] += int(lifecycle["replica.lag_positions"])
            for kind in ("keys_looked_up", "keys_pushed"):
                figures[kind] += table[kind]
                figures[f"{kind}_per_s"] += (table[kind] - (old[kind] if old else 0)) / seconds
            old_tiers = {t["name"]: t for t in old["tiers"]} if old else {}
            for tier in table["tiers"]:
                into = tiers[tier["name"]]
                for field in ("rows", "bytes", "hits", "misses"):
                    into[field] += tier[field]
                    into[f"new_{field}"] += tier[field] - old_tiers.get(tier["name"], {}).get(
                        field, 0
                    )
        shards.append(
            {
                "shard_id": shard["shard_id"],
                "address": addresses[index],
                "rpc": rpcs,
                "tiers": [
                    {
                        "name": name,
                        "rows": int(t["rows"]),
                        "bytes": int(t["bytes"]),
                        "hit_rate": _rate(t["new_hits"], t["new_misses"])
                        if t["new_hits"] + t["new_misses"] > 0
                        else _rate(t["hits"], t["misses"]),
                        "hit_rate_over": "interval"
                        if t["new_hits"] + t["new_misses"] > 0
                        else "since start",
                    }
                    for name, t in tiers.items()
                ],
            }
        )
    return {
        "interval_s": seconds,
        "shards": shards,
        "tables": [
            {
                "name": name,
                **{k: (int(v) if not k.endswith("_per_s") else v) for k, v in figures.items()},
                **lags.get(name, {}),
            }
            for name, figures in sorted(tables.items())
        ],
    }


def _rate(hits: float, misses: float) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def render(figures: dict[str, Any]) -> Any:
    """The view of one frame, as rich renderables."""
    from rich.console import Group
    from rich.table import Table

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:,.2f} ms"

    def size(n: float) -> str:
        return f"{n / 2**20:,.1f} MiB"

    title = f"tierps: {len(figures['shards'])} shards, over {figures['interval_s']:.1f} s"
    rpc = Table(title=f"{title}: calls per shard and RPC", title_justify="left")
    for column in ("shard", "address", "rpc", "calls/s", "p50", "p99"):
        rpc.add_column(column, justify="left" if column in ("address", "rpc") else "right")
    tiers = Table(title="tiers per shard", title_justify="left")
    for column in ("shard", "tier", "rows", "bytes", "hit rate"):
        tiers.add_column(column, justify="left" if column == "tier" else "right")
    for shard in figures["shards"]:
        if shard["rpc"] is None:
            rpc.add_row(
                str(shard["shard_id"]),
                shard["address"],
                "no metrics (start shards with --metrics)",
                "-",
                "-",
                "-",
            )
        else:
            for method, call in shard["rpc"].items():
                rate = f"{call['calls_per_s']:,.1f}"
                rpc.add_row(
                    str(shard["shard_id"]),
                    shard["address"],
                    method,
                    rate,
                    ms(call["p50_s"]),
                    ms(call["p99_s"]),
                )
        for tier in shard["tiers"]:
            rate = tier["hit_rate"]
            shown = "-" if rate is None else f"{rate:.1%}"
            if tier["hit_rate_over"] != "interval" and rate is not None:
                shown += " (since start)"
            tiers.add_row(
                str(shard["shard_id"]),
                tier["name"],
                f"{tier['rows']:,}",
                size(tier["bytes"]),
                shown,
            )
    tables = Table(title="tables", title_justify="left")
    for column in ("table", "rows", "looked up keys/s", "pushed keys/s", "LAG"):
        tables.add_column(column, justify="left" if column == "table" else "right")
    for table in figures["tables"]:
        lag = "-"  # not a replica's table
        if "lag_s" in table:
            lag = f"{table['lag_s']:,.2f} s, {table['lag_positions']:,} changes"
        tables.add_row(
            table["name"],
            f"{table['rows']:,}",
            f"{table['keys_looked_up_per_s']:,.0f}",
            f"{table['keys_pushed_per_s']:,.0f}",
            lag,
        )
    return Group(rpc, tiers, tables)


def run_top(admin: ClusterAdmin, *, interval_s: float, once: bool, as_json: bool) -> Any:
    """`tierps admin top`: with once, one frame over interval_s (returned, for --json; else
    printed); otherwise a view refreshed every interval_s until Ctrl-C."""
    from rich.console import Console
    from rich.live import Live

    console = Console(width=None if sys.stdout.isatty() else 160)
    previous = take_sample(admin)
    time.sleep(interval_s)
    current = take_sample(admin)
    if once:
        figures = frame(previous, current, admin.addresses)
        if not as_json:
            console.print(render(figures))
        return figures
    try:
        with Live(console=console, auto_refresh=False) as live:
            while True:
                live.update(render(frame(previous, current, admin.addresses)), refresh=True)
                time.sleep(interval_s)
                previous, current = current, take_sample(admin)
    except KeyboardInterrupt:
        return None
