"""The `tierps` command: serve one shard, run a local cluster, administer a cluster, demo."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

from tierps.client.command_line import DefaultsHelpFormatter, Parser, redact

log = logging.getLogger("tierps.server")

# The modules of pyproject's `server` extra (tests/unit/test_layers.py holds the two
# together): a trainer's install lacks them, and the commands that run shards check them.
SERVER_EXTRA_MODULES = ("grpc_health", "grpc_reflection", "rocksdict")
RUNS_SHARDS = ("serve", "cluster", "demo", "storage-demo")


def _add_serve(commands: argparse._SubParsersAction) -> None:
    from tierps.core.xp import GPU_ARRAYS
    from tierps.server.config import MAX_INFLIGHT_BYTES, REPLICA_DTYPES, REPLICA_TOKEN_ENV

    serve = commands.add_parser(
        "serve",
        help="run one shard daemon",
        description="Run one shard. Flags win over the --config file. SIGTERM or SIGINT: "
        "stop taking calls, finish in-flight ones, flush, close RocksDB, exit 0.",
    )
    serve.add_argument("--shard-id", type=int, help="this shard's id, 0..num-shards-1")
    serve.add_argument("--num-shards", type=int, help="shards in the cluster")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="gRPC port (default 0: any free port)")
    serve.add_argument("--data-dir", type=Path, help="this shard's RocksDB directory")
    serve.add_argument("--snapshot-dir", type=Path, help="snapshot directory (may be shared)")
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    serve.add_argument("--grace-s", type=float, help="on stop, seconds in-flight calls may take")
    serve.add_argument(
        "--gpu-cache-mb",
        type=int,
        help="GPU cache per table on this shard, MiB, for tables whose gpu_cache_bytes is 0 "
        "(needs cupy and a GPU; without one: a warning, and the host tier serves)",
    )
    serve.add_argument(
        "--require-gpu",
        action="store_true",
        default=None,
        help="exit with an error instead of serving without a GPU",
    )
    serve.add_argument(
        "--gpu-arrays",
        choices=GPU_ARRAYS,
        help="auto: GPU tiers on cupy; numpy: the GPU tier's code on host arrays (tests)",
    )
    serve.add_argument(
        "--flush-interval-s",
        type=float,
        help="write-back tables: write dirty rows to RocksDB at least this often, seconds; "
        "bounds what a crash can lose (default 30; 0: only at stop, snapshot and eviction)",
    )
    serve.add_argument(
        "--sync-writes",
        action="store_true",
        default=None,
        help="fsync RocksDB's log on every write: write-through updates survive a power loss "
        "too, not only a killed process (slower writes)",
    )
    serve.add_argument(
        "--max-step-leap",
        type=int,
        help="refuse a push more than this many steps past its table's largest step "
        "(default 10**9; 0: no limit; a table's first push may start anywhere)",
    )
    security = serve.add_argument_group("security and limits (README, Security)")
    security.add_argument("--tls-cert", type=Path, help="PEM certificate: TLS on the port")
    security.add_argument("--tls-key", type=Path, help="PEM key of --tls-cert")
    security.add_argument(
        "--tls-client-ca",
        type=Path,
        help="mutual TLS: clients must show a certificate signed by this PEM CA",
    )
    security.add_argument(
        "--tokens-file",
        type=Path,
        help="ROLE:TOKEN entries (roles admin, trainer, reader), one per line; without it "
        "$TIERPS_TOKENS is read; with neither, calls need no token",
    )
    security.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="serve on a non-loopback --host without TLS and tokens (a warning is logged)",
    )
    security.add_argument("--metrics-host", help="bind address of /metrics (default: --host)")
    security.add_argument(
        "--health-port",
        type=int,
        help="also serve health alone, in plaintext, on this port (probes that cannot speak "
        "TLS); its own threads, so data calls never starve it",
    )
    security.add_argument(
        "--max-calls",
        type=int,
        help="calls at once, health excepted (default 32); more are "
        "refused with RESOURCE_EXHAUSTED",
    )
    security.add_argument(
        "--max-receiving-streams",
        type=int,
        help="request streams waiting for their messages at once (default 8)",
    )
    security.add_argument(
        "--max-inflight-mb",
        type=int,
        help="request bytes the shard's calls may hold at once, MiB (default "
        f"{MAX_INFLIGHT_BYTES >> 20})",
    )
    security.add_argument(
        "--stream-idle-s", type=float, help="cancel a request stream silent this long (30)"
    )
    security.add_argument(
        "--call-total-s", type=float, help="cancel a data call running this long (600)"
    )
    replica = serve.add_argument_group("read-only replica (README, Serving while training)")
    replica.add_argument(
        "--follow",
        metavar="ADDR[,ADDR...]",
        help="serve as a read-only replica of the training cluster whose shards listen at "
        "these addresses (every shard, in any order); --shard-id/--num-shards are then this "
        "replica cluster's own",
    )
    replica.add_argument(
        "--replica-dtype",
        choices=REPLICA_DTYPES,
        help="the replica's weights in RocksDB (default float32: bit-identical lookups)",
    )
    replica.add_argument(
        "--replica-save-s",
        type=float,
        help="seconds between the replica's saves of where it is (a flush, then its cursors; "
        "default 10): a restart resumes from the last",
    )
    replica.add_argument(
        "--replica-token-file",
        type=Path,
        help=f"the bearer token (role replica) sent to the training shards; without it "
        f"${REPLICA_TOKEN_ENV}",
    )
    replica.add_argument("--follow-tls-ca", type=Path, help="PEM CA of the training shards")
    replica.add_argument(
        "--follow-tls-client-cert", type=Path, help="this replica's PEM certificate (mutual TLS)"
    )
    replica.add_argument("--follow-tls-client-key", type=Path, help="its PEM key")
    replica.add_argument(
        "--follow-tls-server-name", help="the name in the training shards' certificates"
    )
    serve.add_argument("--config", type=Path, help="TOML file of ServerConfig fields")
    serve.add_argument("--port-file", type=Path, help="write the bound ports here (JSON)")
    serve.add_argument("--log-level", default="info", help="debug, info, warning, error")


def _serve(args: argparse.Namespace) -> int:
    from tierps.server import logs
    from tierps.server.config import ServerConfig
    from tierps.server.daemon import serve
    from tierps.storage import TierpsError

    logs.configure(args.log_level)
    flags = {
        "shard_id": args.shard_id,
        "num_shards": args.num_shards,
        "host": args.host,
        "port": args.port,
        "data_dir": args.data_dir,
        "snapshot_dir": args.snapshot_dir,
        "metrics_port": args.metrics_port,
        "grace_s": args.grace_s,
        "gpu_cache_bytes": None if args.gpu_cache_mb is None else args.gpu_cache_mb << 20,
        "require_gpu": args.require_gpu,
        "gpu_arrays": args.gpu_arrays,
        "flush_interval_s": args.flush_interval_s,
        "sync_writes": args.sync_writes,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_client_ca": args.tls_client_ca,
        "tokens_file": args.tokens_file,
        "insecure": args.insecure,
        "metrics_host": args.metrics_host,
        "health_port": args.health_port,
        "max_workers": args.max_calls,
        "max_receiving_streams": args.max_receiving_streams,
        "max_inflight_bytes": None if args.max_inflight_mb is None else args.max_inflight_mb << 20,
        "stream_idle_s": args.stream_idle_s,
        "call_total_s": args.call_total_s,
        "max_step_leap": args.max_step_leap,
        "follow": args.follow,
        "replica_dtype": args.replica_dtype,
        "replica_save_s": args.replica_save_s,
        "replica_token_file": args.replica_token_file,
        "follow_tls_ca": args.follow_tls_ca,
        "follow_tls_cert": args.follow_tls_client_cert,
        "follow_tls_key": args.follow_tls_client_key,
        "follow_tls_server_name": args.follow_tls_server_name,
    }
    try:
        if args.config is not None:
            config = ServerConfig.from_file(args.config, **flags)
        else:
            missing = [
                f"--{k.replace('_', '-')}"
                for k in ("shard_id", "num_shards", "data_dir")
                if flags[k] is None
            ]
            if missing:
                print(f"tierps serve: {', '.join(missing)} required (or --config)", file=sys.stderr)
                return 2
            config = ServerConfig(**{k: v for k, v in flags.items() if v is not None})
        return serve(config, port_file=args.port_file)
    except (TierpsError, ValueError, OSError) as error:
        why = redact(str(error))  # --tokens-file given a token: no file of that name
        log.error("cannot serve: %s", why)
        print(f"tierps serve: {why}", file=sys.stderr)
        return 1


def _add_cluster(commands: argparse._SubParsersAction) -> None:
    cluster = commands.add_parser(
        "cluster",
        help="run N shards on this machine until Ctrl-C",
        description="Start N shard daemons as subprocesses, wait until each is SERVING, print "
        "their addresses, and stop them all gracefully on Ctrl-C or SIGTERM. If a shard exits "
        "on its own (a crash, kill -9), the cluster prints which (its pid, exit code or "
        "signal, and log file), stops the other shards and exits with status 1: no shard "
        "serves another's keys, so a cluster missing one is not left running; start it again "
        "on the same --data-dir.",
    )
    cluster.add_argument("--shards", type=int, required=True, help="number of shards")
    cluster.add_argument(
        "--base-port", type=int, help="shard i binds base-port + i (default: free)"
    )
    cluster.add_argument("--data-dir", type=Path, required=True, help="shard-<i>/ per shard here")
    cluster.add_argument("--snapshot-dir", type=Path, help="shared snapshot directory")
    cluster.add_argument("--metrics", action="store_true", help="each shard serves /metrics")
    cluster.add_argument(
        "--flush-interval-s",
        type=float,
        help="each shard's background flush interval, seconds (default 30; 0: off)",
    )
    cluster.add_argument(
        "--sync-writes", action="store_true", help="each shard fsyncs every RocksDB write"
    )
    cluster.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="also run a cluster of this many read-only replica shards following the "
        "shards (data under --data-dir/replicas; role replica's token from "
        "$TIERPS_REPLICA_TOKEN)",
    )
    from tierps.client import security
    from tierps.server.cluster import add_server_security_arguments

    add_server_security_arguments(cluster)
    security.add_arguments(cluster)


# In a `tierps cluster` data dir while it runs: the shards' addresses, comma-separated.
ADDRESSES_FILE = "addresses"


def _cluster(args: argparse.Namespace) -> int:
    from tierps.client import security
    from tierps.client.addresses import ADDRESSES_ENV
    from tierps.server.cluster import LocalCluster, server_security_args
    from tierps.server.daemon import on_stop_signal

    stop = on_stop_signal()
    durability = ("--sync-writes",) if args.sync_writes else ()
    durability += server_security_args(args)
    if args.flush_interval_s is not None:
        durability += ("--flush-interval-s", str(args.flush_interval_s))
    cluster = LocalCluster(
        args.shards,
        args.data_dir,
        args.snapshot_dir,
        base_port=args.base_port,
        metrics=args.metrics,
        extra_args=durability,
        security=security.from_args(args),
    )
    replicas: LocalCluster | None = None
    try:
        cluster.start()
        if args.replicas:
            client_ca = security.from_args(args).ca_file
            follow_tls = ("--follow-tls-ca", str(Path(client_ca).resolve())) if client_ca else ()
            replicas = LocalCluster(
                args.replicas,
                args.data_dir / "replicas",
                metrics=args.metrics,
                extra_args=durability + follow_tls,
                security=security.from_args(args),
                follow=cluster.addresses,
            )
            replicas.start()
    except (RuntimeError, TimeoutError, OSError) as error:  # start() stopped what it started
        cluster.stop()
        print(f"tierps cluster: {error}", file=sys.stderr)
        return 1
    addresses_file = args.data_dir / ADDRESSES_FILE
    joined = ",".join(cluster.addresses)
    try:
        addresses_file.write_text(joined + "\n")
        print(f"{args.shards} shards serving (logs in {args.data_dir}/shard-<i>.log):")
        for shard_id, address in enumerate(cluster.addresses):
            metrics = cluster.metrics_ports[shard_id]
            extra = f"  metrics http://{cluster.host}:{metrics}/metrics" if metrics else ""
            print(f"  shard {shard_id}: {address}{extra}")
        print(f"addresses: {joined}")
        if replicas is not None:
            print(
                f"{args.replicas} read-only replica shards following them (logs in "
                f"{replicas.data_dir}/shard-<i>.log): {','.join(replicas.addresses)}"
            )
        print(f"# also in {addresses_file}; for the client and tierps admin, in a shell:")
        print(f"export {ADDRESSES_ENV}={joined}", flush=True)
        while not stop:
            died = [("shard", *d) for d in cluster.exited()]
            died += [("replica shard", *d) for d in (replicas.exited() if replicas else [])]
            if died:
                for kind, shard_id, pid, code, log_file in died:
                    how = f"killed by {_signal_name(-code)}" if code < 0 else f"exit code {code}"
                    print(
                        f"tierps cluster: {kind} {shard_id} (pid {pid}) exited on its own "
                        f"({how}); its log: {log_file}; stopping the other shards",
                        file=sys.stderr,
                        flush=True,
                    )
                return 1
            time.sleep(0.2)
        print("stopping...", flush=True)
    finally:
        if replicas is not None:
            replicas.stop()
        cluster.stop()
        if addresses_file.exists() and addresses_file.read_text().strip() == joined:
            addresses_file.unlink()  # only ours: a cluster stopped leaves no stale addresses
    return 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _add_storage_demo(commands: argparse._SubParsersAction) -> None:
    about = (
        "stream a Zipf trace through one table 4x larger than its host budget (storage "
        "engine only, no cluster, no training)"
    )
    demo = commands.add_parser(
        "storage-demo",
        help=about,
        description=f"{about[0].upper()}{about[1:]}: look up each batch and push gradients for "
        "it, then print throughput, hit rates per tier and peak memory.",
        formatter_class=DefaultsHelpFormatter,
    )
    demo.add_argument("--data-dir", type=Path, default=Path("tierps-data"), help="RocksDB here")
    demo.add_argument("--dim", type=int, default=32, help="embedding dim")
    demo.add_argument("--host-mb", type=int, default=64, help="host tier budget, MiB")
    demo.add_argument("--steps", type=int, default=150, help="batches to stream")
    demo.add_argument("--batch", type=int, default=16384, help="keys per batch")
    demo.add_argument("--keep", action="store_true", help="continue from the last run's rows")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tierps")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    """`tierps ...`; the exit status. A reader of its output that goes away (`| head`)
    ends it quietly."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # Python's advice: point stdout at devnull so the exit's flush raises nothing more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # as a shell reports a process ended by SIGPIPE


