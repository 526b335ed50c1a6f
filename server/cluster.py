"""LocalCluster: N shard daemons as subprocesses of this one, on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import grpc

from tierps.client.security import ChannelSecurity

PARENT_PID_ENV = "TIERPS_PARENT_PID"  # set by LocalCluster: the daemon exits with its parent

# `tierps serve` flags a LocalCluster passes on to every shard: (flag, attribute of args)
SERVER_SECURITY_FLAGS = (
    ("--tls-cert", "tls_cert"),
    ("--tls-key", "tls_key"),
    ("--tls-client-ca", "tls_client_ca"),
    ("--tokens-file", "tokens_file"),
)


def add_server_security_arguments(parser: Any) -> None:
    """The shards' TLS and tokens flags of a command that runs a LocalCluster: paths,
    passed on to each `tierps serve`."""
    group = parser.add_argument_group("TLS and tokens (the shards' side)")
    group.add_argument("--tls-cert", type=Path, help="each shard's PEM certificate")
    group.add_argument("--tls-key", type=Path, help="each shard's PEM key")
    group.add_argument("--tls-client-ca", type=Path, help="mutual TLS: the clients' PEM CA")
    group.add_argument("--tokens-file", type=Path, help="ROLE:TOKEN entries, one per line")


def server_security_args(args: Any) -> tuple[str, ...]:
    """The `tierps serve` flags of add_server_security_arguments' values."""
    flags: tuple[str, ...] = ()
    for flag, name in SERVER_SECURITY_FLAGS:
        if getattr(args, name) is not None:
            flags += (flag, str(Path(getattr(args, name)).resolve()))
    return flags


def wait_until_serving(
    address: str, timeout_s: float, security: ChannelSecurity | None = None
) -> None:
    """Block until the gRPC health service at address says SERVING; TimeoutError if not
    within timeout_s. `security`: the CA (and client certificate) of a TLS shard."""
    # The server extra's, imported here rather than at the top: the `tierps` command's
    # parser adds this module's flags, and must build on a trainer's install without it.
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with (security or ChannelSecurity()).channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as error:
                last = f"{error.code().name}: {error.details()}"
            time.sleep(0.05)
    raise TimeoutError(f"shard at {address} not SERVING after {timeout_s:.0f} s (last: {last})")


class ShardStartError(RuntimeError):
    """A shard's daemon exited while starting; the message quotes its log of this start."""


def _ports_of(port_file: Path, pid: int) -> dict[str, Any] | None:
    """The ports a shard daemon with this pid wrote to port_file (JSON), or None while the
    file is missing or was written by another process (an earlier or another daemon)."""
    try:
        ports = json.loads(port_file.read_text())
    except (OSError, ValueError):
        return None
    return ports if ports.get("pid") == pid else None


