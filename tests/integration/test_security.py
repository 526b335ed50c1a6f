"""TLS and tokens with roles against real shard servers on port 0 (server/security.py,
client/security.py): certificates made here with the `cryptography` package, every rpc
tried with each role's token, and what a refusal leaves (nothing changed, counted in the
metrics, logged without the token)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.certs import Certs, make_certs
from tierps.client import ChannelSecurity, EmbeddingClient, ShardError, TableConfig
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto import wire
from tierps.server import cli, security
from tierps.server.cluster import wait_until_serving
from tierps.server.daemon import ShardServer, host_port

CODE = grpc.StatusCode
DIM = 4
TOKENS = {
    "admin": "admin-token-0123456789abcdef",
    "trainer": "trainer-token-0123456789abcdef",
    "reader": "reader-token-0123456789abcdef",
}
REFUSED = (CODE.UNAUTHENTICATED, CODE.PERMISSION_DENIED)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("# role:token\n" + "\n".join(f"{r}:{t}" for r, t in TOKENS.items()) + "\n")
    return path


def health(channel: grpc.Channel) -> Any:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


# -- TLS ---------------------------------------------------------------------------------------


def test_a_plain_client_is_refused_on_a_tls_port_and_a_client_trusting_the_ca_is_served(
    shard_server: Callable[..., ShardServer], certs: Certs
) -> None:
    server = shard_server(tls_cert=certs.server_cert, tls_key=certs.server_key, health_port=0)
    with grpc.insecure_channel(server.address) as plain, pytest.raises(grpc.RpcError) as refused:
        health(plain)
    assert refused.value.code() is CODE.UNAVAILABLE
    # the health port alone speaks plaintext, for probes that cannot speak TLS; nothing else
    with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as probe:
        assert health(probe) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as unimplemented:
            pb_grpc.AdminServiceStub(probe).ListTables(pb.ListTablesRequest(), timeout=5)
        assert unimplemented.value.code() is CODE.UNIMPLEMENTED
    with EmbeddingClient(
        [server.address], timeout_s=10, security=ChannelSecurity(ca_file=certs.ca)
    ) as client:
        client.create_table(TableConfig(name="t", dim=DIM))
        keys = np.arange(5)
        client.assign("t", keys, np.ones((5, DIM), np.float32))
        np.testing.assert_array_equal(client.lookup("t", keys), np.ones((5, DIM), np.float32))
    # a CA that did not sign the server's certificate: refused too
    other = make_certs(certs.ca.parent / "other")
    with (
        ChannelSecurity(ca_file=other.ca).channel(server.address) as wrong_ca,
        pytest.raises(grpc.RpcError) as refused,
    ):
        health(wrong_ca)
    assert refused.value.code() is CODE.UNAVAILABLE


def test_mutual_tls_refuses_a_client_without_a_certificate(
    shard_server: Callable[..., ShardServer], certs: Certs
) -> None:
    server = shard_server(
        tls_cert=certs.server_cert, tls_key=certs.server_key, tls_client_ca=certs.ca
    )
    with (
        ChannelSecurity(ca_file=certs.ca).channel(server.address) as no_cert,
        pytest.raises(grpc.RpcError) as refused,
    ):
        health(no_cert)
    assert refused.value.code() is CODE.UNAVAILABLE
    mutual = ChannelSecurity(
        ca_file=certs.ca, cert_file=certs.client_cert, key_file=certs.client_key
    )
    with mutual.channel(server.address) as channel:
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING


# -- tokens and roles --------------------------------------------------------------------------


def _lookup_stream(create: bool) -> Callable[[grpc.Channel, Any], Any]:
    def call(channel: grpc.Channel, md: Any) -> Any:
        keys = np.arange(3, dtype="<i8").tobytes()
        requests = [
            pb.LookupRequest(table="t", dim=DIM, create=False, keys=keys[:8]),
            pb.LookupRequest(create=create, keys=keys[8:]),
        ]
        stub = pb_grpc.EmbeddingServiceStub(channel)
        return list(stub.Lookup(iter(requests), metadata=md, timeout=5))

    return call


def _lookup_unary(create: bool) -> Callable[[grpc.Channel, Any], Any]:
    def call(channel: grpc.Channel, md: Any) -> Any:
        keys = np.arange(100, 103, dtype="<i8")
        batches = [("t", DIM, 0, (keys[:1],)), ("t", DIM, int(create), (keys[1:],))]
        lookup = channel.unary_unary("/tierps.v1.EmbeddingService/LookupUnary")
        return lookup(wire.encode_batches(batches), metadata=md, timeout=5)

    return call


def _admin(method: str, request: Any) -> Callable[[grpc.Channel, Any], Any]:
    def call(channel: grpc.Channel, md: Any) -> Any:
        reply = getattr(pb_grpc.AdminServiceStub(channel), method)(request, metadata=md, timeout=5)
        return list(reply) if method in ("SaveSnapshot", "LoadSnapshot") else reply

    return call


def _data(channel: grpc.Channel, md: Any, method: str) -> Any:
    stub = pb_grpc.EmbeddingServiceStub(channel)
    keys = np.arange(3, dtype="<i8").tobytes()
    rows = np.zeros((3, DIM), "<f4").tobytes()
    if method == "Assign":
        request = pb.AssignRequest(table="t", dim=DIM, keys=keys, values=rows)
        return stub.Assign(iter([request]), metadata=md, timeout=5)
    if method == "PushGradients":
        request = pb.PushGradientsRequest(table="t", dim=DIM, step=1, keys=keys, grads=rows)
        return stub.PushGradients(iter([request]), metadata=md, timeout=5)
    batches = [("t", DIM, 1, (np.arange(3, dtype="<i8"), np.zeros((3, DIM), "<f4")))]
    push = channel.unary_unary("/tierps.v1.EmbeddingService/PushGradientsUnary")
    return push(wire.encode_batches(batches), metadata=md, timeout=5)


def _push_then_lookup(channel: grpc.Channel, md: Any) -> Any:
    keys = np.arange(3, dtype="<i8")
    push = [("t", DIM, 1, (3 * 8, 3 * 4 * DIM))]  # zero gradients: filled as zeros below
    request, fields = wire.encode_push_then_lookup_in_place(push, [("t", DIM, 0, (keys,))])
    for view in fields[0]:
        view[...] = 0
    fields[0][0].view("<i8")[...] = keys
    call = channel.unary_unary("/tierps.v1.EmbeddingService/PushThenLookup")
    return call(request, metadata=md, timeout=5)


def _reflection(channel: grpc.Channel, md: Any) -> Any:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    return list(stub.ServerReflectionInfo(iter([request]), metadata=md, timeout=5))


# rpc -> the roles that may make it (admin: every one)
CALLS: dict[str, tuple[Callable[[grpc.Channel, Any], Any], set[str]]] = {
    "Lookup": (_lookup_stream(False), {"trainer", "reader"}),
    "Lookup create=true": (_lookup_stream(True), {"trainer"}),
    "LookupUnary": (_lookup_unary(False), {"trainer", "reader"}),
    "LookupUnary create=true": (_lookup_unary(True), {"trainer"}),
    "PushGradients": (lambda c, md: _data(c, md, "PushGradients"), {"trainer"}),
    "PushGradientsUnary": (lambda c, md: _data(c, md, "PushGradientsUnary"), {"trainer"}),
    "Assign": (lambda c, md: _data(c, md, "Assign"), {"trainer"}),
    "PushThenLookup": (_push_then_lookup, {"trainer"}),  # a push's rights and a lookup's
    "ListTables": (_admin("ListTables", pb.ListTablesRequest()), {"trainer", "reader"}),
    "DescribeTable": (_admin("DescribeTable", pb.DescribeTableRequest(table="t")), {"trainer"}),
    "Stats": (_admin("Stats", pb.StatsRequest()), {"trainer", "reader"}),
    "CreateTable": (
        _admin("CreateTable", pb.CreateTableRequest(config=pb.TableConfig(name="x", dim=2))),
        set(),
    ),
    "DropTable": (_admin("DropTable", pb.DropTableRequest(table="absent")), set()),
    "Evict": (_admin("Evict", pb.EvictRequest(table="t")), set()),
    "SaveSnapshot": (_admin("SaveSnapshot", pb.SaveSnapshotRequest(name="s", phase=0)), set()),
    "LoadSnapshot": (_admin("LoadSnapshot", pb.LoadSnapshotRequest(name="absent")), set()),
    "ListSnapshots": (_admin("ListSnapshots", pb.ListSnapshotsRequest()), set()),
    "DeleteSnapshot": (_admin("DeleteSnapshot", pb.DeleteSnapshotRequest(name="absent")), set()),
    "ServerReflectionInfo": (_reflection, set()),
}


def _code(call: Callable[[grpc.Channel, Any], Any], channel: grpc.Channel, md: Any) -> CODE:
    try:
        call(channel, md)
    except grpc.RpcError as error:
        return error.code()
    return CODE.OK


def _rows(server: ShardServer) -> int:
    return sum(tier["rows"] for tier in server.shard.describe("t")["tiers"])


def test_each_role_may_make_its_rpcs_and_is_refused_the_others(
    shard_server: Callable[..., ShardServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = shard_server(tokens_file=tokens_file(tmp_path))
    server.shard.admin.create_table(TableConfig(name="t", dim=DIM))
    refusals = server.metrics.refusals
    with grpc.insecure_channel(server.address) as channel:
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING  # open to probes
        for role, token in TOKENS.items():
            md = [("authorization", f"Bearer {token}")]
            for name, (call, roles) in CALLS.items():
                rows = _rows(server)
                code = _code(call, channel, md)
                if role == "admin" or role in roles:
                    assert code not in REFUSED, f"{role} refused {name}: {code}"
                else:
                    assert code is CODE.PERMISSION_DENIED, f"{role} {name}: {code}"
                    assert _rows(server) == rows, f"{role}'s refused {name} changed rows"
        for md in (
            [],
            [("authorization", "Bearer not-a-token-of-this-shard")],
            [("authorization", TOKENS["admin"])],
        ):  # no "Bearer "
            for name, (call, _) in CALLS.items():
                assert _code(call, channel, md) is CODE.UNAUTHENTICATED, (name, md)
    stats = refusals.labels("/tierps.v1.AdminService/Stats", "PERMISSION_DENIED", "role")
    assert stats._value.get() == 0  # every role may call it
    denied = refusals.labels("/tierps.v1.EmbeddingService/Lookup", "PERMISSION_DENIED", "role")
    assert denied._value.get() == 1  # the reader's create=true
    unknown = refusals.labels("/tierps.v1.AdminService/Stats", "UNAUTHENTICATED", "token")
    assert unknown._value.get() == 3
    logged = "\n".join(r.getMessage() + str(r.__dict__) for r in caplog.records)
    assert "answered PERMISSION_DENIED (role)" in logged and "answered UNAUTHENTICATED" in logged
    assert not any(token in logged for token in TOKENS.values())


def test_clients_with_tokens_train_and_serve(
    shard_server: Callable[..., ShardServer], tmp_path: Path
) -> None:
    server = shard_server(tokens_file=tokens_file(tmp_path))

    def client(role: str) -> EmbeddingClient:
        return EmbeddingClient(
            [server.address], timeout_s=10, security=ChannelSecurity(token=TOKENS[role])
        )

    keys = np.arange(6)
    with client("admin") as admin:
        admin.create_table(TableConfig(name="t", dim=DIM))
    with client("trainer") as trainer:
        trainer.assign("t", keys, np.full((6, DIM), 2.0, np.float32))
        with pytest.raises(ShardError) as refused:
            trainer.drop_table("t")
        assert refused.value.code is CODE.PERMISSION_DENIED
    with client("reader") as reader:
        np.testing.assert_array_equal(
            reader.lookup("t", keys, create=False), np.full((6, DIM), 2.0, np.float32)
        )
        with pytest.raises(ShardError) as refused:
            reader.lookup("t", keys + 100, create=True)
        assert refused.value.code is CODE.PERMISSION_DENIED
    assert _rows(server) == 6  # the reader's create=true stored nothing


def _refusals(server: ShardServer) -> float:
    """Every refusal the shard counted (tierps_refusals_total, all labels)."""
    return sum(
        sample.value
        for metric in server.metrics.refusals.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


def test_a_reader_serves_over_tls_without_a_refusal_and_learns_the_life(
    shard_server: Callable[..., ShardServer],
    tmp_path: Path,
    certs: Certs,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reader's client learns each shard's life from Stats like any client (the reader is
    answered the shard's identity and life only), so serving makes no refusal: nothing
    counted in tierps_refusals_total, no WARNING. Pushes, creates and drops stay refused."""
    server = shard_server(
        tls_cert=certs.server_cert,
        tls_key=certs.server_key,
        tls_client_ca=certs.ca,
        tokens_file=tokens_file(tmp_path),
    )
    mutual = {"ca_file": certs.ca, "cert_file": certs.client_cert, "key_file": certs.client_key}

    def client(role: str) -> EmbeddingClient:
        security = ChannelSecurity(**mutual, token=TOKENS[role])
        return EmbeddingClient([server.address], timeout_s=10, security=security)

    keys = np.arange(8)
    with client("admin") as admin:
        admin.create_table(TableConfig(name="t", dim=DIM))
        admin.assign("t", keys, np.full((8, DIM), 3.0, np.float32))
    before = _refusals(server)
    caplog.clear()
    with caplog.at_level(logging.INFO), client("reader") as reader:
        asked = []
        relearn = reader._relearn_generations
        reader._relearn_generations = lambda shard: (asked.append(shard), relearn(shard))
        for _ in range(3):  # the first lookup learns the life; the others carry it
            np.testing.assert_array_equal(
                reader.lookup("t", keys, create=False), np.full((8, DIM), 3.0, np.float32)
            )
        assert len(asked) <= 1, "a reader asked the shard's Stats again at every lookup"
        assert reader.list_tables()[0].name == "t"
        assert reader._lives == [server.shard.lives.header()]  # "<data id>/<life>"
        (stats,) = reader.stats()
    assert _refusals(server) == before, "a reader's serving traffic was refused"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []
    # what a reader is answered of Stats: the shard's identity and life, nothing else
    hidden = {field: value for field, value in stats.items() if field not in security.READER_STATS}
    assert not any(hidden.values()), f"a reader was answered {hidden}"
    assert (stats["shard_id"], stats["num_shards"]) == (0, 1)
    assert f"{stats['data_id']}/{stats['life']}" == server.shard.lives.header()
    # `tierps admin stats` with a reader's token shows what it is answered, and says so
    for name, value in (
        ("TIERPS_TLS_CA", certs.ca),
        ("TIERPS_TLS_CERT", certs.client_cert),
        ("TIERPS_TLS_KEY", certs.client_key),
        ("TIERPS_TOKEN", TOKENS["reader"]),
    ):
        monkeypatch.setenv(name, str(value))
    capsys.readouterr()
    assert cli.main(["admin", "--addresses", server.address, "stats"]) == 0
    shown = capsys.readouterr().out
    assert server.shard.data_id in shown and "identity, life and data id only" in shown
    assert "rss" not in shown and TOKENS["reader"] not in shown
    with client("reader") as reader:
        for refused_call in (
            lambda: reader.push_gradients("t", keys, np.ones((8, DIM), np.float32)),
            lambda: reader.assign("t", keys, np.zeros((8, DIM), np.float32)),
            lambda: reader.lookup("t", keys + 100, create=True),
            lambda: reader.create_table(TableConfig(name="u", dim=DIM)),
            lambda: reader.drop_table("t"),
        ):
            with pytest.raises(ShardError) as refused:
                refused_call()
            assert refused.value.code is CODE.PERMISSION_DENIED
    assert _refusals(server) == before + 5
    with client("admin") as admin:
        assert [t.name for t in admin.list_tables()] == ["t"]
        np.testing.assert_array_equal(admin.lookup("t", keys), np.full((8, DIM), 3.0, np.float32))
    assert _rows(server) == 8  # nothing the reader was refused stored a row


