"""Limits a misbehaving client cannot break (server/limits.py), against real servers: a
flood of idle streams leaves health and other clients' lookups answering, an abandoned
stream is cancelled and frees its slot, and a refused 1 GiB push costs the shard (a real
subprocess, its RSS read from /proc) at most its in-flight byte budget and a few
messages."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierps.client import EmbeddingClient, TableConfig
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto import wire
from tierps.server.cluster import LocalCluster
from tierps.server.daemon import ShardServer

CODE = grpc.StatusCode
DIM = 4
FLOOD = 64


def idle_lookup(release: threading.Event) -> Iterator[pb.LookupRequest]:
    """A Lookup stream that sends one message and then waits, as an abandoned client."""
    yield pb.LookupRequest(table="t", dim=DIM, keys=np.arange(2, dtype="<i8").tobytes())
    release.wait()


def test_a_flood_of_idle_streams_leaves_health_and_other_lookups_answering(
    shard_server: Callable[..., ShardServer],
) -> None:
    server = shard_server()  # 127.0.0.1, the default limits
    server.shard.create_table(TableConfig(name="t", dim=DIM))
    release = threading.Event()
    channels = [grpc.insecure_channel(server.address) for _ in range(4)]
    try:
        calls = [
            pb_grpc.EmbeddingServiceStub(channels[i % 4]).Lookup(idle_lookup(release), timeout=60)
            for i in range(FLOOD)
        ]
        deadline = time.monotonic() + 20
        while sum(c.done() for c in calls) < FLOOD - server.limits.max_receiving:
            assert time.monotonic() < deadline, "the flood beyond the limit was not refused"
            time.sleep(0.01)
        refused = [c for c in calls if c.done()]
        assert {c.code() for c in refused} == {CODE.RESOURCE_EXHAUSTED}
        assert server.limits.receiving == server.limits.max_receiving  # the rest wait, idle
        with (
            grpc.insecure_channel(server.address) as other,
            EmbeddingClient([server.address], timeout_s=5) as client,
        ):
            latencies = []
            for _ in range(3):
                started = time.perf_counter()
                status = health_pb2_grpc.HealthStub(other).Check(
                    health_pb2.HealthCheckRequest(), timeout=1.0
                )
                assert status.status == health_pb2.HealthCheckResponse.SERVING
                rows = client.lookup("t", np.arange(10), create=False)
                elapsed = time.perf_counter() - started
                assert rows.shape == (10, DIM)
                assert elapsed < 1.0, f"health + lookup took {elapsed:.3f} s under the flood"
                latencies.append(elapsed)
            print(f"under {FLOOD} idle streams: health + lookup in {max(latencies) * 1e3:.1f} ms")
        release.set()
        for call in calls:
            if call not in refused:
                assert len(list(call)) == 1  # the waiting streams, ended, are served
    finally:
        release.set()
        for channel in channels:
            channel.close()
    assert server.limits.calls == 0 and server.limits.receiving == 0


def test_an_abandoned_stream_is_cancelled_after_its_idle_time_and_frees_its_slot(
    shard_server: Callable[..., ShardServer],
) -> None:
    server = shard_server(stream_idle_s=0.3, max_receiving_streams=1)
    server.shard.create_table(TableConfig(name="t", dim=DIM))
    release = threading.Event()
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        abandoned = stub.Lookup(idle_lookup(release), timeout=30)
        time.sleep(0.05)
        second = stub.Lookup(idle_lookup(release), timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            list(second)
        assert refused.value.code() is CODE.RESOURCE_EXHAUSTED  # the one slot is taken
        with pytest.raises(grpc.RpcError) as cancelled:
            list(abandoned)
        assert cancelled.value.code() is CODE.CANCELLED
        release.set()
        keys = np.arange(3, dtype="<i8").tobytes()
        request = pb.LookupRequest(table="t", dim=DIM, create=True, keys=keys)
        assert len(list(stub.Lookup(iter([request]), timeout=10))) == 1  # the slot is free
    assert server.limits.calls == 0 and server.limits.receiving == 0
    cancelled_count = server.metrics.refusals.labels(
        "/tierps.v1.EmbeddingService/Lookup", "CANCELLED", "idle"
    )
    assert cancelled_count._value.get() == 1


def test_calls_beyond_the_cap_are_refused_and_health_still_answers(
    shard_server: Callable[..., ShardServer],
) -> None:
    server = shard_server(max_workers=2, max_receiving_streams=2, stream_idle_s=30)
    server.shard.create_table(TableConfig(name="t", dim=DIM))
    release = threading.Event()
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        waiting = [stub.Lookup(idle_lookup(release), timeout=30) for _ in range(2)]
        deadline = time.monotonic() + 10
        while server.limits.calls < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        lookup = channel.unary_unary("/tierps.v1.EmbeddingService/LookupUnary")
        batch = wire.encode_batches([("t", DIM, 0, (np.arange(2, dtype="<i8"),))])
        with pytest.raises(grpc.RpcError) as refused:
            lookup(batch, timeout=5)
        assert refused.value.code() is CODE.RESOURCE_EXHAUSTED
        assert "2 calls at once" in refused.value.details()
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
        release.set()
        assert all(len(list(call)) == 1 for call in waiting)
        assert lookup(batch, timeout=5)  # answered once the slots are back


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def tier_rows(client: EmbeddingClient) -> list[int]:
    return [tier["rows"] for tier in client.describe("t")[0]["tiers"]]


BUDGET_MIB = 64
PUSH_BYTES = 1 << 30


def test_a_refused_1gib_push_costs_at_most_the_byte_budget_and_a_few_messages(
    tmp_path: Path,
) -> None:
    """The shard (a subprocess) holds at most max_inflight_bytes of a call's messages, and
    lets go of them once it refused the call. The bound on its peak RSS is that budget plus
    16 messages of CHUNK_BYTES: the message being read lives in three forms at once (gRPC's
    bytes, protobuf's, the field's copy), gRPC core buffers what the flow-control window
    lets in, and the allocator keeps what it freed (measured: 30 to 55 MiB over the budget,
    against the 1 GiB the push carries). Afterwards RSS is back within 8 messages of where
    it was."""
    args = ("--max-inflight-mb", str(BUDGET_MIB), "--flush-interval-s", "0")
    with (
        LocalCluster(1, tmp_path / "cluster", extra_args=args) as cluster,
        EmbeddingClient(cluster.addresses, timeout_s=60) as client,
    ):
        dim = 256
        client.create_table(TableConfig(name="t", dim=dim))
        client.lookup("t", np.arange(1000))  # warm: the call path's own allocations
        pid = cluster._processes[0].pid
        rows_before = tier_rows(client)
        before_rss = _status_kib(pid, "VmRSS")
        before_peak = _status_kib(pid, "VmHWM")
        rows = wire.CHUNK_BYTES // (8 + 4 * dim)
        keys = np.arange(rows, dtype="<i8").tobytes()
        grads = np.zeros((rows, dim), "<f4").tobytes()
        chunk = pb.PushGradientsRequest(table="t", dim=dim, step=1, keys=keys, grads=grads)
        messages = PUSH_BYTES // chunk.ByteSize() + 1

        def requests() -> Iterator[pb.PushGradientsRequest]:
            for _ in range(messages):
                yield chunk

        stub = pb_grpc.EmbeddingServiceStub(client._channels[0])
        with pytest.raises(grpc.RpcError) as refused:
            stub.PushGradients(requests(), timeout=60)
        assert refused.value.code() is CODE.RESOURCE_EXHAUSTED
        assert f"at most {BUDGET_MIB << 20}" in refused.value.details()
        peak = _status_kib(pid, "VmHWM")
        grown_kib = peak - max(before_peak, before_rss)
        bound_kib = (BUDGET_MIB << 10) + 16 * (wire.CHUNK_BYTES >> 10)
        print(f"refused 1 GiB push: peak RSS {peak / 1024:.0f} MiB, grown {grown_kib / 1024:.1f} "
              f"MiB over {max(before_peak, before_rss) / 1024:.0f} MiB; bound "
              f"{bound_kib / 1024:.0f} MiB")  # fmt: skip
        assert grown_kib <= bound_kib
        deadline = time.monotonic() + 5
        while _status_kib(pid, "VmRSS") > before_rss + 8 * (wire.CHUNK_BYTES >> 10):
            assert time.monotonic() < deadline, "the refused push's memory stayed"
            time.sleep(0.1)
        assert tier_rows(client) == rows_before  # nothing of the push was applied
