from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SavePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAVE_PHASE_UNSPECIFIED: _ClassVar[SavePhase]
    SAVE_PHASE_WRITE_PART: _ClassVar[SavePhase]
    SAVE_PHASE_COMMIT: _ClassVar[SavePhase]
SAVE_PHASE_UNSPECIFIED: SavePhase
SAVE_PHASE_WRITE_PART: SavePhase
SAVE_PHASE_COMMIT: SavePhase

class PushThenLookupRequest(_message.Message):
    __slots__ = ("push", "lookup")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    push: PushGradientsBatches
    lookup: LookupBatches
    def __init__(self, push: _Optional[_Union[PushGradientsBatches, _Mapping]] = ..., lookup: _Optional[_Union[LookupBatches, _Mapping]] = ...) -> None: ...

class PushThenLookupResponse(_message.Message):
    __slots__ = ("values", "num_rows", "num_keys")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    values: bytes
    num_rows: int
    num_keys: int
    def __init__(self, values: _Optional[bytes] = ..., num_rows: _Optional[int] = ..., num_keys: _Optional[int] = ...) -> None: ...

class LookupBatches(_message.Message):
    __slots__ = ("batches",)
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[LookupRequest]
    def __init__(self, batches: _Optional[_Iterable[_Union[LookupRequest, _Mapping]]] = ...) -> None: ...

