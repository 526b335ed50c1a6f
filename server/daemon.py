"""The shard daemon: one Shard behind a gRPC server with health, reflection and metrics.

`create_server(config) -> (server, port)` builds it for in-process use (tests, notebooks);
`serve(config)` runs it until SIGTERM or SIGINT, then shuts down gracefully.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tierps.core.errors import BackendError, DataLossError, InvalidArgumentError
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.server.cluster import PARENT_PID_ENV
from tierps.server.config import ServerConfig, max_call_request_bytes
from tierps.server.limits import (
    HEALTH_WORKERS,
    RECEIVE_WINDOW_OPTIONS,
    CallLimits,
    max_one_message_bytes,
)
from tierps.server.lives import LIFE_HEADER
from tierps.server.metrics import ShardMetrics
from tierps.server.replica import ReadOnlyCheck
from tierps.server.security import (
    AuthCheck,
    TokensFile,
    check_exposure,
    load_tokens,
    server_credentials,
)
from tierps.server.servicers import (
    AdminServicer,
    ChangeServicer,
    EmbeddingServicer,
    add_embedding_service,
)
from tierps.server.shard import Shard
from tierps.server.status import DecodeCheck, refusal
from tierps.storage.warm_up import warm_up

log = logging.getLogger("tierps.server")

OUR_SERVICES = tuple(service.full_name for service in pb.DESCRIPTOR.services_by_name.values())


def host_port(host: str, port: int) -> str:
    """gRPC's "host:port" of a bind or dial address: an IPv6 literal in brackets ("::1" ->
    "[::1]:port"; one given in brackets stays so), names and IPv4 as they are."""
    try:
        bracket = ipaddress.ip_address(host).version == 6
    except ValueError:  # a name, or "[::1]" already
        bracket = False
    return f"[{host}]:{port}" if bracket else f"{host}:{port}"


class LifeCheck(grpc.ServerInterceptor):
    """Refuses, with DATA_LOSS, a data call from a client that last talked to an earlier
    life of this shard which ended without a clean stop (server/lives.py). The check runs
    before the call reaches the servicer; admin calls (Stats tells a client the life) pass."""

    DATA_METHODS = f"/{pb.DESCRIPTOR.services_by_name['EmbeddingService'].full_name}/"

    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or not details.method.startswith(self.DATA_METHODS):
            return handler
        known = next((v for k, v in details.invocation_metadata if k == LIFE_HEADER), None)
        try:
            self.shard.lives.check(known)
        except (DataLossError, InvalidArgumentError) as error:  # nothing was read
            return refusal(handler, error, shard=self.shard.shard_id)
        return handler


class ShardServer:
    """A shard served over gRPC. start() begins serving; stop() stops taking calls, lets
    in-flight ones finish (up to grace_s), flushes dirty rows and closes RocksDB."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        where = f"shard {config.shard_id}"
        # before the data dir is touched: a shard that would be left open does not start
        tokens: TokensFile | dict[str, str] | None = (
            load_tokens(None)
            if config.tokens_file is None  # $TIERPS_TOKENS, or none
            else TokensFile(config.tokens_file, where)  # read again when it changes
        )
        tls = config.tls_cert is not None
        check_exposure(config.host, tls, tokens is not None, config.insecure, where)
        self.shard = Shard(config)
        try:
            self.metrics = ShardMetrics(self.shard)
            self.health = health.HealthServicer(experimental_non_blocking=True)
            max_call_bytes = max_call_request_bytes(config.max_batch_bytes)
            # the largest request message gRPC takes in: what the budget and a call allow
            receive = max_one_message_bytes(
                config.max_message_bytes, max_call_bytes, config.max_inflight_bytes
            )
            self.limits = CallLimits(
                max_calls=config.max_workers,
                max_receiving=config.max_receiving_streams,
                max_inflight_bytes=config.max_inflight_bytes,
                max_call_bytes=max_call_bytes,
                max_message_bytes=receive,
                idle_s=config.stream_idle_s,
                total_s=config.call_total_s,
                where=where,
                refused=self._refused,
            )
            interceptors: list[grpc.ServerInterceptor] = [
                self.limits,
                LifeCheck(self.shard),
                DecodeCheck(),  # last: see its docstring
            ]
            if self.shard.replica is not None:  # a write is refused before it is admitted
                follows = self.shard.replica.follows
                interceptors.insert(0, ReadOnlyCheck(self.shard.where, follows, self._refused))
            if tokens is not None:  # first: an unknown caller is refused before anything
                interceptors.insert(0, AuthCheck(tokens, self._refused, where))
            # so_reuseport off: a port in use is an error, never two servers on one port.
            options = [
                ("grpc.max_receive_message_length", receive),
                ("grpc.max_send_message_length", config.max_message_bytes),
                *RECEIVE_WINDOW_OPTIONS,  # what gRPC buffers ahead of the byte budget
                ("grpc.so_reuseport", 0),
            ]
            # HEALTH_WORKERS threads more than calls may hold: health always finds one
            self._executor = ThreadPoolExecutor(
                config.max_workers + HEALTH_WORKERS, thread_name_prefix="tierps-rpc"
            )
            self._server = grpc.server(self._executor, options=options, interceptors=interceptors)
            add_embedding_service(EmbeddingServicer(self.shard, self._observe), self._server)
            pb_grpc.add_AdminServiceServicer_to_server(
                AdminServicer(self.shard, self._observe), self._server
            )
            pb_grpc.add_ChangeServiceServicer_to_server(
                ChangeServicer(self.shard, self._observe), self._server
            )
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
            reflection.enable_server_reflection(
                (*OUR_SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
            )
            bind = host_port(config.host, config.port)
            try:
                if tls:
                    credentials = server_credentials(
                        config.tls_cert, config.tls_key, config.tls_client_ca
                    )
                    self.port = self._server.add_secure_port(bind, credentials)
                else:
                    self.port = self._server.add_insecure_port(bind)
            except RuntimeError:  # grpc's "Failed to bind"
                self.port = 0
            if self.port == 0:
                raise OSError(
                    f"shard {config.shard_id}: cannot bind {bind} (in use, or not an address "
                    f"of this machine)"
                )
        except BaseException:
            if hasattr(self, "limits"):
                self.limits.close()
            self.shard.close()
            raise
        self.health_port: int | None = None
        self._health_server: grpc.Server | None = None
        if config.health_port is not None:
            self._serve_health_alone(config)
        self._set_serving(False)
        self.shard.health.on_serving_change = self._set_serving
        self.metrics_port: int | None = None
        self._stopped = False

    def _serve_health_alone(self, config: ServerConfig) -> None:
        """Health alone on its own plaintext port and threads: what probes that cannot speak
        TLS (Kubernetes' gRPC probes) check; data calls never hold these threads."""
        self._health_server = grpc.server(
            ThreadPoolExecutor(HEALTH_WORKERS, thread_name_prefix="tierps-health"),
            options=[("grpc.so_reuseport", 0)],
            interceptors=[DecodeCheck()],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        try:
            self.health_port = self._health_server.add_insecure_port(
                host_port(config.host, config.health_port)
            )
        except RuntimeError:
            self.health_port = 0
        if self.health_port == 0:
            self.limits.close()
            self.shard.close()
            raise OSError(
                f"shard {config.shard_id}: cannot bind the health port "
                f"{host_port(config.host, config.health_port)}"
            )

    @property
    def address(self) -> str:
        return host_port(self.config.host, self.port)

    def _observe(self, method: str, code: str, seconds: float) -> None:
        self.metrics.observe(method, code, seconds)

    def _refused(self, method: str, code: str, cause: str, why: str) -> None:
        """The one place a guard's refusal (or cancellation) is counted and logged; `why`
        never holds a token."""
        self.metrics.refusals.labels(method, code, cause).inc()
        log.warning(
            "rpc %s answered %s (%s): %s",
            method,
            code,
            cause,
            why,
            extra={**self._fields(), "method": method, "code": code, "cause": cause},
        )

    def _set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", *OUR_SERVICES):
            self.health.set(service, status)
        log.info("health %s", "SERVING" if serving else "NOT_SERVING", extra=self._fields())

    def _fields(self) -> dict[str, Any]:
        return {"shard_id": self.config.shard_id, "num_shards": self.config.num_shards}

    def start(self) -> ShardServer:
        # compile (or load from numba's cache) the host kernels now, not in the first RPC
        warm_up()
        self._server.start()
        if self._health_server is not None:
            self._health_server.start()
        self.shard.maintenance.start_background()
        if self.shard.replica is not None:
            self.shard.replica.start()
        if self.config.metrics_port is not None:
            host = self.config.metrics_host or self.config.host
            # an IPv6 literal as "::1": Python's HTTP server takes no brackets
            self.metrics_port = self.metrics.serve(host.strip("[]"), self.config.metrics_port)
            self.shard.metrics_port = self.metrics_port  # Stats tells clients (admin top)
        self.shard.health.publish_serving()  # NOT_SERVING still if its store cannot write
        log.info(
            "serving",
            extra={
                **self._fields(),
                "address": self.address,
                "metrics_port": self.metrics_port,
                "health_port": self.health_port,
                "tls": self.config.tls_cert is not None,
                "mutual_tls": self.config.tls_client_ca is not None,
                "data_dir": str(self.config.data_dir),
                "snapshot_dir": (  # JSON null when there is none, not "None"
                    None if self.config.snapshot_dir is None else str(self.config.snapshot_dir)
                ),
                "tables": [c.name for c in self.shard.admin.list_tables()],
            },
        )
        return self

    def stop(self, grace_s: float | None = None) -> None:
        """Idempotent graceful stop."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.grace_s if grace_s is None else grace_s
        log.info("stopping", extra={**self._fields(), "grace_s": grace})
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        if self._health_server is not None:
            self._health_server.stop(0)
        self._executor.shutdown(wait=False)
        self.limits.close()
        try:
            self.shard.close()
        finally:
            self.metrics.stop()
        log.info("stopped", extra=self._fields())

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout)

    def __enter__(self) -> ShardServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def create_server(config: ServerConfig) -> tuple[ShardServer, int]:
    """A shard server bound to config.host:config.port (0: a free port), not yet started;
    returns it and the bound port."""
    server = ShardServer(config)
    return server, server.port


def _exit_with_parent() -> None:
    """Under LocalCluster, die when the launching thread's process goes (Linux prctl)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent already went before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def serve(config: ServerConfig, *, port_file: Path | None = None) -> int:
    """Run a shard until SIGTERM or SIGINT; then stop gracefully and return 0. The bound
    ports are written to port_file (JSON) once serving."""
    stop = on_stop_signal()
    _exit_with_parent()
    server, port = create_server(config)
    server.start()
    if port_file is not None:
        tmp = port_file.with_name(port_file.name + ".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "port": port,
                    "metrics_port": server.metrics_port,
                    "health_port": server.health_port,
                    "pid": os.getpid(),
                }
            )
        )
        os.replace(tmp, port_file)
    metrics_host = config.metrics_host or config.host
    metrics = f", metrics at http://{host_port(metrics_host, server.metrics_port or 0)}/metrics"
    print(
        f"shard {config.shard_id} of {config.num_shards} serving at {server.address}"
        f"{metrics if server.metrics_port is not None else ''}",
        flush=True,
    )  # stdout, for a person; the JSON log on stderr says the same
    while not stop:
        time.sleep(0.2)
    try:
        server.stop()
    except BackendError as error:  # the last flush failed: say what that means, exit 1
        log.error(
            "stopped without a clean flush: %s; the rows updated since the last flush are "
            "not in RocksDB, and the next start reports an unclean stop to the clients",
            error,
            extra={"shard_id": config.shard_id},
        )
        return 1
    return 0


def on_stop_signal() -> list[int]:
    """Make SIGTERM and SIGINT append to the returned list; the caller polls it. The handler
    only appends (taking no lock: a handler that sets a threading.Event can deadlock with
    the main thread inside Event.wait), and after the first signal the others are ignored,
    so a second Ctrl-C or SIGTERM neither interrupts the flush nor kills the process at
    interpreter exit."""
    received: list[int] = []

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return received
