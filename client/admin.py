"""ClusterAdmin: cluster-wide admin calls, each sent to every shard at once."""

from __future__ import annotations

import collections
import json
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tierps.client.addresses import resolve_addresses
from tierps.client.security import NO_SECURITY, ChannelSecurity
from tierps.core.config import Placement, TableConfig, owner_shard
from tierps.core.errors import DOMAIN, Reason
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto.convert import table_config_to_dict, table_config_to_proto
from tierps.proto.wire import (
    APPLIED_TABLES_HEADER,
    PUSHED_HEADER,
    channel_options,
)

T = TypeVar("T")
Progress = Callable[[int, int], None]  # (rows done, rows in all) across the cluster


def connect_hint(code: grpc.StatusCode, details: str) -> str:
    """What to check when a call could not connect (gRPC's UNAVAILABLE details say only how
    the connection failed), or "" for any other failure."""
    if code is not grpc.StatusCode.UNAVAILABLE:
        return ""
    if "Socket closed" in details or "handshake" in details.lower():
        return (
            "the shard closed the connection while it was being set up: does it serve TLS? "
            "Then give the client its CA (--tls-ca or $TIERPS_TLS_CA, and with mutual TLS "
            "--tls-client-cert/--tls-client-key); else check that a tierps shard listens there"
        )
    if "Connection refused" in details or "failed to connect" in details:
        return (
            "nothing accepts connections at this address: is the shard running? A cluster "
            "restarted since has new ports: take its addresses again from its data dir's "
            "`addresses` file or the export line `tierps cluster` prints"
        )
    return ""


def refusal_of(error: grpc.RpcError) -> tuple[Reason | None, dict[str, str]]:
    """The reason and facts a shard's failed call carries (the google.rpc.ErrorInfo of
    domain "tierps" in its rich status, grpc-status-details-bin): what the client decides
    on, never the message. (None, {}) where there is none: gRPC's own failures (a
    connection, a deadline, a message over a limit gRPC checks; see
    too_large_for_one_message) or an older shard's; reason None, with its facts, for a
    reason newer than this client."""
    trailers = getattr(error, "trailing_metadata", None)  # a grpc.Call's, not every error's
    if trailers is None:
        return None, {}
    try:
        status = rpc_status.from_call(error)
    except (ValueError, DecodeError):  # contradicts the call, or no Status: not a shard's
        return None, {}
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == DOMAIN:
            try:
                return Reason(info.reason), dict(info.metadata)
            except ValueError:
                return None, dict(info.metadata)
    return None, {}


def too_large_for_one_message(error: grpc.RpcError) -> bool:
    """Whether a one-message call was refused as too large for one message before anything
    of it ran, so the stream form may carry it: the shard says so (MESSAGE_TOO_LARGE), or
    gRPC itself refused the message. gRPC's own refusals carry no ErrorInfo, so they are
    told apart by code and by what a tierps shard does, not by gRPC's wording: gRPC
    answers a message over a send or receive limit with RESOURCE_EXHAUSTED (its
    doc/statuscodes.md), and a shard puts an ErrorInfo on every status it sends and says a
    push applied in part in trailers. A reply over this client's own receive limit would
    be refused after the call ran; one-message calls are sent only where the reply fits
    (wire.MAX_MESSAGE_BYTES, the client's limit, is above ONE_MESSAGE_BYTES)."""
    if error.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    reason, _ = refusal_of(error)
    if reason is not None:
        return reason is Reason.MESSAGE_TOO_LARGE
    trailers = getattr(error, "trailing_metadata", None)
    applied = {APPLIED_TABLES_HEADER, PUSHED_HEADER}
    return not any(key in applied for key, _ in (trailers() if trailers else None) or ())


