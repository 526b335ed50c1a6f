"""Where the CPU of a tierps trainer step goes, at bench_deepfm's zipf_200k shape (DeepFM,
batch 2,048, 8 features of 200,000 ids, 4 ids a bag from Zipf(1.2), rows of 16 floats,
Adagrad, one torch thread, a LocalCluster of 2 shards), and what the same step costs
without tierps:

    python -m tests.bench.profile_trainer_step [--rounds 5] [--steps 8] [--top 25]

Loops, taking turns a chunk of `--steps` steps at a time (round 0 warms up):
- model: the same DeepFM over fixed pooled rows (leaf tensors that take a gradient): the
  model's own cost, forward, loss, backward and the dense Adam step, with no embeddings;
- local: over torch.nn.EmbeddingBag(sparse=True) tables + torch.optim.Adagrad;
- plain: tierps' EmbeddingBagCollection, `out = ebc(features); loss.backward();
  opt.step()` (backward holds the push for the next forward's lookup: one call a shard);
- s1: the same through ebc.pipeline() at staleness 1 (the push of step t goes with the
  lookup of step t + 2, in the background thread, while step t + 1 trains).

Printed, CPU ms a step:
1. each loop's CPU in the trainer's main thread, its other threads and each shard (from
   time.thread_time / process_time and /proc/<pid>/stat), means over the chunks;
2. tierps' own work by phase and thread, exclusive (a phase's nested phases are counted
   apart), medians over the chunks: the client's functions are wrapped with per-thread
   thread_time accumulators (a few microseconds a step of their own); the main thread's
   rest is the model and the loop; the other threads' rest is gRPC's own threads (C, no
   Python frame) and glue;
3. the bytes each step sends and receives per shard, by what they carry (push keys and
   gradients, lookup keys, rows, the messages' own fields, gRPC metadata), counted at
   the calls (the one-message calls' request and reply bytes, the metadata's keys and
   values);
4. cProfile's top functions by own time in the main thread and the pipeline thread, for
   a chunk of each tierps loop run under it (cProfile slows Python calls: read its ranks
   and shares, not its milliseconds).

Not part of the test run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tests.bench import bench_deepfm as bench
from tests.bench.cpu_time import process_cpu_s
from tierps.client import (
    EmbeddingClient,
    embedding,
    pooled_lookup,
    push_then_lookup,
    routing,
    transport,
)
from tierps.client import torch as client_torch
from tierps.client.pushes import Pushes
from tierps.demo import data, training
from tierps.demo.deepfm import DeepFM, initial_weights, row_width
from tierps.proto import wire
from tierps.server.cluster import LocalCluster

LOOPS = ("model", "local", "plain", "s1")
CONTENDER = {
    "local": "local_adagrad",
    "plain": "tierps_adagrad_plain",
    "s1": "tierps_adagrad_s1",
}


# -- the model alone --------------------------------------------------------------------------


class FixedEmbeddings(nn.Module):
    """DeepFM's embedding layer with no tables: every feature's pooled rows are a fixed
    random block, a fresh leaf tensor each step that takes its gradient (as an embedding's
    output would), so that a step costs the model's forward, backward and dense step only."""

    def __init__(self, features: list[data.SparseFeature], batch_size: int, width: int) -> None:
        super().__init__()
        self.features = features
        rng = np.random.default_rng(0)
        self._rows = {
            f.name: rng.normal(0, 0.01, (batch_size, width)).astype(np.float32) for f in features
        }

    def sparse_optimizer(self) -> None:
        return None

    def pipeline(self, batches: Any) -> Iterator[Any]:
        return iter(batches)

    def flush(self) -> None:
        """Nothing in flight."""

    def close(self) -> None:
        """Nothing to stop."""

    def forward(self, batch: Any) -> dict[str, torch.Tensor]:
        return {
            name: torch.from_numpy(rows).requires_grad_(True) for name, rows in self._rows.items()
        }


# -- the phase meter --------------------------------------------------------------------------


