"""`tierps demo`: train DeepFM on MovieLens-100k (or a Criteo-like synthetic set) through a
local cluster, and report what happened.

    tierps demo [--dataset movielens|synthetic] [--data-dir ./tierps-data] [--epochs N]
                [--batch-size B] [--dim D] [--shards 2] [--seed S] [--samples N]
                [--staleness 0|1]   (default 1: a lookup may miss the previous push)
                [--trainers N [--mode sync|async] [--staleness K]] [--serve]

It starts a LocalCluster (shards under <data-dir>/demo-cluster-<shards>, snapshots under
<data-dir>/snapshots), drops the tables left by an earlier run (any dataset's) and creates
this dataset's afresh (on a running cluster given instead, it drops its own tables only
with --replace), trains with a progress bar, prints per epoch the train and test logloss and AUC,
samples/s and each tier's hit rate, saves a snapshot, and stops the cluster. With --serve, a
read-only replica shard follows the cluster while it trains (tierps serve --follow), and each
epoch's report adds the test AUC computed from lookups on the replica and its lag. With --trainers
N, N data-parallel trainers under torchrun train instead (tierps.demo.trainers), each on its
share of every batch, saving a job checkpoint after each epoch.

The model, the training loop and its metrics are in tierps.demo.training; `tier_hit_rates`
is here. This module imports only the standard library (and tierps.demo.training, which does
too) at the top, so `tierps --help` stays fast and a server-only install (no torch) still
has a working `tierps` command.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierps.demo.training import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_DIM,
    DEFAULT_LR,
    EpochResult,
    build_tierps_model,
    create_tables,
    train,
)

if TYPE_CHECKING:
    from tierps.client import EmbeddingClient
    from tierps.demo.data import CTRDataset
    from tierps.demo.deepfm import SparseOptimizer

DEFAULT_EPOCHS = {"movielens": 5, "synthetic": 1}  # synthetic overfits from the 2nd epoch
DEFAULT_BATCH_SIZES = {"movielens": DEFAULT_BATCH_SIZE, "synthetic": 1024}
# The embedding pipeline's staleness (tierps.client.torch): the library's default is 0
# (exact); the demo trains at 1, measured as fast or faster with the same test AUC
# (docs/architecture.md, "Pipelined training").
DEFAULT_STALENESS = 1
# With --trainers and --mode async: at 1 every step waits for the previous step's pushes of
# every trainer; at 2 they overlap a whole step (docs/architecture.md, "Many trainers").
DEFAULT_ASYNC_STALENESS = 2
DEFAULT_SAMPLES = 200_000
# Host-tier budget per table and shard: MovieLens fits many times over; the synthetic set
# (~130 MB of rows with Adam state at 200k samples) does not, so its cold rows live in RocksDB.
DEFAULT_HOST_CACHE_MB = {"movielens": 64, "synthetic": 16}
TORCH_INSTALL = (
    "pip install torch==2.13.0 (on PyPI: --index-url https://download.pytorch.org/whl/cpu)"
)


# -- tiers ----------------------------------------------------------------------------------------


def tier_hit_rates(client: EmbeddingClient, tables: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Hits, misses and hit rate of each tier, summed over the tables and every shard (from
    client.describe). A tier counts the keys the tier above it missed."""
    totals: dict[str, dict[str, Any]] = {}
    for table in tables:
        for shard in client.describe(table):
            for tier in shard["tiers"]:
                figures = totals.setdefault(tier["name"], {"hits": 0, "misses": 0, "rows": 0})
                figures["hits"] += tier["hits"]
                figures["misses"] += tier["misses"]
                figures["rows"] += tier["rows"]
    for figures in totals.values():
        looked = figures["hits"] + figures["misses"]
        figures["hit_rate"] = figures["hits"] / looked if looked else 0.0
    return totals


def format_hit_rates(rates: dict[str, dict[str, Any]]) -> str:
    """One line such as: host 99.8% of 1,838,686 keys; rocksdb held 0 of the 3,020 the host
    missed (new keys: rows created). A tier below the first is asked only for the keys the
    tier above missed, so it is worded as such; the last tier's misses are keys seen for the
    first time. Rows are left out: RocksDB's row figure is an estimate that counts
    overwrites until compaction."""
    parts, above = [], None
    for index, (name, figures) in enumerate(rates.items()):
        looked = figures["hits"] + figures["misses"]
        if above is None:
            parts.append(f"{name} {figures['hit_rate']:.1%} of {looked:,} keys")
        else:
            new = " (new keys: rows created)" if index == len(rates) - 1 else ""
            parts.append(
                f"{name} held {figures['hits']:,} of the {looked:,} the {above} missed{new}"
            )
        above = name
    return "; ".join(parts)