class ShardError(RuntimeError):
    """A shard refused a call or could not be reached; names the shard and its address.
    `code` is the gRPC status code; `reason` what the shard said the refusal is for (None
    where it said none: gRPC's own failures, an older shard), and `facts` what it named
    (table, field, limit, ...): decide on these, the message is for people."""

    def __init__(
        self,
        shard_id: int,
        address: str,
        code: grpc.StatusCode,
        details: str,
        reason: Reason | None = None,
        facts: dict[str, str] | None = None,
    ) -> None:
        hint = connect_hint(code, details) if reason is None else ""  # gRPC's own failures
        told = f"shard {shard_id} at {address}: {code.name}: {details}"
        super().__init__(f"{told} ({hint})" if hint else told)
        self.shard_id = shard_id
        self.address = address
        self.code = code
        self.details = details
        self.reason = reason
        self.facts = facts or {}
        # Of a call sent to several shards: the shards where it went through (a data call
        # whose other shards failed; EmbeddingClient fills it in).
        self.succeeded: list[int] = []
        self.failed: list[int] = []  # and the shards where it did not (refused: unchanged)
        # Of a push the failing shard applied in part: the tables it applied (the others not).
        self.applied_tables: list[str] = []

    @classmethod
    def of(cls, shard_id: int, address: str, error: grpc.RpcError) -> ShardError:
        """A gRPC failure of a call to a shard, with its reason and what its trailers say
        was applied."""
        made = cls(shard_id, address, error.code(), error.details() or "", *refusal_of(error))
        trailers = getattr(error, "trailing_metadata", None)  # a grpc.Call's, not every error's
        for key, value in (trailers() if trailers else None) or ():
            if key == APPLIED_TABLES_HEADER:
                try:
                    made.applied_tables = [str(name) for name in json.loads(value)]
                except (ValueError, TypeError):
                    pass  # not ours to read: the message still says it
        return made


LIFE_HEADER = "tierps-life"  # as server/lives.py: "<data id>/<life>" a client last talked to
# A client reaches a shard again within a second of it serving again (gRPC's default
# reconnect backoff grows to 120 s: a shard down 90 s answered UNAVAILABLE 32 s longer).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """grpc.ClientCallDetails with other metadata (grpc's own interceptor examples do so)."""


