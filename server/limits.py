"""Limits that keep a shard serving whatever its clients do (CallLimits, a server
interceptor). Every call is admitted before any of its request is read: a one-message
(unary) handler is served as a request stream of one message (the same call on the wire),
so gRPC asks the client for the message only after admission, and a refused call costs the
shard at most the one stream window gRPC buffers ahead (below). AuthCheck's refusals
(server/security.py) read nothing either.

- at most `max_calls` calls at once (health excepted), RESOURCE_EXHAUSTED beyond: a call never
  queues behind others, and the server's pool keeps HEALTH_WORKERS threads more than the cap,
  so health checks always find one;
- of those, at most `max_receiving` request streams still waiting for their client's
  messages (RESOURCE_EXHAUSTED beyond), so idle streams cannot take the slots other
  clients' calls need;
- request bytes against a per-call limit and the shard's budget of in-flight bytes. A call
  declares its request bytes up front (metadata wire.REQUEST_BYTES_HEADER, as
  EmbeddingClient does): a declaration over the per-call limit, over what the budget has
  left, or (one-message calls) over the receive limit, is refused (RESOURCE_EXHAUSTED)
  before any message is read; an admitted declaration is reserved from the budget until the
  call ends, so concurrent calls cannot overrun it. A one-message data call that declares
  nothing reserves the receive limit (the most its message may be) until it is read. Bytes
  a call sends beyond its declaration are counted as each message arrives,
  RESOURCE_EXHAUSTED once over either limit, before the next message is read;
- the receive limit (gRPC's, checked against a message's length prefix before the message
  is read: max_one_message_bytes) is never more than one call or the whole budget may hold:
  a larger one-message call is refused unread and goes as a counted stream (EmbeddingClient
  falls back). What stays unbudgeted: a one-message call that declares less than it sends
  (or an admin call, whose messages carry no bulk and declare nothing) holds its message,
  at most the receive limit, from its arrival until it is counted and refused;
- a request stream idle for idle_s while the shard waits for its next message (a
  one-message call's one message included), or a data call running for total_s, is
  cancelled (the client sees CANCELLED), freeing its thread;
- what gRPC core takes off the socket ahead of the servicer, before a message is counted:
  RECEIVE_WINDOW_OPTIONS pin each stream's flow-control window to one message.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from tierps.core.errors import InvalidArgumentError, Reason, ResourceExhaustedError
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto.wire import CHUNK_BYTES, REQUEST_BYTES_HEADER
from tierps.server.handlers import as_request_stream, with_behavior
from tierps.server.status import abort, status_of

TRIM_AFTER_BYTES = 16 << 20  # a failed call that held this much gives its memory back
HEALTH_WORKERS = 4  # threads of the server's pool beyond max_calls: health always has some
_HEALTH = "/grpc.health.v1.Health/"
_DATA = f"/{pb.DESCRIPTOR.services_by_name['EmbeddingService'].full_name}/"
Refused = Callable[[str, str, str, str], None]  # (method, code, cause, why): count and log

# The shard server's HTTP/2 flow control. gRPC core buffers what a stream's window lets the
# client send before the servicer asks for it, and the budget counts a message only when it
# is read. By default the window follows the BDP probe: max(4 MiB, 2 x the bytes that arrive
# within one ping's round trip), rounded up to a power of two - up to 1 GiB, and largest when
# the shard is slow (a busy CPU delays the ping's ack while the client keeps sending): a
# refused 1 GiB push had 8 messages (32 MiB) beyond the budget in the shard under CPU load.
# Pinned at one stream message (the BDP probe off), a stream holds at most that ahead, plus
# the message being read (gRPC opens the window to the size of the message the servicer
# waits for, so a one-message call of any size still arrives). The probe also sets the
# largest frame the client may send; without it that stays at 16 KiB: set it to a message
# (HTTP/2 allows frames up to 16 MiB - 1; gRPC would clamp a larger one without a word).
assert CHUNK_BYTES < 1 << 24, "a stream message must fit one HTTP/2 frame"
RECEIVE_WINDOW_OPTIONS = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", CHUNK_BYTES),
    ("grpc.http2.max_frame_size", CHUNK_BYTES),
]


def max_one_message_bytes(max_message_bytes: int, max_call_bytes: int, budget: int) -> int:
    """The largest request message a shard takes (gRPC's receive limit, which gRPC checks
    against a message's length prefix before reading it): the configured message limit, but
    never more than one call or the whole in-flight budget may hold. Larger one-message
    calls are refused unread and go as counted streams (EmbeddingClient falls back)."""
    return min(max_message_bytes, max_call_bytes, budget)


def _libc_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


# A call refused for its bytes had its messages freed, but glibc keeps large freed blocks in
# its heap (its mmap threshold grows to their size): malloc_trim hands them back to the OS.
_MALLOC_TRIM = _libc_malloc_trim()


def _declared_bytes(value: str) -> int | None:
    """A declared request size, or None where the value is not one."""
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 20 else None


_END = object()  # _next_message's answer where a request stream ended whole


class _Expired(grpc.RpcError):
    """The request stream of a call the watchdog cancelled: never taken as a whole request."""


class _Call:
    """One admitted call's share of the limits."""

    __slots__ = (
        "method",
        "declared",
        "one_message",
        "context",
        "started",
        "waiting_since",
        "expired",
        "size",
        "received",
        "held",
        "receiving",
        "timed",
        "failed",
    )

    def __init__(self, method: str, declared: str | None, one_message: bool) -> None:
        self.method = method
        self.declared = declared  # the request bytes the client declared, as it sent them
        self.one_message = one_message  # a unary request: read by the interceptor
        self.context: Any = None
        self.started = time.monotonic()
        self.waiting_since: float | None = None  # while the shard waits for a message
        self.expired: str | None = None
        self.size = 0  # bytes of the message deserialized last
        self.received = 0  # bytes of this call's messages read so far
        self.held = 0  # bytes of the budget this call holds: max(declared, received)
        self.receiving = False
        self.timed = method.startswith(_DATA)  # total_s applies
        self.failed = False  # refused or failed: its messages are garbage now


class CallLimits(grpc.ServerInterceptor):
    def __init__(
        self,
        *,
        max_calls: int,
        max_receiving: int,
        max_inflight_bytes: int,
        max_call_bytes: int,
        max_message_bytes: int,
        idle_s: float,
        total_s: float,
        where: str,
        refused: Refused,
    ) -> None:
        self.max_calls = max_calls
        self.max_receiving = max_receiving
        self.max_inflight_bytes = max_inflight_bytes
        self.max_call_bytes = max_call_bytes
        self.max_message_bytes = max_message_bytes  # the server's gRPC receive limit
        self.idle_s = idle_s
        self.total_s = total_s
        self.where = where
        self._refused = refused
        self._lock = threading.Lock()
        self.calls = 0
        self.receiving = 0
        self.inflight_bytes = 0
        self._watched: set[_Call] = set()
        self._trim = False
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tierps-watchdog", daemon=True)
        self._watchdog.start()

    def close(self) -> None:
        self._stop.set()

    # -- admission ------------------------------------------------------------------------

    def _refusal(
        self, call: _Call, cause: str, reason: Reason, message: str, **facts: int
    ) -> ResourceExhaustedError:
        """Count and log a refusal; the error to raise (or abort with). `facts`: the limit
        passed, and the bytes that passed it."""
        error = ResourceExhaustedError(f"{self.where}: {message}", reason=reason, **facts)
        self._refused(call.method, status_of(error).name, cause, message)
        return error

    def _refuse(
        self, call: _Call, context: Any, cause: str, reason: Reason, message: str, **facts: int
    ) -> None:
        """Abort a call before its behavior runs."""
        abort(context, self._refusal(call, cause, reason, message, **facts))

    def _admit(self, call: _Call, context: Any, streaming: bool) -> None:
        """Take a call slot (and a receiving one for a request stream) and reserve the
        request bytes it declared, or abort: before any of its messages is read. A
        one-message data call that declares nothing reserves the most its message may be
        (the receive limit) until it is read."""
        call.context = context
        declared = 0 if call.declared is None else _declared_bytes(call.declared)
        if declared is None:
            why = (
                f"metadata '{REQUEST_BYTES_HEADER}' expected the call's request bytes (a "
                f"decimal integer >= 0), got {(call.declared or '')[:40]!r}"
            )
            error = InvalidArgumentError(f"{self.where}: {why}", field=REQUEST_BYTES_HEADER)
            self._refused(call.method, status_of(error).name, "declared", why)
            abort(context, error)
        undeclared = call.declared is None and call.one_message and call.method.startswith(_DATA)
        reserve = self.max_message_bytes if undeclared else declared
        with self._lock:
            full = self.calls >= self.max_calls
            streams_full = streaming and self.receiving >= self.max_receiving
            too_large = declared > self.max_call_bytes
            one_too_large = call.one_message and declared > self.max_message_bytes
            left = self.max_inflight_bytes - self.inflight_bytes
            no_room = reserve > left
            if not (full or streams_full or too_large or one_too_large or no_room):
                self.calls += 1
                self.inflight_bytes += reserve  # until the call ends (or its one message
                call.held = reserve  # is read, where it declared nothing)
                if streaming:
                    self.receiving += 1
                    call.receiving = True
                self._watched.add(call)
        if full:
            self._refuse(
                call,
                context,
                "calls",
                Reason.TOO_MANY_CALLS,
                f"{self.max_calls} calls at once expected at most, and as many run "
                f"now; retry later",
                limit=self.max_calls,
            )
        if streams_full:
            self._refuse(
                call,
                context,
                "streams",
                Reason.TOO_MANY_STREAMS,
                f"{self.max_receiving} request streams waiting for their messages "
                f"expected at most, and as many wait now; send the call when its "
                f"messages are ready, or retry later",
                limit=self.max_receiving,
            )
        if too_large:
            self._refuse(
                call,
                context,
                "declared",
                Reason.CALL_TOO_LARGE,
                f"request of {declared} bytes declared ({REQUEST_BYTES_HEADER}), "
                f"expected at most {self.max_call_bytes} bytes per call; split the "
                f"batch",
                limit=self.max_call_bytes,
                bytes=declared,
            )
        if one_too_large:
            self._refuse(
                call,
                context,
                "declared",
                Reason.MESSAGE_TOO_LARGE,
                f"request of {declared} bytes declared ({REQUEST_BYTES_HEADER}) is "
                f"too large for one message: expected at most "
                f"{self.max_message_bytes} bytes; send it as a stream",
                limit=self.max_message_bytes,
                bytes=declared,
            )
        if no_room:
            size = (
                f"a one-message request of up to {reserve} bytes (the receive limit: it "
                f"declared none in {REQUEST_BYTES_HEADER})"
                if undeclared
                else f"request of {declared} bytes declared ({REQUEST_BYTES_HEADER})"
            )
            self._refuse(
                call,
                context,
                "bytes",
                Reason.BYTES_IN_FLIGHT,
                f"{size}, expected at most the {left} bytes left of this shard's "
                f"budget of {self.max_inflight_bytes} request bytes in flight; retry "
                f"later",
                limit=self.max_inflight_bytes,
                bytes=reserve,
            )

    def _take_bytes(self, call: _Call, size: int) -> None:
        """Count a message's bytes: those beyond what the call reserved are taken from the
        budget; or raise ResourceExhaustedError (inside the servicer's reading of the
        stream: its rpc wrapper answers the code)."""
        with self._lock:
            received = call.received + size
            extra = max(0, received - call.held)  # beyond the call's declaration
            over_call = received > self.max_call_bytes
            over = over_call or self.inflight_bytes + extra > self.max_inflight_bytes
            if not over:
                call.received = received
                self.inflight_bytes += extra
                call.held += extra
        if over_call:
            raise self._refusal(
                call,
                "bytes",
                Reason.CALL_TOO_LARGE,
                f"request bytes expected at most {self.max_call_bytes} per call, and "
                f"a message of {size} bytes would pass it ({call.received} bytes of "
                f"this call received); split the batch",
                limit=self.max_call_bytes,
                bytes=call.received + size,
            )
        if over:
            raise self._refusal(
                call,
                "bytes",
                Reason.BYTES_IN_FLIGHT,
                f"request bytes in flight expected at most {self.max_inflight_bytes} "
                f"on this shard, and a message of {size} bytes would pass it "
                f"({call.received} bytes of this call received, "
                f"{call.declared or 0} declared); split the batch, or retry "
                f"later",
                limit=self.max_inflight_bytes,
            )

    def _end_receiving(self, call: _Call) -> None:
        with self._lock:
            if call.receiving:
                call.receiving = False
                self.receiving -= 1

    def _settle(self, call: _Call) -> None:
        """A one-message call's message is read: it holds its bytes (or its declaration,
        where that was more) from now on, no longer the receive limit it reserved."""
        with self._lock:
            keep = max(call.received, _declared_bytes(call.declared or "0") or 0)
            if call.held > keep:
                self.inflight_bytes -= call.held - keep
                call.held = keep

    def _release(self, call: _Call) -> None:
        with self._lock:
            self.calls -= 1
            if call.receiving:
                call.receiving = False
                self.receiving -= 1
            self.inflight_bytes -= call.held
            # A failed call that held much: the allocator gets its memory back (by the
            # watchdog: the failure's traceback, which holds the messages, is let go by gRPC
            # only after this returns). Not after a call that succeeded: the next one of its
            # size reuses the memory.
            self._trim = self._trim or (call.failed and call.held >= TRIM_AFTER_BYTES)
            call.held = 0
            self._watched.discard(call)

    # -- the request -----------------------------------------------------------------------

    @staticmethod
    def _next_message(call: _Call, requests: Iterator[Any]) -> Any:
        """The call's next request message, or _END where its stream ended whole; _Expired
        where the call ended first (the watchdog cancelled it, the client broke it, or
        gRPC's receive limit refused the message: gRPC has told the client)."""
        call.waiting_since = time.monotonic()
        try:
            return next(requests)
        except StopIteration:
            if call.expired is not None or not call.context.is_active():
                raise _Expired() from None
            return _END
        except grpc.RpcError:
            raise _Expired() from None
        finally:
            call.waiting_since = None

    def _messages(self, call: _Call, requests: Iterator[Any]) -> Iterator[Any]:
        """The request stream, each message's bytes counted as it arrives; its receiving
        slot given back at its end. A stream the watchdog cancelled (or the client broke)
        raises instead of ending: a partial request is never taken for a whole one."""
        while (message := self._next_message(call, requests)) is not _END:
            self._take_bytes(call, call.size)
            yield message
        self._end_receiving(call)

    def _one_message(self, call: _Call, requests: Iterator[Any]) -> Any:
        """A one-message call's request, read now that the call is admitted (gRPC asks the
        client for it only here), its bytes counted; aborts where they are over a limit or
        none came."""
        message = self._next_message(call, requests)
        if message is _END:
            why = f"{call.method} expected one request message, got none"
            abort(call.context, InvalidArgumentError(f"{self.where}: {why}"))
        try:
            self._take_bytes(call, call.size)
        except ResourceExhaustedError as error:
            abort(call.context, error)
        self._settle(call)
        return message

    # -- the interceptor --------------------------------------------------------------------

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        """Every call admitted before its request is read: a one-message handler becomes a
        request-stream one (the same call on the wire), whose behavior takes the message
        only after admission, so a call refused here has none of its message received
        beyond the one window gRPC buffers (RECEIVE_WINDOW_OPTIONS)."""
        handler = continuation(details)
        if handler is None or details.method.startswith(_HEALTH):
            return handler
        streaming = handler.request_streaming
        declared = (v for k, v in details.invocation_metadata or () if k == REQUEST_BYTES_HEADER)
        call = _Call(details.method, next(declared, None), one_message=not streaming)
        inner = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            call.size = len(data)
            return inner(data) if inner is not None else data

        def request_of(requests: Iterator[Any]) -> Any:
            if streaming:
                return self._messages(call, requests)
            return self._one_message(call, requests)

        def wrap(behavior: Callable[..., Any]) -> Callable[..., Any]:
            if handler.response_streaming:

                def responses(requests: Any, context: Any) -> Iterator[Any]:
                    self._admit(call, context, streaming)  # aborts if refused: nothing taken
                    try:
                        yield from behavior(request_of(requests), context)
                    except _Expired:
                        call.failed = True
                        if streaming:
                            raise
                    except BaseException:
                        call.failed = True
                        raise
                    finally:
                        self._release(call)

                return responses

            def response(requests: Any, context: Any) -> Any:
                self._admit(call, context, streaming)
                try:
                    return behavior(request_of(requests), context)
                except _Expired:
                    call.failed = True
                    if streaming:
                        raise
                    return None  # the call has ended: nothing to answer
                except BaseException:
                    call.failed = True
                    raise
                finally:
                    self._release(call)

            return response

        if streaming:
            return with_behavior(handler, wrap, deserialize)
        return as_request_stream(handler, wrap, deserialize)

    # -- the watchdog -----------------------------------------------------------------------

    def _watch(self) -> None:
        tick = max(0.01, min(self.idle_s, self.total_s, 1.0) / 4)
        while not self._stop.wait(tick):
            now = time.monotonic()
            with self._lock:
                watched = list(self._watched)
                trim, self._trim = self._trim, False
            if trim and _MALLOC_TRIM is not None:
                _MALLOC_TRIM(0)
            for call in watched:
                waiting = call.waiting_since
                if waiting is not None and now - waiting > self.idle_s:
                    self._expire(call, "idle", f"no message for {self.idle_s:g} s")
                elif call.timed and now - call.started > self.total_s:
                    self._expire(call, "total", f"running for more than {self.total_s:g} s")

    def _expire(self, call: _Call, cause: str, why: str) -> None:
        if call.expired is not None:
            return
        call.expired = cause
        self._refused(call.method, "CANCELLED", cause, f"the shard cancelled it: {why}")
        call.context.cancel()
