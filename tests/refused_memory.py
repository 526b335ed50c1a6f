"""What refused one-message calls cost a shard: a real `tierps serve` subprocess with TLS
(tests/certs.py) and tokens, CALLS threads each sending a one-message push of CALL_MIB MiB
(PushGradientsUnary, a valid encoding) that the shard must refuse, and the shard's peak RSS
(VmHWM from /proc, reset just before the calls) over its RSS just before.

Used by tests/integration/test_limits.py (a bound derived from the configuration) and by
tests/bench/bench_refused_memory.py (the table of every case, to compare server code)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from tests.certs import Certs
from tierps.client import ChannelSecurity, EmbeddingClient, TableConfig
from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import tierps_service_pb2_grpc as pb_grpc
from tierps.proto import wire
from tierps.server.cluster import LocalCluster
from tierps.server.config import MAX_BATCH_BYTES, MAX_INFLIGHT_BYTES, max_call_request_bytes

CALLS = 8
CALL_MIB = 250
DIM = 64
TOKENS = {
    "admin": "admin-token-0123456789abcdef",
    "trainer": "trainer-token-0123456789abcdef",
    "reader": "reader-token-0123456789abcdef",
}
PUSH = "/tierps.v1.EmbeddingService/PushGradientsUnary"
LOOKUP = "/tierps.v1.EmbeddingService/LookupUnary"
# The budget that case "taken" fills: the default, held by two streams that each declared
# the per-call limit and sent one small message.
HOLDERS = MAX_INFLIGHT_BYTES // max_call_request_bytes(MAX_BATCH_BYTES)
HOLDER_MESSAGE_BYTES = 1 << 20


@dataclass(frozen=True)
class Case:
    """role: the token the calls carry (None: none). declared: the calls declare their bytes
    (wire.REQUEST_BYTES_HEADER, as EmbeddingClient does). taken: the shard's in-flight budget
    is reserved by other calls while these arrive. budget_mib: --max-inflight-mb (None: the
    default)."""

    name: str
    role: str | None
    declared: bool
    taken: bool = False
    budget_mib: int | None = None


CASES = (
    Case("no token", None, declared=True),
    Case("reader token (may not push)", "reader", declared=True),
    Case("trainer, budget taken, declared", "trainer", declared=True, taken=True),
    Case("trainer, budget taken, undeclared", "trainer", declared=False, taken=True),
    Case("trainer, budget 200 MiB < one call", "trainer", declared=False, budget_mib=200),
)


@dataclass(frozen=True)
class Result:
    case: Case
    baseline_kib: int  # the shard's RSS just before the calls
    peak_kib: int  # its peak RSS while they ran
    codes: tuple[str, ...]  # each call's status code
    details: str  # one refusal's message
    admitted_bytes: int  # request bytes the shard took in from calls it admitted

    @property
    def grown_mib(self) -> float:
        return (self.peak_kib - self.baseline_kib) / 1024


def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def tokens_file(directory: Path) -> Path:
    path = directory / "tokens"
    path.write_text("\n".join(f"{role}:{token}" for role, token in TOKENS.items()) + "\n")
    return path


def push_request(call_bytes: int) -> bytes:
    """A PushGradientsBatches of table 't' of about call_bytes: what a trainer sends."""
    keys = (call_bytes - 1024) // (8 + 4 * DIM)
    grads = np.zeros((keys, DIM), "<f4")
    return wire.encode_batches([("t", DIM, 1, (np.arange(keys, dtype="<i8"), grads))])


def _held(sent: threading.Event, release: threading.Event) -> Iterator[pb.PushGradientsRequest]:
    keys = HOLDER_MESSAGE_BYTES // (8 + 4 * DIM)
    yield pb.PushGradientsRequest(
        table="t",
        dim=DIM,
        step=1,
        keys=np.arange(keys, dtype="<i8").tobytes(),
        grads=np.zeros((keys, DIM), "<f4").tobytes(),
    )
    sent.set()
    release.wait(120)


def measure(case: Case, directory: Path, certs: Certs, request: bytes) -> Result:
    """Start a TLS + tokens shard, send CALLS copies of `request` at once as `case` says,
    and read what they cost it."""
    args = (
        "--tls-cert",
        str(certs.server_cert),
        "--tls-key",
        str(certs.server_key),
        "--tokens-file",
        str(tokens_file(directory)),
        "--flush-interval-s",
        "0",
    )
    if case.budget_mib is not None:
        args += ("--max-inflight-mb", str(case.budget_mib))
    security = ChannelSecurity(ca_file=certs.ca)
    admin_security = ChannelSecurity(ca_file=certs.ca, token=TOKENS["admin"])
    options = wire.channel_options(len(request) + (1 << 20))
    with (
        LocalCluster(1, directory / "cluster", extra_args=args, security=security) as cluster,
        EmbeddingClient(cluster.addresses, timeout_s=60, security=admin_security) as admin,
        security.channel(cluster.addresses[0], options) as channel,
    ):
        admin.create_table(TableConfig(name="t", dim=DIM))
        pid = cluster._processes[0].pid  # noqa: SLF001 - the shard's process, for /proc
        token = [] if case.role is None else [("authorization", f"Bearer {TOKENS[case.role]}")]
        trainer = [("authorization", f"Bearer {TOKENS['trainer']}")]
        push = channel.unary_unary(PUSH)
        stub = pb_grpc.EmbeddingServiceStub(channel)
        channel.unary_unary(LOOKUP)(  # warm: TLS, the call path, the decoders
            wire.encode_batches([("t", DIM, 0, (np.arange(8, dtype="<i8"),))]),
            timeout=30,
            metadata=trainer,
        )
        release = threading.Event()
        holders = []
        if case.taken:
            declared = wire.declared(max_call_request_bytes(MAX_BATCH_BYTES))
            for _ in range(HOLDERS):
                sent = threading.Event()
                holders.append(
                    stub.PushGradients.future(
                        _held(sent, release), timeout=120, metadata=[*trainer, *declared]
                    )
                )
                assert sent.wait(30), "a stream holding the budget did not start"
            time.sleep(0.5)  # its first message read, its declaration reserved
        metadata = [*token, *(wire.declared(len(request)) if case.declared else ())]
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # its peak RSS (VmHWM) := its RSS
        baseline = status_kib(pid, "VmRSS")
        codes: list[str] = []
        details: list[str] = []

        def call() -> None:
            try:
                push(request, timeout=120, metadata=metadata)
                codes.append("OK")
            except grpc.RpcError as error:
                codes.append(error.code().name)
                details.append(error.details() or "")

        threads = [threading.Thread(target=call) for _ in range(CALLS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        peak = status_kib(pid, "VmHWM")
        for holder in holders:
            holder.cancel()
        release.set()
        admitted = len(holders) * HOLDER_MESSAGE_BYTES + codes.count("OK") * len(request)
        return Result(case, baseline, peak, tuple(codes), details[0] if details else "", admitted)


def table(results: list[Result]) -> str:
    lines = [f"{'case':<40} {'baseline MiB':>12} {'peak MiB':>9} {'grown MiB':>10}  codes"]
    for r in results:
        codes = ", ".join(f"{code} x{r.codes.count(code)}" for code in sorted(set(r.codes)))
        lines.append(
            f"{r.case.name:<40} {r.baseline_kib / 1024:>12.0f} {r.peak_kib / 1024:>9.0f} "
            f"{r.grown_mib:>10.1f}  {codes}"
        )
    return "\n".join(lines)