def life_metadata(life: str | None, fixed: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The metadata every call to a shard carries: `fixed` (the client's token, where it has
    one) and the data dir and life of the shard this client last talked to, when known."""
    return [*fixed] if life is None else [*fixed, (LIFE_HEADER, life)]


class _LifeHeader(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the life of the shard this client last talked to (when known) to every call:
    the shard refuses a data call with DATA_LOSS if that life ended without a clean stop.
    And the client's own metadata (its token), where it has any."""

    def __init__(
        self, life: Callable[[], str | None], fixed: list[tuple[str, str]] | None = None
    ) -> None:
        self.life = life
        self.fixed = fixed or []

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        added = life_metadata(self.life(), self.fixed)
        if not added:
            return details
        metadata = [*(details.metadata or ()), *added]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of calls that fail with UNAVAILABLE (a shard restarting, unreachable, or
    shutting down), done by gRPC itself from its retry service config: the n-th retry waits
    a random time up to min(initial_backoff_s * multiplier**(n-1), max_backoff_s). Other
    codes are never retried. gRPC caps max_attempts at 5, and retries a call only while its
    request fits buffer_bytes (larger requests fail on the first UNAVAILABLE)."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    buffer_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= 5:
            raise ValueError(f"RetryPolicy: max_attempts expected 1..5, got {self.max_attempts}")
        for field in ("initial_backoff_s", "max_backoff_s"):
            if not getattr(self, field) >= 1e-6:  # gRPC durations; written with 6 decimals
                raise ValueError(
                    f"RetryPolicy: {field} expected >= 1e-6 seconds, got {getattr(self, field)}"
                )
        if not self.multiplier > 0:
            raise ValueError(f"RetryPolicy: multiplier expected > 0, got {self.multiplier}")
        if self.buffer_bytes < 0:
            raise ValueError(f"RetryPolicy: buffer_bytes expected >= 0, got {self.buffer_bytes}")

    # Calls safe to repeat: lookups and assigns (idempotent: the same rows, the same values),
    # pushes (each carries its id, and a shard applies an id once: server/ledger.py; a retry
    # sends the same metadata) and admin calls that read or are idempotent. Snapshot saves
    # and loads are long streams: never repeated.
    RETRIED = (
        *(
            {"service": "tierps.v1.EmbeddingService", "method": method}
            for method in (
                "Lookup",
                "LookupUnary",
                "Assign",
                "PushGradients",
                "PushGradientsUnary",
                "PushThenLookup",
            )
        ),
        *(
            {"service": "tierps.v1.AdminService", "method": method}
            for method in ("CreateTable", "ListTables", "DescribeTable", "ListSnapshots", "Stats")
        ),
    )

    def channel_options(self) -> list[tuple[str, Any]]:
        if self.max_attempts == 1:
            return [("grpc.enable_retries", 0)]
        policy = {
            "maxAttempts": self.max_attempts,
            "initialBackoff": f"{self.initial_backoff_s:.6f}s",  # no exponent: gRPC's format
            "maxBackoff": f"{self.max_backoff_s:.6f}s",
            "backoffMultiplier": self.multiplier,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }
        config = {"methodConfig": [{"name": list(self.RETRIED), "retryPolicy": policy}]}
        return [
            ("grpc.enable_retries", 1),
            ("grpc.service_config", json.dumps(config)),
            ("grpc.per_rpc_retry_buffer_size", self.buffer_bytes),
        ]


class ClusterAdmin:
    """Admin of the cluster whose shard i listens at addresses[i] (None: the addresses in
    TIERPS_ADDRESSES). A context manager.
    Every call but the snapshot save and load streams (which run as long as the data takes)
    has a deadline of timeout_s; UNAVAILABLE is retried as `retry` says. `security`: the
    CA, client certificate and token of shards that ask for them (client/security.py)."""

    def __init__(
        self,
        addresses: Sequence[str] | str | None = None,
        *,
        timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        security: ChannelSecurity | None = None,
    ) -> None:
        # None: from TIERPS_ADDRESSES (tierps.client.addresses)
        addresses = resolve_addresses(addresses, type(self).__name__)
        self.addresses = addresses
        self.timeout_s = timeout_s
        self.retry = RetryPolicy() if retry is None else retry
        self.security = NO_SECURITY if security is None else security
        options = channel_options() + RECONNECT_OPTIONS + self.retry.channel_options()
        # The life each shard was in when this client last learned it (None: not yet; data
        # calls learn it first, from Stats): a shard that restarted uncleanly since refuses
        # this client's data calls with DATA_LOSS until it accepts the restart.
        # As LIFE_HEADER carries it: "<data id>/<life>".
        self._lives: list[str | None] = [None] * len(addresses)
        # Per shard: the generation of each table's rows this client knows (learned with
        # the life, from Stats); its pushes carry them, and a shard refuses (ABORTED) a push
        # made against rows a snapshot load replaced since.
        self._generations: list[dict[str, int]] = [{} for _ in addresses]
        # shards that refused this client Stats (a reader, on a shard older than readers'
        # Stats): its calls go without a life there
        self._life_denied: set[int] = set()
        # Channels without the interceptor, for the hot data calls: they pass what it adds
        # themselves (_metadata), as gRPC's interceptor machinery costs about 0.1-0.2 ms a call.
        self._plain_channels = [self.security.channel(address, options) for address in addresses]
        self._fixed_metadata = self.security.metadata()
        self._channels = [
            grpc.intercept_channel(
                channel, _LifeHeader(lambda i=i: self._lives[i], self._fixed_metadata)
            )
            for i, channel in enumerate(self._plain_channels)
        ]
        self._stubs = [pb_grpc.AdminServiceStub(channel) for channel in self._channels]
        self._pool = ThreadPoolExecutor(len(addresses), thread_name_prefix="tierps-admin")

    def _metadata(self, shard_id: int, *extra: tuple[str, str]) -> list[tuple[str, str]]:
        """The metadata of a call to shard_id on its plain channel: what _LifeHeader adds to
        the other calls, then `extra`."""
        return [*life_metadata(self._lives[shard_id], self._fixed_metadata), *extra]

    def _on(self, shard_id: int, call: Callable[[int, pb_grpc.AdminServiceStub], T]) -> T:
        """call(shard_id, stub); a gRPC failure is raised as a ShardError naming the shard."""
        try:
            return call(shard_id, self._stubs[shard_id])
        except grpc.RpcError as error:
            raise ShardError.of(shard_id, self.addresses[shard_id], error) from None

    def _each(self, call: Callable[[int, pb_grpc.AdminServiceStub], T]) -> list[T]:
        """call(shard_id, stub) on every shard at once; the first failure is raised."""
        return list(self._pool.map(lambda i: self._on(i, call), range(len(self.addresses))))

    def _learn_lives(self, shards: list[int]) -> None:
        """Learn the life of each of these shards not yet known (one Stats call each; every
        role may call it, a reader being answered the life and little else)."""
        for shard_id in shards:
            if self._lives[shard_id] is None and shard_id not in self._life_denied:
                try:
                    reply = self._ask_stats(shard_id)
                except ShardError as error:
                    if error.code is not grpc.StatusCode.PERMISSION_DENIED:
                        raise
                    # a reader on a shard older than readers' Stats: it looks up without a
                    # life, as before, rather than not at all
                    self._life_denied.add(shard_id)
                    continue
                self._learned(shard_id, reply)

    def _ask_stats(self, shard_id: int) -> pb.StatsResponse:
        return self._on(
            shard_id, lambda i, stub: stub.Stats(pb.StatsRequest(), timeout=self.timeout_s)
        )

    def _learned(self, shard_id: int, reply: pb.StatsResponse) -> None:
        """Take a shard's life, data dir and table generations from its Stats."""
        life = f"{reply.data_id}/{reply.life}" if reply.data_id else str(reply.life)
        self._generations[shard_id] = {t.config.name: t.generation for t in reply.tables}
        self._lives[shard_id] = life

    def _relearn_generations(self, shard_id: int) -> None:
        """Learn a shard's table generations again (a table new to this client, or rows
        replaced under it). Best effort: a shard that does not answer keeps what was known,
        and the data call itself says what is wrong with it."""
        try:
            reply = self._ask_stats(shard_id)
        except ShardError:
            return
        self._generations[shard_id] = {t.config.name: t.generation for t in reply.tables}

    def accept_restart(self, shards: list[int] | None = None) -> None:
        """Go on after a shard restarted without a clean stop (its data calls were refused
        with DATA_LOSS): forget the life this client knew of those shards (all by default),
        so the next data call learns the new one. Only after deciding that the rows as they
        are now will do - a snapshot load accepts by itself."""
        for shard_id in range(len(self.addresses)) if shards is None else shards:
            self._lives[shard_id] = None
            self._generations[shard_id] = {}

    def check_topology(self) -> None:
        """Every shard says it is shard i of len(addresses), at position i."""
        stats = self._each(lambda i, stub: stub.Stats(pb.StatsRequest(), timeout=self.timeout_s))
        for shard_id, reply in enumerate(stats):
            if (reply.shard_id, reply.num_shards) != (shard_id, len(self.addresses)):
                raise ShardError(
                    shard_id,
                    self.addresses[shard_id],
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"expected shard {shard_id} of {len(self.addresses)} (its position in the "
                    f"address list), but it is shard {reply.shard_id} of {reply.num_shards}",
                )

    # -- tables ------------------------------------------------------------------------------

    def create_table(self, config: TableConfig) -> bool:
        """Create on every shard; True if any shard created it, False if all had it. Every
        shard keeps the config; a table placed whole (placement="table") stores rows on its
        owner_shard only, and a table_shard outside this cluster is refused before anything
        is sent (InvalidArgumentError)."""
        if config.placement is Placement.TABLE:
            owner_shard(config, len(self.addresses))
        request = pb.CreateTableRequest(config=table_config_to_proto(config.to_dict()))
        replies = self._each(lambda i, stub: stub.CreateTable(request, timeout=self.timeout_s))
        return any(reply.created for reply in replies)

    def drop_table(self, name: str) -> None:
        request = pb.DropTableRequest(table=name)
        self._each(lambda i, stub: stub.DropTable(request, timeout=self.timeout_s))

    def list_tables(self) -> list[TableConfig]:
        """The tables of shard 0 (every shard has the same ones when created through here)."""
        request = pb.ListTablesRequest()
        reply = self._on(0, lambda i, stub: stub.ListTables(request, timeout=self.timeout_s))
        return [TableConfig.from_dict(table_config_to_dict(t)) for t in reply.tables]

    def describe(self, name: str) -> list[dict[str, Any]]:
        """Each shard's description of a table (config, tiers with rows, bytes, hit rates)."""
        request = pb.DescribeTableRequest(table=name)
        replies = self._each(lambda i, stub: stub.DescribeTable(request, timeout=self.timeout_s))
        return [_as_dict(reply) for reply in replies]

    def stats(self) -> list[dict[str, Any]]:
        replies = self._each(lambda i, stub: stub.Stats(pb.StatsRequest(), timeout=self.timeout_s))
        return [_as_dict(reply) for reply in replies]

    def evict(self, table: str) -> dict[str, Any]:
        """Remove the table's stale (steps_to_live) and small (min_l2_norm) rows on every
        shard, from every tier: {"table", "removed": rows in all, "per_shard": rows removed
        by shard i at [i], "current_step": each shard's step of the table at [i]}. A table
        with neither option removes nothing. Not retried: a repeat would report 0."""
        request = pb.EvictRequest(table=table)
        replies = self._each(lambda i, stub: stub.Evict(request, timeout=self.timeout_s))
        return {
            "table": table,
            "removed": sum(reply.num_rows for reply in replies),
            "per_shard": [reply.num_rows for reply in replies],
            "current_step": [reply.current_step for reply in replies],
        }

    # -- snapshots ---------------------------------------------------------------------------

    def _stream(
        self,
        calls: Callable[[int, pb_grpc.AdminServiceStub], Iterator[pb.SnapshotProgress]],
        progress: Progress | None,
    ) -> list[pb.SnapshotProgress]:
        """Run a progress-streaming call on every shard; report summed progress, from the
        moment every shard has reported (so the total does not grow as shards start); return
        each shard's last message."""
        lock = threading.Lock()
        figures: list[tuple[int, int] | None] = [None] * len(self.addresses)

        def follow(shard_id: int, stub: pb_grpc.AdminServiceStub) -> pb.SnapshotProgress:
            last = None
            for last in calls(shard_id, stub):
                with lock:
                    figures[shard_id] = (last.rows_done, last.rows_total)
                    if progress is not None and None not in figures:
                        progress(sum(f[0] for f in figures), sum(f[1] for f in figures))
            if last is None or not last.done:
                raise ShardError(
                    shard_id,
                    self.addresses[shard_id],
                    grpc.StatusCode.UNKNOWN,
                    "the progress stream ended before it said done",
                )
            return last

        return self._each(follow)

    def save_snapshot(
        self, name: str, *, base: str | None = None, progress: Progress | None = None
    ) -> dict[str, Any]:
        """Every shard writes its part (pushes each shard receives while it cuts its part
        wait); then shard 0 checks the parts and writes the manifest. base: the complete
        snapshot an incremental snapshot builds on (None: a full snapshot): only the rows
        changed since base was cut, and tombstones of the rows removed since, are written;
        the result's "diffs" says, per shard, how each table's changes were found ("journal":
        its change journal; "compare": the table compared with the base chain's rows, after
        a restart, a load or another shard count; "all": a table the base lacks)."""
        self.check_topology()
        save_id = uuid.uuid4().hex
        part = pb.SaveSnapshotRequest(
            name=name, phase=pb.SAVE_PHASE_WRITE_PART, save_id=save_id, base=base or ""
        )
        commit = pb.SaveSnapshotRequest(name=name, phase=pb.SAVE_PHASE_COMMIT, save_id=save_id)
        try:
            parts = self._stream(lambda i, stub: stub.SaveSnapshot(part), progress)
            last = self._on(
                0, lambda i, stub: list(stub.SaveSnapshot(commit, timeout=self.timeout_s))
            )[-1]
        except ShardError:
            self._remove_failed_save(name, save_id)
            raise
        return {
            "name": name,
            "rows": sum(p.rows_done for p in parts),
            "path": last.path,
            "evicted": sum(p.rows_evicted for p in parts),  # evict_before_snapshot's rows
            "base": base or "",
            "diffs": [dict(p.diffs) for p in parts],
        }

    def load_snapshot(self, name: str, *, progress: Progress | None = None) -> dict[str, Any]:
        """Every shard takes the snapshot's rows of its keys, from every part."""
        self.check_topology()
        request = pb.LoadSnapshotRequest(name=name)
        shards = self._stream(lambda i, stub: stub.LoadSnapshot(request), progress)
        self.accept_restart()  # every row is the snapshot's now, whatever a restart lost
        return {"name": name, "rows": sum(s.rows_kept for s in shards), "path": shards[0].path}

    def _remove_failed_save(self, name: str, save_id: str) -> None:
        """The parts a failed save left on the shared snapshot dir, removed (best effort:
        `snapshot gc` removes what this cannot)."""
        request = pb.DeleteSnapshotRequest(name=name, save_id=save_id, incomplete_only=True)
        try:
            self._on(0, lambda i, stub: stub.DeleteSnapshot(request, timeout=self.timeout_s))
        except ShardError:
            pass  # the save's own failure is the one to raise

    def delete_snapshot(self, name: str) -> list[str]:
        """Remove snapshot `name` from the snapshot dir (complete or not); the paths removed."""
        request = pb.DeleteSnapshotRequest(name=name)
        reply = self._on(0, lambda i, stub: stub.DeleteSnapshot(request, timeout=self.timeout_s))
        return list(reply.removed)

    def gc_snapshots(self) -> list[str]:
        """Remove what failed saves left (incomplete snapshots, save directories no manifest
        names); run it while no save runs. The paths removed."""
        request = pb.DeleteSnapshotRequest(incomplete_only=True)
        reply = self._on(0, lambda i, stub: stub.DeleteSnapshot(request, timeout=self.timeout_s))
        return list(reply.removed)

    def list_snapshots(self) -> list[dict[str, Any]]:
        request = pb.ListSnapshotsRequest()
        reply = self._on(0, lambda i, stub: stub.ListSnapshots(request, timeout=self.timeout_s))
        return [_as_dict(info) for info in reply.snapshots]

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _as_dict(message: Any) -> dict[str, Any]:
    """A reply as plain Python values (ints stay ints; a table config comes back as
    TableConfig.to_dict gives it, defaults filled in)."""
    if isinstance(message, pb.TableConfig):
        return TableConfig.from_dict(table_config_to_dict(message)).to_dict()
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = dict(value)
        elif field.is_repeated:
            out[field.name] = [_as_dict(v) if field.message_type else v for v in value]
        elif field.message_type is not None:
            out[field.name] = _as_dict(value)
        else:
            out[field.name] = value
    return out
