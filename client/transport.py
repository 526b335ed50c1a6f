"""The data calls to the shards: one call to a shard (in one message each way where both
fit, else streamed; again as a stream after a shard refused one message as too large), the
fan-out of a call's parts to all shards at once, and the identity each push call carries
(a push id, the generations of its tables' rows), so that a shard applies it once and is
told when rows were replaced under it. What goes to which shard is tierps.client.routing's."""

from __future__ import annotations

import collections
import itertools
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from tierps.client.admin import ShardError, too_large_for_one_message
from tierps.client.routing import Batch, Router, key_and_row_bytes, place_rows, reply_bytes
from tierps.core.errors import Reason
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto import wire

PIECES_AT_ONCE = 2  # calls of one fan-out to one shard at once (its lanes, see fan_out)
SERVICE = f"/{pb.DESCRIPTOR.services_by_name['EmbeddingService'].full_name}"
# What fan_out hands each call: its batches, or what the caller pairs with a shard.
Work = TypeVar("Work")


@dataclass(frozen=True)
class ClusterLink:
    """What the data calls take of the connection a ClusterAdmin keeps to its shards."""

    addresses: Sequence[str]
    timeout_s: Callable[[], float]  # the deadline of each call to a shard, as set now
    # metadata(shard, *extra): a call's metadata on the shard's plain channel (its life
    # header and token, then `extra`)
    metadata: Callable[..., list[tuple[str, str]]]
    learn_lives: Callable[[list[int]], None]  # learn these shards' lives, where not known
    # know_generations(shard, tables): the generations of the shard's tables, as known
    know_generations: Callable[[int, list[str]], dict[str, int]]
    relearn_generations: Callable[[int], None]  # ask a shard its generations again
    # forget_stale_config(table, expected, got): a shard refused the dim `got` a call sent
    # for the table, its own being `expected`: where `got` is the dim the client knew, the
    # table was created again; the client forgets what it knew of it (to learn it at its
    # next call) and says True
    forget_stale_config: Callable[[str, int, int], bool]


