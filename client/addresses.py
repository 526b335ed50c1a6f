"""Where the cluster is: the shards' addresses, given or from the TIERPS_ADDRESSES variable."""

from __future__ import annotations

import os
from collections.abc import Sequence

ADDRESSES_ENV = "TIERPS_ADDRESSES"


def resolve_addresses(addresses: Sequence[str] | str | None, owner: str) -> list[str]:
    """The shards' "host:port" addresses in shard order: `addresses` as given (a list, or one
    comma-separated string), or when None the comma-separated value of TIERPS_ADDRESSES
    (which `tierps cluster` prints as an export line). ValueError naming `owner` when that
    leaves none."""
    source = "addresses"
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
    return resolved
