"""The one place where errors become gRPC statuses, and where every call is timed and
logged. An error's reason (tierps.core.errors.Reason) gives its status code (CODE_OF); the
status carries the reason as a google.rpc.ErrorInfo (domain "tierps", the error's facts as
its metadata) in grpc-status-details-bin, which clients decide on. Every refusal goes out
through `abort` (or `refusal`, for an interceptor): servicer methods wrapped by `rpc`,
CallLimits, AuthCheck, LifeCheck, DecodeCheck. What a refusal says is kept to what a client
can receive (`details`)."""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from tierps.core.errors import (
    DOMAIN,
    QUOTED_CHARS,
    InvalidArgumentError,
    Reason,
    TierpsError,
)
from tierps.server.handlers import as_request_stream, with_behavior

log = logging.getLogger("tierps.server")

# The status code of each reason: what a client may do (retry only UNAVAILABLE).
CODE_OF: dict[Reason, grpc.StatusCode] = {
    Reason.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.UNDECODABLE_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.NOT_OWNER: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.TABLE_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Reason.SNAPSHOT_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Reason.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.TABLE_REPLACED: grpc.StatusCode.ABORTED,  # rows replaced under the caller
    Reason.TABLE_LOADING: grpc.StatusCode.UNAVAILABLE,  # a table being replaced: retry
    Reason.READ_ONLY: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.SNAPSHOT_NEEDED: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.MESSAGE_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.CALL_TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.BYTES_IN_FLIGHT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.TOO_MANY_CALLS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.TOO_MANY_STREAMS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.OUT_OF_MEMORY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.STORAGE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,  # retrying won't help
    Reason.BACKEND_FAILED: grpc.StatusCode.UNAVAILABLE,
    Reason.DATA_CORRUPT: grpc.StatusCode.DATA_LOSS,
    Reason.SHARD_RESTARTED: grpc.StatusCode.DATA_LOSS,
    Reason.DATA_DIR_CHANGED: grpc.StatusCode.DATA_LOSS,
    Reason.UNKNOWN_TOKEN: grpc.StatusCode.UNAUTHENTICATED,
    Reason.ROLE_NOT_ALLOWED: grpc.StatusCode.PERMISSION_DENIED,
    Reason.INTERNAL: grpc.StatusCode.INTERNAL,
}


def reason_of(error: BaseException) -> Reason:
    """The reason an error carries; out of host or GPU memory (cupy's OutOfMemoryError is a
    MemoryError too: the call changed nothing, a tier allocates before it lets go of
    anything) is OUT_OF_MEMORY; any other error is INTERNAL."""
    if isinstance(error, TierpsError):
        return error.reason
    if isinstance(error, MemoryError):
        return Reason.OUT_OF_MEMORY
    return Reason.INTERNAL


def status_of(error: BaseException) -> grpc.StatusCode:
    return CODE_OF[reason_of(error)]


# A status message travels twice: in the grpc-message trailer, percent-encoded (every byte
# but printable ASCII takes 3), and in grpc-status-details-bin, as UTF-8 inside the status
# proto, base64'd (4/3). A client refuses trailers over 8 KiB (some, at random) or 16 KiB
# (all), and then sees RESOURCE_EXHAUSTED "received metadata size exceeds" instead of the
# error. Details are cut to this many bytes in grpc-message: at most 2.33 times that (ASCII)
# for both, about 6 KiB, leaving room for the ErrorInfo and other trailers.
MAX_DETAILS_WIRE_BYTES = 2560
# In a message over that, a quoted run this long without whitespace is a caller's string
# echoed (a table name has at most QUOTED_CHARS characters): shown as its first QUOTED_CHARS
# and its length. (No whitespace: the text between two unrelated quotes has some.)
_RUN = 2 * QUOTED_CHARS
_LONG_QUOTED = re.compile(rf"'([^'\s]{{{_RUN},}})'|\"([^\"\s]{{{_RUN},}})\"")
# Bytes grpc-message carries as they are: printable ASCII but '%'.
_VERBATIM = bytes(b for b in range(0x20, 0x7F) if b != ord("%"))


def _wire_bytes(text: str) -> int:
    raw = text.encode("utf-8", "backslashreplace")
    return len(raw) + 2 * len(raw.translate(None, _VERBATIM))


def _fitting(chars: Iterator[str], budget: int) -> int:
    """How many of `chars` fit `budget` wire bytes."""
    count = 0
    for char in chars:
        budget -= _wire_bytes(char)
        if budget < 0:
            break
        count += 1
    return count


def _short_quote(match: re.Match[str]) -> str:
    quote = "'" if match.group(1) is not None else '"'
    inner = match.group(1) if match.group(1) is not None else match.group(2)
    return f"{quote}{inner[:QUOTED_CHARS]}…{quote} ({len(inner)} chars)"