def _thread_group() -> str:
    name = threading.current_thread().name
    if name == "MainThread":
        return "main"
    return name.split("_")[0]  # tierps-pipeline, tierps-calls (ThreadPoolExecutor's prefixes)


class PhaseMeter:
    """Exclusive CPU (thread_time) of wrapped functions, by (thread group, phase): a call's
    time less that of the wrapped calls it makes."""

    def __init__(self) -> None:
        self.spent: dict[tuple[str, str], float] = defaultdict(float)
        self._local = threading.local()
        self._undo: list[Callable[[], None]] = []

    def wrap(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        local, spent, clock = self._local, self.spent, time.thread_time

        def metered(*args: Any, **kwargs: Any) -> Any:
            stack = getattr(local, "stack", None)
            if stack is None:
                stack = local.stack = []
            started = clock()
            stack.append(0.0)  # the time of nested wrapped calls
            try:
                return fn(*args, **kwargs)
            finally:
                nested = stack.pop()
                took = clock() - started
                spent[(_thread_group(), phase)] += took - nested
                if stack:
                    stack[-1] += took

        return metered

    def patch(self, owner: Any, name: str, phase: str, static: bool = False) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        fn = original.__func__ if static else original
        wrapped = self.wrap(fn, phase)
        setattr(owner, name, staticmethod(wrapped) if static else wrapped)
        self._undo.append(lambda: setattr(owner, name, original))

    def patch_calls(self, calls: list[Any], phase: str) -> None:
        """Each shard's gRPC multicallable in a list (Transport.lookup_one, ...)."""
        originals = list(calls)
        calls[:] = [self.wrap(call, phase) for call in originals]
        self._undo.append(lambda: calls.__setitem__(slice(None), originals))

    def undo(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def take(self) -> dict[tuple[str, str], float]:
        """The times so far, and start again (the wrappers keep writing to self.spent)."""
        spent = dict(self.spent)
        self.spent.clear()
        return spent


# Phases: (owner, attribute, phase name); a function imported by name is patched where it
# is called from.
PHASES = [
    (client_torch.EmbeddingBagCollection, "_forward", "torch glue: forward"),
    (client_torch.EmbeddingBagCollection, "_prefetch", "torch glue: prefetch"),
    (client_torch.EmbeddingBagCollection, "_push", "torch glue: backward's push"),
    (client_torch.EmbeddingBagCollection, "_push_then_fetch", "pipeline thread glue"),
    (client_torch, "_fetch_on", "pipeline thread glue"),
    (client_torch, "jagged_features", "torch glue: forward"),
    (embedding, "prepare", "prepare: checks, concatenation"),
    (pooled_lookup, "_as_bags", "prepare: checks, concatenation"),
    (pooled_lookup, "distinct_keys", "dedup (distinct_keys)"),
    (pooled_lookup, "stacked_pooling_layout", "pooling layout (CSR arrays)"),
    (pooled_lookup, "pool", "pooling forward (embedding_bag)"),
    (pooled_lookup.PreparedHost, "fetch", "fetch: outputs"),
    (pooled_lookup.PooledLookup, "key_gradients", "backward: stack gradients"),
    (pooled_lookup, "float_array", "backward: gradient checks"),
    (pooled_lookup, "unpool", "backward: gradient sum (A.T @ G)"),
    (routing.Router, "route", "routing (group by shard, cut calls)"),
    (Pushes, "reserve", "push steps and bookkeeping"),
    (Pushes, "done", "push steps and bookkeeping"),
    (push_then_lookup.PushThenLookup, "push_then_lookup", "fused call: split and check"),
    (push_then_lookup.PushThenLookup, "_fused_call", "fused call: metadata, identity"),
    (wire, "encode_push_then_lookup_in_place", "wire: encode"),
    (wire, "encode_batches", "wire: encode"),
    (wire, "encode_batches_in_place", "wire: encode"),
    (push_then_lookup, "fill_push", "wire: encode"),
    (transport, "fill_push", "wire: encode"),
    (wire, "push_then_lookup_reply", "wire: decode reply"),
    (wire, "lookup_reply_values", "wire: decode reply"),
    (transport.Transport, "place_reply", "place rows (reply into the table's rows)"),
    (transport.Transport, "lookup_into", "fan-out and calls: glue"),
    (transport.Transport, "lookup_unique", "fan-out and calls: glue"),
    (transport.Transport, "fan_out", "fan-out and calls: glue"),
]
GRPC_PHASE = "gRPC call (the calling thread's part)"
DENSE_STEP = "model: the dense Adam step"  # metered too, as the part a push may overlap


def meter_client(meter: PhaseMeter, client: EmbeddingClient) -> None:
    for owner, name, phase in PHASES:
        meter.patch(owner, name, phase)
    link = client._transport
    for calls in (link.lookup_one, link.push_one, client._fused.fused_one):
        meter.patch_calls(calls, GRPC_PHASE)


# -- bytes on the wire ------------------------------------------------------------------------


class ByteMeter:
    """Per shard: the bytes of every one-message data call (request, reply, metadata), and
    the bulk they carry (push keys and gradients, lookup keys, rows)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, str], int] = defaultdict(int)
        self._undo: list[Callable[[], None]] = []

    def add(self, shard: int, what: str, size: int) -> None:
        self.counts[(shard, what)] += size

    def patch(self, client: EmbeddingClient) -> None:
        link = client._transport
        for calls in (link.lookup_one, link.push_one, client._fused.fused_one):
            originals = list(calls)
            calls[:] = [self._counted(shard, call) for shard, call in enumerate(originals)]
            self._undo.append(lambda calls=calls, o=originals: calls.__setitem__(slice(None), o))
        for cls, name, kinds in (
            (push_then_lookup.PushThenLookup, "_fused_call", "fused"),
            (transport.Transport, "lookup_call", "lookup"),
            (transport.Transport, "push_call", "push"),
        ):
            original = cls.__dict__[name]
            setattr(cls, name, self._bulk(original, kinds))
            self._undo.append(lambda cls=cls, name=name, o=original: setattr(cls, name, o))

    def _counted(self, shard: int, call: Any) -> Callable[..., Any]:
        def counted(request: bytes, **kwargs: Any) -> Any:
            metadata = kwargs.get("metadata") or ()
            self.add(shard, "calls", 1)
            self.add(shard, "request", len(request))
            self.add(shard, "metadata", sum(len(k) + len(v) for k, v in metadata))
            reply = call(request, **kwargs)
            size = reply.ByteSize() if hasattr(reply, "ByteSize") else len(reply)
            self.add(shard, "reply", size)
            return reply

        return counted

    def _bulk(self, method: Callable[..., Any], kind: str) -> Callable[..., Any]:
        meter = self

        def counted(self: Any, shard: int, *args: Any) -> Any:
            push = args[0] if kind in ("fused", "push") else None
            lookup = args[1] if kind == "fused" else args[0] if kind == "lookup" else None
            for _, dim, keys, _ in push or ():
                meter.add(shard, "push keys", 8 * keys.size)
                meter.add(shard, "push gradients", 4 * dim * keys.size)
            for _, dim, keys, _ in lookup or ():
                meter.add(shard, "lookup keys", 8 * keys.size)
                meter.add(shard, "rows", 4 * dim * keys.size)
            return method(self, shard, *args)

        return counted

    def undo(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def take(self) -> dict[tuple[int, str], int]:
        counts = dict(self.counts)
        self.counts.clear()
        return counts


# -- CPU by process and thread ----------------------------------------------------------------


def cpu_now(pids: list[int]) -> dict[str, float]:
    """CPU seconds so far: this thread, this process's other threads, each shard."""
    main, process = time.thread_time(), time.process_time()
    out = {"trainer main thread": main, "trainer other threads": process - main}
    for index, pid in enumerate(pids):
        out[f"shard {index}"] = process_cpu_s([pid])
    return out


# -- the run ----------------------------------------------------------------------------------


def build(loop: str, dataset: data.CTRDataset, weights: Any, client: EmbeddingClient) -> DeepFM:
    if loop == "model":
        width = row_width(bench.EMBEDDING_DIM)
        fixed = FixedEmbeddings(list(dataset.features), 2048, width)
        return DeepFM(fixed, dim=bench.EMBEDDING_DIM, num_dense=dataset.num_dense, seed=0)
    contender = next(c for c in bench.CONTENDERS if c.name == CONTENDER[loop])
    return bench.build(contender, dataset, weights, client)


def chunk(
    trainer: tuple[DeepFM, Any, Any], loop: str, dataset: data.CTRDataset, steps: int, seed: int
) -> float:
    """Train `steps` batches of a loop's (model, dense optimizer, sparse optimizer); returns
    the wall seconds."""
    model, dense, sparse = trainer
    _, _, seconds, _ = training.train_epoch(
        model,
        dataset,
        dense,
        sparse,
        batch_size=2048,
        shuffle_seed=seed,
        max_batches=steps,
        steps=iter if loop in ("model", "local", "plain") else None,
    )
    model.embeddings.close()
    return seconds


@contextmanager
def profiled_threads() -> Iterator[dict[str, cProfile.Profile]]:
    """cProfile in the main thread and in every thread started meanwhile (one profiler a
    thread, enabled by threading's profile hook at the thread's first call)."""
    profiles: dict[str, cProfile.Profile] = {}
    lock = threading.Lock()

    def start_in_thread(*_: Any) -> None:
        sys.setprofile(None)
        profile = cProfile.Profile(time.thread_time_ns, 1e-9)  # CPU, not waits
        with lock:
            profiles[f"{_thread_group()} {threading.get_ident()}"] = profile
        profile.enable()

    main = cProfile.Profile(time.thread_time_ns, 1e-9)
    profiles["main"] = main
    threading.setprofile(start_in_thread)
    main.enable()
    try:
        yield profiles
    finally:
        main.disable()
        threading.setprofile(None)


def top(profile: cProfile.Profile, count: int) -> str:
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(count)
    lines = text.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    return "\n".join(line.replace(str(Path.cwd()) + "/", "") for line in lines[start:])


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dataset = bench.zipf_dataset(bench.ZIPF_IDS, 2048)
    weights = initial_weights(dataset.tables, bench.EMBEDDING_DIM, bench.SEED)
    root = Path(tempfile.mkdtemp(prefix="tierps-profile-trainer-"))
    try:
        with (
            LocalCluster(bench.SHARDS, root / "cluster") as cluster,
            EmbeddingClient(cluster.addresses) as client,
        ):
            pids = [pid for pid in cluster.pids if pid is not None]
            run(args, dataset, weights, client, pids)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def run(args: Any, dataset: Any, weights: Any, client: EmbeddingClient, pids: list[int]) -> None:
    phases = PhaseMeter()
    trainers = {}
    for loop in LOOPS:
        model = build(loop, dataset, weights, client)
        dense = training.dense_optimizer_for(model, bench.DENSE_LR)
        dense.step = phases.wrap(dense.step, DENSE_STEP)  # not tierps': the model's
        trainers[loop] = (model, dense, model.embeddings.sparse_optimizer())
    wires = ByteMeter()
    cpu: dict[str, list[dict[str, float]]] = defaultdict(list)
    by_phase: dict[str, list[dict[tuple[str, str], float]]] = defaultdict(list)
    wall: dict[str, list[float]] = defaultdict(list)
    counted: dict[str, dict[tuple[int, str], int]] = {}
    meter_client(phases, client)
    wires.patch(client)
    try:
        for round_index in range(args.rounds + 1):
            for loop in LOOPS:
                phases.take()
                wires.take()
                before = cpu_now(pids)
                seconds = chunk(trainers[loop], loop, dataset, args.steps, round_index)
                after = cpu_now(pids)
                spent = phases.take()
                counts = wires.take()
                if round_index == 0:
                    continue
                cpu[loop].append({k: 1e3 * (after[k] - before[k]) / args.steps for k in after})
                by_phase[loop].append({k: 1e3 * v / args.steps for k, v in spent.items()})
                wall[loop].append(1e3 * seconds / args.steps)
                if round_index == 1:
                    counted[loop] = {k: v / args.steps for k, v in counts.items()}
    finally:
        phases.undo()
        wires.undo()
    report(args, cpu, by_phase, wall, counted)
    for loop in ("plain", "s1"):
        with profiled_threads() as profiles:
            chunk(trainers[loop], loop, dataset, args.steps, 99)
        for name, profile in profiles.items():
            if name == "main" or name.startswith("tierps-pipeline"):
                print(f"\n## cProfile, {loop}, {name.split()[0]} thread, {args.steps} steps")
                print(top(profile, args.top))


def _median(rows: list[dict[Any, float]], key: Any) -> float:
    return statistics.median(row.get(key, 0.0) for row in rows)


def report(
    args: Any,
    cpu: dict[str, list[dict[str, float]]],
    by_phase: dict[str, list[dict[tuple[str, str], float]]],
    wall: dict[str, list[float]],
    counted: dict[str, dict[tuple[int, str], int]],
) -> None:
    print(
        f"# CPU ms a step, means over {args.rounds} chunks of {args.steps} steps (a shard's "
        f"CPU comes in 10 ms ticks); wall: the median chunk's (load average "
        f"{os.getloadavg()[0]:.1f})"
    )
    parts = list(next(iter(cpu.values()))[0])
    print(f"{'loop':8} {'wall':>7} " + " ".join(f"{p:>22}" for p in parts))
    for loop, rows in cpu.items():
        cells = " ".join(f"{statistics.fmean(row[p] for row in rows):22.2f}" for p in parts)
        print(f"{loop:8} {statistics.median(wall[loop]):7.2f} {cells}")
    for loop in ("plain", "s1"):
        rows = by_phase[loop]
        keys = sorted({k for row in rows for k in row})
        print(f"\n# {loop}: tierps' phases, exclusive CPU ms a step (median)")
        totals: dict[str, float] = defaultdict(float)
        for group in ("main", "tierps-pipeline", "tierps-calls"):
            for key in sorted((k for k in keys if k[0] == group), key=lambda k: -_median(rows, k)):
                ms = _median(rows, key)
                totals[group] += 0 if key[1] == DENSE_STEP else ms
                print(f"  {group:16} {key[1]:45} {ms:6.2f}")
        main_cpu = statistics.fmean(row["trainer main thread"] for row in cpu[loop])
        other_cpu = statistics.fmean(row["trainer other threads"] for row in cpu[loop])
        model = statistics.fmean(row["trainer main thread"] for row in cpu["model"])
        print(
            f"  main thread: tierps' phases {totals['main']:.2f}, the rest (model, loop) "
            f"{main_cpu - totals['main']:.2f}; the model alone {model:.2f}"
        )
        wrapped = totals["tierps-pipeline"] + totals["tierps-calls"]
        print(
            f"  other threads: tierps' phases {wrapped:.2f}, the rest (gRPC's own threads) "
            f"{other_cpu - wrapped:.2f}"
        )
    for loop in ("plain", "s1"):
        counts = counted[loop]
        shards = sorted({shard for shard, _ in counts})
        print(f"\n# {loop}: bytes a step, per shard (chunk 1)")
        whats = (
            "calls",
            "request",
            "reply",
            "metadata",
            "push keys",
            "push gradients",
            "lookup keys",
            "rows",
        )
        for shard in shards:
            cells = ", ".join(f"{w} {counts.get((shard, w), 0):,.1f}" for w in whats)
            print(f"  shard {shard}: {cells}")


if __name__ == "__main__":
    raise SystemExit(main())