# -- the command ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tierps demo` flags."""
    parser.add_argument(
        "--dataset",
        choices=("movielens", "synthetic"),
        default="movielens",
        help="movielens: MovieLens-100k from the recbole package; synthetic: Criteo-like",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path("tierps-data"),
        help="shards and snapshots go here (default ./tierps-data)",
    )
    parser.add_argument("--epochs", type=int, help="default 5 (movielens), 1 (synthetic)")
    parser.add_argument("--batch-size", type=int, help="default 256 (movielens), 1024 (synthetic)")
    parser.add_argument("--dim", type=int, default=DEFAULT_DIM, help="embedding dim")
    parser.add_argument("--shards", type=int, default=2, help="shards of the local cluster")
    parser.add_argument("--seed", type=int, default=0, help="split, initial weights, order")
    parser.add_argument(
        "--samples",
        type=int,
        default=DEFAULT_SAMPLES,
        help=f"synthetic samples (default {DEFAULT_SAMPLES:,})",
    )
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help="Adam's, sparse and dense")
    parser.add_argument(
        "--host-cache-mb",
        type=int,
        help="host-tier budget per table and shard, MiB (default 64 movielens, 16 synthetic)",
    )
    parser.add_argument(
        "--gpu-cache-mb",
        type=int,
        default=0,
        help="a GPU tier of this many MiB per table on each shard (needs cupy and a GPU; "
        "without one the shards warn and serve from the host tier)",
    )
    parser.add_argument(
        "--staleness",
        type=int,
        help="one trainer: 1 (the default) lets the next batch's lookup run before this "
        "step's push is applied, so lookups and pushes overlap the dense step; on MovieLens it "
        "trained 1.1-1.9x faster with the same test AUC over 5 epochs (0.7852 against 0.7843); "
        "0: each lookup sees every earlier push, exactly synchronous training (the library's "
        "default). With --trainers and --mode async: the bound k >= 1 on the steps of other "
        f"trainers' pushes a lookup may miss (default {DEFAULT_ASYNC_STALENESS})",
    )
    parser.add_argument(
        "--trainers",
        type=int,
        help="train with this many data-parallel trainers under torchrun (each its share of "
        "every batch of --batch-size); default: one trainer in this process",
    )
    parser.add_argument(
        "--mode",
        choices=("sync", "async"),
        default="sync",
        help="with --trainers: sync (default) trains as one trainer would on the whole batch; "
        "async lets each trainer push on its own, its lookups at most --staleness steps behind",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="torch's intra-op threads (default: the cores the shards leave, at most 4)",
    )
    from tierps.client import security
    from tierps.server.cluster import add_server_security_arguments

    add_server_security_arguments(parser)
    security.add_arguments(parser)
    parser.add_argument(
        "--keep-snapshots",
        type=int,
        default=1,
        help="after saving, keep this many of the dataset's newest demo snapshots on the "
        "cluster (<data-dir>/snapshots on the demo's own) and delete the older ones; with "
        "--trainers, of the newest job checkpoints in <data-dir>/checkpoints made on this "
        "cluster, each with its snapshot (0: keep all)",
    )
    parser.add_argument(
        "--addresses",
        help="train on this running cluster (host:port, comma-separated, shard order) instead "
        "of starting one; default: $TIERPS_ADDRESSES when set",
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="run one read-only replica shard beside the cluster (under <data-dir>/demo-replica) "
        "that follows it while it trains, and print after each epoch the test AUC computed "
        "from lookups on the replica, and its lag (one trainer only)",
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="on a running cluster (--addresses, $TIERPS_ADDRESSES): drop the dataset's "
        "tables there (movielens, synthetic.criteo) and create them afresh; without it the "
        "demo refuses to touch a table it did not create",
    )


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, or None."""
    for flag, low in (
        ("epochs", 1),
        ("batch_size", 1),
        ("dim", 1),
        ("shards", 1),
        ("samples", 10),
        ("host_cache_mb", 0),
        ("gpu_cache_mb", 0),
        ("seed", 0),
        ("torch_threads", 1),
        ("keep_snapshots", 0),
    ):
        value = getattr(args, flag)
        if value is not None and value < low:
            return f"--{flag.replace('_', '-')} expected >= {low}, got {value}"
    if not args.lr > 0:
        return f"--lr expected > 0, got {args.lr}"
    if args.trainers is not None and args.trainers < 1:
        return f"--trainers expected >= 1, got {args.trainers}"
    if args.serve and args.trainers is not None:
        return "--serve expected with one trainer (no --trainers), got --trainers too"
    if args.staleness is not None:
        if args.trainers is None:
            expected, ok = "0 or 1 with one trainer", args.staleness in (0, 1)
        elif args.mode == "sync":
            expected, ok = "0 in sync mode (--mode async for a bound)", args.staleness == 0
        else:
            expected, ok = ">= 1 in async mode", args.staleness >= 1
        if not ok:
            return f"--staleness expected {expected}, got {args.staleness}"
    return None


def staleness_of(args: argparse.Namespace) -> int:
    """--staleness, or its default for the trainers and mode given."""
    if args.staleness is not None:
        return args.staleness
    if args.trainers is None:
        return DEFAULT_STALENESS
    return 0 if args.mode == "sync" else DEFAULT_ASYNC_STALENESS


def run(args: argparse.Namespace) -> int:
    """Run `tierps demo` with parsed flags; the exit code."""
    problem = _check(args)
    if problem:
        print(f"tierps demo: {problem}", file=sys.stderr)
        return 2
    from tierps.client.admin import ShardError

    with _on_interrupt():
        try:
            problem = _check_given_cluster(args)  # before the seconds torch and the data take
            if problem:
                print(f"tierps demo: {problem}", file=sys.stderr)
                return 1
            try:
                import torch  # the demo's one extra requirement
            except ImportError:
                print(
                    f"tierps demo needs torch (the `torch` extra): {TORCH_INSTALL}",
                    file=sys.stderr,
                )
                return 1
            # Two intra-op threads on a core the shards also want stall torch's parallel
            # regions (a 2-core machine ran an epoch ~40x slower): leave the shards their cores.
            torch.set_num_threads(args.torch_threads or default_torch_threads(args.shards))
            from tierps.demo.data import DatasetUnavailableError, load_dataset

            started = time.perf_counter()
            try:
                dataset = load_dataset(args.dataset, seed=args.seed, samples=args.samples)
            except DatasetUnavailableError as error:
                print(f"tierps demo: {error}", file=sys.stderr)
                return 1
            print(f"{dataset.describe()} (loaded in {time.perf_counter() - started:.1f} s)")
            return _train_on_cluster(args, dataset, started)
        except Interrupted as interrupted:
            print(f"tierps demo: interrupted: {interrupted}", file=sys.stderr, flush=True)
            return 130  # as a shell reports a process ended by SIGINT
        except BaseException as error:
            if INTERRUPTED.is_set():  # before a cluster was there to stop
                print("tierps demo: interrupted", file=sys.stderr, flush=True)
                return 130
            if isinstance(error, (ShardError, ValueError)):
                print(f"tierps demo: {error}", file=sys.stderr)
                return 1
            raise


class Interrupted(Exception):
    """Ctrl-C, after the demo cleaned up; the message says what it did."""


# Set by the first SIGINT while `tierps demo` runs (_on_interrupt): any failure after it
# (a pipeline whose shards stopped) is the interrupt's doing.
INTERRUPTED = threading.Event()


@contextlib.contextmanager
def _on_interrupt() -> Iterator[None]:
    """The first SIGINT, SIGTERM or SIGHUP raises KeyboardInterrupt; later ones are ignored,
    so the clean-up it starts (stopping the cluster, removing a partial snapshot) runs to its
    end. Threads failing meanwhile (a pipeline whose shards stopped) say nothing: the one line
    the demo prints says what happened."""
    import signal

    INTERRUPTED.clear()
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread (a test calling run())
        return

    def handler(number: int, frame: Any) -> None:
        if INTERRUPTED.is_set():
            return
        INTERRUPTED.set()
        raise KeyboardInterrupt

    def quiet(hook_args: threading.ExceptHookArgs) -> None:
        if not INTERRUPTED.is_set():
            previous_hook(hook_args)

    # SIGTERM and SIGHUP (a closed terminal) too: torchrun runs in a session of its own and
    # would not hear them, so the demo stops it as for a Ctrl-C
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {number: signal.signal(number, handler) for number in stops}
    previous_hook = threading.excepthook
    threading.excepthook = quiet
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
        threading.excepthook = previous_hook


def _given_addresses(args: argparse.Namespace) -> tuple[str | None, str]:
    """The running cluster's addresses the demo was given, if any, and where they came
    from (for messages)."""
    from tierps.client.addresses import ADDRESSES_ENV

    if args.addresses:
        return args.addresses, "--addresses"
    return os.environ.get(ADDRESSES_ENV) or None, f"${ADDRESSES_ENV}"


def _check_given_cluster(args: argparse.Namespace) -> str | None:
    """A running cluster given: reachable (one call, failing in a second or two), or what is
    wrong with it. None without one."""
    from tierps.client import ClusterAdmin, security

    if _given_addresses(args)[0] is None:
        return None
    try:  # None: ClusterAdmin reads $TIERPS_ADDRESSES itself, and names it in its errors
        admin = ClusterAdmin(args.addresses or None, security=security.from_args(args))
    except ValueError as error:
        return str(error).removeprefix("ClusterAdmin: ")  # the demo names itself
    with admin:
        admin.list_tables()
    return None


def _refuse_to_replace(
    client: EmbeddingClient, dataset: CTRDataset, addresses: str, source: str
) -> str | None:
    """On a running cluster: the refusal to drop tables the demo did not create, or None."""
    from tierps.demo.deepfm import _table_names

    ours = _table_names(dataset.features)
    there = sorted({config.name for config in client.list_tables()} & set(ours))
    if not there:
        return None
    return (
        f"the cluster at {addresses} (from {source}) has table(s) "
        f"{', '.join(repr(name) for name in there)}: the demo would drop and create them "
        f"afresh, losing their rows. Give --replace to let it, or train on the demo's own "
        f"cluster (no --addresses, TIERPS_ADDRESSES unset)"
    )


def default_torch_threads(shards: int) -> int:
    """The cores the shards leave (at least 1, at most 4)."""
    import os

    return min(4, max(1, (os.cpu_count() or 1) - shards))


def _train_on_cluster(args: argparse.Namespace, dataset: CTRDataset, started: float) -> int:
    import torch

    from tierps.client import EmbeddingClient, security
    from tierps.demo.deepfm import SparseOptimizer
    from tierps.server.cluster import LocalCluster, server_security_args

    epochs = args.epochs or DEFAULT_EPOCHS[args.dataset]
    batch_size = args.batch_size or DEFAULT_BATCH_SIZES[args.dataset]
    host_mb = args.host_cache_mb
    if host_mb is None:
        host_mb = DEFAULT_HOST_CACHE_MB[args.dataset]
    cluster_dir = args.data_dir / f"demo-cluster-{args.shards}"
    snapshot_dir = args.data_dir / "snapshots"
    optimizer = SparseOptimizer("adam", args.lr)
    staleness = staleness_of(args)
    trainers = (
        f"{args.trainers} trainer(s) under torchrun, {args.mode}" if args.trainers else "1 trainer"
    )
    addresses, source = _given_addresses(args)
    print(
        f"DeepFM dim {args.dim}, batch {batch_size}, {epochs} epoch(s), Adam lr {args.lr} "
        f"({trainers}; tables: on the shards, staleness {staleness}; dense: torch, "
        f"{torch.get_num_threads()} thread(s) per trainer); "
        + ("" if addresses else f"{args.shards} shards in {cluster_dir}, ")
        + f"host tier {host_mb} MiB per table and shard"
        + (f", GPU tier {args.gpu_cache_mb} MiB" if args.gpu_cache_mb else "")
    )
    gpu_flags = ("--gpu-cache-mb", str(args.gpu_cache_mb)) if args.gpu_cache_mb else ()
    channel_security = security.from_args(args)
    server_flags = gpu_flags + server_security_args(args)
    # What an interrupt leaves to clean: the snapshots this run began (names), the job dir.
    work = _Work()
    try:
        with (
            (
                contextlib.nullcontext(None)
                if addresses
                else LocalCluster(
                    args.shards,
                    cluster_dir,
                    snapshot_dir,
                    extra_args=server_flags,
                    security=channel_security,
                    own_session=True,  # Ctrl-C: the trainers stop first, then the shards
                )
            ) as cluster,
            EmbeddingClient(addresses or cluster.addresses, security=channel_security) as client,
        ):
            try:
                return _train_with_client(
                    args,
                    dataset,
                    started,
                    client,
                    cluster,
                    work,
                    epochs=epochs,
                    batch_size=batch_size,
                    host_mb=host_mb,
                    optimizer=optimizer,
                    staleness=staleness,
                    addresses=addresses,
                    source=source,
                )
            except BaseException:
                if not INTERRUPTED.is_set():
                    raise
                if cluster is None:  # the user's cluster runs on: remove what this run began
                    removed = work.remove_partial_snapshots(client)
                    raise Interrupted(
                        f"the cluster at {addresses} is left running; " + _removed(removed)
                    ) from None
                raise
    except Interrupted:
        raise
    except BaseException:  # the demo's own cluster, stopped: its snapshot dir is ours
        if not INTERRUPTED.is_set():
            raise  # a failure while the pipeline or the shards stopped is Ctrl-C's
        from tierps.storage.snapshot_catalog import gc

        removed = [Path(path).name for path in gc(snapshot_dir)] if snapshot_dir.exists() else []
        work.remove_empty_job_dir()
        raise Interrupted("the demo's cluster stopped; " + _removed(removed)) from None


def _removed(names: list[str]) -> str:
    if not names:
        return "no partial snapshot left"
    return f"partial snapshot{'s' if len(names) > 1 else ''} removed: {', '.join(names)}"


@dataclass
class _Work:
    """What a run began that an interrupt may leave half done."""

    snapshots_before: set[str] | None = None  # the cluster's snapshots when training began
    job_dir: Path | None = None  # --trainers: the job's checkpoint directory

    def remove_partial_snapshots(self, client: EmbeddingClient) -> list[str]:
        """Delete the incomplete demo snapshots (named deepfm-...) begun since training began
        on a user's cluster (best effort: a shard that cannot be reached keeps them for
        `snapshot gc`). Job checkpoints (ckpt-step...) are every TrainerGroup's names, another
        job's among them: an incomplete one is left to `tierps admin snapshot gc`."""
        from tierps.client.admin import ShardError

        if self.snapshots_before is None:
            return []
        removed = []
        try:
            for info in client.list_snapshots():
                name = info["name"]
                ours = name.startswith("deepfm-")
                if not info["complete"] and ours and name not in self.snapshots_before:
                    client.delete_snapshot(name)
                    removed.append(name)
        except ShardError:
            pass
        self.remove_empty_job_dir()
        return removed

    def remove_empty_job_dir(self) -> None:
        """A job interrupted before its first checkpoint was written leaves an empty dir."""
        import shutil

        from tierps.client.distributed import CHECKPOINT_PREFIX

        job = self.job_dir
        if job is not None and job.is_dir() and not any(job.glob(f"{CHECKPOINT_PREFIX}*.pt")):
            shutil.rmtree(job)


