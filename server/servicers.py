"""Thin gRPC servicers: decode and check the request's bytes, call the shard, encode.
Errors become status codes in `status.rpc`. `add_embedding_service` registers the data
service with the one-message calls decoded and encoded by hand (tierps.proto.wire): their
bulk fields are read as views of the received bytes, and a lookup's reply is built once."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import numpy as np

from tierps.core.codec import WIRE_DTYPE, wire_row_bytes
from tierps.core.config import MAX_DIM
from tierps.core.errors import Reason, quoted
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto import wire
from tierps.proto.convert import table_config_to_dict, table_config_to_proto
from tierps.server.ledger import (
    GENERATIONS_HEADER,
    PUSH_ID_HEADER,
    PushId,
    parse_generations,
    parse_push_id,
)
from tierps.server.shard import AssignBatch, LookupBatch, PushBatch, Shard
from tierps.server.status import Observe, rpc, run_to_completion
from tierps.storage import InvalidArgumentError, ResourceExhaustedError, TableConfig
from tierps.storage.snapshot_format import Progress

# Table batches one data call may carry: far more tables than a model has, and a bound on
# the work a call makes before its tables are looked up.
MAX_BATCHES_PER_CALL = 1024

# -- bytes <-> arrays ---------------------------------------------------------------------------


def table_batches(
    requests: Iterable[Any], header: tuple[str, ...], bulk: tuple[str, ...], max_bytes: int
) -> list[tuple[Any, dict[str, Any]]]:
    """The batches of a request stream, one per table: each batch's first message (its
    header fields apply to the whole batch) and each bulk field joined over the batch's
    messages (bytes, or a memoryview of a one-message call's bytes). A message whose
    'table' is set and differs from the current batch's begins the next batch
    (tierps_service.proto, "Several tables in one call")."""
    batches: list[tuple[Any, dict[str, list[bytes]]]] = []
    seen: set[str] = set()  # the tables of the batches so far: linear in the call's batches
    total = 0
    for index, message in enumerate(requests):
        if not batches or (message.table and message.table != batches[-1][0].table):
            if message.table in seen:
                raise InvalidArgumentError(
                    f"message {index} of the stream: table {quoted(message.table)} expected in "
                    f"one batch per call, but it begins a second batch; send its keys together",
                    table=message.table,
                    field="table",
                )
            if len(batches) == MAX_BATCHES_PER_CALL:
                raise InvalidArgumentError(
                    f"message {index} of the stream: at most {MAX_BATCHES_PER_CALL} table "
                    f"batches per call expected, got more; send the tables in several calls"
                )
            seen.add(message.table)
            batches.append((message, {field: [] for field in bulk}))
            if not 1 <= message.dim <= MAX_DIM:
                raise InvalidArgumentError(
                    f"table {quoted(message.table)}: field 'dim' expected in [1, {MAX_DIM}], "
                    f"got {message.dim}",
                    table=message.table,
                    field="dim",
                )
        else:
            first = batches[-1][0]
            for field in header:
                value, expected = getattr(message, field), getattr(first, field)
                if value and value != expected:
                    raise InvalidArgumentError(
                        f"message {index} of the stream: field '{field}' expected "
                        f"{expected!r} (as in the first message of table {first.table!r}) or "
                        f"unset, got {value!r}",
                        table=first.table,
                        field=field,
                    )
        for field in bulk:
            data = getattr(message, field)
            batches[-1][1][field].append(data)
            total += len(data)
        if total > max_bytes:
            raise ResourceExhaustedError(
                f"request of {total}+ bulk bytes expected at most {max_bytes} bytes per call; "
                f"split the batch",
                reason=Reason.CALL_TOO_LARGE,
                limit=max_bytes,
            )
    if not batches:
        raise InvalidArgumentError("request stream expected at least one message, got none")
    return [
        (first, {field: _joined(chunks) for field, chunks in parts.items()})
        for first, parts in batches
    ]


def _push_identity(context: Any) -> tuple[PushId | None, list[int] | None]:
    """A push call's id and the generations its batches were made against (metadata; see
    server/ledger.py), each None where the call carries none."""
    push_id = generations = None
    for key, value in context.invocation_metadata() or ():
        if key == PUSH_ID_HEADER:
            push_id = parse_push_id(value)
        elif key == GENERATIONS_HEADER:
            generations = parse_generations(value)
    return push_id, generations


def _tell_applied_tables(context: Any, error: BaseException) -> None:
    """A push the shard applied in part says which tables in its trailers (the client keeps
    its step and says so; the same call sent again applies only the others)."""
    tables = getattr(error, "applied_tables", None)
    if tables:
        context.set_trailing_metadata(((wire.APPLIED_TABLES_HEADER, json.dumps(tables)),))


def _joined(chunks: list[Any]) -> Any:
    """A bulk field's chunks as one bytes-like object: a lone chunk as it is (a join would
    copy it, memoryviews of a one-message call included)."""
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def decode_keys(raw: bytes, table: str) -> np.ndarray:
    if len(raw) % 8:
        raise InvalidArgumentError(
            f"table {table!r}: field 'keys' expected a multiple of 8 bytes (little-endian "
            f"int64), got {len(raw)} bytes",
            table=table,
            field="keys",
        )
    return np.frombuffer(raw, dtype="<i8")


def decode_rows(raw: bytes, field: str, table: str, n: int, dim: int) -> np.ndarray:
    if dim < 1:
        raise InvalidArgumentError(
            f"table {table!r}: field 'dim' expected >= 1, got {dim}", table=table, field="dim"
        )
    row_bytes = wire_row_bytes(dim)
    if len(raw) != n * row_bytes:
        raise InvalidArgumentError(
            f"table {table!r}: field '{field}' expected {n * row_bytes} bytes ({n} keys x dim "
            f"{dim} x 4-byte float32), got {len(raw)} bytes"
            + (f", not a multiple of 4*dim={row_bytes}" if len(raw) % row_bytes else ""),
            table=table,
            field=field,
        )
    return np.frombuffer(raw, dtype=WIRE_DTYPE).reshape(n, dim)


def _progress(progress: Progress) -> pb.SnapshotProgress:
    return pb.SnapshotProgress(
        rows_done=progress.rows_done,
        rows_total=progress.rows_total,
        rows_kept=progress.rows_kept,
        done=progress.done,
        path=progress.path,
        rows_evicted=progress.rows_evicted,
        diffs=progress.diffs,
    )


def _config(message: pb.TableConfig) -> TableConfig:
    try:
        return TableConfig.from_dict(table_config_to_dict(message))
    except (ValueError, TypeError) as error:
        raise InvalidArgumentError(
            f"CreateTable: field 'config': {error}", field="config"
        ) from None


def _description(described: dict[str, Any]) -> pb.TableDescription:
    return pb.TableDescription(
        config=table_config_to_proto(described["config"].to_dict()),
        shard_id=described["shard_id"],
        num_shards=described["num_shards"],
        tiers=[pb.TierStats(**tier) for tier in described["tiers"]],
        initialized=described["initialized"],
        created=described["created"],
        lifecycle=described["lifecycle"],
        current_step=described["current_step"],
        keys_looked_up=described["keys_looked_up"],
        keys_pushed=described["keys_pushed"],
        generation=described["generation"],
        generation_snapshot=described["generation_snapshot"],
    )


# -- services -----------------------------------------------------------------------------------


class _Servicer:
    def __init__(self, shard: Shard, observe: Observe) -> None:
        self.shard = shard
        self.observe = observe
        self.chunk_bytes = shard.config.chunk_bytes
        self.max_batch_bytes = shard.config.max_batch_bytes
        self.max_reply_message = shard.config.max_message_bytes - 4096


def _one_message(request: Any) -> list[Any]:
    """The batches of a one-message call: a protobuf message's, or those of bytes decoded by
    hand (wire.WireBatches), whose undecodable bytes are the caller's error."""
    try:
        return list(request.batches)
    except wire.WireError as error:
        raise InvalidArgumentError(str(error)) from None