def details(message: str) -> str:
    """`message` as a status can carry it: as it is if it fits MAX_DETAILS_WIRE_BYTES; else
    with long quoted words (a caller's 1 MiB table name) shortened, then, if still over,
    its middle cut (the start says what failed, the end often what was expected)."""
    if _wire_bytes(message) <= MAX_DETAILS_WIRE_BYTES:
        return message
    message = _LONG_QUOTED.sub(_short_quote, message)
    if _wire_bytes(message) <= MAX_DETAILS_WIRE_BYTES:
        return message
    budget = MAX_DETAILS_WIRE_BYTES - 48  # the marker
    head = _fitting(iter(message), budget * 3 // 4)
    tail = _fitting(reversed(message), budget - _wire_bytes(message[:head]))
    tail = min(tail, len(message) - head)
    cut = len(message) - head - tail
    return f"{message[:head]} …[{cut} chars cut]… {message[len(message) - tail :]}"


# Of a fact longer than this (a caller's 1 MiB table name) the status says nothing: the
# message quotes it shortened, and a shortened fact would be a wrong one.
MAX_FACT_CHARS = 4 * QUOTED_CHARS


def _utf8(text: str) -> str:
    """`text` as valid UTF-8 (a path's undecodable bytes, held as lone surrogates, written
    as escapes): what a protobuf string and grpc-message take."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class _Status(
    collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status
):
    """A status to end a call with (grpc.Status is an interface without a constructor)."""


def status_for(error: BaseException, trailers: Any = None, **facts: str | int) -> grpc.Status:
    """The status a call failing with `error` ends with: its reason's code, its message
    (`details`), and a google.rpc.Status holding an ErrorInfo (reason, DOMAIN, `facts` and
    the error's own as metadata) in grpc-status-details-bin, after `trailers` (those the
    call has set already, such as wire.APPLIED_TABLES_HEADER: abort_with_status sends the
    status' trailers instead of them)."""
    reason = reason_of(error)
    code = CODE_OF[reason]
    given = {name: str(value) for name, value in facts.items()} | getattr(error, "facts", {})
    known = {name: _utf8(value) for name, value in given.items() if len(value) <= MAX_FACT_CHARS}
    info = error_details_pb2.ErrorInfo(reason=reason.value, domain=DOMAIN, metadata=known)
    rich = status_pb2.Status(code=code.value[0], message=_utf8(details(str(error))))
    rich.details.add().Pack(info)
    made = rpc_status.to_status(rich)
    ours = {key for key, _ in made.trailing_metadata}
    kept = tuple((key, value) for key, value in trailers or () if key not in ours)
    return _Status(made.code, made.details, kept + tuple(made.trailing_metadata))


def abort(context: grpc.ServicerContext, error: BaseException, **facts: str | int) -> NoReturn:
    """End the call with `error`'s status (status_for), keeping the trailers it has set."""
    context.abort_with_status(status_for(error, context.trailing_metadata(), **facts))
    raise AssertionError("abort_with_status returned")  # it raises; this tells type checkers


def refusal(handler: grpc.RpcMethodHandler, error: TierpsError, **facts: str | int) -> Any:
    """A handler that answers `error`'s status (with `facts`) and reads nothing of the request, a
    one-message call's included: it takes the request as a stream it never reads, so gRPC
    never asks for the message and its flow control lets no more than one window of it in
    (a one-message handler would have the whole message received before it runs)."""

    def refuse(requests: Any, context: grpc.ServicerContext) -> Any:
        abort(context, error, **facts)

    return as_request_stream(handler, lambda behavior: refuse)


Observe = Callable[[str, str, float], None]  # (method, code, seconds)
F = TypeVar("F", bound=Callable[..., Any])


def rpc(method: F) -> F:
    """Wrap a servicer method (unary or streaming response) of a servicer with `observe` and
    `shard`: end a failed call with its error's status (naming the shard), log failures,
    and report (method, code, seconds) to `observe`."""
    name = method.__name__

    def ended(servicer: Any, started: float) -> None:
        # The request stream broke: the client cancelled, its deadline passed, or a message
        # was over max_message_bytes. gRPC has already told the client why; nothing to send.
        servicer.observe(name, grpc.StatusCode.CANCELLED.name, time.perf_counter() - started)
        log.info(
            "rpc %s ended by the transport (client cancel, deadline, or a message over the "
            "size limit)",
            name,
            extra={"method": name, "code": "CANCELLED"},
        )

    def finish(servicer: Any, context: grpc.ServicerContext, started: float, error: Any) -> None:
        if error is not None and not context.is_active():
            ended(servicer, started)  # the transport ended the call first
            return
        code = grpc.StatusCode.OK if error is None else status_of(error)
        servicer.observe(name, code.name, time.perf_counter() - started)
        if error is None:
            return
        status = status_for(error, context.trailing_metadata(), shard=servicer.shard.shard_id)
        if code is grpc.StatusCode.INTERNAL:
            log.error("rpc %s failed", name, exc_info=error, extra={"method": name})
        else:
            log.info(
                "rpc %s refused: %s",
                name,
                status.details,
                extra={"method": name, "code": code.name},
            )
        context.abort_with_status(status)

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def streaming(servicer: Any, request: Any, context: grpc.ServicerContext) -> Iterator:
            started = time.perf_counter()
            try:
                yield from method(servicer, request, context)
            except grpc.RpcError:
                ended(servicer, started)
            except Exception as error:  # noqa: BLE001 - every error becomes a status
                finish(servicer, context, started, error)
            else:
                finish(servicer, context, started, None)

        return streaming  # type: ignore[return-value]

    @functools.wraps(method)
    def unary(servicer: Any, request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        try:
            response = method(servicer, request, context)
        except grpc.RpcError:
            ended(servicer, started)
            return None
        except Exception as error:  # noqa: BLE001 - every error becomes a status
            finish(servicer, context, started, error)  # aborts, unless the call has ended
            return None
        finish(servicer, context, started, None)
        return response

    return unary  # type: ignore[return-value]


class _Undecodable:
    """What DecodeCheck's deserializer returns for bytes that are not the request message."""

    __slots__ = ("error",)

    def __init__(self, error: InvalidArgumentError) -> None:
        self.error = error


class DecodeCheck(grpc.ServerInterceptor):
    """A request message that does not decode (not protobuf, a string field not UTF-8) is
    the caller's error: INVALID_ARGUMENT naming the method and the message type, for every
    rpc of the server (gRPC itself answers INTERNAL "Exception deserializing request!").
    Install it last: authentication and limits see the call before its messages are judged.
    A stream is refused at its bad message; the servicer sees no message after it."""

    def intercept_service(self, continuation: Any, call: Any) -> Any:
        handler = continuation(call)
        if handler is None or handler.request_deserializer is None:
            return handler
        method, inner = call.method, handler.request_deserializer
        kind = getattr(getattr(inner, "__self__", None), "DESCRIPTOR", None)
        expected = kind.full_name if kind is not None else "request message"
        received = 0

        def deserialize(data: bytes) -> Any:
            nonlocal received
            received += 1
            try:
                return inner(data)
            except DecodeError as error:
                return _Undecodable(
                    InvalidArgumentError(
                        f"{method}: request message {received} ({len(data)} bytes) expected a "
                        f"{expected} in protobuf's encoding, with every string field valid "
                        f"UTF-8, got bytes that do not decode as one ({error})",
                        reason=Reason.UNDECODABLE_REQUEST,
                        method=method,
                        message=received,
                    )
                )

        def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            for request in requests:
                if isinstance(request, _Undecodable):
                    # the status holds for a servicer outside `rpc` (reflection) too, which
                    # ends the call with the code, details and trailers set here
                    status = status_for(request.error, context.trailing_metadata())
                    context.set_code(status.code)
                    context.set_details(status.details)
                    context.set_trailing_metadata(status.trailing_metadata)
                    raise request.error
                yield request

        def wrap(behavior: Callable[..., Any]) -> Callable[..., Any]:
            if handler.request_streaming:
                return lambda requests, context: behavior(checked(requests, context), context)

            def one(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    abort(context, request.error)
                return behavior(request, context)

            return one

        return with_behavior(handler, wrap, deserialize)


_DONE = object()


def run_to_completion(work: Iterator[Any], *, name: str) -> Iterator[Any]:
    """Drive `work` (a generator of progress) in its own thread, and yield its progress:
    long admin work (a snapshot) finishes even if the caller goes away. Progress items may
    be skipped when the caller reads slower than they come; the last one never is. An error
    in `work` is raised here."""
    updates: queue.Queue[Any] = queue.Queue()
    outcome: dict[str, Any] = {}

    def drive() -> None:
        last = None
        try:
            for last in work:
                updates.put(last)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome["error"] = error
        outcome["last"] = last
        updates.put(_DONE)

    threading.Thread(target=drive, name=f"tierps-{name}", daemon=True).start()
    finished = False
    while not finished:
        newest = None
        item = updates.get()
        while True:
            if item is _DONE:
                finished = True
            else:
                newest = item
            if finished or updates.empty():
                break
            item = updates.get_nowait()  # skip to the newest
        if newest is not None:
            yield newest
    if "error" in outcome:
        raise outcome["error"]