def _train_with_client(
    args: argparse.Namespace,
    dataset: CTRDataset,
    started: float,
    client: EmbeddingClient,
    cluster: Any,
    work: _Work,
    *,
    epochs: int,
    batch_size: int,
    host_mb: int,
    optimizer: SparseOptimizer,
    staleness: int,
    addresses: str | None,
    source: str,
) -> int:
    print(
        ("the running cluster at " if cluster is None else "cluster serving at ")
        + f"{', '.join(client.addresses)}; hit rates below count since "
        f"the cluster started, evaluation lookups included: each tier's share of the keys "
        f"the tier above missed (the last tier's misses are new rows)"
    )
    if cluster is None and not args.replace:
        refusal = _refuse_to_replace(client, dataset, str(addresses), source)
        if refusal:
            print(f"tierps demo: {refusal}", file=sys.stderr)
            return 1
    tables = create_tables(
        client,
        dataset,
        dim=args.dim,
        seed=args.seed,
        optimizer=optimizer,
        host_cache_bytes=host_mb << 20,
        drop_others=cluster is not None,
    )
    if cluster is not None:  # its own snapshot dir, no save running: what a crash left
        left = client.gc_snapshots()
        if left:
            print(f"removed {len(left)} incomplete snapshot path(s) an earlier run left")
    work.snapshots_before = {snapshot["name"] for snapshot in client.list_snapshots()}
    # Snapshots are pruned on either cluster: in the demo's own snapshot dir, or through the
    # calls of a running cluster's shards (only the demo's own names are ever deleted).
    snapshots: Path | EmbeddingClient = client if cluster is None else cluster.snapshot_dir
    if args.trainers is not None:
        return _train_with_torchrun(
            args, client, tables, epochs, batch_size, started, snapshots, work
        )
    model = build_tierps_model(client, dataset, dim=args.dim, seed=args.seed, staleness=staleness)
    with contextlib.ExitStack() as serving:
        replica = None
        if args.serve:
            replica = serving.enter_context(_Replica(args, client, dataset, tables))
        return _train_one(
            args, dataset, started, client, tables, model, replica, snapshots, epochs, batch_size
        )


