"""TableConfig <-> its wire message, through the plain dict of TableConfig.to_dict (so this
package imports nothing of ours). A field left unset on the wire is left out of the dict,
so the dataclass's default applies."""

from __future__ import annotations

from typing import Any

from tierps.proto import tierps_service_pb2 as pb

_STRINGS = (
    "dtype",
    "eviction",
    "write_policy",
    "placement",
    "admission",
    "cold_dtype",
    "cold_state_dtype",
)
# Scalars whose presence is kept: an explicit 0 or false stays apart from unset.
_OPTIONAL_INTS = (
    "seed",
    "host_cache_bytes",
    "gpu_cache_bytes",
    "use_hashtable",
    "capacity",
    "table_shard",
    "hash_bucket_size",
    "promote_after",
    "admit_after",
    "max_elements",
    "false_positive_rate",
    "default_value",
    "steps_to_live",
    "min_l2_norm",
    "evict_before_snapshot",
)
_COMPONENTS = ("initializer", "optimizer")


def table_config_to_proto(config: dict[str, Any]) -> pb.TableConfig:
    """The wire message of TableConfig.to_dict()'s output."""
    message = pb.TableConfig(name=config["name"], dim=config["dim"])
    for field in _STRINGS + _OPTIONAL_INTS:
        if field in config:
            setattr(message, field, config[field])
    for field in _COMPONENTS:
        if field in config:
            params = dict(config[field])
            component = getattr(message, field)
            component.kind = params.pop("kind")
            component.params.update({k: float(v) for k, v in params.items()})
    return message


def table_config_to_dict(message: pb.TableConfig) -> dict[str, Any]:
    """The TableConfig.from_dict input of a wire message."""
    out: dict[str, Any] = {"name": message.name, "dim": message.dim}
    for field in _STRINGS:
        if getattr(message, field):
            out[field] = getattr(message, field)
    for field in _OPTIONAL_INTS:
        if message.HasField(field):
            out[field] = getattr(message, field)
    for field in _COMPONENTS:
        if message.HasField(field):
            component = getattr(message, field)
            out[field] = {"kind": component.kind, **dict(component.params)}
    return out