class PushGradientsBatches(_message.Message):
    __slots__ = ("batches",)
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[PushGradientsRequest]
    def __init__(self, batches: _Optional[_Iterable[_Union[PushGradientsRequest, _Mapping]]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("table", "dim", "create", "keys")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    table: str
    dim: int
    create: bool
    keys: bytes
    def __init__(self, table: _Optional[str] = ..., dim: _Optional[int] = ..., create: _Optional[bool] = ..., keys: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("values", "num_rows")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    values: bytes
    num_rows: int
    def __init__(self, values: _Optional[bytes] = ..., num_rows: _Optional[int] = ...) -> None: ...

class PushGradientsRequest(_message.Message):
    __slots__ = ("table", "dim", "step", "keys", "grads")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    table: str
    dim: int
    step: int
    keys: bytes
    grads: bytes
    def __init__(self, table: _Optional[str] = ..., dim: _Optional[int] = ..., step: _Optional[int] = ..., keys: _Optional[bytes] = ..., grads: _Optional[bytes] = ...) -> None: ...

class PushGradientsResponse(_message.Message):
    __slots__ = ("num_keys",)
    NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    num_keys: int
    def __init__(self, num_keys: _Optional[int] = ...) -> None: ...

class AssignRequest(_message.Message):
    __slots__ = ("table", "dim", "keys", "values")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    table: str
    dim: int
    keys: bytes
    values: bytes
    def __init__(self, table: _Optional[str] = ..., dim: _Optional[int] = ..., keys: _Optional[bytes] = ..., values: _Optional[bytes] = ...) -> None: ...

class AssignResponse(_message.Message):
    __slots__ = ("num_keys",)
    NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    num_keys: int
    def __init__(self, num_keys: _Optional[int] = ...) -> None: ...

class FollowRequest(_message.Message):
    __slots__ = ("shard", "shard_count", "cursors", "max_batch_rows")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    CURSORS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    shard_count: int
    cursors: _containers.RepeatedCompositeFieldContainer[FollowCursor]
    max_batch_rows: int
    def __init__(self, shard: _Optional[int] = ..., shard_count: _Optional[int] = ..., cursors: _Optional[_Iterable[_Union[FollowCursor, _Mapping]]] = ..., max_batch_rows: _Optional[int] = ...) -> None: ...

class FollowCursor(_message.Message):
    __slots__ = ("table", "cursor")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    table: str
    cursor: str
    def __init__(self, table: _Optional[str] = ..., cursor: _Optional[str] = ...) -> None: ...

class ChangeBatch(_message.Message):
    __slots__ = ("table", "config", "resync", "resync_done", "keys", "values", "removed", "cursor", "head", "head_unix_s", "oldest_change_unix_s", "dropped")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    RESYNC_DONE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    HEAD_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    OLDEST_CHANGE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    table: str
    config: TableConfig
    resync: bool
    resync_done: bool
    keys: bytes
    values: bytes
    removed: bytes
    cursor: str
    head: int
    head_unix_s: float
    oldest_change_unix_s: float
    dropped: bool
    def __init__(self, table: _Optional[str] = ..., config: _Optional[_Union[TableConfig, _Mapping]] = ..., resync: _Optional[bool] = ..., resync_done: _Optional[bool] = ..., keys: _Optional[bytes] = ..., values: _Optional[bytes] = ..., removed: _Optional[bytes] = ..., cursor: _Optional[str] = ..., head: _Optional[int] = ..., head_unix_s: _Optional[float] = ..., oldest_change_unix_s: _Optional[float] = ..., dropped: _Optional[bool] = ...) -> None: ...

class Component(_message.Message):
    __slots__ = ("kind", "params")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    params: _containers.ScalarMap[str, float]
    def __init__(self, kind: _Optional[str] = ..., params: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TableConfig(_message.Message):
    __slots__ = ("name", "dim", "dtype", "initializer", "optimizer", "seed", "host_cache_bytes", "gpu_cache_bytes", "eviction", "write_policy", "use_hashtable", "capacity", "placement", "table_shard", "hash_bucket_size", "promote_after", "admit_after", "admission", "max_elements", "false_positive_rate", "default_value", "steps_to_live", "min_l2_norm", "evict_before_snapshot", "cold_dtype", "cold_state_dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    WRITE_POLICY_FIELD_NUMBER: _ClassVar[int]
    USE_HASHTABLE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    TABLE_SHARD_FIELD_NUMBER: _ClassVar[int]
    HASH_BUCKET_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_AFTER_FIELD_NUMBER: _ClassVar[int]
    ADMIT_AFTER_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    MAX_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    FALSE_POSITIVE_RATE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_VALUE_FIELD_NUMBER: _ClassVar[int]
    STEPS_TO_LIVE_FIELD_NUMBER: _ClassVar[int]
    MIN_L2_NORM_FIELD_NUMBER: _ClassVar[int]
    EVICT_BEFORE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    COLD_DTYPE_FIELD_NUMBER: _ClassVar[int]
    COLD_STATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    dtype: str
    initializer: Component
    optimizer: Component
    seed: int
    host_cache_bytes: int
    gpu_cache_bytes: int
    eviction: str
    write_policy: str
    use_hashtable: bool
    capacity: int
    placement: str
    table_shard: int
    hash_bucket_size: int
    promote_after: int
    admit_after: int
    admission: str
    max_elements: int
    false_positive_rate: float
    default_value: float
    steps_to_live: int
    min_l2_norm: float
    evict_before_snapshot: bool
    cold_dtype: str
    cold_state_dtype: str
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., dtype: _Optional[str] = ..., initializer: _Optional[_Union[Component, _Mapping]] = ..., optimizer: _Optional[_Union[Component, _Mapping]] = ..., seed: _Optional[int] = ..., host_cache_bytes: _Optional[int] = ..., gpu_cache_bytes: _Optional[int] = ..., eviction: _Optional[str] = ..., write_policy: _Optional[str] = ..., use_hashtable: _Optional[bool] = ..., capacity: _Optional[int] = ..., placement: _Optional[str] = ..., table_shard: _Optional[int] = ..., hash_bucket_size: _Optional[int] = ..., promote_after: _Optional[int] = ..., admit_after: _Optional[int] = ..., admission: _Optional[str] = ..., max_elements: _Optional[int] = ..., false_positive_rate: _Optional[float] = ..., default_value: _Optional[float] = ..., steps_to_live: _Optional[int] = ..., min_l2_norm: _Optional[float] = ..., evict_before_snapshot: _Optional[bool] = ..., cold_dtype: _Optional[str] = ..., cold_state_dtype: _Optional[str] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: TableConfig
    def __init__(self, config: _Optional[_Union[TableConfig, _Mapping]] = ...) -> None: ...

class CreateTableResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class DropTableRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class DropTableResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableConfig]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableConfig, _Mapping]]] = ...) -> None: ...

class DescribeTableRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "rows", "bytes", "hits", "misses", "hit_rate", "scratch_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    SCRATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    bytes: int
    hits: int
    misses: int
    hit_rate: float
    scratch_bytes: int
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., hit_rate: _Optional[float] = ..., scratch_bytes: _Optional[int] = ...) -> None: ...