class _Replica:
    """--serve: one replica shard following the cluster (LocalCluster(follow=...)), a client
    of it, and a copy of the model whose embeddings it serves; `report` evaluates that copy
    with the trained model's dense weights, as a serving system would after a checkpoint."""

    def __init__(
        self, args: argparse.Namespace, client: EmbeddingClient, dataset: Any, tables: list[str]
    ) -> None:
        from tierps.server.cluster import LocalCluster, server_security_args

        self.args, self.client, self.dataset, self.tables = args, client, dataset, tables
        self.cluster = LocalCluster(
            1,
            args.data_dir / "demo-replica",
            None,
            extra_args=server_security_args(args),
            security=client.security,
            own_session=True,
            follow=client.addresses,
        )
        self.reader: EmbeddingClient | None = None
        self.model: Any = None

    def __enter__(self) -> _Replica:
        from tierps.client import EmbeddingClient
        from tierps.demo.training import build_tierps_model

        self.cluster.start()
        try:
            self.reader = EmbeddingClient(self.cluster.addresses, security=self.client.security)
            self._wait_for_tables(timeout_s=60.0)
            self.model = build_tierps_model(
                self.reader, self.dataset, dim=self.args.dim, seed=self.args.seed
            )
        except BaseException:  # not entered: __exit__ will not run, so stop it here
            self.__exit__()
            raise
        print(f"replica serving at {', '.join(self.cluster.addresses)}, following the cluster")
        return self

    def _wait_for_tables(self, timeout_s: float) -> None:
        """Until the replica holds every table of the cluster, of its dim: it learns them
        from its first rounds of the change streams, which may come after it answers as
        serving (and a replica data dir an earlier run left may hold older ones)."""
        assert self.reader is not None
        deadline = time.monotonic() + timeout_s
        wanted = {config.name: config.dim for config in self.client.list_tables()}
        wanted = {name: dim for name, dim in wanted.items() if name in self.tables}
        while True:
            held = {config.name: config.dim for config in self.reader.list_tables()}
            missing = sorted(name for name, dim in wanted.items() if held.get(name) != dim)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the replica at {', '.join(self.cluster.addresses)} holds "
                    f"{held or 'no tables'} (table: dim) after {timeout_s:.0f} s; expected "
                    f"{wanted} (missing or of another dim: {missing})"
                )
            time.sleep(0.05)

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self.reader is not None:
                self.reader.close()
        finally:
            self.cluster.stop()

    def lag(self) -> tuple[float, int]:
        """(seconds, changes) the replica is behind, the largest over the tables."""
        assert self.reader is not None
        seconds, changes = 0.0, 0
        for table in self.tables:
            for shard in self.reader.describe(table):
                lifecycle = shard.get("lifecycle", {})
                seconds = max(seconds, float(lifecycle.get("replica.lag_s", 0.0)))
                changes = max(changes, int(lifecycle.get("replica.lag_positions", 0)))
        return seconds, changes

    def report(self, trained: Any, training_auc: float) -> str:
        from tierps.demo.training import evaluate

        seconds, changes = self.lag()
        self.model.load_state_dict(trained.state_dict())
        _, served_auc = evaluate(self.model, self.dataset)
        return (
            f"  replica: test AUC {served_auc:.4f} from its rows ({training_auc:.4f} from the "
            f"cluster's), lag {seconds:.2f} s, {changes:,} change(s) when asked"
        )


