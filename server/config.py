"""ServerConfig: everything one shard daemon needs, from flags or a TOML file."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierps.core.config import TableConfig
from tierps.core.validation import DEFAULT_MAX_STEP_LEAP, MAX_STEP, check_int
from tierps.core.xp import GPU_ARRAYS
from tierps.proto.wire import CHUNK_BYTES, HEADER_ROOM, MAX_MESSAGE_BYTES, ONE_MESSAGE_BYTES

# Why the size defaults are what they are: EmbeddingClient sends at most max_call_bytes
# (DEFAULT_MAX_CALL_BYTES, 256 MiB) of bulk per call and shard, and asks for at most that
# much back; the wire carries that much as one message (ONE_MESSAGE_BYTES, plus HEADER_ROOM).
# A shard that takes as much per call never refuses a call of the default client, and a call
# holds no more than that of the shard's memory.
MAX_BATCH_BYTES = ONE_MESSAGE_BYTES  # bulk bytes of one call's request, or of a lookup's reply
REPLICA_DTYPES = ("float32", "bfloat16")  # a replica's weights in RocksDB
REPLICA_TOKEN_ENV = "TIERPS_REPLICA_TOKEN"  # a replica's token to its training shards


def max_call_request_bytes(max_batch_bytes: int) -> int:
    """A call's request bytes on the wire, at most: its bulk plus the messages' headers. The
    one message's fit HEADER_ROOM; a stream's take ~40 bytes plus the table's name each,
    under 1/16 of the bulk for messages of 8 KiB or more (the client's are CHUNK_BYTES)."""
    return max_batch_bytes + max(HEADER_ROOM, max_batch_bytes // 16)


# Two calls of the largest size at once, and their memory is all the shard holds of requests.
MAX_INFLIGHT_BYTES = 2 * max_call_request_bytes(MAX_BATCH_BYTES)


@dataclass(frozen=True)
class ServerConfig:
    """One shard daemon.

    shard_id / num_shards: this shard holds the keys k with k % num_shards == shard_id.
    data_dir: this shard's RocksDB and identity (one directory per shard).
    snapshot_dir: where snapshots are written and read; may be shared by every shard (and by
    several clusters). host / port: the gRPC bind address (port 0: any free port).
    metrics_port: Prometheus metrics over HTTP on host, off when None (0: any free port).
    max_workers: gRPC worker threads (each streaming call holds one while it runs).
    grace_s: on stop, how long in-flight calls may take before they are cancelled.
    tables: tables created at start (an identical existing table is kept as it is).
    gpu_cache_bytes: each table's GPU tier on this shard, for tables whose own
    gpu_cache_bytes is 0 (0: none). require_gpu: refuse to start where no GPU is usable
    (otherwise GPU tiers are left out with one warning). gpu_arrays: "auto" (cupy) or
    "numpy" (the GPU tier's code on host arrays: tests, trying a configuration).
    tls_cert / tls_key: PEM files: TLS on the gRPC port (both, or neither). tls_client_ca:
    mutual TLS, clients must show a certificate signed by this CA. tokens_file: `ROLE:TOKEN`
    entries (server/security.py); without it, $TIERPS_TOKENS if set; with neither, no
    authentication. insecure: serve off loopback without TLS and tokens (with a warning;
    refused otherwise). metrics_host: the /metrics bind address (default: host).
    health_port: also serve the health service alone, in plaintext, on host:health_port with
    threads of its own (probes that cannot speak TLS; never starved by data calls). None: off.
    max_workers is also the cap on calls at once (health excepted), RESOURCE_EXHAUSTED
    beyond; max_receiving_streams: of those, request streams still waiting for their
    messages; max_inflight_bytes: request bytes held at once by the shard's calls (each call
    is held to max_call_request_bytes(max_batch_bytes) on the wire);
    stream_idle_s: a request stream silent this long is cancelled; call_total_s: a data call
    running this long is cancelled (server/limits.py).
    flush_interval_s: a background flush writes every dirty row (write-back tables) down to
    RocksDB at least this often, so a crash loses at most about this many seconds of
    acknowledged updates (0: flush only at stop, snapshot save and eviction).
    sync_writes: fsync RocksDB's log on every write, so write-through updates survive a power
    loss, not only a killed process.
    max_step_leap: one push may move a table's clock (its largest step pushed) forward by at
    most this many steps, or is refused with INVALID_ARGUMENT before anything changes; a
    table's first push (clock 0) may start at any step (DEFAULT_MAX_STEP_LEAP in
    core/validation.py says why 10**9). 0: no limit.
    follow: the addresses of every shard of a training cluster: this shard is then a
    read-only replica (server/replica.py) holding the keys of shard_id of num_shards (its
    own cluster's count, any count) of every table they have, refusing every write.
    replica_dtype: the type of the replica's weights in RocksDB ("float32", "bfloat16").
    replica_save_s: how often a replica flushes its rows and then saves where it is in each
    training shard's changes: a restart resumes from there (the training shard's changes
    since are sent again). Each save writes every row changed since the last one to RocksDB,
    so a short interval costs the replica CPU while training writes fast (docs/perf).
    replica_token_file: the bearer token sent to the training shards (role replica; without
    it, $TIERPS_REPLICA_TOKEN). follow_tls_ca / follow_tls_cert / follow_tls_key /
    follow_tls_server_name: how the replica reaches TLS training shards, as a client's
    ChannelSecurity (client/security.py).
    """

    shard_id: int
    num_shards: int
    data_dir: Path
    snapshot_dir: Path | None = None
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    max_workers: int = 32
    grace_s: float = 10.0
    chunk_bytes: int = CHUNK_BYTES
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_batch_bytes: int = MAX_BATCH_BYTES
    tables: tuple[TableConfig, ...] = field(default_factory=tuple)
    gpu_cache_bytes: int = 0
    require_gpu: bool = False
    gpu_arrays: str = "auto"
    flush_interval_s: float = 30.0
    sync_writes: bool = False
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    tokens_file: Path | None = None
    insecure: bool = False
    metrics_host: str | None = None
    health_port: int | None = None
    max_receiving_streams: int = 8
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES
    stream_idle_s: float = 30.0
    call_total_s: float = 600.0
    max_step_leap: int = DEFAULT_MAX_STEP_LEAP
    follow: tuple[str, ...] = ()
    replica_dtype: str = "float32"
    replica_save_s: float = 10.0
    replica_token_file: Path | None = None
    follow_tls_ca: Path | None = None
    follow_tls_cert: Path | None = None
    follow_tls_key: Path | None = None
    follow_tls_server_name: str | None = None

    def __post_init__(self) -> None:
        owner = "ServerConfig"
        check_int(owner, "num_shards", self.num_shards, 1, 1 << 16)
        check_int(owner, "shard_id", self.shard_id, 0, self.num_shards - 1)
        check_int(owner, "port", self.port, 0, 65535)
        if self.metrics_port is not None:
            check_int(owner, "metrics_port", self.metrics_port, 0, 65535)
        if self.health_port is not None:
            check_int(owner, "health_port", self.health_port, 0, 65535)
        check_int(owner, "max_workers", self.max_workers, 1, 1024)
        check_int(owner, "chunk_bytes", self.chunk_bytes, 1 << 12, 1 << 30)
        check_int(
            owner, "max_message_bytes", self.max_message_bytes, self.chunk_bytes + 4096, 1 << 31
        )
        check_int(owner, "max_batch_bytes", self.max_batch_bytes, 1, 1 << 40)
        check_int(owner, "gpu_cache_bytes", self.gpu_cache_bytes, 0, 2**62)
        if self.gpu_arrays not in GPU_ARRAYS:
            raise ValueError(
                f"{owner}: field 'gpu_arrays' expected one of {GPU_ARRAYS}, got {self.gpu_arrays!r}"
            )
        if not isinstance(self.require_gpu, bool):
            raise ValueError(
                f"{owner}: field 'require_gpu' expected a bool, got {self.require_gpu!r}"
            )
        if not isinstance(self.sync_writes, bool):
            raise ValueError(
                f"{owner}: field 'sync_writes' expected a bool, got {self.sync_writes!r}"
            )
        if not (
            isinstance(self.flush_interval_s, int | float)
            and 0 <= self.flush_interval_s < float("inf")
        ):
            raise ValueError(
                f"{owner}: field 'flush_interval_s' expected seconds >= 0 (0: off), got "
                f"{self.flush_interval_s!r}"
            )
        if not self.grace_s >= 0:
            raise ValueError(f"{owner}: field 'grace_s' expected >= 0, got {self.grace_s!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"{owner}: field 'host' expected a host name, got {self.host!r}")
        check_int(owner, "max_receiving_streams", self.max_receiving_streams, 1, self.max_workers)
        check_int(owner, "max_inflight_bytes", self.max_inflight_bytes, 1 << 20, 1 << 44)
        check_int(owner, "max_step_leap", self.max_step_leap, 0, MAX_STEP)
        for name in ("stream_idle_s", "call_total_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < float("inf")):
                raise ValueError(f"{owner}: field '{name}' expected seconds > 0, got {value!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                f"{owner}: fields 'tls_cert' and 'tls_key' expected both or neither, got "
                f"tls_cert={self.tls_cert}, tls_key={self.tls_key}"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(f"{owner}: field 'tls_client_ca' needs tls_cert and tls_key")
        if isinstance(self.follow, str):  # "host:port,host:port", as the flag and TOML give it
            object.__setattr__(self, "follow", tuple(a for a in self.follow.split(",") if a))
        object.__setattr__(self, "follow", tuple(self.follow))
        if not (isinstance(self.replica_save_s, int | float) and self.replica_save_s > 0):
            raise ValueError(
                f"{owner}: field 'replica_save_s' expected seconds > 0, got {self.replica_save_s!r}"
            )
        if self.replica_dtype not in REPLICA_DTYPES:
            raise ValueError(
                f"{owner}: field 'replica_dtype' expected one of {REPLICA_DTYPES}, got "
                f"{self.replica_dtype!r}"
            )
        replica_only = ("replica_token_file", "follow_tls_ca", "follow_tls_cert")
        if not self.follow and any(getattr(self, name) is not None for name in replica_only):
            raise ValueError(f"{owner}: fields {replica_only} need 'follow' (a replica's)")
        for name in (
            "tls_cert",
            "tls_key",
            "tls_client_ca",
            "tokens_file",
            "replica_token_file",
            "follow_tls_ca",
            "follow_tls_cert",
            "follow_tls_key",
        ):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.snapshot_dir is not None:
            object.__setattr__(self, "snapshot_dir", Path(self.snapshot_dir))
        object.__setattr__(self, "tables", tuple(self.tables))
        for table in self.tables:
            if not isinstance(table, TableConfig):
                raise ValueError(
                    f"{owner}: field 'tables' expected TableConfigs, got {type(table).__name__}"
                )

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> ServerConfig:
        """Read a TOML file whose top-level keys are this class's fields, with [[tables]]
        entries as TableConfig.to_dict gives them; `overrides` (flags given on the command
        line) win over the file."""
        with open(path, "rb") as source:
            data = tomllib.load(source)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"ServerConfig file {path}: unknown keys {unknown}; "
                f"expected some of {sorted(known)}"
            )
        data["tables"] = tuple(TableConfig.from_dict(t) for t in data.get("tables", ()))
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)
