"""Prometheus metrics of one shard: table figures read at scrape time, RPC latencies."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tierps.server.shard import Shard

# Seconds; gRPC calls here run from ~0.3 ms (a small lookup) to seconds (a snapshot).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class _TableCollector(Collector):
    """Rows, bytes, scratch, hits and misses per table and tier, keys looked up and pushed
    per table, a replica's lag per table, the last flush's time and the process's memory,
    read from the shard when scraped."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def collect(self) -> Iterator[Metric]:
        labels = ["shard", "table", "tier"]
        rows = GaugeMetricFamily(
            "tierps_table_rows", "Rows held, per table and tier", labels=labels
        )
        size = GaugeMetricFamily(
            "tierps_table_bytes",
            "Bytes held (rows, state, index), per table and tier",
            labels=labels,
        )
        scratch = GaugeMetricFamily(
            "tierps_table_scratch_bytes",
            "Working memory beside the bytes held: the host tier's push scratch (the values a "
            "push saves to undo a refusal), per table and tier",
            labels=labels,
        )
        hits = CounterMetricFamily(
            "tierps_table_hits", "Keys looked for and found, per table and tier", labels=labels
        )
        misses = CounterMetricFamily(
            "tierps_table_misses",
            "Keys looked for and not found, per table and tier",
            labels=labels,
        )
        looked_up = CounterMetricFamily(
            "tierps_table_keys_looked_up", "Keys looked up, per table", labels=["shard", "table"]
        )
        pushed = CounterMetricFamily(
            "tierps_table_keys_pushed", "Keys pushed, per table", labels=["shard", "table"]
        )
        last_flush = GaugeMetricFamily(
            "tierps_last_flush_timestamp_seconds",
            "Unix time of the last flush of every dirty row to RocksDB (0: none yet); the "
            "flush lag is time() minus this",
            labels=["shard"],
        )
        lag_s = GaugeMetricFamily(
            "tierps_replica_lag_seconds",
            "A replica's staleness per table: seconds since the oldest training change it has "
            "not applied (0: at the training shards' heads)",
            labels=["shard", "table"],
        )
        lag_positions = GaugeMetricFamily(
            "tierps_replica_lag_positions",
            "A replica's changes not applied per table: the training journals' heads minus "
            "the positions applied, summed over the training shards",
            labels=["shard", "table"],
        )
        rss = GaugeMetricFamily(
            "tierps_resident_memory_bytes", "Resident memory of the shard process", labels=["shard"]
        )
        shard = str(self.shard.shard_id)
        try:
            stats = self.shard.stats()
        except Exception:  # closing, or a table dropped mid-scrape: report nothing this time
            stats = {"tables": []}
        for table in stats["tables"]:
            name = table["config"].name
            for tier in table["tiers"]:
                values = [shard, name, tier["name"]]
                rows.add_metric(values, tier["rows"])
                size.add_metric(values, tier["bytes"])
                scratch.add_metric(values, tier["scratch_bytes"])
                hits.add_metric(values, tier["hits"])
                misses.add_metric(values, tier["misses"])
            looked_up.add_metric([shard, name], table["keys_looked_up"])
            pushed.add_metric([shard, name], table["keys_pushed"])
            lifecycle = table["lifecycle"]
            if "replica.lag_s" in lifecycle:  # a replica shard's (server/replica.py)
                lag_s.add_metric([shard, name], lifecycle["replica.lag_s"])
                lag_positions.add_metric([shard, name], lifecycle["replica.lag_positions"])
        if "last_flush_unix_s" in stats:
            last_flush.add_metric([shard], stats["last_flush_unix_s"])
            rss.add_metric([shard], stats["rss_bytes"])
        yield from (rows, size, scratch, hits, misses, looked_up, pushed, last_flush, rss)
        yield from (lag_s, lag_positions)


class ShardMetrics:
    """One registry per shard (several shards may share a process in tests)."""

    def __init__(self, shard: Shard) -> None:
        self.registry = CollectorRegistry()
        self.shard_label = str(shard.shard_id)
        self.rpc_seconds = Histogram(
            "tierps_rpc_seconds",
            "Server-side latency of gRPC calls, by shard, method and status code",
            ["shard", "method", "code"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.refusals = Counter(
            "tierps_refusals",
            "Calls refused or cancelled by the shard's guards (server/security.py, "
            "server/limits.py), by method, status code and cause (token, role, calls, "
            "streams, bytes, idle, total)",
            ["method", "code", "cause"],
            registry=self.registry,
        )
        self.registry.register(_TableCollector(shard))
        self._http = None

    def observe(self, method: str, code: str, seconds: float) -> None:
        """One call's latency in tierps_rpc_seconds."""
        self.rpc_seconds.labels(self.shard_label, method, code).observe(seconds)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP; returns the bound port."""
        self._http, _thread = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