def _train_one(
    args: argparse.Namespace,
    dataset: CTRDataset,
    started: float,
    client: EmbeddingClient,
    tables: list[str],
    model: Any,
    replica: _Replica | None,
    snapshots: Path | EmbeddingClient,
    epochs: int,
    batch_size: int,
) -> int:
    """One trainer's epochs, its snapshot and the final report."""

    def report(result: EpochResult) -> None:
        print(
            f"epoch {result.epoch}: train logloss {result.train_logloss:.4f} AUC "
            f"{result.train_auc:.4f} | test logloss {result.test_logloss:.4f} AUC "
            f"{result.test_auc:.4f} | {result.samples_per_s:,.0f} samples/s "
            f"({result.train_seconds:.1f} s)",
            flush=True,
        )
        print(f"  hit rates: {format_hit_rates(tier_hit_rates(client, tables))}", flush=True)
        if replica is not None:
            print(replica.report(model, result.test_auc), flush=True)

    try:
        results = train(
            model,
            dataset,
            epochs=epochs,
            batch_size=batch_size,
            lr=args.lr,
            seed=args.seed,
            progress="train",
            on_epoch=report,
        )
    finally:
        model.embeddings.close()  # its pushes are in before the snapshot
    name = _snapshot_name(client, args.dataset)
    saved = client.save_snapshot(name)
    print(f"snapshot {saved['name']!r}: {saved['rows']:,} rows in {saved['path']}")
    if args.keep_snapshots:
        pruned = prune_demo_snapshots(snapshots, args.dataset, args.keep_snapshots)
        if pruned:
            print(
                f"deleted {len(pruned)} older demo snapshot(s) (--keep-snapshots "
                f"{args.keep_snapshots}): {', '.join(pruned)}"
            )
    rates = tier_hit_rates(client, tables)
    print(
        f"done in {time.perf_counter() - started:.1f} s: test AUC {results[-1].test_auc:.4f}, "
        f"{results[-1].samples_per_s:,.0f} samples/s; hit rates: {format_hit_rates(rates)}"
    )
    return 0


