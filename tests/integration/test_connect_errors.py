"""A client that cannot reach a shard says what to check, and says it within a couple of
seconds: a plaintext client on a TLS port (a real TLS shard), a port nothing listens on (the
stale addresses of a restarted cluster), and an address without a port, refused before any
call."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.certs import make_certs
from tierps.client import EmbeddingClient
from tierps.client.addresses import resolve_addresses
from tierps.client.admin import ShardError
from tierps.server import cli
from tierps.server.daemon import ShardServer

# gRPC's retries of UNAVAILABLE (RetryPolicy: 5 attempts, 0.1 s backoff doubling) take about
# 1.5 s on a connection that fails at once; 4 s leaves a loaded machine room.
FAIL_FAST_S = 4.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _first_call_error(address: str) -> tuple[ShardError, float]:
    started = time.monotonic()
    with EmbeddingClient([address], timeout_s=30) as client:
        with pytest.raises(ShardError) as raised:
            client.list_tables()
    return raised.value, time.monotonic() - started


def test_a_plaintext_client_on_a_tls_port_is_told_to_check_the_tls_flags(
    tmp_path: Path, shard_server: Callable[..., ShardServer]
) -> None:
    certs = make_certs(tmp_path / "certs")
    server = shard_server(tls_cert=certs.server_cert, tls_key=certs.server_key)
    error, seconds = _first_call_error(f"127.0.0.1:{server.port}")
    assert error.code.name == "UNAVAILABLE" and "Socket closed" in error.details
    assert "does it serve TLS? Then give the client its CA (--tls-ca" in str(error), error
    assert seconds < FAIL_FAST_S, f"{seconds:.1f} s to fail"


def test_a_port_nothing_listens_on_points_at_the_addresses_of_a_restarted_cluster() -> None:
    error, seconds = _first_call_error(f"127.0.0.1:{_free_port()}")
    assert error.code.name == "UNAVAILABLE"
    message = str(error)
    assert "nothing accepts connections at this address: is the shard running?" in message
    assert "data dir's `addresses` file" in message, message
    assert seconds < FAIL_FAST_S, f"{seconds:.1f} s to fail"


def test_an_address_without_a_port_is_refused_before_any_call(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(
        ValueError,
        match=r"address '127\.0\.0\.1' \(from the addresses given\) "
        r"expected host:port .*; got no port",
    ):
        EmbeddingClient(["127.0.0.1"])
    monkeypatch.setenv("TIERPS_ADDRESSES", "127.0.0.1:5000,localhost")
    with pytest.raises(ValueError, match=r"'localhost' \(from \$TIERPS_ADDRESSES\)"):
        EmbeddingClient()
    for good in ("127.0.0.1:5000", "[::1]:5000", "localhost:1"):
        EmbeddingClient([good]).close()  # accepted (nothing is called)
    started = time.monotonic()
    assert cli.main(["admin", "tables", "--addresses", "127.0.0.1"]) == 1
    assert time.monotonic() - started < 1.0  # refused, not tried on port 443
    err = capsys.readouterr().err
    assert "address '127.0.0.1' (from the addresses given) expected host:port" in err, err


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:50051",
        "[::1]:50051",
        "[fe80::1%eth0]:50051",
        "shard-0.tierps:50051",
        "dns:///shard-0:50051",
        "dns:shard-0:50051",
        "DNS:shard-0:50051",
        "ipv4:127.0.0.1:50051",
        "ipv6:[::1]:50051",
        "unix:/tmp/tierps.sock",
        "unix-abstract:tierps",
        "xds:///tierps",
    ],
)
def test_every_form_of_address_grpc_takes_is_accepted(address: str) -> None:
    assert resolve_addresses([address], "EmbeddingClient") == [address]


@pytest.mark.parametrize("address", ["127.0.0.1", "shard-0", "[::1]", "host:0", "host:70000"])
def test_a_host_without_a_valid_port_is_refused(address: str) -> None:
    with pytest.raises(ValueError, match="expected host:port with a port 1..65535"):
        resolve_addresses([address], "EmbeddingClient")