class TableDescription(_message.Message):
    __slots__ = ("config", "shard_id", "num_shards", "tiers", "initialized", "created", "lifecycle", "current_step", "keys_looked_up", "keys_pushed", "generation", "generation_snapshot")
    class LifecycleEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STEP_FIELD_NUMBER: _ClassVar[int]
    KEYS_LOOKED_UP_FIELD_NUMBER: _ClassVar[int]
    KEYS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    config: TableConfig
    shard_id: int
    num_shards: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    initialized: int
    created: int
    lifecycle: _containers.ScalarMap[str, float]
    current_step: int
    keys_looked_up: int
    keys_pushed: int
    generation: int
    generation_snapshot: str
    def __init__(self, config: _Optional[_Union[TableConfig, _Mapping]] = ..., shard_id: _Optional[int] = ..., num_shards: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., initialized: _Optional[int] = ..., created: _Optional[int] = ..., lifecycle: _Optional[_Mapping[str, float]] = ..., current_step: _Optional[int] = ..., keys_looked_up: _Optional[int] = ..., keys_pushed: _Optional[int] = ..., generation: _Optional[int] = ..., generation_snapshot: _Optional[str] = ...) -> None: ...

class SaveSnapshotRequest(_message.Message):
    __slots__ = ("name", "phase", "save_id", "base")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    name: str
    phase: SavePhase
    save_id: str
    base: str
    def __init__(self, name: _Optional[str] = ..., phase: _Optional[_Union[SavePhase, str]] = ..., save_id: _Optional[str] = ..., base: _Optional[str] = ...) -> None: ...

class LoadSnapshotRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class SnapshotProgress(_message.Message):
    __slots__ = ("rows_done", "rows_total", "rows_kept", "done", "path", "rows_evicted", "diffs")
    class DiffsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROWS_DONE_FIELD_NUMBER: _ClassVar[int]
    ROWS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROWS_KEPT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ROWS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    DIFFS_FIELD_NUMBER: _ClassVar[int]
    rows_done: int
    rows_total: int
    rows_kept: int
    done: bool
    path: str
    rows_evicted: int
    diffs: _containers.ScalarMap[str, str]
    def __init__(self, rows_done: _Optional[int] = ..., rows_total: _Optional[int] = ..., rows_kept: _Optional[int] = ..., done: _Optional[bool] = ..., path: _Optional[str] = ..., rows_evicted: _Optional[int] = ..., diffs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotInfo(_message.Message):
    __slots__ = ("name", "complete", "num_shards", "created_unix", "table_rows", "base", "chain")
    class TableRowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    TABLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    complete: bool
    num_shards: int
    created_unix: float
    table_rows: _containers.ScalarMap[str, int]
    base: str
    chain: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., complete: _Optional[bool] = ..., num_shards: _Optional[int] = ..., created_unix: _Optional[float] = ..., table_rows: _Optional[_Mapping[str, int]] = ..., base: _Optional[str] = ..., chain: _Optional[_Iterable[str]] = ...) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[SnapshotInfo]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[SnapshotInfo, _Mapping]]] = ...) -> None: ...

class DeleteSnapshotRequest(_message.Message):
    __slots__ = ("name", "save_id", "incomplete_only")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    INCOMPLETE_ONLY_FIELD_NUMBER: _ClassVar[int]
    name: str
    save_id: str
    incomplete_only: bool
    def __init__(self, name: _Optional[str] = ..., save_id: _Optional[str] = ..., incomplete_only: _Optional[bool] = ...) -> None: ...

class DeleteSnapshotResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, removed: _Optional[_Iterable[str]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("num_rows", "current_step")
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STEP_FIELD_NUMBER: _ClassVar[int]
    num_rows: int
    current_step: int
    def __init__(self, num_rows: _Optional[int] = ..., current_step: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("shard_id", "num_shards", "tables", "rss_bytes", "peak_rss_bytes", "uptime_s", "life", "previous_life_clean", "last_flush_unix_s", "writable", "metrics_port", "data_id", "data_created_unix_s")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    LIFE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_LIFE_CLEAN_FIELD_NUMBER: _ClassVar[int]
    LAST_FLUSH_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    num_shards: int
    tables: _containers.RepeatedCompositeFieldContainer[TableDescription]
    rss_bytes: int
    peak_rss_bytes: int
    uptime_s: float
    life: int
    previous_life_clean: bool
    last_flush_unix_s: float
    writable: bool
    metrics_port: int
    data_id: str
    data_created_unix_s: float
    def __init__(self, shard_id: _Optional[int] = ..., num_shards: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableDescription, _Mapping]]] = ..., rss_bytes: _Optional[int] = ..., peak_rss_bytes: _Optional[int] = ..., uptime_s: _Optional[float] = ..., life: _Optional[int] = ..., previous_life_clean: _Optional[bool] = ..., last_flush_unix_s: _Optional[float] = ..., writable: _Optional[bool] = ..., metrics_port: _Optional[int] = ..., data_id: _Optional[str] = ..., data_created_unix_s: _Optional[float] = ...) -> None: ...
