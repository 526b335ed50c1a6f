"""Integration fixtures: real shard servers on port 0 over real RocksDB in tmp_path, and
stubs to talk to them. Every server and channel made here is closed at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc

from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto import wire
from tierps.server.config import ServerConfig
from tierps.server.daemon import ShardServer, create_server

_DEFAULT = object()  # "not given" where None means something (snapshot_dir=None: none)


@dataclass
class Stubs:
    """One channel to one shard, with a stub for each of its services."""

    channel: grpc.Channel
    embedding: pb_grpc.EmbeddingServiceStub
    admin: pb_grpc.AdminServiceStub
    health: health_pb2_grpc.HealthStub
    changes: pb_grpc.ChangeServiceStub

    def close(self) -> None:
        self.channel.close()


def address_of(target: ShardServer | str | int) -> str:
    """'127.0.0.1:port' of a server, a port, or an address given as it is."""
    if isinstance(target, ShardServer):
        return f"127.0.0.1:{target.port}"
    if isinstance(target, int):
        return f"127.0.0.1:{target}"
    return target


def open_stubs(
    target: ShardServer | str | int, max_message_bytes: int = wire.MAX_MESSAGE_BYTES
) -> Stubs:
    """Stubs over a new channel with the wire's explicit message limits (raise
    max_message_bytes to send a message the server must refuse). The caller closes it."""
    channel = grpc.insecure_channel(
        address_of(target), options=wire.channel_options(max_message_bytes)
    )
    return Stubs(
        channel=channel,
        embedding=pb_grpc.EmbeddingServiceStub(channel),
        admin=pb_grpc.AdminServiceStub(channel),
        health=health_pb2_grpc.HealthStub(channel),
        changes=pb_grpc.ChangeServiceStub(channel),
    )


@pytest.fixture
def shard_server(tmp_path: Path) -> Iterator[Callable[..., ShardServer]]:
    """Factory of started in-process shard servers on a free port:

        server = shard_server(shard_id=0, num_shards=1, data_dir=None, snapshot_dir=...,
                              start=True, **other ServerConfig fields)

    data_dir defaults to a new directory under tmp_path per server; snapshot_dir defaults to
    tmp_path / "snapshots" (shared by every server of the test; pass None for none). Every
    server is stopped at teardown (stop() is idempotent, so a test may stop one itself)."""
    servers: list[ShardServer] = []

    def make(
        shard_id: int = 0,
        num_shards: int = 1,
        *,
        data_dir: Path | None = None,
        snapshot_dir: Any = _DEFAULT,
        start: bool = True,
        **fields: Any,
    ) -> ShardServer:
        if data_dir is None:
            data_dir = tmp_path / f"data-{len(servers)}-shard-{shard_id}-of-{num_shards}"
        if snapshot_dir is _DEFAULT:
            snapshot_dir = tmp_path / "snapshots"
        config = ServerConfig(
            shard_id=shard_id,
            num_shards=num_shards,
            data_dir=data_dir,
            snapshot_dir=snapshot_dir,
            grace_s=fields.pop("grace_s", 1.0),
            **fields,
        )
        server, port = create_server(config)
        assert port == server.port > 0
        servers.append(server)
        if start:
            server.start()
        return server

    yield make
    errors = []
    for server in reversed(servers):
        try:
            server.stop(grace_s=0.5)
        except Exception as error:  # noqa: BLE001 - stop the others first, then report
            errors.append(error)
    if errors:
        raise errors[0]


@pytest.fixture
def connect() -> Iterator[Callable[..., Stubs]]:
    """Factory of Stubs (see open_stubs) whose channels are closed at teardown:
    connect(server_or_port_or_address, max_message_bytes=...)."""
    opened: list[Stubs] = []

    def make(
        target: ShardServer | str | int, max_message_bytes: int = wire.MAX_MESSAGE_BYTES
    ) -> Stubs:
        stubs = open_stubs(target, max_message_bytes)
        opened.append(stubs)
        return stubs

    yield make
    for stubs in opened:
        stubs.close()