def test_tokens_come_from_the_environment_and_bad_entries_are_refused(
    shard_server: Callable[..., ShardServer], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(security.TOKENS_ENV, f"reader:{TOKENS['reader']}")
    server = shard_server()
    with grpc.insecure_channel(server.address) as channel:
        describe = CALLS["DescribeTable"][0]
        assert _code(describe, channel, [("authorization", f"Bearer {TOKENS['reader']}")]) is (
            CODE.PERMISSION_DENIED
        )
        assert _code(describe, channel, []) is CODE.UNAUTHENTICATED
    for text, why in (
        ("admin:short", "16 characters"),
        ("root:" + "x" * 20, "ROLE one of"),
        ("", "at least one"),
    ):
        with pytest.raises(ValueError, match=why) as refused:
            security.parse_tokens(text, "test")
        assert "x" * 20 not in str(refused.value)


def test_a_shard_off_loopback_without_tls_and_tokens_refuses_to_start(
    shard_server: Callable[..., ShardServer], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="--insecure"):
        shard_server(host="0.0.0.0", data_dir=tmp_path / "open")
    assert not (tmp_path / "open").exists()  # refused before the data dir is touched
    assert security.is_loopback("127.0.0.1") and security.is_loopback("::1")
    assert not security.is_loopback("10.0.0.1") and not security.is_loopback("shard-0")
    with caplog.at_level(logging.WARNING, logger="tierps.server"):
        security.check_exposure("10.0.0.1", tls=True, tokens=False, insecure=True, where="s")
    assert "without tokens (--insecure)" in caplog.text


@pytest.mark.slow  # a subprocess
def test_a_local_cluster_passes_tls_and_tokens_to_its_shards(tmp_path: Path, certs: Certs) -> None:
    """`tierps cluster`'s flags (tierps.server.cluster.server_security_args) reach every
    shard subprocess; the cluster checks their health over TLS with a client certificate."""
    import argparse

    from tierps.server.cluster import LocalCluster, server_security_args

    flags = argparse.Namespace(
        tls_cert=certs.server_cert,
        tls_key=certs.server_key,
        tls_client_ca=certs.ca,
        tokens_file=tokens_file(tmp_path),
    )
    mutual = {"ca_file": certs.ca, "cert_file": certs.client_cert, "key_file": certs.client_key}
    with LocalCluster(
        2,
        tmp_path / "cluster",
        extra_args=server_security_args(flags),
        security=ChannelSecurity(**mutual),
    ) as cluster:
        with EmbeddingClient(
            cluster.addresses,
            timeout_s=10,
            security=ChannelSecurity(**mutual, token=TOKENS["admin"]),
        ) as client:
            client.create_table(TableConfig(name="t", dim=DIM))
            assert client.lookup("t", np.arange(4)).shape == (4, DIM)
        with (
            EmbeddingClient(
                cluster.addresses, timeout_s=10, security=ChannelSecurity(**mutual)
            ) as no_token,
            pytest.raises(ShardError) as refused,
        ):
            no_token.list_tables()
        assert refused.value.code is CODE.UNAUTHENTICATED


@pytest.mark.slow  # a subprocess
def test_a_token_is_rotated_by_editing_the_tokens_file_without_a_restart(
    shard_server: Callable[..., ShardServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tokens_file(tmp_path)
    server = shard_server(tokens_file=path)
    new = "trainer-token-rotated-0123456789"
    stats = CALLS["Stats"][0]

    def code(token: str) -> CODE:
        with grpc.insecure_channel(server.address) as channel:
            return _code(stats, channel, [("authorization", f"Bearer {token}")])

    def settles(token: str, expected: CODE) -> None:
        deadline = time.monotonic() + 10 * security.RELOAD_CHECK_S
        while code(token) is not expected:
            assert time.monotonic() < deadline, f"tokens file change not taken: {expected}"
            time.sleep(0.1)

    assert code(TOKENS["trainer"]) is CODE.OK and code(new) is CODE.UNAUTHENTICATED
    # 1. the new token beside the old one; 2. the old one removed
    path.write_text(path.read_text() + f"trainer:{new}\n")
    settles(new, CODE.OK)
    assert code(TOKENS["trainer"]) is CODE.OK
    path.write_text(path.read_text().replace(f"trainer:{TOKENS['trainer']}\n", ""))
    settles(TOKENS["trainer"], CODE.UNAUTHENTICATED)
    assert code(new) is CODE.OK
    # a file that does not parse keeps the tokens in force
    path.write_text("trainer:short\n")
    time.sleep(2 * security.RELOAD_CHECK_S)
    assert code(new) is CODE.OK
    assert "cannot be used" in caplog.text and new not in caplog.text


# -- IPv6 literal hosts -------------------------------------------------------------------------


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_host_port_brackets_ipv6_literals_only() -> None:
    assert host_port("::1", 5) == "[::1]:5"
    assert host_port("[::1]", 5) == "[::1]:5"  # given in brackets: kept
    assert host_port("fe80::1", 0) == "[fe80::1]:0"
    assert host_port("127.0.0.1", 5) == "127.0.0.1:5"
    assert host_port("localhost", 5) == "localhost:5"
    assert security.is_loopback("::1") and security.is_loopback("[::1]")


@pytest.mark.slow  # a subprocess
@pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_tierps_serve_binds_an_ipv6_literal_host(tmp_path: Path) -> None:
    """`tierps serve --host ::1` (a real subprocess) binds [::1]:port, says so, and serves
    a client that dials that address; ::1 is loopback, so no TLS or tokens are asked for."""
    port_file = tmp_path / "shard.port"
    log = tmp_path / "shard.log"
    command = [
        sys.executable,
        "-m",
        "tierps.server.cli",
        "serve",
        "--shard-id",
        "0",
        "--num-shards",
        "1",
        "--host",
        "::1",
        "--port",
        "0",
        "--data-dir",
        str(tmp_path / "data"),
        "--port-file",
        str(port_file),
    ]
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output, stderr=output)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert process.poll() is None, f"the shard exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the shard did not write its port in 60 s"
            time.sleep(0.05)
        address = f"[::1]:{json.loads(port_file.read_text())['port']}"
        wait_until_serving(address, 30)
        with EmbeddingClient([address], timeout_s=10) as client:
            client.create_table(TableConfig(name="t", dim=DIM))
            assert client.lookup("t", np.arange(3)).shape == (3, DIM)
        assert f"serving at {address}" in log.read_text()
    finally:
        process.terminate()
        assert process.wait(30) == 0
