"""Direct tables (use_hashtable=False, capacity=N) through real in-process shard servers on
port 0: keys in [0, N) look up and train as in a hashed table; a key outside that range is
refused with INVALID_ARGUMENT naming the table, the key and the range, and changes nothing.
With several shards, shard i of S holds the keys k % S == i of [0, N)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.integration.test_service_inprocess import (
    CODE,
    DIM,
    Connect,
    ServerFactory,
    as_keys,
    assert_same_state,
    assign,
    call_raw,
    create_table,
    describe,
    lookup,
    push,
    refused,
    sgd_oracle,
    shard_state,
    tier,
)
from tierps.client.admin import ClusterAdmin
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import wire
from tierps.storage import TableConfig, init, optim

CAPACITY = 50
LR = 0.5
DIRECT = TableConfig(
    "d",
    DIM,
    initializer=init.Normal(0.0, 0.1),
    optimizer=optim.SGD(lr=LR),
    seed=11,
    use_hashtable=False,
    capacity=CAPACITY,
)


def test_a_direct_table_serves_keys_in_range_and_refuses_the_others(
    shard_server: ServerFactory, connect: Connect
) -> None:
    server = shard_server()
    stubs = connect(server)
    assert create_table(stubs, DIRECT) is True
    keys = as_keys([0, 7, CAPACITY - 1, -1, 7])
    expected = DIRECT.initial_rows(as_keys([0, 7, CAPACITY - 1, 0, 7]))[:, :DIM]
    expected[3] = 0.0  # padding
    np.testing.assert_array_equal(lookup(stubs, "d", keys), expected)

    grads = np.random.default_rng(0).standard_normal((keys.size, DIM)).astype(np.float32)
    assert push(stubs, "d", keys, grads, step=1) == 3
    oracle = sgd_oracle(DIRECT, keys, grads, LR)
    got = lookup(stubs, "d", as_keys(sorted(oracle)))
    np.testing.assert_allclose(got, np.stack([oracle[k] for k in sorted(oracle)]), atol=1e-6)

    description = describe(stubs, "d")
    assert [t.name for t in description.tiers] == ["direct", "rocksdb"]
    assert tier(description, "direct").rows == 3
    assert tier(description, "direct").bytes >= CAPACITY * DIRECT.row_bytes
    assert tier(description, "direct").hits > 0

    before = shard_state(server)
    bad = as_keys([3, CAPACITY])
    needles = ("table 'd'", f"got key {CAPACITY} at index 1", f"[0, {CAPACITY})")
    refused(CODE.INVALID_ARGUMENT, lambda: lookup(stubs, "d", bad), *needles)
    refused(CODE.INVALID_ARGUMENT, lambda: lookup(stubs, "d", bad, create=False), *needles)
    refused(
        CODE.INVALID_ARGUMENT,
        lambda: push(stubs, "d", bad, np.ones((2, DIM), np.float32), 2),
        *needles,
    )
    refused(
        CODE.INVALID_ARGUMENT,
        lambda: assign(stubs, "d", bad, np.ones((2, DIM), np.float32)),
        *needles,
    )
    huge = as_keys([2**62])
    refused(CODE.INVALID_ARGUMENT, lambda: lookup(stubs, "d", huge), f"got key {2**62} at index 0")
    assert_same_state(before, shard_state(server))
    assert tier(describe(stubs, "d"), "direct").rows == 3
    assert describe(stubs, "d").created == 3


def test_a_key_out_of_range_in_a_later_batch_refuses_the_whole_call(
    shard_server: ServerFactory, connect: Connect
) -> None:
    server = shard_server()
    stubs = connect(server)
    create_table(stubs, TableConfig("t", DIM, optimizer=optim.SGD(lr=0.1)))
    create_table(stubs, DIRECT)
    push(stubs, "t", [1, 2], np.ones((2, DIM), np.float32), step=1)
    before = shard_state(server)
    good_keys = as_keys([1, 2, 3]).tobytes()
    bad_keys = as_keys([4, CAPACITY + 3, 5]).tobytes()
    values = np.ones((3, DIM), np.float32).tobytes()
    pushes = [
        *wire.push_requests("t", DIM, 2, good_keys, values),
        *wire.push_requests("d", DIM, 2, bad_keys, values),
    ]
    assigns = [
        pb.AssignRequest(table="t", dim=DIM, keys=good_keys, values=values),
        pb.AssignRequest(table="d", dim=DIM, keys=bad_keys, values=values),
    ]
    needles = ("table 'd'", f"got key {CAPACITY + 3} at index 1", f"[0, {CAPACITY})")
    refused(CODE.INVALID_ARGUMENT, lambda: call_raw(stubs, "PushGradients", pushes), *needles)
    refused(CODE.INVALID_ARGUMENT, lambda: call_raw(stubs, "Assign", assigns), *needles)
    assert_same_state(before, shard_state(server))
    # A training lookup too: table t's new keys get no row when table d's batch is refused.
    lookups = [
        pb.LookupRequest(table="t", dim=DIM, create=True, keys=good_keys),
        pb.LookupRequest(table="d", dim=DIM, create=True, keys=bad_keys),
    ]
    refused(CODE.INVALID_ARGUMENT, lambda: call_raw(stubs, "Lookup", lookups), *needles)
    refused(
        CODE.INVALID_ARGUMENT,
        lambda: stubs.embedding.LookupUnary(pb.LookupBatches(batches=lookups)),
        *needles,
    )
    assert_same_state(before, shard_state(server))


def test_shard_i_of_two_holds_the_keys_of_its_residue_in_range(
    shard_server: ServerFactory, connect: Connect
) -> None:
    server = shard_server(shard_id=1, num_shards=2)
    stubs = connect(server)
    create_table(stubs, DIRECT)
    mine = as_keys([1, 3, CAPACITY - 1])
    np.testing.assert_array_equal(lookup(stubs, "d", mine), DIRECT.initial_rows(mine)[:, :DIM])
    before = shard_state(server)
    # a key of this shard's residue beyond capacity: out of range
    refused(
        CODE.INVALID_ARGUMENT,
        lambda: lookup(stubs, "d", [5, CAPACITY + 1]),
        f"got key {CAPACITY + 1} at index 1",
        f"[0, {CAPACITY})",
    )
    # a key of the other shard: refused by the shard check, as for any table
    refused(CODE.INVALID_ARGUMENT, lambda: lookup(stubs, "d", [4]), "key 4 at index 0", "shard 0")
    assert_same_state(before, shard_state(server))


def test_save_load_and_restart_keep_a_direct_table(
    shard_server: ServerFactory, connect: Connect, tmp_path: Path
) -> None:
    servers = [shard_server(0, 2), shard_server(1, 2)]
    stubs = [connect(s) for s in servers]
    keys = np.arange(CAPACITY, dtype=np.int64)
    grads = np.random.default_rng(1).standard_normal((CAPACITY, DIM)).astype(np.float32)
    with ClusterAdmin([s.address for s in servers]) as admin:
        admin.create_table(DIRECT)
        for shard_id in (0, 1):
            mine = keys % 2 == shard_id
            push(stubs[shard_id], "d", keys[mine], grads[mine], step=1)
        weights = {
            shard_id: lookup(stubs[shard_id], "d", keys[keys % 2 == shard_id])
            for shard_id in (0, 1)
        }
        admin.save_snapshot("direct")
    oracle = sgd_oracle(DIRECT, keys, grads, LR)
    for shard_id, got in weights.items():
        want = np.stack([oracle[k] for k in range(shard_id, CAPACITY, 2)])
        np.testing.assert_allclose(got, want, atol=1e-6)

    # One shard loads both parts: every key of [0, capacity) is its.
    data_dir = tmp_path / "single"
    single = shard_server(0, 1, data_dir=data_dir)
    with ClusterAdmin([single.address]) as admin:
        assert admin.load_snapshot("direct")["rows"] == CAPACITY
    single_stubs = connect(single)
    merged = lookup(single_stubs, "d", keys, create=False)
    np.testing.assert_allclose(merged, np.stack([oracle[k] for k in range(CAPACITY)]), atol=1e-6)
    assert [t.name for t in describe(single_stubs, "d").tiers] == ["direct", "rocksdb"]
    state = shard_state(single)
    single.stop(grace_s=0.5)

    # Restart on the same data dir: the rows come back from RocksDB.
    again = shard_server(0, 1, data_dir=data_dir)
    assert_same_state(state, shard_state(again))
    again_stubs = connect(again)
    np.testing.assert_array_equal(lookup(again_stubs, "d", keys, create=False), merged)
    refused(CODE.INVALID_ARGUMENT, lambda: lookup(again_stubs, "d", [CAPACITY]), "[0, 50)")
