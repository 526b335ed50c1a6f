"""The one place where errors become gRPC status codes, and where every call is timed and
logged. Servicer methods are wrapped by `rpc`."""

from __future__ import annotations

import functools
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from tierps.server.security import PermissionDeniedError
from tierps.storage.errors import (
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
        if code is grpc.StatusCode.INTERNAL:
            log.error("rpc %s failed", name, exc_info=error, extra={"method": name})
        else:
            log.info("rpc %s refused: %s", name, error, extra={"method": name, "code": code.name})
        context.abort(code, str(error))

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
