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

from tests import refused_memory
from tests.certs import Certs, make_certs
from tierps.client import EmbeddingClient, TableConfig
from tierps.client.embedding import DEFAULT_MAX_CALL_BYTES
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto import wire
from tierps.server.cluster import LocalCluster
from tierps.server.config import MAX_BATCH_BYTES, ServerConfig, max_call_request_bytes
from tierps.server.daemon import ShardServer
from tierps.server.limits import RECEIVE_WINDOW_OPTIONS
from tierps.storage import optim

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
    server.shard.admin.create_table(TableConfig(name="t", dim=DIM))
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
    server = shard_server(stream_idle_s=1.0, max_receiving_streams=1)
    server.shard.admin.create_table(TableConfig(name="t", dim=DIM))
    release = threading.Event()
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        abandoned = stub.Lookup(idle_lookup(release), timeout=30)
        deadline = time.monotonic() + 5  # admitted (under load, not within a fixed sleep)
        while not server.limits.receiving:
            assert time.monotonic() < deadline, "the first stream was never admitted"
            time.sleep(0.005)
        second = stub.Lookup(idle_lookup(release), timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            list(second)
        assert refused.value.code() is CODE.RESOURCE_EXHAUSTED  # the one slot is taken
        with pytest.raises(grpc.RpcError) as cancelled:
            list(abandoned)
        assert cancelled.value.code() is CODE.CANCELLED
        release.set()
        deadline = time.monotonic() + 5  # the client hears CANCELLED before the shard's
        while server.limits.receiving:  # thread has unwound the call and given its slot back
            assert time.monotonic() < deadline, "the cancelled stream's slot was not given back"
            time.sleep(0.01)
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
    server.shard.admin.create_table(TableConfig(name="t", dim=DIM))
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
    lets go of them once it refused the call. Its peak RSS, from its RSS just before the
    push, grows by at most that budget plus 16 messages of CHUNK_BYTES. Live at the refusal,
    beyond the budget (the bulk fields of the messages taken), 6 messages: the refused one
    (counted only once read: gRPC's bytes and protobuf's message), the batch's first message
    and the previous one (protobuf's copies, held while the next is read), and in gRPC core
    its stream's flow-control window and the message it assembles (server/limits.py pins
    the window to one message: with gRPC's BDP probe it grew under CPU load, 8 messages
    ahead). The other 10: freed message-sized blocks the allocator keeps in its per-thread
    arenas (measured, not derived: 5 at most under 4 busy loops on 2 cores; twice that
    allowed). Afterwards RSS is back within 8 messages of where it was."""
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
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # its peak RSS (VmHWM) := its RSS
        before_rss = _status_kib(pid, "VmRSS")
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
        grown_kib = peak - before_rss
        bound_kib = (BUDGET_MIB << 10) + (6 + 10) * (wire.CHUNK_BYTES >> 10)
        print(
            f"refused 1 GiB push: peak RSS {peak / 1024:.0f} MiB, grown {grown_kib / 1024:.1f} "
            f"MiB over {before_rss / 1024:.0f} MiB; bound "
            f"{bound_kib / 1024:.0f} MiB"
        )
        assert grown_kib <= bound_kib
        deadline = time.monotonic() + 5
        while _status_kib(pid, "VmRSS") > before_rss + 8 * (wire.CHUNK_BYTES >> 10):
            assert time.monotonic() < deadline, "the refused push's memory stayed"
            time.sleep(0.1)
        assert tier_rows(client) == rows_before  # nothing of the push was applied


def push_chunk(dim: int, step: int = 1) -> pb.PushGradientsRequest:
    """One stream message of about CHUNK_BYTES: what a client streaming a push sends."""
    rows = wire.CHUNK_BYTES // (8 + 4 * dim)
    keys = np.arange(rows, dtype="<i8").tobytes()
    grads = np.zeros((rows, dim), "<f4").tobytes()
    return pb.PushGradientsRequest(table="t", dim=dim, step=step, keys=keys, grads=grads)


def test_a_declared_1gib_push_is_refused_before_a_message_is_read(tmp_path: Path) -> None:
    """With the default limits, a push declaring 1 GiB (wire.REQUEST_BYTES_HEADER, as
    EmbeddingClient declares every call) is over the per-call limit: the shard (a subprocess,
    RSS from /proc) refuses it before reading a message. It costs what gRPC core takes off
    the socket before the refusal reaches the client: its flow-control window (one message:
    server/limits.py pins it) and the message it was assembling (CHUNK_BYTES):
    the bound is 4 messages of CHUNK_BYTES, against the ~100 MiB an undeclared push costs
    with a 64 MiB budget (the test above)."""
    with (
        LocalCluster(1, tmp_path / "cluster", extra_args=("--flush-interval-s", "0")) as cluster,
        EmbeddingClient(cluster.addresses, timeout_s=60) as client,
    ):
        dim = 256
        client.create_table(TableConfig(name="t", dim=dim))
        client.lookup("t", np.arange(1000))  # warm: the call path's own allocations
        pid = cluster._processes[0].pid
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # its peak RSS (VmHWM) := its RSS
        before_rss = _status_kib(pid, "VmRSS")
        chunk = push_chunk(dim)
        messages = PUSH_BYTES // chunk.ByteSize() + 1
        declared = messages * chunk.ByteSize()
        stub = pb_grpc.EmbeddingServiceStub(client._channels[0])
        started = time.perf_counter()
        with pytest.raises(grpc.RpcError) as refused:
            stub.PushGradients(
                (chunk for _ in range(messages)), timeout=60, metadata=wire.declared(declared)
            )
        elapsed = time.perf_counter() - started
        assert refused.value.code() is CODE.RESOURCE_EXHAUSTED
        limit = max_call_request_bytes(MAX_BATCH_BYTES)
        details = refused.value.details()
        assert f"shard 0: request of {declared} bytes declared" in details
        assert f"at most {limit} bytes per call" in details
        peak = _status_kib(pid, "VmHWM")
        grown_kib = peak - before_rss
        bound_kib = 4 * (wire.CHUNK_BYTES >> 10)
        print(
            f"refused declared 1 GiB push in {elapsed * 1e3:.0f} ms: peak RSS "
            f"{peak / 1024:.0f} MiB, grown {grown_kib / 1024:.1f} MiB over "
            f"{before_rss / 1024:.0f} MiB; bound "
            f"{bound_kib / 1024:.0f} MiB"
        )
        assert grown_kib <= bound_kib
        assert client.describe("t")[0]["current_step"] == 0  # nothing of the push was applied


def held_push(
    dim: int, keys: np.ndarray, step: int, sent_first: threading.Event, go: threading.Event
) -> Iterator[pb.PushGradientsRequest]:
    """A push stream that sends its first message, then waits for `go` before the rest."""
    grads = np.ones((keys.size, dim), "<f4").tobytes()
    for index, message in enumerate(
        wire.push_requests("t", dim, step, keys.astype("<i8").tobytes(), grads, 1 << 20)
    ):
        if index == 1:
            sent_first.set()
            go.wait(30)
        yield message


def test_declared_calls_reserve_the_budget_and_one_past_it_is_refused(
    shard_server: Callable[..., ShardServer],
) -> None:
    """Two pushes declaring 6 MiB each hold 12 MiB of a 16 MiB budget from their admission,
    while they still send; a third declaring 6 MiB is refused at once, naming its size and
    what was left; the two complete, their rows updated as numpy says (SGD lr 1: -1 each)."""
    budget, dim, n = 16 << 20, 60, 26_000
    server = shard_server(max_inflight_bytes=budget)
    server.shard.admin.create_table(TableConfig(name="t", dim=dim, optimizer=optim.SGD(lr=1.0)))
    declared = wire.stream_bytes("t", dim, 1, n, 4 * dim, 1 << 20)
    assert 6 << 20 < declared < 7 << 20
    go = threading.Event()
    with EmbeddingClient([server.address], timeout_s=30) as client:
        before = client.lookup("t", np.arange(3 * n))
        stub = pb_grpc.EmbeddingServiceStub(client._channels[0])
        started, calls = [], []
        for index in range(2):
            started.append(threading.Event())
            keys = np.arange(index * n, (index + 1) * n)
            stream = held_push(dim, keys, index + 1, started[index], go)
            calls.append(
                stub.PushGradients.future(stream, timeout=30, metadata=wire.declared(declared))
            )
        assert all(event.wait(10) for event in started)
        # a stream's first message is on its way once its generator is asked for the second:
        # the shard admits the call (and reserves its bytes) a moment later
        deadline = time.monotonic() + 10
        while server.limits.inflight_bytes < 2 * declared and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.limits.inflight_bytes == 2 * declared  # reserved, not yet all received
        third = held_push(dim, np.arange(2 * n, 3 * n), 3, threading.Event(), go)
        with pytest.raises(grpc.RpcError) as refused:
            stub.PushGradients(third, timeout=30, metadata=wire.declared(declared))
        assert refused.value.code() is CODE.RESOURCE_EXHAUSTED
        assert (
            f"shard 0: request of {declared} bytes declared (tierps-request-bytes), expected "
            f"at most the {budget - 2 * declared} bytes left of this shard's budget of "
            f"{budget}"
        ) in refused.value.details()
        go.set()
        assert [call.result().num_keys for call in calls] == [n, n]
        after = client.lookup("t", np.arange(3 * n))
        np.testing.assert_array_equal(after[: 2 * n], before[: 2 * n] - np.float32(1))
        np.testing.assert_array_equal(after[2 * n :], before[2 * n :])  # the refused push
    assert server.limits.inflight_bytes == 0 and server.limits.calls == 0


def test_a_call_sending_more_than_it_declared_is_cut_off_at_the_budget(
    shard_server: Callable[..., ShardServer],
) -> None:
    """A push declaring 1 MiB that sends 40 MiB is counted past its declaration as its
    messages arrive, and cut off at the 16 MiB budget, as an undeclared one; a declaration
    that is not a size is INVALID_ARGUMENT."""
    budget, dim = 16 << 20, 256
    server = shard_server(max_inflight_bytes=budget)
    server.shard.admin.create_table(TableConfig(name="t", dim=dim))
    chunk = push_chunk(dim)
    stub = pb_grpc.EmbeddingServiceStub(grpc.insecure_channel(server.address))
    with pytest.raises(grpc.RpcError) as cut:
        stub.PushGradients((chunk for _ in range(10)), timeout=30, metadata=wire.declared(1 << 20))
    assert cut.value.code() is CODE.RESOURCE_EXHAUSTED
    assert f"expected at most {budget} on this shard" in cut.value.details()
    assert f"{1 << 20} declared" in cut.value.details()
    with pytest.raises(grpc.RpcError) as malformed:
        stub.PushGradients(iter([chunk]), timeout=30, metadata=(("tierps-request-bytes", "-1"),))
    assert malformed.value.code() is CODE.INVALID_ARGUMENT
    assert "'tierps-request-bytes' expected the call's request bytes" in malformed.value.details()
    assert server.limits.inflight_bytes == 0 and server.limits.calls == 0
    assert server.shard.describe("t")["current_step"] == 0  # nothing applied


@pytest.mark.parametrize("num_shards", [1, 2])
@pytest.mark.parametrize("one_message_bytes", [wire.ONE_MESSAGE_BYTES, 0], ids=["one", "stream"])
def test_a_large_push_the_client_splits_fits_the_shards_limits(
    shard_server: Callable[..., ShardServer], one_message_bytes: int, num_shards: int
) -> None:
    """The client's calls of max_call_bytes of bulk fit a shard whose max_batch_bytes is the
    same, scaled down (4 MiB, a 10 MiB push a shard in three calls to it, on 1 and 2 shards:
    never more than two at once to one shard), as one message or streamed; and the defaults
    agree: a call of DEFAULT_MAX_CALL_BYTES fits the default per-call limit, and two of them
    the default budget."""
    batch, dim, n = 4 << 20, 64, 40_000 * num_shards  # 10.6 MB of keys and gradients a shard
    servers = [
        shard_server(
            shard_id=i,
            num_shards=num_shards,
            max_batch_bytes=batch,
            max_inflight_bytes=2 * max_call_request_bytes(batch),
        )
        for i in range(num_shards)
    ]
    for server in servers:
        server.shard.admin.create_table(TableConfig(name="t", dim=dim, optimizer=optim.SGD(lr=1.0)))
    with EmbeddingClient(
        [server.address for server in servers],
        max_call_bytes=batch,
        one_message_bytes=one_message_bytes,
    ) as client:
        keys = np.arange(n)
        before = client.lookup("t", keys)
        assert client.push_gradients("t", keys, np.ones((n, dim), np.float32)) == n
        np.testing.assert_array_equal(client.lookup("t", keys), before - np.float32(1))
    for server in servers:
        refusals = server.metrics.refusals.labels
        for method in ("PushGradients", "PushGradientsUnary"):  # none refused for its bytes
            for cause in ("declared", "bytes"):
                refused = refusals(
                    f"/tierps.v1.EmbeddingService/{method}", "RESOURCE_EXHAUSTED", cause
                )
                assert refused._value.get() == 0
    default_call = DEFAULT_MAX_CALL_BYTES // (8 + 4 * dim)  # keys of the widest default call
    streamed = wire.stream_bytes("t" * 255, dim, 2**63, default_call, 4 * dim)
    assert streamed <= max_call_request_bytes(MAX_BATCH_BYTES)
    defaults = ServerConfig(shard_id=0, num_shards=1, data_dir=Path())
    assert 2 * streamed <= defaults.max_inflight_bytes


# -- one-message calls: admitted before their message is read -----------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def big_push() -> bytes:
    return refused_memory.push_request(refused_memory.CALL_MIB << 20)


EXPECTED = {  # each case's status code, and words its refusal says
    "no token": (CODE.UNAUTHENTICATED, "expected metadata 'authorization: Bearer TOKEN'"),
    "reader token (may not push)": (CODE.PERMISSION_DENIED, "role 'reader' may not call"),
    "trainer, budget taken, declared": (CODE.RESOURCE_EXHAUSTED, "bytes declared"),
    "trainer, budget taken, undeclared": (CODE.RESOURCE_EXHAUSTED, "declared none"),
    "trainer, budget 200 MiB < one call": (CODE.RESOURCE_EXHAUSTED, "larger than max"),
}
SLACK_MESSAGES = 4  # the allocator's own: freed message-sized blocks it keeps


@pytest.mark.slow
@pytest.mark.parametrize("case", refused_memory.CASES, ids=lambda case: case.name)
def test_refused_one_message_calls_cost_the_shard_one_window_each(
    tmp_path: Path, certs: Certs, big_push: bytes, case: refused_memory.Case
) -> None:
    """8 one-message pushes of 250 MiB at once to a TLS + tokens shard (a subprocess, its
    peak RSS from /proc): without a token, with a reader's (which may not push), or with a
    trainer's while other calls hold the whole in-flight budget (declared as EmbeddingClient
    does, or declaring nothing), or to a shard whose budget is below one such call. Each is
    refused before its message is read: the shard holds of it at most the one stream
    window gRPC buffers ahead (RECEIVE_WINDOW_OPTIONS' lookahead). Bound: the bytes of the
    calls it admitted (the budget's holders' first messages), one window per refused call,
    and SLACK_MESSAGES messages of CHUNK_BYTES."""
    result = refused_memory.measure(case, tmp_path, certs, big_push)
    code, words = EXPECTED[case.name]
    window = dict(RECEIVE_WINDOW_OPTIONS)["grpc.http2.lookahead_bytes"]
    bound_kib = (
        result.admitted_bytes + refused_memory.CALLS * window + SLACK_MESSAGES * wire.CHUNK_BYTES
    ) >> 10
    print(
        f"\n{refused_memory.table([result])}\nbound: {bound_kib / 1024:.0f} MiB over the "
        f"baseline; refusal: {result.details[:200]}"
    )
    assert result.codes == (code.name,) * refused_memory.CALLS
    assert words in result.details
    assert result.peak_kib - result.baseline_kib <= bound_kib


def test_a_one_message_call_over_the_receive_limit_is_refused_unread_and_goes_as_a_stream(
    shard_server: Callable[..., ShardServer],
) -> None:
    """A shard whose largest request message (max_message_bytes) is below a push's bytes
    refuses the one-message call by its declaration, before reading it, as too large for one
    message; EmbeddingClient sends the push again as a stream, and it applies once."""
    dim, n = 64, 40_000  # 10.6 MB of keys and gradients
    server = shard_server(max_message_bytes=6 << 20)
    assert server.limits.max_message_bytes == 6 << 20
    server.shard.admin.create_table(TableConfig(name="t", dim=dim, optimizer=optim.SGD(lr=1.0)))
    with EmbeddingClient([server.address], timeout_s=30) as client:
        keys = np.arange(n)
        before = client.lookup("t", keys)
        assert client.push_gradients("t", keys, np.ones((n, dim), np.float32)) == n
        np.testing.assert_array_equal(client.lookup("t", keys), before - np.float32(1))
    refused = server.metrics.refusals.labels(
        "/tierps.v1.EmbeddingService/PushGradientsUnary", "RESOURCE_EXHAUSTED", "declared"
    )
    assert refused._value.get() == 1
    assert server.limits.inflight_bytes == 0 and server.limits.calls == 0


def test_an_undeclared_one_message_data_call_reserves_the_receive_limit(
    shard_server: Callable[..., ShardServer],
) -> None:
    """With 16 MiB of budget (so a message of at most 16 MiB), a one-message lookup that
    declares nothing could bring 16 MiB: while a stream holds 6 MiB of the budget it is
    refused before it is read, naming what to do; declared, the same lookup is served, and
    so is an admin call (whose messages carry no bulk); with the budget free again, it is
    served undeclared too, and holds only its bytes once read."""
    budget, dim, n = 16 << 20, 60, 26_000
    server = shard_server(max_inflight_bytes=budget)
    assert server.limits.max_message_bytes == budget
    server.shard.admin.create_table(TableConfig(name="t", dim=dim))
    lookup_batch = wire.encode_batches([("t", dim, 0, (np.arange(4, dtype="<i8"),))])
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        lookup = channel.unary_unary("/tierps.v1.EmbeddingService/LookupUnary")
        sent, go = threading.Event(), threading.Event()
        declared = wire.stream_bytes("t", dim, 1, n, 4 * dim, 1 << 20)
        holder = stub.PushGradients.future(
            held_push(dim, np.arange(n), 1, sent, go),
            timeout=30,
            metadata=wire.declared(declared),
        )
        try:
            assert sent.wait(10)
            with pytest.raises(grpc.RpcError) as refused:
                lookup(lookup_batch, timeout=10)
            assert refused.value.code() is CODE.RESOURCE_EXHAUSTED
            assert (
                f"a one-message request of up to {budget} bytes (the receive limit: it "
                f"declared none in tierps-request-bytes), expected at most the "
                f"{budget - declared} bytes left"
            ) in refused.value.details()
            assert lookup(lookup_batch, timeout=10, metadata=wire.declared(len(lookup_batch)))
            tables = pb_grpc.AdminServiceStub(channel).ListTables(pb.ListTablesRequest())
            assert [t.name for t in tables.tables] == ["t"]
        finally:
            go.set()
        assert holder.result().num_keys == n
        assert lookup(lookup_batch, timeout=10)
    assert server.limits.inflight_bytes == 0 and server.limits.calls == 0


def test_a_one_message_call_whose_message_never_comes_is_cancelled_or_refused(
    shard_server: Callable[..., ShardServer],
) -> None:
    """A one-message call is admitted before its message is read, so a client that opens
    one and sends nothing holds a call slot until the idle watchdog cancels it; one that
    ends without a message is INVALID_ARGUMENT. Both give their slot back."""
    server = shard_server(stream_idle_s=0.3)
    release = threading.Event()

    def nothing_until_released() -> Iterator[bytes]:
        release.wait(30)
        yield from ()

    with grpc.insecure_channel(server.address) as channel:
        push = channel.stream_unary("/tierps.v1.EmbeddingService/PushGradientsUnary")
        try:
            with pytest.raises(grpc.RpcError) as cancelled:
                push(nothing_until_released(), timeout=30, metadata=wire.declared(100))
            assert cancelled.value.code() is CODE.CANCELLED
        finally:
            release.set()
        with pytest.raises(grpc.RpcError) as empty:
            push(iter(()), timeout=30)
        assert empty.value.code() is CODE.INVALID_ARGUMENT
        assert "PushGradientsUnary expected one request message, got none" in (
            empty.value.details()
        )
    deadline = time.monotonic() + 5
    while server.limits.calls or server.limits.inflight_bytes:
        assert time.monotonic() < deadline, "a call's slot or bytes were not given back"
        time.sleep(0.01)