def _train_with_torchrun(
    args: argparse.Namespace,
    client: EmbeddingClient,
    tables: list[str],
    epochs: int,
    batch_size: int,
    started: float,
    snapshots: Path | EmbeddingClient,
    work: _Work,
) -> int:
    """--trainers N: the ranks train (tierps.demo.trainers), checkpointing each epoch; then
    all but the --keep-snapshots newest job checkpoints made on this cluster are deleted,
    with their snapshots (prune_job_checkpoints)."""
    import torch

    from tierps.demo.trainers import launch

    job = time.strftime(f"{job_prefix(args.dataset)}%Y%m%d-%H%M%S")
    checkpoint_dir = args.data_dir / "checkpoints" / job
    work.job_dir = checkpoint_dir
    code = launch(
        args,
        client.addresses,
        epochs=epochs,
        batch_size=batch_size,
        staleness=staleness_of(args),
        checkpoint_dir=checkpoint_dir,
        torch_threads=max(1, torch.get_num_threads() // args.trainers),
    )
    if code != 0:
        print(f"tierps demo: the trainers failed (torchrun exit code {code})", file=sys.stderr)
        return 1
    if args.keep_snapshots:
        pruned = prune_job_checkpoints(
            checkpoint_dir.parent, snapshots, args.dataset, args.keep_snapshots
        )
        if pruned:
            print(
                f"deleted {len(pruned)} older job checkpoint(s) (--keep-snapshots "
                f"{args.keep_snapshots}): {', '.join(pruned)}"
            )
    rates = tier_hit_rates(client, tables)
    print(
        f"done in {time.perf_counter() - started:.1f} s; job checkpoints in {checkpoint_dir}; "
        f"hit rates: {format_hit_rates(rates)}"
    )
    return 0


def prune_oldest(paths: Iterable[Path], keep: int, delete: Callable[[Path], Any]) -> list[str]:
    """--keep-snapshots' rule: delete (with `delete`) all but the `keep` newest of `paths`,
    by modification time (then name); the names deleted, oldest first."""
    newest_last = sorted(paths, key=lambda path: (path.stat().st_mtime_ns, path.name))
    old = newest_last[: max(0, len(newest_last) - keep)]
    for path in old:
        delete(path)
    return [path.name for path in old]


def prune_demo_snapshots(snapshots: Path | EmbeddingClient, dataset: str, keep: int) -> list[str]:
    """Delete all but the `keep` newest of the dataset's demo snapshots
    (deepfm-<dataset>-<date>-<time>[-n]): in a snapshot dir (the demo's own cluster's), or
    through a running cluster's snapshot calls (its complete ones, newest by commit time).
    The names deleted, oldest first."""
    import re
    import shutil

    demo_name = re.compile(rf"deepfm-{re.escape(dataset)}-\d{{8}}-\d{{6}}(?:-\d+)?")
    if isinstance(snapshots, Path):
        demo_snapshots = (p for p in snapshots.glob(f"deepfm-{dataset}-*") if p.is_dir())
        return prune_oldest(demo_snapshots, keep, shutil.rmtree)
    listed = [
        info
        for info in snapshots.list_snapshots()
        if info["complete"] and demo_name.fullmatch(info["name"])
    ]
    newest_last = sorted(listed, key=lambda info: (info["created_unix"], info["name"]))
    old = [info["name"] for info in newest_last[: max(0, len(newest_last) - keep)]]
    for name in old:
        snapshots.delete_snapshot(name)
    return old


def job_prefix(dataset: str) -> str:
    """The start of the name of a --trainers job's checkpoint directory for a dataset."""
    return f"deepfm-{dataset}-job-"


def prune_job_checkpoints(
    checkpoints_dir: Path, snapshots: Path | EmbeddingClient, dataset: str, keep: int
) -> list[str]:
    """Delete all but the `keep` newest of the dataset's --trainers job checkpoints made on
    this cluster: each <checkpoints_dir>/<job>/<id>.pt (written by
    TrainerGroup.save_checkpoint) whose snapshot <id> is on it - in `snapshots`, the demo's
    own snapshot dir, or a running cluster's client. A checkpoint whose snapshot is
    elsewhere (another cluster) is never counted nor deleted. The .pt goes first, then its
    snapshot: a .pt always has its snapshot, even if this stops halfway. A job directory of
    a deleted checkpoint left without any is removed (its latest.json names a deleted one).
    Returns the ids deleted, oldest first."""
    import shutil

    from tierps.client.distributed import CHECKPOINT_PREFIX

    if isinstance(snapshots, Path):
        directory = snapshots
        has_snapshot: Callable[[str], bool] = lambda name: (directory / name).is_dir()  # noqa: E731
        delete_snapshot: Callable[[str], Any] = lambda name: shutil.rmtree(directory / name)  # noqa: E731
    else:
        names = {info["name"] for info in snapshots.list_snapshots() if info["complete"]}
        has_snapshot, delete_snapshot = names.__contains__, snapshots.delete_snapshot

    def delete(checkpoint: Path) -> None:
        checkpoint.unlink()
        delete_snapshot(checkpoint.stem)

    checkpoints = [
        path
        for path in checkpoints_dir.glob(f"{job_prefix(dataset)}*/{CHECKPOINT_PREFIX}*.pt")
        if has_snapshot(path.stem)
    ]
    pruned = prune_oldest(checkpoints, keep, delete)
    emptied = {path.parent for path in checkpoints if not path.exists()}
    for job in emptied:
        if not any(job.glob(f"{CHECKPOINT_PREFIX}*.pt")):
            shutil.rmtree(job)
    return [name.removesuffix(".pt") for name in pruned]


def _snapshot_name(client: EmbeddingClient, dataset: str) -> str:
    """deepfm-<dataset>-<date>-<time>, with a -<n> suffix if a snapshot has that name."""
    base = f"deepfm-{dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    taken = {snapshot["name"] for snapshot in client.list_snapshots()}
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    return name


def main(argv: list[str] | None = None) -> int:
    """`python -m tierps.demo.main` does what `tierps demo` does."""
    from tierps.client.command_line import DefaultsHelpFormatter, Parser

    parser = Parser(prog="tierps demo", description=__doc__, formatter_class=DefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
