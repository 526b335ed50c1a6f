"""`tierps admin`: tables, describe, stats and snapshots of a running cluster."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tierps.client import security
from tierps.client.addresses import ADDRESSES_ENV
from tierps.client.admin import ShardError
from tierps.client.embedding import EmbeddingClient
from tierps.client.top import run_top
from tierps.core.config import TableConfig
from tierps.core.errors import Reason, TierpsError


def _connection_flags(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """--addresses, --timeout-s and --json: on `tierps admin` itself (with the defaults) and
    again on every subcommand (suppress: no default there, so one given before the
    subcommand is not overwritten), so they may come before or after it."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--addresses",
        default=default(None),
        help=f"the shards' host:port, comma-separated, in shard order (shard 0 first); "
        f"default: ${ADDRESSES_ENV}",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=default(30.0),
        help="deadline of each call, seconds (default 30)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=default(False),
        help="print JSON instead of a table",
    )


def _subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every subcommand parser below parser (snapshot's verbs too), depth first."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += [sub, *_subcommands(sub)]
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _connection_flags(parser, suppress=False)
    security.add_arguments(parser)
    actions = parser.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a table on every shard")
    create.add_argument(
        "--config",
        type=Path,
        required=True,
        help="a TableConfig as JSON: one object, or a list of them (the form `tables --json` "
        "prints), each created",
    )
    create.add_argument(
        "--init",
        type=Path,
        help="initial rows, read here: a .npy matrix [n, dim] (row i: key i) or a .npz with "
        "arrays keys and values (a --config of one table)",
    )
    actions.add_parser("tables", help="list the tables and their configs")
    describe = actions.add_parser(
        "describe",
        help="rows, bytes and hit rates of a table per tier, its admission filter, eviction and "
        "adaptive embedding",
    )
    describe.add_argument("table")
    actions.add_parser(
        "stats", help="every shard's tables, memory and uptime, and each table's tiers"
    )
    evict = actions.add_parser(
        "evict", help="remove a table's stale (steps_to_live) and small (min_l2_norm) rows"
    )
    evict.add_argument("table")
    top = actions.add_parser(
        "top",
        help="a live view: per shard calls/s and p50/p99 latency per RPC (shards serving "
        "metrics), rows, bytes and hit rate per tier; per table rows and keys/s looked up and "
        "pushed",
    )
    top.add_argument(
        "--interval-s",
        type=float,
        default=2.0,
        help="seconds between refreshes, and the window of the rates (default 2)",
    )
    top.add_argument("--once", action="store_true", help="print one frame and exit (scripts)")
    snapshot = actions.add_parser("snapshot", help="save, load or list snapshots")
    verbs = snapshot.add_subparsers(dest="verb", required=True)
    save = verbs.add_parser("save", help="save a consistent snapshot of every table")
    save.add_argument("name")
    save.add_argument(
        "--base",
        default="",
        help="an incremental snapshot: only the rows changed since the complete snapshot BASE "
        "was cut, and the rows removed since (loading it loads BASE's chain too)",
    )
    verbs.add_parser("load", help="load a snapshot (any shard count)").add_argument("name")
    verbs.add_parser("list", help="the snapshots in the snapshot directory")
    verbs.add_parser("delete", help="remove a snapshot, complete or not").add_argument("name")
    verbs.add_parser(
        "gc",
        help="remove what failed saves left: incomplete snapshots, unnamed save dirs "
        "(run it while no save runs)",
    )
    for subcommand in _subcommands(parser):
        _connection_flags(subcommand, suppress=True)


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _print_rows(header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


def _bytes(n: float) -> str:
    return f"{n / 2**10:,.1f} KiB" if n < 2**20 else _mb(int(n))


def _hit_rate(tier: dict[str, Any]) -> str:
    """A tier's hit rate, or "-" before any lookup reached it (as `top` shows it)."""
    return f"{tier['hit_rate']:.1%}" if tier["hits"] + tier["misses"] else "-"


def _count(name: str) -> Callable[[dict[str, float]], str]:
    return lambda figures: f"{figures[name]:,.0f}"


# Per lifecycle feature: the figure that says the table has it (DescribeTable's lifecycle
# map), the line introducing it (from the config), and its columns per shard.
_LIFECYCLE_TABLES: tuple[
    tuple[str, Callable[[dict[str, Any]], str], list[tuple[str, Callable[[dict], str]]]], ...
] = (
    (
        "admission.counters",
        lambda c: (
            f"admission: {c['admission']} filter, a row after {c['admit_after']} "
            f"sightings; keys without one read {c['default_value']:g}"
        ),
        [
            ("keys counted", _count("admission.keys_counted")),
            (
                "counters used",
                lambda a: f"{a['admission.counters_used']:,.0f} / {a['admission.counters']:,.0f}",
            ),
            ("filter memory", lambda a: _bytes(a["admission.bytes"])),
            ("sightings", _count("admission.sightings")),
            ("admitted", _count("admission.keys_admitted")),
            ("default lookups", _count("admission.lookups_default")),
            ("gradients dropped", _count("admission.gradients_dropped")),
        ],
    ),
    (
        "eviction.runs",
        lambda c: (
            f"eviction: steps_to_live {c['steps_to_live']}, min_l2_norm "
            f"{c['min_l2_norm']:g}, before snapshots: {c['evict_before_snapshot']}"
        ),
        [
            ("current step", _count("eviction.current_step")),
            ("runs", _count("eviction.runs")),
            ("removed (last)", _count("eviction.last_removed")),
            ("removed (all)", _count("eviction.removed_total")),
        ],
    ),
    (
        "adaptive.bucket_rows",
        lambda c: (
            f"adaptive: {c['hash_bucket_size']:,} bucket rows a shard, a row of its own "
            f"after {c['promote_after']} sightings"
        ),
        [
            ("bucket rows", _count("adaptive.bucket_rows")),
            ("bucket memory", lambda a: _bytes(a["adaptive.bucket_bytes"])),
            ("keys counted", _count("adaptive.keys_counted")),
            ("sightings", _count("adaptive.sightings")),
            ("promoted", _count("adaptive.keys_promoted")),
            ("bucket lookups", _count("adaptive.lookups_from_buckets")),
            ("bucket gradients", _count("adaptive.gradients_to_buckets")),
            ("bucket updates", _count("adaptive.bucket_updates")),
        ],
    ),
)


def _print_lifecycle(shards: list[dict[str, Any]]) -> None:
    """The figures of each lifecycle feature the table has (admission, eviction, adaptive
    embedding), a row per shard."""
    for marker, title, columns in _LIFECYCLE_TABLES:
        if not any(marker in s["lifecycle"] for s in shards):
            continue
        print(title(shards[0]["config"]))
        _print_rows(
            ["shard", *(header for header, _ in columns)],
            [[s["shard_id"], *(show(s["lifecycle"]) for _, show in columns)] for s in shards],
        )


def _component(data: dict[str, Any]) -> str:
    params = ", ".join(f"{k}={v:g}" for k, v in data.items() if k != "kind")
    return f"{data['kind']}({params})"


# The lifecycle options and their off values: describe prints those that are on.
_LIFECYCLE_OFF = {
    "use_hashtable": True,
    "capacity": 0,
    "placement": "row",
    "table_shard": -1,
    "hash_bucket_size": 0,
    "promote_after": 0,
    "admit_after": 0,
    "steps_to_live": 0,
    "min_l2_norm": 0.0,
    "evict_before_snapshot": False,
}


def _lifecycle_options(config: dict[str, Any]) -> str:
    on = {name: config[name] for name, off in _LIFECYCLE_OFF.items() if config.get(name) != off}
    if config.get("admit_after"):
        on.update({k: config[k] for k in ("admission", "default_value")})
        if config["admission"] == "bloom":
            on.update({k: config[k] for k in ("max_elements", "false_positive_rate")})
    return ", ".join(f"{name}={value}" for name, value in on.items())


def _with_bar(action: Any, label: str) -> dict[str, Any]:
    """action(progress=...) with a progress bar of rows on stderr, only where stderr is a
    terminal (a log gets no carriage-return updates). The bar appears at the first report,
    so a call refused at once (a snapshot not found) shows none; its total is the first one
    reported, once every shard reported (ClusterAdmin._stream), and stays fixed."""
    if not sys.stderr.isatty():
        return action(progress=None)
    bar: tqdm | None = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=max(total, 1), unit="row", desc=label, file=sys.stderr)
        bar.n = min(done, bar.total)  # a save's total is an estimate: never past 100%
        bar.refresh()

    try:
        return action(progress=progress)
    finally:
        if bar is not None:
            bar.close()


def _snapshot_not_found(admin: EmbeddingClient, error: ShardError) -> str:
    """The message of a call naming a snapshot that does not exist (SNAPSHOT_NOT_FOUND), with
    the snapshots that do."""
    try:
        names = [s["name"] for s in admin.list_snapshots()]
    except ShardError:
        return str(error)
    return f"{error}; snapshots there: {', '.join(names) if names else 'none'}"


def run(args: argparse.Namespace) -> int:
    try:
        channel_security = security.from_args(args)
        with EmbeddingClient(
            args.addresses, timeout_s=args.timeout_s, security=channel_security
        ) as admin:
            try:
                result = _act(admin, args)
            except ShardError as error:
                if error.reason is not Reason.SNAPSHOT_NOT_FOUND:
                    raise
                print(f"tierps admin: {_snapshot_not_found(admin, error)}", file=sys.stderr)
                return 1
    except BrokenPipeError:
        raise  # the output's reader went away: tierps' main exits quietly
    except (ShardError, TierpsError, ValueError, OSError) as error:
        print(f"tierps admin: {error}", file=sys.stderr)
        return 1
    if args.json and result is not None:
        print(json.dumps(result, indent=1, default=str))
    return 0


def _read_configs(path: Path) -> list[TableConfig]:
    """The TableConfigs of a JSON file: one object, or a list (as `tables --json` prints)."""
    data = json.loads(path.read_text())
    entries = data if isinstance(data, list) else [data]
    if not entries or not all(isinstance(entry, dict) for entry in entries):
        raise ValueError(
            f"{path}: expected a TableConfig JSON object or a non-empty list of them (the form "
            f"`tierps admin tables --json` prints), got {type(data).__name__}"
            + (f" of {sorted({type(e).__name__ for e in entries})}" if entries else " (empty)")
        )
    return [TableConfig.from_dict(entry) for entry in entries]


def _act(admin: EmbeddingClient, args: argparse.Namespace) -> Any:
    if args.action == "top":
        if not args.interval_s > 0:
            raise ValueError(f"--interval-s expected > 0, got {args.interval_s}")
        return run_top(admin, interval_s=args.interval_s, once=args.once, as_json=args.json)
    if args.action == "create":
        configs = _read_configs(args.config)
        if args.init is not None and len(configs) != 1:
            raise ValueError(
                f"--init expected a --config of one table, got {len(configs)} tables in "
                f"{args.config}"
            )
        results = []
        for config in configs:
            created = admin.create_table(config, initial=args.init)
            result = {"table": config.name, "created": created}
            if args.init is not None:
                result["initial_rows_from"] = str(args.init)
            results.append(result)
            if not args.json:
                verb = "created" if created else "exists already, with this config,"
                rows = f", initial rows from {args.init}" if args.init is not None else ""
                shards = len(admin.addresses)
                where = f"{shards} shard" + ("" if shards == 1 else "s")
                print(f"table {config.name!r} {verb} on {where}{rows}")
        return results[0] if len(results) == 1 else results
    if args.action == "tables":
        configs = [c.to_dict() for c in admin.list_tables()]
        if not args.json:
            _print_rows(
                [
                    "table",
                    "dim",
                    "optimizer",
                    "initializer",
                    "host cache",
                    "gpu cache",
                    "write policy",
                ],
                [
                    [
                        c["name"],
                        c["dim"],
                        _component(c["optimizer"]),
                        _component(c["initializer"]),
                        _mb(c["host_cache_bytes"]),
                        _mb(c["gpu_cache_bytes"]),
                        c["write_policy"],
                    ]
                    for c in configs
                ],
            )
        return configs
    if args.action == "describe":
        shards = admin.describe(args.table)
        if not args.json:
            config = shards[0]["config"]
            print(f"table {args.table!r}: {_component(config['optimizer'])}, dim {config['dim']}")
            options = _lifecycle_options(config)
            if options:
                print(f"  options: {options}")
            _print_rows(
                ["shard", "tier", "rows", "bytes", "scratch", "hits", "misses", "hit rate"],
                [
                    [
                        s["shard_id"],
                        t["name"],
                        f"{t['rows']:,}",
                        _mb(t["bytes"]),
                        _mb(t["scratch_bytes"]),
                        f"{t['hits']:,}",
                        f"{t['misses']:,}",
                        _hit_rate(t),
                    ]
                    for s in shards
                    for t in s["tiers"]
                ],
            )
            _print_lifecycle(shards)
        return shards
    if args.action == "stats":
        shards = admin.stats()
        if not args.json and all(not s["uptime_s"] and not s["rss_bytes"] for s in shards):
            # a reader's token is answered each shard's identity, life and data id only
            _print_rows(
                ["shard", "address", "life", "data id"],
                [
                    [s["shard_id"], address, s["life"], s["data_id"]]
                    for s, address in zip(shards, admin.addresses, strict=True)
                ],
            )
            print(
                "(this token's role is answered each shard's identity, life and data id "
                "only: its tables, memory and uptime need a trainer or admin token)"
            )
            return shards
        if not args.json:
            _print_rows(
                ["shard", "address", "tables", "rows (durable)", "rss", "peak rss", "uptime"],
                [
                    [
                        s["shard_id"],
                        address,
                        len(s["tables"]),
                        f"{sum(t['tiers'][-1]['rows'] for t in s['tables']):,}",
                        _mb(s["rss_bytes"]),
                        _mb(s["peak_rss_bytes"]),
                        f"{s['uptime_s']:.0f} s",
                    ]
                    for s, address in zip(shards, admin.addresses, strict=True)
                ],
            )
            print()
            _print_rows(
                ["shard", "table", "tier", "rows", "bytes", "hits", "misses", "hit rate"],
                [
                    [
                        s["shard_id"],
                        t["config"]["name"],
                        tier["name"],
                        f"{tier['rows']:,}",
                        _mb(tier["bytes"]),
                        f"{tier['hits']:,}",
                        f"{tier['misses']:,}",
                        _hit_rate(tier),
                    ]
                    for s in shards
                    for t in s["tables"]
                    for tier in t["tiers"]
                ],
            )
        return shards
    if args.action == "evict":
        result = admin.evict(args.table)
        if not args.json:
            shards = ", ".join(
                f"shard {i}: {n:,} (step {step:,})"
                for i, (n, step) in enumerate(
                    zip(result["per_shard"], result["current_step"], strict=True)
                )
            )
            print(f"table {args.table!r}: evicted {result['removed']:,} rows ({shards})")
        return result
    if args.verb in ("save", "load"):
        action, done = {
            "save": (admin.save_snapshot, "saved snapshot {!r}: {:,} rows in {}"),
            "load": (admin.load_snapshot, "loaded snapshot {!r}: {:,} rows from {}"),
        }[args.verb]
        options = {"base": args.base} if args.verb == "save" and args.base else {}
        result = _with_bar(
            lambda progress: action(args.name, progress=progress, **options),
            f"{args.verb} {args.name}",
        )
        if not args.json:
            print(done.format(args.name, result["rows"], result["path"]))
            if result.get("evicted"):
                print(f"evicted {result['evicted']:,} rows first (evict_before_snapshot)")
            if result.get("base"):
                print(f"incremental over {result['base']!r}: changes found by " + _diffs(result))
        return result
    if args.verb in ("delete", "gc"):
        removed = (
            admin.delete_snapshot(args.name) if args.verb == "delete" else (admin.gc_snapshots())
        )
        if not args.json:
            print(f"removed {len(removed)} path(s)" + "".join(f"\n  {p}" for p in removed))
        return {"removed": removed}
    snapshots = admin.list_snapshots()
    if not args.json:
        _print_rows(
            ["snapshot", "complete", "shards", "chain", "tables (rows)"],
            [
                [
                    s["name"],
                    "yes" if s["complete"] else "NO",
                    s["num_shards"] or "-",
                    " -> ".join(s["chain"]) or "full" if s["complete"] else "-",
                    ", ".join(f"{t} ({n:,})" for t, n in sorted(s["table_rows"].items())),
                ]
                for s in snapshots
            ],
        )
    return snapshots


def _diffs(result: dict[str, Any]) -> str:
    """How an incremental save found each table's changes, per shard: "ada: journal (shards
    0, 1), compare (shard 2)"."""
    found: dict[str, dict[str, list[int]]] = {}
    for shard, diffs in enumerate(result["diffs"]):
        for table, diff in diffs.items():
            found.setdefault(table, {}).setdefault(diff, []).append(shard)
    return "; ".join(
        f"{table}: "
        + ", ".join(
            f"{diff} (shard{'s' if len(shards) > 1 else ''} {', '.join(map(str, shards))})"
            for diff, shards in sorted(by.items())
        )
        for table, by in sorted(found.items())
    )
