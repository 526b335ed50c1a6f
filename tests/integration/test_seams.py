"""The edges between operations: a push of several tables is one unit on a shard; a push is
applied once however often it arrives; a snapshot load fences the pushes of the tables it
replaces and tells the trainers whose rows it replaced; a wiped data dir is told; a call's
work is bounded by its batches.

Counting tables (SGD lr=1 from zeros, every gradient -1) make a row's weight the number of
pushes applied to it, so "applied once" is compared exactly; the optimizers' own results
are compared with torch elsewhere (test_optim_parity)."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from tests.integration.test_crash_safety import free_base_port
from tierps.client import EmbeddingClient, Feature
from tierps.client.admin import RetryPolicy, ShardError
from tierps.client.push_then_lookup import PushNotApplied
from tierps.core.errors import Reason
from tierps.proto import wire
from tierps.server.cluster import LocalCluster
from tierps.server.config import ServerConfig
from tierps.server.ledger import PushId
from tierps.server.servicers import MAX_BATCHES_PER_CALL
from tierps.server.shard import PushBatch, Shard
from tierps.storage import (
    BackendError,
    InvalidArgumentError,
    ResourceExhaustedError,
    StorageFullError,
    TableConfig,
    init,
    optim,
)

DIM = 4
CODE = grpc.StatusCode


def counting(name: str, **fields: Any) -> TableConfig:
    return TableConfig(name, DIM, initializer=init.Zeros(), optimizer=optim.SGD(lr=1.0), **fields)


def ones(keys: np.ndarray) -> np.ndarray:
    return -np.ones((keys.size, DIM), np.float32)


def rows_of(client: EmbeddingClient, table: str, keys: np.ndarray) -> np.ndarray:
    return client.lookup(table, keys, create=False)


# -- a push is one unit on each shard ------------------------------------------------------


@pytest.mark.parametrize("x_index", ["hashed", "direct"])
@pytest.mark.parametrize("transport", ["one-message", "stream", "push-then-lookup"])
def test_a_refused_table_changes_no_other_table_of_the_push(
    shard_server: Any, transport: str, x_index: str
) -> None:
    """Table x (SGD; hashed, or direct: both train their rows in place) and table y (Adam)
    in one push; y's gradient 1e20 makes Adam's second moment inf in float32: the shard
    refuses the whole push, and x keeps every bit."""
    server = shard_server()
    options = {"one_message_bytes": 0} if transport == "stream" else {}
    direct = {"use_hashtable": False, "capacity": 16} if x_index == "direct" else {}
    with EmbeddingClient([f"127.0.0.1:{server.port}"], **options) as client:
        client.create_table(counting("x", **direct))
        client.create_table(TableConfig("y", DIM, optimizer=optim.Adam(lr=0.1)))
        keys = np.array([[1, 2], [3, 4]])
        features = [Feature("fx", "x"), Feature("fy", "y")]
        pooled = client.lookup_pooled_features({"fx": keys, "fy": keys}, features)
        before = {t: rows_of(client, t, keys.reshape(-1)) for t in ("x", "y")}
        grads = {"fx": np.ones((2, DIM), np.float32), "fy": np.full((2, DIM), 1e20, np.float32)}
        if transport == "push-then-lookup":
            pushes = pooled.key_gradients(grads)
            tables = {t: (DIM, keys.reshape(-1)) for t in ("x", "y")}
            with pytest.raises(PushNotApplied) as raised:
                client._fused.push_then_lookup(pushes, None, tables, True)
            error = raised.value.error
        else:
            with pytest.raises(ShardError) as caught:
                pooled.push_gradients(grads)
            error = caught.value
        assert error.code is CODE.INVALID_ARGUMENT, error
        assert "non-finite" in error.details or "finite" in error.details
        assert error.succeeded == []
        for table in ("x", "y"):
            np.testing.assert_array_equal(rows_of(client, table, keys.reshape(-1)), before[table])
        # nothing was taken: the same push with a finite gradient applies x once
        grads["fy"] = np.ones((2, DIM), np.float32)
        pooled.push_gradients(grads)
        np.testing.assert_array_equal(rows_of(client, "x", np.arange(1, 5)), ones(np.arange(4)))


def test_across_shards_the_error_names_what_applied_and_what_did_not(shard_server: Any) -> None:
    servers = [shard_server(shard_id=i, num_shards=2) for i in range(2)]
    with EmbeddingClient([f"127.0.0.1:{s.port}" for s in servers]) as client:
        client.create_table(counting("x"))
        client.create_table(TableConfig("y", DIM, optimizer=optim.Adam(lr=0.1)))
        keys = np.array([[2, 4], [1, 3]])  # row 0 on shard 0, row 1 on shard 1
        features = [Feature("fx", "x"), Feature("fy", "y")]
        pooled = client.lookup_pooled_features({"fx": keys, "fy": keys}, features)
        grad_y = np.ones((2, DIM), np.float32)
        grad_y[1] = 1e20  # only shard 1's keys of y overflow
        with pytest.raises(ShardError) as raised:
            pooled.push_gradients({"fx": np.ones((2, DIM), np.float32), "fy": grad_y})
        error = raised.value
        assert (error.shard_id, error.succeeded, error.failed) == (1, [0], [1])
        assert "tables ['x', 'y'] was applied on shards [0], and not on shards [1]" in str(error)
        x = rows_of(client, "x", np.array([2, 4, 1, 3]))
        np.testing.assert_array_equal(x[:2], -np.ones((2, DIM)))  # shard 0: applied
        np.testing.assert_array_equal(x[2:], np.zeros((2, DIM)))  # shard 1: untouched


def out_of_memory() -> BaseException:
    """numpy's own out-of-memory error, which is not made of a message alone."""
    try:
        np.empty((1 << 55,), np.float32)  # 128 PiB
    except MemoryError as error:
        return error
    raise AssertionError("expected numpy to refuse 128 PiB")