def build_parser() -> Parser:
    """The `tierps` command line, every subcommand's flags included."""
    parser = Parser(prog="tierps", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tierps {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve(commands)
    _add_cluster(commands)
    # The admin command is a client of the cluster: it lives with the client.
    from tierps.client import admin_cli

    admin_cli.add_arguments(commands.add_parser("admin", help="administer a running cluster"))
    # The demo trains a model with the client: it lives in tierps.demo (torch is imported
    # only when it runs).
    from tierps.demo import main as demo_main

    demo_main.add_arguments(
        commands.add_parser(
            "demo",
            help="train DeepFM on MovieLens-100k through a local cluster",
            description="Train DeepFM (MovieLens-100k, or a Criteo-like synthetic set) through "
            "a local cluster; print logloss, AUC, samples/s and tier hit rates per epoch.",
            formatter_class=DefaultsHelpFormatter,
        )
    )
    _add_storage_demo(commands)
    return parser


def missing_server_extra() -> list[str]:
    """The modules of the server extra that do not import here (none where it is installed)."""
    missing = []
    for name in SERVER_EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def _main(argv: list[str] | None) -> int:
    from tierps.client import admin_cli
    from tierps.demo import main as demo_main

    args = build_parser().parse_args(argv)
    if args.command in RUNS_SHARDS and (missing := missing_server_extra()):
        print(
            f"tierps {args.command}: runs shards, which need the server extra "
            f"({', '.join(missing)} not installed): pip install 'tierps[server]'",
            file=sys.stderr,
        )
        return 1
    if args.command == "serve":
        return _serve(args)
    if args.command == "cluster":
        return _cluster(args)
    if args.command == "admin":
        return admin_cli.run(args)
    if args.command == "demo":
        return demo_main.run(args)
    from tierps.server.storage_demo import run_storage_demo

    run_storage_demo(
        args.data_dir,
        dim=args.dim,
        host_mb=args.host_mb,
        steps=args.steps,
        batch=args.batch,
        keep=args.keep,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