class EmbeddingServicer(_Servicer, pb_grpc.EmbeddingServiceServicer):
    def _lookup_batches(
        self, messages: Iterable[pb.LookupRequest], max_reply_bytes: int
    ) -> list[LookupBatch]:
        """A lookup's batches, refused if their reply would pass max_reply_bytes."""
        batches = []
        for first, bulk in table_batches(
            messages, ("table", "dim", "create"), ("keys",), self.max_batch_bytes
        ):
            keys = decode_keys(bulk["keys"], first.table)
            batches.append(LookupBatch(first.table, first.dim, keys, first.create))
        reply_bytes = sum(batch.keys.size * wire_row_bytes(batch.dim) for batch in batches)
        if reply_bytes > max_reply_bytes:
            tables = ", ".join(repr(batch.table) for batch in batches)
            one = max_reply_bytes < self.max_batch_bytes  # the message limit, not the call's
            raise ResourceExhaustedError(
                f"tables {tables}: a lookup of {sum(batch.keys.size for batch in batches)} "
                f"keys answers {reply_bytes} bytes, expected at most {max_reply_bytes} "
                + (
                    "(too large for one message: stream it, or split the batch)"
                    if one
                    else "per call; split the batch"
                ),
                reason=Reason.MESSAGE_TOO_LARGE if one else Reason.CALL_TOO_LARGE,
                limit=max_reply_bytes,
                bytes=reply_bytes,
            )
        return batches

    def _push_batches(self, messages: Iterable[pb.PushGradientsRequest]) -> list[PushBatch]:
        batches = []
        for first, bulk in table_batches(
            messages, ("table", "dim", "step"), ("keys", "grads"), self.max_batch_bytes
        ):
            keys = decode_keys(bulk["keys"], first.table)
            grads = decode_rows(bulk["grads"], "grads", first.table, keys.size, first.dim)
            batches.append(PushBatch(first.table, first.dim, keys, grads, first.step))
        return batches

    def _push(
        self, messages: Iterable[pb.PushGradientsRequest], context: Any
    ) -> pb.PushGradientsResponse:
        push_id, generations = _push_identity(context)
        batches = self._push_batches(messages)
        try:
            updated = self.shard.push_gradients(batches, push_id, generations)
        except Exception as error:
            _tell_applied_tables(context, error)
            raise
        return pb.PushGradientsResponse(num_keys=updated)

    @rpc
    def Lookup(self, requests: Iterator[pb.LookupRequest], context: Any) -> Iterator:
        for rows in self.shard.lookup(self._lookup_batches(requests, self.max_batch_bytes)):
            per_chunk = max(1, self.chunk_bytes // wire_row_bytes(rows.shape[1]))
            for start in range(0, rows.shape[0], per_chunk):
                chunk = rows[start : start + per_chunk]
                yield pb.LookupResponse(values=chunk.tobytes(), num_rows=chunk.shape[0])

    @rpc
    def LookupUnary(self, request: Any, context: Any) -> Any:
        """The serialized LookupResponse (registered without a serializer), whose rows the
        storage lookup writes straight into the reply's bytes (wire.lookup_reply). The
        reply must fit the message limit."""
        limit = min(self.max_batch_bytes, self.max_reply_message)
        batches = self._lookup_batches(_one_message(request), limit)
        reply, rows = wire.lookup_reply([(batch.keys.size, batch.dim) for batch in batches])
        self.shard.lookup(batches, out=rows)
        return reply

    @rpc
    def PushGradients(self, requests: Iterator[pb.PushGradientsRequest], context: Any) -> Any:
        return self._push(requests, context)

    @rpc
    def PushGradientsUnary(self, request: pb.PushGradientsBatches, context: Any) -> Any:
        return self._push(_one_message(request), context)

    @rpc
    def PushThenLookup(self, request: Any, context: Any) -> Any:
        """The serialized PushThenLookupResponse (registered without a serializer): the push
        applied as PushGradientsUnary's, then the lookup served as LookupUnary's, its rows
        written straight into the reply's bytes. A failure after the push was applied says
        so in trailing metadata (wire.PUSHED_HEADER: the push's num_keys)."""
        push_id, generations = _push_identity(context)
        pushes = self._push_batches(_one_message(request.push))
        limit = min(self.max_batch_bytes, self.max_reply_message)
        lookups = self._lookup_batches(_one_message(request.lookup), limit)
        shapes = [(batch.keys.size, batch.dim) for batch in lookups]
        built: list[bytes] = []
        pushed: list[int] = []

        def reply_rows(num_keys: int) -> list[np.ndarray]:
            pushed.append(num_keys)
            reply, rows = wire.lookup_reply(shapes, num_keys)
            built.append(reply)
            return rows

        try:
            self.shard.push_then_lookup(pushes, lookups, reply_rows, push_id, generations)
        except Exception as error:
            if pushed:
                context.set_trailing_metadata(((wire.PUSHED_HEADER, str(pushed[0])),))
            else:
                _tell_applied_tables(context, error)
            raise
        return built[0]

    @rpc
    def Assign(self, requests: Iterator[pb.AssignRequest], context: Any) -> Any:
        batches = []
        for first, bulk in table_batches(
            requests, ("table", "dim"), ("keys", "values"), self.max_batch_bytes
        ):
            keys = decode_keys(bulk["keys"], first.table)
            values = decode_rows(bulk["values"], "values", first.table, keys.size, first.dim)
            batches.append(AssignBatch(first.table, first.dim, keys, values))
        return pb.AssignResponse(num_keys=self.shard.assign(batches))


def add_embedding_service(servicer: EmbeddingServicer, server: grpc.Server) -> None:
    """Register the data service on a gRPC server, as the generated
    add_EmbeddingServiceServicer_to_server does, but with the one-message calls decoded by
    hand and the replies of LookupUnary and PushThenLookup sent as the bytes the servicer
    built."""
    messages = {
        "Lookup": grpc.stream_stream_rpc_method_handler(
            servicer.Lookup,
            request_deserializer=pb.LookupRequest.FromString,
            response_serializer=pb.LookupResponse.SerializeToString,
        ),
        "PushGradients": grpc.stream_unary_rpc_method_handler(
            servicer.PushGradients,
            request_deserializer=pb.PushGradientsRequest.FromString,
            response_serializer=pb.PushGradientsResponse.SerializeToString,
        ),
        "Assign": grpc.stream_unary_rpc_method_handler(
            servicer.Assign,
            request_deserializer=pb.AssignRequest.FromString,
            response_serializer=pb.AssignResponse.SerializeToString,
        ),
        "LookupUnary": grpc.unary_unary_rpc_method_handler(
            servicer.LookupUnary, request_deserializer=wire.decode_lookup_batches
        ),
        "PushGradientsUnary": grpc.unary_unary_rpc_method_handler(
            servicer.PushGradientsUnary,
            request_deserializer=wire.decode_push_batches,
            response_serializer=pb.PushGradientsResponse.SerializeToString,
        ),
        "PushThenLookup": grpc.unary_unary_rpc_method_handler(
            servicer.PushThenLookup, request_deserializer=wire.decode_push_then_lookup
        ),
    }
    service = pb.DESCRIPTOR.services_by_name["EmbeddingService"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, messages),))
    server.add_registered_method_handlers(service, messages)


