"""deploy/grafana-dashboard.json against what a real shard exports: every metric a panel
(or a variable) names is in a scrape of a shard's /metrics, and every label a query groups
or filters by is one that metric carries."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tierps.client import EmbeddingClient, TableConfig
from tierps.server.daemon import ShardServer

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"
METRIC = re.compile(r"\btierps_[a-z0-9_]+")
GROUPED = re.compile(r"\bby \(([^)]*)\)")
MATCHED = re.compile(r"\b(\w+)\s*(?:=~|!=|!~|=)\s*\"")


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = [
        (f"panel {panel['title']!r}", target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]
    found += [
        (f"variable {v['name']!r}", v["query"])
        for v in dashboard["templating"]["list"]
        if v["type"] == "query"
    ]
    return found


def test_every_metric_the_dashboard_names_is_exported(
    shard_server: Callable[..., ShardServer],
) -> None:
    server = shard_server(metrics_port=0)
    with EmbeddingClient([f"127.0.0.1:{server.port}"]) as client:
        client.create_table(TableConfig("items", 4))
        keys = np.arange(10)
        client.lookup("items", keys)
        client.push_gradients("items", keys, np.ones((10, 4), np.float32))
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)

    found = queries()
    assert len(found) >= 8
    panels = {where for where, _ in found}
    for needed in ("latency", "calls/s", "Hit rate", "Memory per tier", "Flush lag"):
        assert any(needed in where for where in panels), (needed, panels)
    for where, query in found:
        names = METRIC.findall(query)
        assert names, f"{where}: names no tierps metric: {query}"
        for name in names:
            assert name in labels, f"{where}: {name} is not exported; exported: {sorted(labels)}"
        used = {label.strip() for group in GROUPED.findall(query) for label in group.split(",")}
        used |= set(MATCHED.findall(query))
        for label in used - {""}:
            assert any(label in labels[name] for name in names), (
                f"{where}: label {label!r} is on none of {names}"
            )