def _running_daemon(port_file: Path) -> dict[str, Any] | None:
    """The ports of the shard daemon that wrote port_file if that process still runs a
    `tierps ... serve` (not a pid reused since), else None."""
    try:
        ports = json.loads(port_file.read_text())
        cmdline = Path(f"/proc/{int(ports['pid'])}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return ports if b"serve" in cmdline and any(b"tierps" in a for a in cmdline) else None


class LocalCluster:
    """N shards, each a `tierps serve` subprocess with its data under data_dir/shard-<i>
    and its JSON logs in data_dir/shard-<i>.log, sharing snapshot_dir.

        with LocalCluster(num_shards=2, data_dir=d, snapshot_dir=s) as cluster:
            cluster.addresses  # ["127.0.0.1:41234", "127.0.0.1:41235"]

    extra_args go to each `tierps serve` (TLS and tokens flags among them:
    server_security_args); `security` is what this process needs to check their health.
    base_port None binds free ports; otherwise shard i binds base_port + i. The daemons exit
    with the thread that started them (Linux), so none outlives a crashed parent.
    own_session: the daemons run in sessions of their own, so a terminal's Ctrl-C reaches
    only this process, which stops them when it chooses (after what still uses them).
    follow: the addresses of a training cluster's shards: these N shards are then read-only
    replicas following it (`tierps serve --follow`, server/replica.py), N being the replica
    cluster's own count; replica_dtype their weights' type in RocksDB (None: float32).

        with LocalCluster(2, d / "training") as training, LocalCluster(
            3, d / "replicas", follow=training.addresses
        ) as replicas:
            EmbeddingClient(replicas.addresses).lookup("items", keys, create=False)
    """

    def __init__(
        self,
        num_shards: int,
        data_dir: str | os.PathLike[str],
        snapshot_dir: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        base_port: int | None = None,
        metrics: bool = False,
        start_timeout_s: float = 60.0,
        stop_timeout_s: float = 30.0,
        extra_args: tuple[str, ...] = (),
        security: ChannelSecurity | None = None,
        own_session: bool = False,
        follow: Sequence[str] = (),
        replica_dtype: str | None = None,
    ) -> None:
        if not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"LocalCluster: num_shards expected an int >= 1, got {num_shards!r}")
        self.num_shards = num_shards
        self.data_dir = Path(data_dir)
        self.snapshot_dir = Path(snapshot_dir) if snapshot_dir is not None else None
        self.host = host
        self.base_port = base_port
        self.metrics = metrics
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.extra_args = extra_args
        self.security = security  # how this process checks the shards' health (TLS)
        self.own_session = own_session
        self.follow = tuple(follow)
        self.replica_dtype = replica_dtype
        if replica_dtype is not None and not self.follow:
            raise ValueError("LocalCluster: replica_dtype needs follow (a replica cluster's)")
        self.addresses: list[str] = []
        self.metrics_ports: list[int | None] = []
        self._processes: list[subprocess.Popen[bytes] | None] = [None] * num_shards
        self._logs: list[IO[bytes] | None] = [None] * num_shards
        self._log_starts = [0] * num_shards
        self._deadlines = [0.0] * num_shards  # monotonic: by when each launch must serve

    def _paths(self, shard_id: int) -> tuple[Path, Path, Path]:
        stem = self.data_dir / f"shard-{shard_id}"
        return stem, stem.with_suffix(".port"), stem.with_suffix(".log")

    def _command(self, shard_id: int) -> list[str]:
        data, port_file, _ = self._paths(shard_id)
        port = 0 if self.base_port is None else self.base_port + shard_id
        command = [
            sys.executable,
            "-m",
            "tierps.server.cli",
            "serve",
            "--shard-id",
            str(shard_id),
            "--num-shards",
            str(self.num_shards),
            "--host",
            self.host,
            "--port",
            str(port),
            "--data-dir",
            str(data),
            "--port-file",
            str(port_file),
        ]
        if self.snapshot_dir is not None:
            command += ["--snapshot-dir", str(self.snapshot_dir)]
        if self.metrics:
            command += ["--metrics-port", "0"]
        if self.follow:
            command += ["--follow", ",".join(self.follow)]
        if self.replica_dtype is not None:
            command += ["--replica-dtype", self.replica_dtype]
        return command + list(self.extra_args)

    def start_shard(self, shard_id: int) -> None:
        """Start one shard's daemon (again, after stop_shard) and wait until it serves."""
        self._check_free(shard_id)
        self._launch(shard_id)
        self._await_serving(shard_id)

    def _check_free(self, shard_id: int) -> None:
        """Refuse a shard that is running here, or whose data dir a running daemon holds."""
        if self._processes[shard_id] is not None:
            raise RuntimeError(f"LocalCluster: shard {shard_id} is running; stop_shard it first")
        _, port_file, _ = self._paths(shard_id)
        running = _running_daemon(port_file)
        if running is not None:
            raise ShardStartError(
                f"shard {shard_id}: {port_file.with_suffix('')} is in use by a running shard "
                f"(pid {running['pid']}, port {running['port']}): another cluster on this data "
                f"dir? Stop it, or give another data dir"
            )

    def _launch(self, shard_id: int) -> None:
        """Start the shard's daemon process, not waiting for it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        _, _, log_file = self._paths(shard_id)
        # The port file is left as it is (a shard starting at once could own it): this
        # shard's is the one naming its pid.
        log = open(log_file, "ab")  # noqa: SIM115 - closed in stop_shard
        self._log_starts[shard_id] = log.tell()  # a failure quotes this start's lines only
        try:
            self._processes[shard_id] = subprocess.Popen(
                self._command(shard_id),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env={**os.environ, PARENT_PID_ENV: str(os.getpid())},
                start_new_session=self.own_session,
            )
        except BaseException:
            log.close()
            raise
        self._logs[shard_id] = log
        self._deadlines[shard_id] = time.monotonic() + self.start_timeout_s

    def _await_serving(self, shard_id: int) -> None:
        """Wait until the launched shard wrote its ports and serves; record its address."""
        _, port_file, _ = self._paths(shard_id)
        deadline = self._deadlines[shard_id]
        process = self._processes[shard_id]
        assert process is not None
        while (ports := _ports_of(port_file, process.pid)) is None:
            if process.poll() is not None:
                raise ShardStartError(self._failure(shard_id, "exited while starting"))
            if time.monotonic() > deadline:
                raise TimeoutError(self._failure(shard_id, "did not start in time"))
            time.sleep(0.05)
        address = f"{self.host}:{ports['port']}"
        wait_until_serving(address, max(1.0, deadline - time.monotonic()), self.security)
        while len(self.addresses) <= shard_id:
            self.addresses.append("")
            self.metrics_ports.append(None)
        self.addresses[shard_id] = address
        self.metrics_ports[shard_id] = ports["metrics_port"]

    def _failure(self, shard_id: int, what: str) -> str:
        _, _, log_file = self._paths(shard_id)
        process = self._processes[shard_id]
        try:
            with open(log_file, "rb") as lines:
                lines.seek(self._log_starts[shard_id])
                tail = lines.read().decode(errors="replace")[-3000:]
        except OSError:
            tail = ""
        code = process.poll() if process is not None else None
        return f"shard {shard_id} {what} (exit code {code}); log {log_file}:\n{tail}"

    def stop_shard(
        self, shard_id: int, *, sig: int = signal.SIGTERM, signalled: bool = False
    ) -> int | None:
        """Stop one shard (SIGTERM: graceful; SIGKILL: a crash) and return its exit code;
        one that does not stop within stop_timeout_s is killed. signalled: it was sent
        `sig` already; only wait."""
        process = self._processes[shard_id]
        if process is None:
            return None
        if process.poll() is None:
            if not signalled:
                process.send_signal(sig)
            try:
                process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes[shard_id] = None
        log = self._logs[shard_id]
        if log is not None:
            log.close()
            self._logs[shard_id] = None
        return process.returncode

    @property
    def pids(self) -> list[int | None]:
        """Each shard's daemon process id (None: not running)."""
        return [None if process is None else process.pid for process in self._processes]

    def exited(self) -> list[tuple[int, int, int, Path]]:
        """The shards whose daemon exited on its own since it started (a crash, kill -9):
        (shard id, pid, exit code - negative: the signal that ended it -, log file). Polling
        reaps them; stop_shard or stop still forgets them."""
        found = []
        for shard_id, process in enumerate(self._processes):
            if process is not None and process.poll() is not None:
                found.append((shard_id, process.pid, process.returncode, self._paths(shard_id)[2]))
        return found

    def start(self) -> LocalCluster:
        """Start every shard at once (nothing is started if any data dir is in use) and wait
        until each serves; on a failure, stop them all."""
        for shard_id in range(self.num_shards):
            self._check_free(shard_id)
        try:
            for shard_id in range(self.num_shards):
                self._launch(shard_id)
            for shard_id in range(self.num_shards):
                self._await_serving(shard_id)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> list[int | None]:
        """Stop every shard gracefully (all signalled first, then awaited); exit codes."""
        for process in self._processes:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)  # all at once: they flush in parallel
        return [self.stop_shard(i, signalled=True) for i in range(self.num_shards)]

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
