"""Thin gRPC servicers: decode and check the request's bytes, call the shard, encode.
Errors become status codes in `status.rpc`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto.convert import table_config_to_dict, table_config_to_proto
from tierps.server.shard import Shard
from tierps.server.status import Observe, rpc, run_to_completion
from tierps.storage import InvalidArgumentError, ResourceExhaustedError, TableConfig
from tierps.storage.snapshot import Progress

# -- bytes <-> arrays ---------------------------------------------------------------------------


def gather(
    requests: Iterable[Any], header: tuple[str, ...], bulk: tuple[str, ...], max_bytes: int
) -> tuple[Any, dict[str, bytes]]:
    """The first message of a request stream (its header fields apply to the whole call) and
    each bulk field joined over all messages."""
    first = None
    parts: dict[str, list[bytes]] = {field: [] for field in bulk}
    total = 0
    for index, message in enumerate(requests):
        if first is None:
            first = message
        else:
            for field in header:
                value, expected = getattr(message, field), getattr(first, field)
                if value and value != expected:
                    raise InvalidArgumentError(
                        f"message {index} of the stream: field '{field}' expected "
                        f"{expected!r} (as in message 0) or unset, got {value!r}"
                    )
        for field in bulk:
            data = getattr(message, field)
            parts[field].append(data)
            total += len(data)
        if total > max_bytes:
            raise ResourceExhaustedError(
                f"request of {total}+ bulk bytes expected at most {max_bytes} bytes per call; "
                f"split the batch"
            )
    if first is None:
        raise InvalidArgumentError("request stream expected at least one message, got none")
    return first, {field: b"".join(chunks) for field, chunks in parts.items()}


def decode_keys(raw: bytes, table: str) -> np.ndarray:
    if len(raw) % 8:
        raise InvalidArgumentError(
            f"table {table!r}: field 'keys' expected a multiple of 8 bytes (little-endian "
            f"int64), got {len(raw)} bytes"
        )
    return np.frombuffer(raw, dtype="<i8")


def decode_rows(raw: bytes, field: str, table: str, n: int, dim: int) -> np.ndarray:
    if dim < 1:
        raise InvalidArgumentError(f"table {table!r}: field 'dim' expected >= 1, got {dim}")
    expected = 4 * n * dim
    if len(raw) != expected:
        raise InvalidArgumentError(
            f"table {table!r}: field '{field}' expected {expected} bytes ({n} keys x dim "
            f"{dim} x 4-byte float32), got {len(raw)} bytes"
            + (f", not a multiple of 4*dim={4 * dim}" if len(raw) % (4 * dim) else "")
        )
    return np.frombuffer(raw, dtype="<f4").reshape(n, dim)


def _progress(progress: Progress) -> pb.SnapshotProgress:
    return pb.SnapshotProgress(
        rows_done=progress.rows_done,
        rows_total=progress.rows_total,
        rows_kept=progress.rows_kept,
        done=progress.done,
        path=progress.path,
    )


def _config(message: pb.TableConfig) -> TableConfig:
    try:
        return TableConfig.from_dict(table_config_to_dict(message))
    except (ValueError, TypeError) as error:
        raise InvalidArgumentError(f"CreateTable: field 'config': {error}") from None


def _description(described: dict[str, Any]) -> pb.TableDescription:
    return pb.TableDescription(
        config=table_config_to_proto(described["config"].to_dict()),
        shard_id=described["shard_id"],
        num_shards=described["num_shards"],
        tiers=[pb.TierStats(**tier) for tier in described["tiers"]],
        initialized=described["initialized"],
        created=described["created"],
    )


# -- services -----------------------------------------------------------------------------------


class _Servicer:
    def __init__(self, shard: Shard, observe: Observe) -> None:
        self.shard = shard
        self.observe = observe
        self.chunk_bytes = shard.config.chunk_bytes
        self.max_batch_bytes = shard.config.max_batch_bytes


class EmbeddingServicer(_Servicer, pb_grpc.EmbeddingServiceServicer):
    @rpc
    def Lookup(self, requests: Iterator[pb.LookupRequest], context: Any) -> Iterator:
        first, bulk = gather(requests, ("table", "dim", "create"), ("keys",), self.max_batch_bytes)
        keys = decode_keys(bulk["keys"], first.table)
        if 4 * keys.size * first.dim > self.max_batch_bytes:
            raise ResourceExhaustedError(
                f"table {first.table!r}: a lookup of {keys.size} keys of dim {first.dim} "
                f"answers {4 * keys.size * first.dim} bytes, expected at most "
                f"{self.max_batch_bytes} per call; split the batch"
            )
        rows = self.shard.lookup(first.table, first.dim, keys, create=first.create)
        per_chunk = max(1, self.chunk_bytes // (4 * first.dim))
        for start in range(0, keys.size, per_chunk):
            chunk = rows[start : start + per_chunk]
            yield pb.LookupResponse(values=chunk.tobytes(), num_rows=chunk.shape[0])

    @rpc
    def PushGradients(self, requests: Iterator[pb.PushGradientsRequest], context: Any) -> Any:
        first, bulk = gather(
            requests, ("table", "dim", "step"), ("keys", "grads"), self.max_batch_bytes
        )
        keys = decode_keys(bulk["keys"], first.table)
        grads = decode_rows(bulk["grads"], "grads", first.table, keys.size, first.dim)
        updated = self.shard.push_gradients(first.table, first.dim, keys, grads, first.step)
        return pb.PushGradientsResponse(num_keys=updated)

    @rpc
    def Assign(self, requests: Iterator[pb.AssignRequest], context: Any) -> Any:
        first, bulk = gather(requests, ("table", "dim"), ("keys", "values"), self.max_batch_bytes)
        keys = decode_keys(bulk["keys"], first.table)
        values = decode_rows(bulk["values"], "values", first.table, keys.size, first.dim)
        return pb.AssignResponse(num_keys=self.shard.assign(first.table, first.dim, keys, values))


class AdminServicer(_Servicer, pb_grpc.AdminServiceServicer):
    @rpc
    def CreateTable(self, request: pb.CreateTableRequest, context: Any) -> Any:
        return pb.CreateTableResponse(created=self.shard.create_table(_config(request.config)))

    @rpc
    def DropTable(self, request: pb.DropTableRequest, context: Any) -> Any:
        self.shard.drop_table(request.table)
        return pb.DropTableResponse()

    @rpc
    def ListTables(self, request: pb.ListTablesRequest, context: Any) -> Any:
        return pb.ListTablesResponse(
            tables=[table_config_to_proto(c.to_dict()) for c in self.shard.list_tables()]
        )

    @rpc
    def DescribeTable(self, request: pb.DescribeTableRequest, context: Any) -> Any:
        return _description(self.shard.describe(request.table))

    @rpc
    def SaveSnapshot(self, request: pb.SaveSnapshotRequest, context: Any) -> Iterator:
        phases: dict[int, Callable[[str, str], Iterator[Progress]]] = {
            pb.SAVE_PHASE_WRITE_PART: self.shard.save_part,
            pb.SAVE_PHASE_COMMIT: self.shard.commit_snapshot,
        }
        if request.phase not in phases:
            raise InvalidArgumentError(
                f"SaveSnapshot: field 'phase' expected SAVE_PHASE_WRITE_PART or "
                f"SAVE_PHASE_COMMIT (1 or 2), got {request.phase}"
            )
        work = phases[request.phase](request.name, request.save_id)
        for progress in run_to_completion(work, name="save-snapshot"):
            yield _progress(progress)

    @rpc
    def LoadSnapshot(self, request: pb.LoadSnapshotRequest, context: Any) -> Iterator:
        for progress in run_to_completion(self.shard.load_snapshot(request.name), name="load"):
            yield _progress(progress)

    @rpc
    def ListSnapshots(self, request: pb.ListSnapshotsRequest, context: Any) -> Any:
        return pb.ListSnapshotsResponse(
            snapshots=[pb.SnapshotInfo(**info) for info in self.shard.list_snapshots()]
        )

    @rpc
    def Stats(self, request: pb.StatsRequest, context: Any) -> Any:
        stats = self.shard.stats()
        stats["tables"] = [_description(table) for table in stats["tables"]]
        return pb.StatsResponse(**stats)