@pytest.mark.parametrize("failure", ["backend", "out-of-memory"])
def test_a_storage_failure_between_tables_is_named_and_a_resend_applies_only_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """Table b's RocksDB write fails once (injected: a real one would need a disk that fills
    between two tables' writes of one call); a's rows are in. The error says so, and the same
    call sent again applies b only: each table once."""
    shard = Shard(ServerConfig(0, 1, tmp_path / "shard"))
    try:
        for name in ("a", "b"):
            shard.admin.create_table(counting(name, write_policy="write_through"))
        keys = np.arange(8, dtype=np.int64)
        batches = [PushBatch(name, DIM, keys, ones(keys), 1) for name in ("a", "b")]
        durable = shard.store.table("b").durable
        real_write = durable.write
        failures = iter(
            [
                BackendError("rocksdb backend failed to write table 'b' (injected)")
                if failure == "backend"
                else out_of_memory()
            ]
        )

        def failing_write(*args: Any, **kwargs: Any) -> Any:
            failure = next(failures, None)
            if failure is not None:
                raise failure
            return real_write(*args, **kwargs)

        monkeypatch.setattr(durable, "write", failing_write)
        push_id = PushId("trainer", 7)
        kind = BackendError if failure == "backend" else ResourceExhaustedError
        with pytest.raises(kind) as raised:
            shard.push_gradients(batches, push_id)
        assert "tables ['a'] were applied and ['b'] were not" in str(raised.value)
        assert raised.value.applied_tables == ["a"]
        for name, want in (("a", -1.0), ("b", 0.0)):
            rows = shard.lookup([_lookup(name, keys)])[0]
            np.testing.assert_array_equal(rows, np.full((keys.size, DIM), -want, np.float32))
        assert shard.push_gradients(batches, push_id) == 2 * keys.size  # the resend
        assert shard.push_gradients(batches, push_id) == 2 * keys.size  # and again: no-op
        for name in ("a", "b"):
            rows = shard.lookup([_lookup(name, keys)])[0]
            np.testing.assert_array_equal(rows, np.ones((keys.size, DIM), np.float32))
    finally:
        shard.close()