class Transport:
    """The data calls of an EmbeddingClient: each shard's one-message calls (bytes encoded
    and decoded here, tierps.proto.wire), its streaming calls, and the fan-out over both.
    It keeps, per shard, the bulk bytes a call may carry as one message each way: lowered
    for a shard that refused a call as too large for one (its message limit is lower)."""

    def __init__(
        self,
        link: ClusterLink,
        router: Router,
        channels: Sequence[grpc.Channel],
        plain_channels: Sequence[grpc.Channel],
        *,
        chunk_bytes: int,
        one_message_bytes: int,
    ) -> None:
        self.link = link
        self.router = router
        self.chunk_bytes = chunk_bytes
        # The calls' own threads: snapshot streams hold the admin pool for as long as they
        # run, and a prefetch may fan out while a push does.
        self._calls = ThreadPoolExecutor(
            PIECES_AT_ONCE * len(link.addresses), thread_name_prefix="tierps-calls"
        )
        self._plain_channels = plain_channels
        self._streams = [pb_grpc.EmbeddingServiceStub(channel) for channel in channels]
        # Each shard's one-message calls, on the plain channels: no serializers, so gRPC
        # hands over the bytes as they are; their calls pass their metadata themselves.
        self.lookup_one = self.unary("LookupUnary")
        self.push_one = self.unary(
            "PushGradientsUnary", response_deserializer=pb.PushGradientsResponse.FromString
        )
        self._one_message_bytes = [one_message_bytes] * len(link.addresses)
        self._lock = threading.Lock()
        # Each push call's identity (wire.PUSH_ID_HEADER): this client's id and a number of
        # its own, the same on every retry of the call, so that a shard applies it once.
        self._client_id = uuid.uuid4().hex
        self._sequence = itertools.count(1)

    def unary(self, method: str, response_deserializer: Any = None) -> list[Any]:
        """Each shard's one-message call of EmbeddingService's `method`, on its plain channel
        (bytes in; bytes out unless a response_deserializer is given)."""
        return [
            channel.unary_unary(f"{SERVICE}/{method}", response_deserializer=response_deserializer)
            for channel in self._plain_channels
        ]

    def close(self) -> None:
        self._calls.shutdown(wait=False)

    def fits_one_message(self, shard: int, bulk: int) -> bool:
        """Whether a call of `bulk` bytes (its larger way) goes to the shard as one message."""
        return bulk <= self._one_message_bytes[shard]

    def refused_as_too_large(self, shard: int, error: grpc.RpcError, bulk: int) -> bool:
        """Whether the shard refused a one-message call of `bulk` bytes (its larger way) as
        too large for one message, before it touched anything (gRPC's message limit, or the
        shard's own reply check): then this shard's one-message calls stay below `bulk`."""
        too_large = too_large_for_one_message(error)
        if too_large:
            with self._lock:
                limit = self._one_message_bytes[shard]
                self._one_message_bytes[shard] = min(limit, bulk - 1)
        return too_large

    # -- lookups ---------------------------------------------------------------------------------

    def lookup_unique(
        self,
        tables: dict[str, tuple[int, np.ndarray]],
        create: bool,
        out: dict[str, np.ndarray] | None = None,
        *,
        read_only: bool = False,
    ) -> dict[str, np.ndarray]:
        """Rows [u, dim] of each table's distinct keys >= 0: one call per shard for all.
        `out`: arrays [u, dim] to write them into (views of a larger buffer may do). Without
        it, new arrays; or, with read_only, for a table whose rows all came in one reply, a
        read-only view of that reply (no copy)."""
        calls = self.router.lookup_calls(tables)
        if out is None:
            whole = {
                name
                for _, batches in calls
                for name, _, keys, _ in batches
                if read_only and keys.size == tables[name][1].size
            }
            out = {
                name: np.empty((keys.size, dim), np.float32)
                for name, (dim, keys) in tables.items()
                if name not in whole
            }
        else:
            out = dict(out)

        self.fan_out(calls, lambda shard, batches: self.lookup_into(shard, batches, create, out))
        return out

    def lookup_into(
        self, shard: int, batches: list[Batch], create: bool, out: dict[str, np.ndarray]
    ) -> None:
        """One lookup call to a shard, its rows placed in `out` (place_reply)."""
        self.place_reply(shard, batches, self.lookup_call(shard, batches, create), out)

    def place_reply(
        self, shard: int, batches: list[Batch], values: Any, out: dict[str, np.ndarray]
    ) -> None:
        """A lookup reply's rows from a shard (bytes-like values), checked for their size
        and placed by batch (routing.place_rows)."""
        if len(values) != reply_bytes(batches):
            raise self._reply_size_error(shard, batches, str(len(values)))
        place_rows(batches, values, out)

    def lookup_call(self, shard: int, batches: list[Batch], create: bool) -> Any:
        """The rows of one call's batches, as bytes-like values: in one message each way
        where both fit, else streamed (also after the shard refused one message as too
        large: a lookup changes nothing it could repeat)."""
        bulk = max(sum(8 * keys.size for _, _, keys, _ in batches), reply_bytes(batches))
        self.link.know_generations(shard, [name for name, *_ in batches])
        if self.fits_one_message(shard, bulk):
            request = wire.encode_batches(
                [(name, dim, create, (wire_keys(keys),)) for name, dim, keys, _ in batches]
            )
            try:
                reply = self.lookup_one[shard](
                    request,
                    timeout=self.link.timeout_s(),
                    metadata=self.link.metadata(shard, *wire.declared(len(request))),
                )
                return wire.lookup_reply_values(reply)
            except grpc.RpcError as error:
                if not self.refused_as_too_large(shard, error, bulk):
                    raise
        requests = (
            request
            for name, dim, keys, _ in batches
            for request in wire.lookup_requests(
                name, dim, wire_keys(keys).tobytes(), create=create, chunk_bytes=self.chunk_bytes
            )
        )
        values = np.empty(reply_bytes(batches), np.uint8)  # the chunks land in place
        filled = 0
        size = sum(
            wire.stream_bytes(name, dim, create, keys.size, 0, self.chunk_bytes)
            for name, dim, keys, _ in batches
        )
        replies = self._streams[shard].Lookup(
            requests, timeout=self.link.timeout_s(), metadata=wire.declared(size)
        )
        for response in replies:
            chunk = np.frombuffer(response.values, np.uint8)
            if filled + chunk.size > values.size:
                raise self._reply_size_error(shard, batches, f"more than {values.size}")
            values[filled : filled + chunk.size] = chunk
            filled += chunk.size
        return values[:filled]

    def _reply_size_error(self, shard: int, batches: list[Batch], got: str) -> ShardError:
        names = sorted({name for name, *_ in batches})
        return ShardError(
            shard,
            self.link.addresses[shard],
            grpc.StatusCode.INTERNAL,
            f"lookup reply of tables {names} expected {reply_bytes(batches)} bytes, got {got}",
        )

    # -- pushes and assigns ----------------------------------------------------------------------

    def push_call(
        self,
        shard: int,
        batches: list[Batch],
        steps: dict[str, int],
        pushes: dict[str, tuple[np.ndarray, np.ndarray]],
    ) -> Any:
        """One push call to a shard: its PushGradientsResponse. Each batch's gradients are
        its rows of pushes[table][1], at its positions; steps[table] is the table's step."""
        bulk = sum(key_and_row_bytes(dim) * keys.size for _, dim, keys, _ in batches)
        identity = self.push_identity(shard, [name for name, *_ in batches])
        if self.fits_one_message(shard, bulk):
            request = push_request(batches, steps, pushes)
            try:
                return self.push_one[shard](
                    request,
                    timeout=self.link.timeout_s(),
                    metadata=self.link.metadata(shard, *wire.declared(len(request)), *identity),
                )
            except grpc.RpcError as error:
                # refused before it was read: nothing applied, the stream may carry it
                if not self.refused_as_too_large(shard, error, bulk):
                    raise

        def grads_of(name: str, keys: np.ndarray, at: np.ndarray) -> np.ndarray:
            grads = pushes[name][1]  # every key of the table in this call: no gather
            grads = grads if keys.size == grads.shape[0] else grads[at]
            return np.ascontiguousarray(grads, "<f4")

        parts = [(name, dim, keys, grads_of(name, keys, at)) for name, dim, keys, at in batches]
        requests = (
            request
            for name, dim, keys, grads in parts
            for request in wire.push_requests(
                name,
                dim,
                steps[name],
                wire_keys(keys).tobytes(),
                grads.tobytes(),
                self.chunk_bytes,
            )
        )
        size = sum(
            wire.stream_bytes(name, dim, steps[name], k.size, 4 * dim, self.chunk_bytes)
            for name, dim, k, _ in parts
        )
        return self._streams[shard].PushGradients(
            requests, timeout=self.link.timeout_s(), metadata=(*wire.declared(size), *identity)
        )

    def push_identity(self, shard: int, tables: list[str]) -> tuple[tuple[str, str], ...]:
        """The metadata that makes a push call to a shard safe to send again: a new push id,
        and the generation of each table's rows there as this client knows it (learned
        once per table; 0 where the shard does not say, as to a reader)."""
        known = self.link.know_generations(shard, tables)
        generations = ",".join(str(known.get(table, 0)) for table in tables)
        return (
            (wire.PUSH_ID_HEADER, f"{self._client_id}:{next(self._sequence)}"),
            (wire.GENERATIONS_HEADER, generations),
        )

    def assign_call(
        self, shard: int, batches: list[Batch], values: np.ndarray, rows: np.ndarray
    ) -> Any:
        """One assign call to a shard (streamed): each batch's keys and their values, the
        key at position p of its table's keys taking values[rows[p]]. Its AssignResponse."""
        requests = (
            request
            for name, dim, keys, at in batches
            for request in wire.assign_requests(
                name,
                dim,
                wire_keys(keys).tobytes(),
                values[rows[at]].tobytes(),
                self.chunk_bytes,
            )
        )
        size = sum(
            wire.stream_bytes(name, dim, 0, keys.size, 4 * dim, self.chunk_bytes)
            for name, dim, keys, _ in batches
        )
        return self._streams[shard].Assign(
            requests, timeout=self.link.timeout_s(), metadata=wire.declared(size)
        )

    # -- the fan-out -----------------------------------------------------------------------------

    def told(self, error: ShardError) -> ShardError:
        """A shard's refusal as the caller is told it. A refused dim that is the one this
        client knew for the table, the table's own being another (it was created again
        since the client learned it), has the client forget what it knew, so that its next
        call learns it again, and says so; any other refusal is returned as it is."""
        facts = error.facts
        if not (
            error.reason is Reason.INVALID_ARGUMENT
            and facts.get("field") == "dim"
            and facts.get("expected", "").isdigit()
            and facts.get("got", "").isdigit()
            and self.link.forget_stale_config(
                facts.get("table", ""), int(facts["expected"]), int(facts["got"])
            )
        ):
            return error
        told = ShardError(
            error.shard_id,
            error.address,
            error.code,
            f"{error.details} (table {facts.get('table', '')!r} was created again with dim "
            f"{facts['expected']} since this client learned it: the client learns its "
            f"config again at its next call)",
            error.reason,
            facts,
        )
        told.applied_tables = error.applied_tables
        return told

    def fan_out(self, calls: list[tuple[int, Work]], call: Callable[[int, Work], Any]) -> list[Any]:
        """call(shard, work) for every call (work: its batches, or what the caller pairs
        with the shard), all at once but at most PIECES_AT_ONCE to one shard: a shard's
        calls go in that many lanes, each lane's calls one after another (a shard's
        in-flight byte budget is sized for two calls at once, and a call of a split push
        or assign may carry max_call_bytes). The last lane runs in this thread, the others
        on the call threads (persistent: a gRPC future would start a thread per call; there
        are two a shard, so every lane of a fan-out runs at once). Returns the results in
        call order once every call has ended; if any failed, raises the first failure as a
        ShardError naming its shard, with `succeeded` set to the shards whose calls went
        through."""
        if not calls:
            return []
        self.link.learn_lives([shard for shard, _ in calls])
        lanes: dict[tuple[int, int], list[int]] = {}
        seen: collections.Counter[int] = collections.Counter()
        for index, (shard, _) in enumerate(calls):
            lanes.setdefault((shard, seen[shard] % PIECES_AT_ONCE), []).append(index)
            seen[shard] += 1
        outcomes: list[Any] = [None] * len(calls)

        def run_lane(indices: list[int]) -> None:
            for index in indices:
                shard, work = calls[index]
                try:
                    outcomes[index] = call(shard, work)
                except grpc.RpcError as error:
                    outcomes[index] = ShardError.of(shard, self.link.addresses[shard], error)
                except ShardError as error:
                    outcomes[index] = error

        *others, last = lanes.values()
        futures = [self._calls.submit(run_lane, indices) for indices in others]
        try:
            run_lane(last)
        finally:  # none left running into the caller's output, whatever the last raised
            wait(futures)
        for future in futures:
            future.result()  # raises what a lane raised other than a ShardError (a bug)
        for index, outcome in enumerate(outcomes):
            if isinstance(outcome, ShardError):
                outcomes[index] = self.told(outcome)
        failures = [outcome for outcome in outcomes if isinstance(outcome, ShardError)]
        if failures:
            # a shard counts only if every one of its calls went through (a part of more
            # than max_call_bytes goes as several calls, which may fail one by one)
            failed = {
                shard
                for (shard, _), outcome in zip(calls, outcomes, strict=True)
                if isinstance(outcome, ShardError)
            }
            failures[0].succeeded = sorted({shard for shard, _ in calls} - failed)
            failures[0].failed = sorted(failed)
            raise failures[0]
        return outcomes