class AdminServicer(_Servicer, pb_grpc.AdminServiceServicer):
    @rpc
    def CreateTable(self, request: pb.CreateTableRequest, context: Any) -> Any:
        created = self.shard.admin.create_table(_config(request.config))
        return pb.CreateTableResponse(created=created)

    @rpc
    def DropTable(self, request: pb.DropTableRequest, context: Any) -> Any:
        self.shard.admin.drop_table(request.table)
        return pb.DropTableResponse()

    @rpc
    def ListTables(self, request: pb.ListTablesRequest, context: Any) -> Any:
        return pb.ListTablesResponse(
            tables=[table_config_to_proto(c.to_dict()) for c in self.shard.admin.list_tables()]
        )

    @rpc
    def DescribeTable(self, request: pb.DescribeTableRequest, context: Any) -> Any:
        return _description(self.shard.describe(request.table))

    @rpc
    def SaveSnapshot(self, request: pb.SaveSnapshotRequest, context: Any) -> Iterator:
        admin = self.shard.admin
        phases: dict[int, Callable[[], Iterator[Progress]]] = {
            pb.SAVE_PHASE_WRITE_PART: lambda: admin.save_part(
                request.name, request.save_id, request.base
            ),
            pb.SAVE_PHASE_COMMIT: lambda: admin.commit_snapshot(request.name, request.save_id),
        }
        if request.phase not in phases:
            raise InvalidArgumentError(
                f"SaveSnapshot: field 'phase' expected SAVE_PHASE_WRITE_PART or "
                f"SAVE_PHASE_COMMIT (1 or 2), got {request.phase}",
                field="phase",
            )
        for progress in run_to_completion(phases[request.phase](), name="save-snapshot"):
            yield _progress(progress)

    @rpc
    def LoadSnapshot(self, request: pb.LoadSnapshotRequest, context: Any) -> Iterator:
        loading = self.shard.admin.load_snapshot(request.name)
        for progress in run_to_completion(loading, name="load"):
            yield _progress(progress)

    @rpc
    def ListSnapshots(self, request: pb.ListSnapshotsRequest, context: Any) -> Any:
        return pb.ListSnapshotsResponse(
            snapshots=[pb.SnapshotInfo(**info) for info in self.shard.admin.list_snapshots()]
        )

    @rpc
    def DeleteSnapshot(self, request: pb.DeleteSnapshotRequest, context: Any) -> Any:
        removed = self.shard.admin.delete_snapshot(
            request.name, request.save_id, request.incomplete_only
        )
        return pb.DeleteSnapshotResponse(removed=removed)

    @rpc
    def Evict(self, request: pb.EvictRequest, context: Any) -> Any:
        result = self.shard.maintenance.evict(request.table)
        return pb.EvictResponse(num_rows=result["removed"], current_step=result["current_step"])

    @rpc
    def Stats(self, request: pb.StatsRequest, context: Any) -> Any:
        stats = self.shard.stats()
        stats["tables"] = [_description(table) for table in stats["tables"]]
        return pb.StatsResponse(**stats)


class ChangeServicer(_Servicer, pb_grpc.ChangeServiceServicer):
    @rpc
    def Follow(self, request: pb.FollowRequest, context: Any) -> Iterator:
        yield from self.shard.change_feed(request).batches(context.is_active)
