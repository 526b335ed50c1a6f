"""The one place where errors become gRPC status codes, and where every call is timed and
logged. Servicer methods are wrapped by `rpc`; a request that does not decode is refused by
DecodeCheck; what a refusal says is kept to what a client can receive (`details`)."""

from __future__ import annotations

import functools
import inspect
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from tierps.core.errors import (
    QUOTED_CHARS,
    BackendError,
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    StorageFullError,
    TableReplacedError,
    UnavailableError,
)
from tierps.server.handlers import with_behavior
from tierps.server.security import PermissionDeniedError

log = logging.getLogger("tierps.server")

# Checked in order; the first class the error is an instance of gives the code.
STATUS_OF: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),  # a reader's create=true
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StorageFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),  # a full disk: retrying won't help
    (DataLossError, grpc.StatusCode.DATA_LOSS),  # before BackendError: both are backend errors
    (BackendError, grpc.StatusCode.UNAVAILABLE),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),  # a table being replaced: retry
    (TableReplacedError, grpc.StatusCode.ABORTED),  # rows replaced under the caller
    # out of host or GPU memory (cupy's OutOfMemoryError is a MemoryError): the call changed
    # nothing (a tier allocates before it lets go of anything); smaller batches may pass
    (MemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def status_of(error: BaseException) -> grpc.StatusCode:
    for kind, code in STATUS_OF:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


# A status message travels in the grpc-message trailer, percent-encoded (every byte but
# printable ASCII takes 3); a client refuses trailers over 8 KiB (some, at random) or 16 KiB
# (all), and then sees RESOURCE_EXHAUSTED "received metadata size exceeds" instead of the
# error. Details are cut to this many bytes on the wire, leaving room for other trailers.
MAX_DETAILS_WIRE_BYTES = 4096
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
    return f"{message[:head]} …[{cut} chars cut]… {message[len(message) - tail:]}"


Observe = Callable[[str, str, float], None]  # (method, code, seconds)
F = TypeVar("F", bound=Callable[..., Any])


def rpc(method: F) -> F:
    """Wrap a servicer method (unary or streaming response): map errors to status codes,
    log failures, and report (method, code, seconds) to the servicer's `observe`."""
    name = method.__name__

    def ended(servicer: Any, started: float) -> None:
        # The request stream broke: the client cancelled, its deadline passed, or a message
        # was over max_message_bytes. gRPC has already told the client why; nothing to send.
        servicer.observe(name, grpc.StatusCode.CANCELLED.name, time.perf_counter() - started)
        log.info(
            "rpc %s ended by the transport (client cancel, deadline, or a message over the "
            "size limit)", name, extra={"method": name, "code": "CANCELLED"},
        )  # fmt: skip

    def finish(servicer: Any, context: grpc.ServicerContext, started: float, error: Any) -> None:
        if error is not None and not context.is_active():
            ended(servicer, started)  # the transport ended the call first
            return
        code = grpc.StatusCode.OK if error is None else status_of(error)
        servicer.observe(name, code.name, time.perf_counter() - started)
        if error is None:
            return
        message = details(str(error))
        if code is grpc.StatusCode.INTERNAL:
            log.error("rpc %s failed", name, exc_info=error, extra={"method": name})
        else:
            log.info("rpc %s refused: %s", name, message, extra={"method": name, "code": code.name})
        context.abort(code, message)

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

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


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
                    f"{method}: request message {received} ({len(data)} bytes) expected a "
                    f"{expected} in protobuf's encoding, with every string field valid "
                    f"UTF-8, got bytes that do not decode as one ({error})"
                )

        def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            for request in requests:
                if isinstance(request, _Undecodable):
                    # the code and details hold for a servicer outside `rpc` (reflection) too
                    context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                    context.set_details(details(request.why))
                    raise InvalidArgumentError(request.why)
                yield request

        def wrap(behavior: Callable[..., Any]) -> Callable[..., Any]:
            if handler.request_streaming:
                return lambda requests, context: behavior(checked(requests, context), context)

            def one(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, details(request.why))
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
