"""Who may talk to a shard: TLS credentials, bearer tokens with roles, and the rule that a
shard reachable off loopback is not left open by accident.

Tokens: `ROLE:TOKEN` entries (whitespace- or newline-separated, `#` starts a comment), read
from ServerConfig.tokens_file or, without one, from the TIERPS_TOKENS environment variable;
never from the command line (a process list shows it). A call carries its token as
`authorization: Bearer TOKEN` metadata. AuthCheck (a server interceptor) answers
UNAUTHENTICATED to a call without a known token and PERMISSION_DENIED to a role that may not
make the call; health stays open for probes.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from tierps.core.errors import PermissionDeniedError, TierpsError, UnauthenticatedError
from tierps.proto import tierps_service_pb2 as pb
from tierps.server.handlers import with_behavior
from tierps.server.status import abort, refusal, status_of

log = logging.getLogger("tierps.server")

TOKENS_ENV = "TIERPS_TOKENS"
AUTH_HEADER = "authorization"
BEARER = "Bearer "
MIN_TOKEN_CHARS = 16
HEALTH_SERVICE = "/grpc.health.v1.Health/"
_DATA = f"/{pb.DESCRIPTOR.services_by_name['EmbeddingService'].full_name}/"
_ADMIN = f"/{pb.DESCRIPTOR.services_by_name['AdminService'].full_name}/"
_CHANGES = f"/{pb.DESCRIPTOR.services_by_name['ChangeService'].full_name}/"
LOOKUPS = frozenset({_DATA + "Lookup", _DATA + "LookupUnary"})
STATS = _ADMIN + "Stats"
# The rpcs of each role but admin (which may make every call, reflection included).
# Stats is every role's: EmbeddingClient learns each shard's life and data id from it when it
# connects, which is how a client is told that a shard lost acknowledged updates. A reader
# may make lookups with create=false only, ListTables (the client reads each table's dim from
# it) and Stats, of which it is answered READER_STATS only.
ROLE_METHODS: dict[str, frozenset[str]] = {
    "trainer": frozenset(
        {*LOOKUPS, _DATA + "PushGradients", _DATA + "PushGradientsUnary", _DATA + "Assign"}
        | {_DATA + "PushThenLookup"}  # a push and a lookup: a trainer's rights, not a reader's
        | {_ADMIN + m for m in ("ListTables", "DescribeTable", "Stats")}
    ),
    "reader": frozenset({*LOOKUPS, _ADMIN + "ListTables", STATS}),
    # a replica following a training shard: its changed rows (weights only) and where it is
    "replica": frozenset({_CHANGES + "Follow", _ADMIN + "ListTables", STATS}),
}
# The Stats fields a reader is answered: which shard it is and the life a client sends back.
# Not the tables' rows, bytes and hit rates, memory, flush times or the metrics port: a
# serving fleet's token is the most widely handed out, and serving needs none of them.
READER_STATS = ("shard_id", "num_shards", "life", "data_id")
ROLES = ("admin", *ROLE_METHODS)


# -- TLS ----------------------------------------------------------------------------------------


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise OSError(f"{what} {path}: cannot read it: {error.strerror or error}") from None


def server_credentials(
    cert: Path, key: Path, client_ca: Path | None = None
) -> grpc.ServerCredentials:
    """TLS for a shard's port from PEM files; with client_ca, mutual TLS: a client must
    show a certificate signed by it."""
    return grpc.ssl_server_credentials(
        [(_read(key, "TLS key"), _read(cert, "TLS certificate"))],
        root_certificates=None if client_ca is None else _read(client_ca, "TLS client CA"),
        require_client_auth=client_ca is not None,
    )


# -- tokens -------------------------------------------------------------------------------------


def parse_tokens(text: str, source: str) -> dict[str, str]:
    """{token: role} of `ROLE:TOKEN` entries; a bad entry is refused naming its source and
    position, never its token."""
    tokens: dict[str, str] = {}
    words = (w for line in text.splitlines() for w in line.split("#", 1)[0].split())
    for index, entry in enumerate(words):
        role, _, token = entry.partition(":")
        if role not in ROLES or len(token) < MIN_TOKEN_CHARS:
            raise ValueError(
                f"{source}: entry {index} expected ROLE:TOKEN with ROLE one of {ROLES} and a "
                f"token of at least {MIN_TOKEN_CHARS} characters, got role {role!r} and "
                f"{len(token)} characters"
            )
        if token in tokens:
            raise ValueError(f"{source}: entry {index} repeats an earlier entry's token")
        tokens[token] = role
    if not tokens:
        raise ValueError(f"{source}: expected at least one ROLE:TOKEN entry, got none")
    return tokens


def load_tokens(tokens_file: Path | None) -> dict[str, str] | None:
    """{token: role} from tokens_file, else from $TIERPS_TOKENS; None where neither is set
    (no authentication). (A shard keeps reading a tokens file as it changes: TokensFile.)"""
    if tokens_file is not None:
        text = _read(tokens_file, "tokens file").decode()
        return parse_tokens(text, f"tokens file {tokens_file}")
    text = os.environ.get(TOKENS_ENV)
    return None if text is None else parse_tokens(text, f"${TOKENS_ENV}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def check_exposure(host: str, tls: bool, tokens: bool, insecure: bool, where: str) -> None:
    """Refuse (ValueError) to serve off loopback without TLS and tokens unless `insecure`;
    with it, warn."""
    if is_loopback(host) or (tls and tokens):
        return
    missing = " and ".join(m for m, have in (("TLS", tls), ("tokens", tokens)) if not have)
    if not insecure:
        raise ValueError(
            f"{where}: --host {host} is reachable off this machine but has no {missing}; "
            f"give --tls-cert/--tls-key and a tokens file (or ${TOKENS_ENV}), or --insecure "
            f"to serve so on a network you trust"
        )
    log.warning(
        "%s: serving on %s without %s (--insecure): anyone who reaches the port may read, "
        "write and drop every table",
        where,
        host,
        missing,
    )


# -- the interceptor ----------------------------------------------------------------------------


RELOAD_CHECK_S = 1.0  # how often a tokens file is looked at for changes


class TokensFile:
    """The tokens of a file, read again when it changes (its mtime, size or inode: a
    Kubernetes Secret volume swaps a link), looked at most every RELOAD_CHECK_S: a token is
    rotated without a restart. A changed file that does not parse keeps the tokens in force,
    and says why in the log."""

    def __init__(self, path: Path, where: str) -> None:
        self.path = Path(path)
        self.where = where
        self._stamp = self._stat()
        self.tokens = load_tokens(self.path) or {}
        self._next_check = time.monotonic() + RELOAD_CHECK_S
        self._lock = threading.Lock()

    def _stat(self) -> tuple[int, int, int]:
        info = os.stat(self.path)
        return info.st_mtime_ns, info.st_size, info.st_ino

    def current(self) -> dict[str, str]:
        now = time.monotonic()
        if now < self._next_check or not self._lock.acquire(blocking=False):
            return self.tokens
        try:
            self._next_check = now + RELOAD_CHECK_S
            stamp = self._stat()
            if stamp != self._stamp:
                self._stamp = stamp
                self.tokens = load_tokens(self.path) or {}
                log.warning(
                    "%s: tokens file %s changed: %d tokens now (%s)",
                    self.where,
                    self.path,
                    len(self.tokens),
                    ", ".join(f"{r}: {list(self.tokens.values()).count(r)}" for r in ROLES),
                )
        except (OSError, ValueError) as error:
            log.error(
                "%s: tokens file %s changed but cannot be used, the tokens in force stay: %s",
                self.where,
                self.path,
                error,
            )
        finally:
            self._lock.release()
        return self.tokens


class AuthCheck(grpc.ServerInterceptor):
    """Checks each call's bearer token and role before the call runs. `refused(method, code,
    cause, why)` is told of each refusal (cause "token" or "role"); `why` never holds the
    token."""

    def __init__(
        self,
        tokens: dict[str, str] | TokensFile,
        refused: Callable[[str, str, str, str], None],
        where: str,
    ) -> None:
        self._source = tokens
        self._known: dict[str, str] = {}
        self._tokens: list[tuple[bytes, str]] = []
        self._refused = refused
        self.where = where

    def _current(self) -> list[tuple[bytes, str]]:
        tokens = self._source.current() if isinstance(self._source, TokensFile) else self._source
        if tokens is not self._known:  # encoded once per version of the tokens
            self._known = tokens
            self._tokens = [(token.encode(), role) for token, role in tokens.items()]
        return self._tokens

    def role_of(self, metadata: Any) -> str | None:
        """The role of the call's token; every known token is compared, in constant time."""
        given = next((v for k, v in metadata or () if k == AUTH_HEADER), "")
        if isinstance(given, bytes):
            given = given.decode("latin-1")
        presented = (given[len(BEARER) :] if given.startswith(BEARER) else "").encode()
        role = None
        for token, token_role in self._current():
            if hmac.compare_digest(token, presented):
                role = token_role
        return role

    def _refuse(
        self, handler: Any, method: str, kind: type[TierpsError], why: str, **facts: str
    ) -> Any:
        """A handler refusing the call with a `kind` error saying `why`, counted and
        logged."""
        error = kind(f"{self.where}: {why}", method=method, **facts)
        cause = "token" if kind is UnauthenticatedError else "role"
        self._refused(method, status_of(error).name, cause, why)
        return refusal(handler, error)

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        method = details.method
        if handler is None or method.startswith(HEALTH_SERVICE):
            return handler
        role = self.role_of(details.invocation_metadata)
        if role is None:
            return self._refuse(
                handler,
                method,
                UnauthenticatedError,
                f"{method} expected metadata '{AUTH_HEADER}: {BEARER}TOKEN' with a token this "
                f"shard knows, got none or an unknown one",
            )
        if role == "admin":
            return handler
        if method not in ROLE_METHODS[role]:
            return self._refuse(
                handler,
                method,
                PermissionDeniedError,
                f"role {role!r} may not call {method} (it may call "
                f"{', '.join(sorted(m.rsplit('/', 1)[1] for m in ROLE_METHODS[role]))})",
                role=role,
            )
        if role == "reader" and method in LOOKUPS:
            return self._reader_lookup(handler, method)
        if role == "reader" and method == STATS:
            return with_behavior(handler, _reader_stats)
        return handler

    def _reader_lookup(self, handler: Any, method: str) -> Any:
        """The lookup, refused where it creates (refusing_create)."""

        def refuse(index: int) -> PermissionDeniedError:
            why = (
                f"role 'reader' may look up with create=false only; message {index} of "
                f"{method} has create=true"
            )
            error = PermissionDeniedError(
                f"{self.where}: {why}", role="reader", method=method, field="create"
            )
            self._refused(method, status_of(error).name, "role", why)
            return error

        return refusing_create(handler, method, refuse)


def refusing_create(
    handler: Any, method: str, refuse: Callable[[int], TierpsError]
) -> grpc.RpcMethodHandler:
    """A lookup's handler whose create flags are checked as the message(s) are read (the
    fields the servicer decodes anyway: no second parse): a batch or message with
    create=true ends the call with refuse(its index) before the shard is asked anything.
    The handler may take LookupUnary's one message as a stream of one (CallLimits reads it
    so, after admission). The one reading of a lookup's create flags: a reader's token
    (AuthCheck) and a read-only replica (server/replica.py) both refuse through it."""
    one_message = method == _DATA + "LookupUnary"

    def creating(message: Any) -> int | None:
        """The index of a batch (of a one-message call) or message that creates."""
        if not one_message:
            return 0 if message.create else None
        try:
            batches = message.batches
        except ValueError:  # undecodable: the servicer says what is wrong
            return None
        return next((i for i, b in enumerate(batches) if b.create), None)

    if handler.request_streaming:

        def checked(requests: Iterator[Any], context: Any) -> Iterator[Any]:
            for index, message in enumerate(requests):
                created = creating(message)
                if created is not None and one_message:  # read before the servicer runs
                    abort(context, refuse(created))
                if created is not None:  # read by the servicer: its wrapper answers
                    raise refuse(index)
                yield message

        return with_behavior(
            handler,
            lambda behavior: lambda requests, ctx: behavior(checked(requests, ctx), ctx),
        )

    def unary(behavior: Any) -> Any:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            index = creating(request)
            if index is not None:
                abort(context, refuse(index))
            return behavior(request, context)

        return run

    return with_behavior(handler, unary)


def _reader_stats(behavior: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Stats as a reader is answered: the READER_STATS fields of the shard's answer."""

    def run(request: Any, context: grpc.ServicerContext) -> Any:
        full = behavior(request, context)
        return pb.StatsResponse(**{field: getattr(full, field) for field in READER_STATS})

    return run