def push_request(
    batches: list[Batch],
    steps: dict[str, int],
    pushes: dict[str, tuple[np.ndarray, np.ndarray]],
) -> bytes:
    """A one-message push of these batches, serialized: each batch's keys and gradients
    (its rows of pushes[table][1], at its positions) written straight into the message's
    bytes (wire.encode_batches_in_place): one copy of the gradients, no gather and join."""
    request, fields = wire.encode_batches_in_place(
        [
            (name, dim, steps[name], (8 * keys.size, 4 * dim * keys.size))
            for name, dim, keys, _ in batches
        ]
    )
    fill_push(batches, fields, pushes)
    return request


def fill_push(
    batches: list[Batch],
    fields: list[list[np.ndarray]],
    pushes: dict[str, tuple[np.ndarray, np.ndarray]],
) -> None:
    """Write each push batch's keys and gradients into its fields' views (of a request's
    bytes, from wire's in-place encoders)."""
    for (name, dim, keys, at), (key_bytes, grad_bytes) in zip(batches, fields, strict=True):
        key_bytes.view("<i8")[...] = keys
        grads, out = pushes[name][1], grad_bytes.view("<f4").reshape(keys.size, dim)
        if keys.size == grads.shape[0]:  # every key of the table in this call: in order
            out[...] = grads
        else:  # "clip": positions are valid; numpy buffers `out` only for mode="raise"
            np.take(grads, at, axis=0, out=out, mode="clip")


def push_applied(error: grpc.RpcError) -> bool:
    """Whether a failed call's shard says its push was applied (trailing metadata
    wire.PUSHED_HEADER, as a PushThenLookup's): then only its lookup failed."""
    return any(key == wire.PUSHED_HEADER for key, _ in error.trailing_metadata() or ())


def wire_keys(keys: np.ndarray) -> np.ndarray:
    """Keys as the wire carries them: C-contiguous little-endian int64 (no copy if so)."""
    return np.ascontiguousarray(keys, "<i8")