def test_a_push_a_shard_applied_in_part_keeps_its_step_and_says_which_tables(
    shard_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the service: table b's write finds the disk full (injected once) after a's
    rows are in. RESOURCE_EXHAUSTED is not retried; the client is told which tables the
    shard applied (a trailer the rich status keeps) and why, and keeps the push's step."""
    server = shard_server()
    with EmbeddingClient([f"127.0.0.1:{server.port}"]) as client:
        for name in ("a", "b"):
            client.create_table(counting(name, write_policy="write_through"))
        durable = server.shard.store.table("b").durable
        real_write = durable.write
        failures = iter([StorageFullError("rocksdb backend: No space left on device (injected)")])

        def failing_write(*args: Any, **kwargs: Any) -> Any:
            failure = next(failures, None)
            if failure is not None:
                raise failure
            return real_write(*args, **kwargs)

        keys = np.array([[1, 2]])
        features = [Feature("fa", "a"), Feature("fb", "b")]
        pooled = client.lookup_pooled_features({"fa": keys, "fb": keys}, features)
        monkeypatch.setattr(durable, "write", failing_write)  # after the lookup's own writes
        with pytest.raises(ShardError) as raised:
            pooled.push_gradients({f: -np.ones((1, DIM), np.float32) for f in ("fa", "fb")})
        error = raised.value
        assert error.code is CODE.RESOURCE_EXHAUSTED and error.applied_tables == ["a"]
        assert error.reason is Reason.STORAGE_FULL
        assert "shard 0 applied its part of tables ['a'] and not of the others" in str(error)
        assert client._pushes.last_step("a") == 1  # the step stays taken: a's rows moved at it
        np.testing.assert_array_equal(rows_of(client, "a", keys[0]), np.ones((2, DIM)))
        np.testing.assert_array_equal(rows_of(client, "b", keys[0]), np.zeros((2, DIM)))


def _lookup(table: str, keys: np.ndarray) -> Any:
    from tierps.server.shard import LookupBatch

    return LookupBatch(table, DIM, keys, False)


# -- exactly once ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_push_id_is_applied_once_across_a_clean_restart(tmp_path: Path, policy: str) -> None:
    config = ServerConfig(0, 1, tmp_path / "shard")
    keys = np.arange(5, dtype=np.int64)
    batch = [PushBatch("t", DIM, keys, ones(keys), 1)]
    shard = Shard(config)
    shard.admin.create_table(counting("t", write_policy=policy))
    assert shard.push_gradients(batch, PushId("c", 1)) == keys.size
    assert shard.push_gradients(batch, PushId("c", 1)) == keys.size  # a repeat: acknowledged
    shard.close()
    shard = Shard(config)
    try:
        assert shard.push_gradients(batch, PushId("c", 1)) == keys.size  # remembered
        rows = shard.lookup([_lookup("t", keys)])[0]
        np.testing.assert_array_equal(rows, np.ones((keys.size, DIM), np.float32))
        shard.push_gradients(batch, PushId("c", 2))  # a new call applies
        rows = shard.lookup([_lookup("t", keys)])[0]
        np.testing.assert_array_equal(rows, np.full((keys.size, DIM), 2, np.float32))
    finally:
        shard.close()


@pytest.mark.parametrize("header", ["no-colon", ":5", "a:b", "x" * 65 + ":1", "a b:1"])
def test_a_malformed_push_id_is_refused_and_applies_nothing(
    shard_server: Any, connect: Any, header: str
) -> None:
    server = shard_server()
    with EmbeddingClient([f"127.0.0.1:{server.port}"]) as client:
        client.create_table(counting("t"))
    stubs = connect(server)
    keys = np.arange(3, dtype=np.int64)
    request = wire.encode_batches([("t", DIM, 1, (keys.tobytes(), ones(keys).tobytes()))])
    push = stubs.channel.unary_unary("/tierps.v1.EmbeddingService/PushGradientsUnary")
    with pytest.raises(grpc.RpcError) as raised:
        push(request, metadata=((wire.PUSH_ID_HEADER, header),), timeout=10)
    assert raised.value.code() is CODE.INVALID_ARGUMENT
    assert wire.PUSH_ID_HEADER in raised.value.details()
    with EmbeddingClient([f"127.0.0.1:{server.port}"]) as client:
        np.testing.assert_array_equal(rows_of(client, "t", keys), np.zeros((3, DIM)))


# -- loads fence pushes; trainers are told ----------------------------------------------------


def test_pushes_during_a_load_are_refused_or_kept_and_the_trainer_is_told(
    shard_server: Any,
) -> None:
    """A trainer pushes in a loop while an admin loads a snapshot. Every push it saw
    acknowledged after the load is in the rows; pushes while the load stages are refused
    (UNAVAILABLE, retried by the client), and the first push made against the replaced
    rows is refused with ABORTED naming the snapshot: the trainer is told, once."""
    server = shard_server()
    address = [f"127.0.0.1:{server.port}"]
    counted = np.array([7], dtype=np.int64)
    bulk = np.arange(100, 200_100, dtype=np.int64)  # enough rows that staging takes a while
    with EmbeddingClient(address) as admin:
        admin.create_table(counting("t"))
        admin.assign("t", bulk, np.ones((bulk.size, DIM), np.float32))
        admin.push_gradients("t", counted, ones(counted))
        admin.save_snapshot("base")
        saved = float(rows_of(admin, "t", counted)[0, 0])
    outcomes: list[tuple[str, float]] = []  # ("ok" | code name, when)
    stop = threading.Event()
    retry = RetryPolicy(max_attempts=5, initial_backoff_s=0.05, max_backoff_s=0.2)

    def train() -> None:
        with EmbeddingClient(address, retry=retry) as trainer:
            while not stop.is_set():
                try:
                    trainer.push_gradients("t", counted, ones(counted))
                    outcomes.append(("ok", time.monotonic()))
                except ShardError as error:
                    outcomes.append((error.code.name, time.monotonic()))
                    if error.code is CODE.ABORTED:
                        assert error.reason is Reason.TABLE_REPLACED
                        assert "snapshot 'base'" in error.details, error.details
                time.sleep(0.002)

    thread = threading.Thread(target=train)
    thread.start()
    try:
        time.sleep(0.3)
        with EmbeddingClient(address) as admin:
            admin.load_snapshot("base")
            loaded_at = time.monotonic()
            time.sleep(0.5)
            stop.set()
            thread.join(30)
            final = float(rows_of(admin, "t", counted)[0, 0])
    finally:
        stop.set()
        thread.join(30)
    codes = [code for code, _ in outcomes]
    aborted = [i for i, code in enumerate(codes) if code == "ABORTED"]
    assert len(aborted) == 1, codes  # told once
    kept = sum(1 for code in codes[aborted[0] + 1 :] if code == "ok")
    assert set(codes) <= {"ok", "ABORTED", "UNAVAILABLE"}, set(codes)
    assert kept > 0 and outcomes[-1][1] > loaded_at
    # every push acknowledged against the loaded rows is in them; none before was
    assert final == saved + kept, (final, saved, kept, codes.count("ok"))
    print(
        f"pushes during a load: {codes.count('ok')} acknowledged, {kept} after the load "
        f"(all kept), {codes.count('UNAVAILABLE')} refused as UNAVAILABLE, 1 ABORTED"
    )


# -- a shard knows its data dir --------------------------------------------------------------


def test_a_wiped_data_dir_is_told_to_the_clients_that_knew_the_old_one(tmp_path: Path) -> None:
    cluster = LocalCluster(
        2,
        tmp_path / "data",
        tmp_path / "snapshots",
        start_timeout_s=60,
        base_port=free_base_port(2),
    )
    keys = np.arange(40, dtype=np.int64)
    with cluster, EmbeddingClient(cluster.addresses) as client:
        client.create_table(counting("t", write_policy="write_through"))
        for _ in range(50):
            client.push_gradients("t", keys, ones(keys))
        assert cluster.stop_shard(1, sig=signal.SIGKILL) == -signal.SIGKILL
        shutil.rmtree(tmp_path / "data" / "shard-1")
        cluster.start_shard(1)
        with pytest.raises(ShardError) as told:
            client.push_gradients("t", keys, ones(keys))
        assert told.value.code is CODE.DATA_LOSS and told.value.shard_id == 1
        assert told.value.reason is Reason.DATA_DIR_CHANGED
        assert "another data dir" in told.value.details
        assert told.value.succeeded == [0]
        with EmbeddingClient(cluster.addresses) as fresh:  # a new client goes on
            stats = fresh.stats()
            assert stats[0]["data_id"] != stats[1]["data_id"]


# -- a call's work is bounded ----------------------------------------------------------------


def test_a_call_naming_too_many_tables_is_refused_before_any_lookup(
    shard_server: Any, connect: Any
) -> None:
    server = shard_server()
    stubs = connect(server)
    lookup = stubs.channel.unary_unary("/tierps.v1.EmbeddingService/LookupUnary")
    key = np.array([1], dtype=np.int64).tobytes()
    for count, code in ((MAX_BATCHES_PER_CALL, CODE.NOT_FOUND), (40_000, CODE.INVALID_ARGUMENT)):
        request = wire.encode_batches([(f"unknown-{i}", DIM, 0, (key,)) for i in range(count)])
        started = time.process_time()
        with pytest.raises(grpc.RpcError) as raised:
            lookup(request, timeout=60)
        assert raised.value.code() is code, raised.value.details()[:300]
        print(
            f"{count} unknown tables: {raised.value.code().name} after "
            f"{time.process_time() - started:.2f} s of this process's CPU"
        )
    assert str(MAX_BATCHES_PER_CALL) in raised.value.details()


def test_a_dim_past_every_table_is_invalid_not_too_large(shard_server: Any, connect: Any) -> None:
    server = shard_server()
    stubs = connect(server)
    lookup = stubs.channel.unary_unary("/tierps.v1.EmbeddingService/LookupUnary")
    request = wire.encode_batches([("t", 2**32 - 1, 0, (np.arange(4).tobytes(),))])
    with pytest.raises(grpc.RpcError) as raised:
        lookup(request, timeout=10)
    assert raised.value.code() is CODE.INVALID_ARGUMENT
    assert "field 'dim' expected in [1, " in raised.value.details()


def test_shard_checks_every_table_before_it_locks_any(tmp_path: Path) -> None:
    """A refusal found by the checks (an unknown table after a known one) takes no lock and
    changes nothing; the shard stays usable for the next call."""
    shard = Shard(ServerConfig(0, 1, tmp_path / "shard"))
    try:
        shard.admin.create_table(counting("a"))
        keys = np.arange(3, dtype=np.int64)
        with pytest.raises(InvalidArgumentError):
            shard.push_gradients(
                [
                    PushBatch("a", DIM, keys, ones(keys), 1),
                    PushBatch("a", DIM + 1, keys, np.ones((3, DIM + 1), np.float32), 1),
                ]
            )
        shard.push_gradients([PushBatch("a", DIM, keys, ones(keys), 1)])
        rows = shard.lookup([_lookup("a", keys)])[0]
        np.testing.assert_array_equal(rows, np.ones((keys.size, DIM), np.float32))
    finally:
        shard.close()


# -- a client is back within a second of its shard ------------------------------------------


@pytest.mark.slow
def test_a_client_reaches_a_restarted_shard_within_a_second_of_it_serving(
    tmp_path: Path,
) -> None:
    """The shard is down 8 s while the client keeps calling. With gRPC's default reconnect
    backoff (1 s growing 1.6x a try, to 120 s) its next try may come 6 s after the shard
    serves again; capped at 1 s (client.admin.RECONNECT_OPTIONS, +-20% jitter), it comes
    within 1.2 s: the bound below leaves room for a slow machine, not for the default."""
    cluster = LocalCluster(
        1,
        tmp_path / "data",
        tmp_path / "snapshots",
        start_timeout_s=60,
        base_port=free_base_port(1),
    )
    keys = np.arange(10, dtype=np.int64)
    with cluster, EmbeddingClient(cluster.addresses, timeout_s=2.0) as client:
        client.create_table(counting("t"))
        client.push_gradients("t", keys, ones(keys))
        assert cluster.stop_shard(0) == 0
        down_until = time.monotonic() + 8.0
        while time.monotonic() < down_until:
            with pytest.raises(ShardError) as refused:
                client.lookup("t", keys, create=False)
            assert refused.value.code in (CODE.UNAVAILABLE, CODE.DEADLINE_EXCEEDED)
        cluster.start_shard(0)  # returns once the shard answers health SERVING
        serving = time.monotonic()
        while True:
            try:
                rows = client.lookup("t", keys, create=False)
                break
            except ShardError:
                assert time.monotonic() - serving < 30
        back = time.monotonic() - serving
        np.testing.assert_array_equal(rows, np.ones((keys.size, DIM), np.float32))
        print(f"back {back:.2f} s after the shard served again (down 8 s)")
        assert back < 2.5, back


@pytest.mark.parametrize("generations", ["5", "0,0,7", "x,1"])
def test_a_generations_header_that_does_not_match_the_batches_is_refused(
    shard_server: Any, connect: Any, generations: str
) -> None:
    server = shard_server()
    with EmbeddingClient([f"127.0.0.1:{server.port}"]) as client:
        for name in ("a", "b"):
            client.create_table(counting(name))
    stubs = connect(server)
    keys = np.arange(3, dtype=np.int64)
    request = wire.encode_batches(
        [(name, DIM, 1, (keys.tobytes(), ones(keys).tobytes())) for name in ("a", "b")]
    )
    push = stubs.channel.unary_unary("/tierps.v1.EmbeddingService/PushGradientsUnary")
    with pytest.raises(grpc.RpcError) as raised:
        push(request, metadata=((wire.GENERATIONS_HEADER, generations),), timeout=10)
    assert raised.value.code() is CODE.INVALID_ARGUMENT, raised.value.details()
    assert wire.GENERATIONS_HEADER in raised.value.details()
    with EmbeddingClient([f"127.0.0.1:{server.port}"]) as client:
        for name in ("a", "b"):
            np.testing.assert_array_equal(rows_of(client, name, keys), np.zeros((3, DIM)))


@pytest.mark.parametrize("life", ["abc", "x/y", ""])
def test_a_life_header_that_is_none_is_invalid_not_data_loss(
    shard_server: Any, connect: Any, life: str
) -> None:
    server = shard_server()
    stubs = connect(server)
    lookup = stubs.channel.unary_unary("/tierps.v1.EmbeddingService/LookupUnary")
    request = wire.encode_batches([("t", DIM, 0, (np.arange(4).tobytes(),))])
    with pytest.raises(grpc.RpcError) as raised:
        lookup(request, metadata=(("tierps-life", life),), timeout=10)
    assert raised.value.code() is CODE.INVALID_ARGUMENT, raised.value.details()
    assert "tierps-life" in raised.value.details()
