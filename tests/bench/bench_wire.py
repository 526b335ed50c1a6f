"""The hand-written wire of a trainer's step against protobuf's own (upb) encoder and parser,
on the message a DeepFM step sends each shard: a PushThenLookupRequest of 8 tables, each
with the push of about 1,200 distinct keys' gradients (dim 16) and the lookup of as many
keys (bench_deepfm's zipf_200k shape, 2 shards).

    python -m tests.bench.bench_wire [--rounds 7] [--calls 300] [--out PATH]

- encode: wire.encode_push_then_lookup_in_place, then the keys and gradients written into
  its views (what the client does), against pb.PushThenLookupRequest built from the arrays'
  bytes and SerializeToString();
- decode: wire.decode_push_then_lookup, every table's fields read and its bulk fields as
  numpy arrays (what the shard does), against pb.PushThenLookupRequest.FromString and the
  same reads.
Both encoders' bytes are checked equal first. Contenders alternate in rounds; medians of the
rounds' microseconds a call. Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tierps.proto import tierps_service_pb2 as pb
from tierps.proto import wire

TABLES, KEYS, DIM, IDS = 8, 1200, 16, 200_000


def message() -> tuple[list[tuple[str, np.ndarray, np.ndarray]], list[tuple[str, np.ndarray]]]:
    """(push: (table, keys, grads) each, lookup: (table, keys) each)."""
    rng = np.random.default_rng(0)

    def keys() -> np.ndarray:
        return np.sort(rng.choice(IDS, KEYS, replace=False)).astype(np.int64)

    push = [
        (f"zipf.t{i}", keys(), rng.normal(size=(KEYS, DIM)).astype(np.float32))
        for i in range(TABLES)
    ]
    return push, [(f"zipf.t{i}", keys()) for i in range(TABLES)]


def encoders(step: int = 7) -> dict[str, Callable[[], bytes]]:
    push, lookup = message()

    def tierps() -> bytes:
        request, fields = wire.encode_push_then_lookup_in_place(
            [(name, DIM, step, (8 * k.size, 4 * DIM * k.size)) for name, k, _ in push],
            [(name, DIM, True, (k,)) for name, k in lookup],
        )
        for (_, k, g), (keys_view, grads_view) in zip(push, fields, strict=True):
            keys_view[:] = k.view(np.uint8)
            grads_view[:] = g.reshape(-1).view(np.uint8)
        return request

    def protobuf() -> bytes:
        return pb.PushThenLookupRequest(
            push=pb.PushGradientsBatches(
                batches=[
                    pb.PushGradientsRequest(
                        table=name, dim=DIM, step=step, keys=k.tobytes(), grads=g.tobytes()
                    )
                    for name, k, g in push
                ]
            ),
            lookup=pb.LookupBatches(
                batches=[
                    pb.LookupRequest(table=name, dim=DIM, create=True, keys=k.tobytes())
                    for name, k in lookup
                ]
            ),
        ).SerializeToString()

    return {"tierps": tierps, "protobuf": protobuf}


def decoders(data: bytes) -> dict[str, Callable[[], Any]]:
    def read(push: Any, lookup: Any) -> Any:
        return [
            (b.table, b.dim, b.step, np.frombuffer(b.keys, np.int64), np.frombuffer(b.grads, "<f4"))
            for b in push
        ], [(b.table, b.dim, b.create, np.frombuffer(b.keys, np.int64)) for b in lookup]

    def tierps() -> Any:
        decoded = wire.decode_push_then_lookup(data)
        return read(decoded.push.batches, decoded.lookup.batches)

    def protobuf() -> Any:
        decoded = pb.PushThenLookupRequest.FromString(data)
        return read(decoded.push.batches, decoded.lookup.batches)

    return {"tierps": tierps, "protobuf": protobuf}


def timed(fn: Callable[[], Any], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - started) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    encode = encoders()
    data = encode["tierps"]()
    if data != encode["protobuf"]():
        raise SystemExit("bench_wire: the two encoders' bytes differ")
    decode = decoders(data)
    results: dict[str, Any] = {"bytes": len(data), "tables": TABLES, "keys": KEYS, "dim": DIM}
    for what, contenders in (("encode", encode), ("decode", decode)):
        each: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.rounds + 1):  # round 0 warms up
            for name, fn in contenders.items():
                each[name].append(timed(fn, args.calls))
        us = {name: statistics.median(times[1:]) for name, times in each.items()}
        results[what] = {"us": us, "vs_protobuf": us["protobuf"] / us["tierps"]}
        print(
            f"{what}: tierps {us['tierps']:.0f} us, protobuf {us['protobuf']:.0f} us a call "
            f"({us['protobuf'] / us['tierps']:.2f}x; {len(data):,} bytes)"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
