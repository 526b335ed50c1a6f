"""A push, then a lookup that sees it, as one PushThenLookup call per shard where both fit
(a pipelined trainer's held push and its next batch's lookup): one round trip instead of
two. Where they do not fit, or a shard does not know the call, they go as a push, then a
lookup; either way a push is applied once and never sent again once a shard applied it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from tierps.client.admin import ShardError, refusal_of
from tierps.client.pushes import Pushes
from tierps.client.routing import Batch, Router, key_and_row_bytes, reply_bytes
from tierps.client.transport import Transport, fill_push, push_applied, wire_keys
from tierps.core.errors import Reason
from tierps.proto import wire


class PushNotApplied(Exception):
    """Raised by PushThenLookup.push_then_lookup when its push failed (on some shard):
    `error` is the push's error, as a push alone would raise it."""

    def __init__(self, error: ShardError) -> None:
        super().__init__(str(error))
        self.error = error


class PushThenLookup:
    """The fused calls of an EmbeddingClient. It keeps, per shard, whether the shard takes
    PushThenLookup (False once it answered UNIMPLEMENTED, an older shard: its pushes and
    lookups go as separate calls from then on), and the request bulk bytes a fused call to
    it may carry (its push and its lookup's keys): max_call_bytes, lowered for a shard that
    refused one as over its per-call limit (a lower max_batch_bytes). `push_unique` sends a
    push alone where the two do not go as fused calls (EmbeddingClient.push_unique)."""

    def __init__(
        self,
        transport: Transport,
        router: Router,
        pushes: Pushes,
        push_unique: Callable[[dict[str, tuple[np.ndarray, np.ndarray]], int | None], int],
    ) -> None:
        self.transport = transport
        self.router = router
        self.pushes = pushes
        self.push_unique = push_unique
        self.fused_one = transport.unary("PushThenLookup")  # each shard's fused call
        num_shards = router.num_shards
        self._fuses = [True] * num_shards
        self._fused_call_bytes = [router.max_call_bytes] * num_shards
        self._lock = threading.Lock()

    def push_then_lookup(
        self,
        pushes: dict[str, tuple[np.ndarray, np.ndarray]],
        step: int | None,
        tables: dict[str, tuple[int, np.ndarray]],
        create: bool,
    ) -> dict[str, np.ndarray]:
        """push_unique(pushes, step), then lookup_unique(tables, create) seeing it, in one
        PushThenLookup call per shard where every shard's parts of both are one call each
        and fit in one message each way (or a shard has a part of one of them only, sent
        alone); else those two, as separate calls for all shards (a lookup cut into pieces
        then sends them at once). A shard that refuses the fused call as too large, or does
        not know it, gets its push call, then its lookup call. A push not applied on every
        shard of its calls (refused, or a failure before they ran: table_step, routing,
        learning a shard's life) raises PushNotApplied with the error push_unique would
        raise; a lookup that failed after the push was applied everywhere raises its
        ShardError."""
        transport = self.transport
        pushes = {t: (keys, grads) for t, (keys, grads) in pushes.items() if keys.size}
        if not pushes:
            return transport.lookup_unique(tables, create)
        try:
            push_calls = self.router.push_calls(pushes)
            lookup_calls = self.router.lookup_calls(tables)
        except ShardError as error:  # nothing sent, no step taken
            raise PushNotApplied(error) from None
        parts: dict[int, tuple[list[list[Batch]], list[list[Batch]]]] = {}
        for shard, batches in push_calls:
            parts.setdefault(shard, ([], []))[0].append(batches)
        for shard, batches in lookup_calls:
            parts.setdefault(shard, ([], []))[1].append(batches)
        if not all(self._fuses_parts(shard, *both) for shard, both in parts.items()):
            try:
                self.push_unique(pushes, step)
            except ShardError as error:
                raise PushNotApplied(error) from None
            return transport.lookup_unique(tables, create)
        try:
            steps = self.pushes.reserve(list(pushes), step)
        except ShardError as error:  # table_step failed: no step taken, nothing sent
            raise PushNotApplied(error) from None
        out = {name: np.empty((keys.size, dim), np.float32) for name, (dim, keys) in tables.items()}
        # each shard's push call and lookup call (None: it has no part of that one)
        work = {
            shard: (push[0] if push else None, lookup[0] if lookup else None)
            for shard, (push, lookup) in parts.items()
        }
        pushed: set[int] = set()  # shards whose part of the push is applied
        push_failed: dict[int, ShardError] = {}

        def run(shard: int, both: tuple[list[Batch] | None, list[Batch] | None]) -> None:
            push, lookup = both
            values = None  # the fused call's reply, once it returned
            try:
                if push is not None and lookup is not None:
                    values = self._fused_call(shard, push, lookup, steps, pushes, create)
                if values is None and push is not None:
                    transport.push_call(shard, push, steps, pushes)
            except grpc.RpcError as error:
                if push_applied(error):
                    pushed.add(shard)  # the push is in; its lookup failed
                else:
                    address = transport.link.addresses[shard]
                    push_failed[shard] = transport.told(ShardError.of(shard, address, error))
                raise
            pushed.add(shard)  # before its reply is read, which may fail
            if values is not None and lookup is not None:
                rows = wire.push_then_lookup_reply(values)[0]
                transport.place_reply(shard, lookup, rows, out)
            elif lookup is not None:
                transport.lookup_into(shard, lookup, create, out)

        try:
            transport.fan_out(list(work.items()), run)
        except ShardError as error:
            # the push is applied only where every shard of its calls says so; anything
            # else (a push refused, or a failure before any call ran) is no silent loss
            push_shards = {shard for shard, _ in push_calls}
            if push_shards <= pushed:  # a lookup failed after the push went in
                self.pushes.done(steps, step)
                raise
            failure = push_failed[min(push_failed)] if push_failed else error
            failure.succeeded = sorted(pushed & push_shards)
            failure.failed = sorted(push_shards - pushed)
            raise PushNotApplied(self.pushes.failure(failure, steps, step)) from None
        self.pushes.done(steps, step)
        return out

    def _fused_call(
        self,
        shard: int,
        push: list[Batch],
        lookup: list[Batch],
        steps: dict[str, int],
        pushes: dict[str, tuple[np.ndarray, np.ndarray]],
        create: bool,
    ) -> Any:
        """One PushThenLookup to a shard: its reply, undecoded (its push is applied); None
        (nothing done) where it does not fit in one message each way, or the shard refused
        it as too large or does not know it."""
        if not self._fits_fused(shard, push, lookup):
            return None
        request_bytes, bulk = _fused_bytes(push, lookup)
        request, fields = wire.encode_push_then_lookup_in_place(
            [
                (name, dim, steps[name], (8 * keys.size, 4 * dim * keys.size))
                for name, dim, keys, _ in push
            ],
            [(name, dim, create, (wire_keys(keys),)) for name, dim, keys, _ in lookup],
        )
        fill_push(push, fields, pushes)
        transport = self.transport
        identity = transport.push_identity(shard, [name for name, *_ in push])
        try:
            reply = self.fused_one[shard](
                request,
                timeout=transport.link.timeout_s(),
                metadata=transport.link.metadata(shard, *wire.declared(len(request)), *identity),
            )
        except grpc.RpcError as error:
            if push_applied(error):  # whatever else it says: the push must not go again
                raise
            if error.code() is grpc.StatusCode.UNIMPLEMENTED:  # an older shard
                self._fuses[shard] = False
                return None
            if transport.refused_as_too_large(shard, error, bulk):  # before it was read
                return None
            if self._refused_per_call(shard, error, request_bytes):  # likewise
                return None
            raise
        return reply

    def _fuses_parts(self, shard: int, push: list[list[Batch]], lookup: list[list[Batch]]) -> bool:
        """Whether a shard's push calls and lookup calls go as at most one fused call:
        one of each that fits it (_fits_fused), or calls of one kind only, one at most."""
        if len(push) > 1 or len(lookup) > 1:
            return False
        return not (push and lookup) or self._fits_fused(shard, push[0], lookup[0])

    def _fits_fused(self, shard: int, push: list[Batch], lookup: list[Batch]) -> bool:
        """Whether the shard takes this push and lookup as one PushThenLookup: it knows
        the call, both ways fit in one message, and the request in one call."""
        request_bytes, bulk = _fused_bytes(push, lookup)
        return (
            self._fuses[shard]
            and self.transport.fits_one_message(shard, bulk)
            and request_bytes <= self._fused_call_bytes[shard]
        )

    def _refused_per_call(self, shard: int, error: grpc.RpcError, bulk: int) -> bool:
        """Whether the shard refused a PushThenLookup of `bulk` request bytes as over its
        per-call limit (CallLimits, before any handler ran: nothing applied); then this
        shard's fused calls stay below `bulk`."""
        refused = refusal_of(error)[0] is Reason.CALL_TOO_LARGE
        if refused:
            with self._lock:
                self._fused_call_bytes[shard] = min(self._fused_call_bytes[shard], bulk - 1)
        return refused


def _fused_bytes(push: list[Batch], lookup: list[Batch]) -> tuple[int, int]:
    """A PushThenLookup's request bulk (the push's keys and gradients, the lookup's keys),
    and its larger way's bulk (that or the reply's rows)."""
    request = sum(key_and_row_bytes(dim) * keys.size for _, dim, keys, _ in push)
    request += sum(8 * keys.size for _, _, keys, _ in lookup)
    return request, max(request, reply_bytes(lookup))
