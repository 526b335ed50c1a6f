"""Where the cluster is: the shards' addresses, given or from the TIERPS_ADDRESSES variable."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

ADDRESSES_ENV = "TIERPS_ADDRESSES"
# host:port, or [IPv6 literal]:port; gRPC's own targets (dns:///..., unix:...) pass as given
_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.%\w]+\]|[^\s:\[\]/]+):(?P<port>\d{1,5})")
# gRPC's name schemes (its resolvers'), with or without "//authority/"; a name without one
# of them is host:port (gRPC itself would take "127.0.0.1" for dns with port 443)
_GRPC_TARGET = re.compile(
    r"^(?:[a-z][a-z0-9+.-]*:///|(?:dns|unix|unix-abstract|ipv4|ipv6|vsock|xds|google-c2p):)",
    re.IGNORECASE,
)


def check_address(address: str, source: str) -> str:
    """`address` if it is host:port ([v6]:port) with a port 1..65535, or a gRPC target with
    a scheme; else ValueError naming it, where it came from and the form expected. Without
    this, gRPC takes "127.0.0.1" for port 443 and fails only after its retries."""
    if _GRPC_TARGET.match(address):
        return address
    match = _HOST_PORT.fullmatch(address)
    if match is None or not 1 <= int(match["port"]) <= 65535:
        no_port = ":" not in address.strip("[]") or address.endswith("]")
        got = "no port" if no_port else "no valid one"
        raise ValueError(
            f"address {address!r} (from {source}) expected host:port with a port 1..65535, "
            f"such as 127.0.0.1:50051 or [::1]:50051 (an IPv6 literal in brackets); got {got}"
        )
    return address


def resolve_addresses(addresses: Sequence[str] | str | None, owner: str) -> list[str]:
    """The shards' "host:port" addresses in shard order: `addresses` as given (a list, or one
    comma-separated string), or when None the comma-separated value of TIERPS_ADDRESSES
    (which `tierps cluster` prints as an export line). ValueError naming `owner` when that
    leaves none, or when an address has no port (check_address)."""
    source = "the addresses given"
    if addresses is None:
        source = f"${ADDRESSES_ENV}"
        addresses = os.environ.get(ADDRESSES_ENV, "")
    if isinstance(addresses, str):
        addresses = addresses.split(",")
    resolved = [address.strip() for address in addresses if address.strip()]
    if not resolved:
        raise ValueError(
            f"{owner}: addresses expected at least one 'host:port' (given, or in "
            f"{ADDRESSES_ENV}=host:port,host:port, as `tierps cluster` prints it), got none "
            f"from {source}"
        )
    try:
        return [check_address(address, source) for address in resolved]
    except ValueError as error:
        raise ValueError(f"{owner}: {error}") from None
