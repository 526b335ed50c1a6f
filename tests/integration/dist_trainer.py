"""A trainer rank run by torchrun in tests/integration/test_distributed.py (not a test).

Each rank trains the small model below on its share of a synthetic global batch per step,
against the cluster at --addresses, with a TrainerGroup in --mode, and writes what it saw
to --out/rank-<r>.json. The test runs the same model on the global batch in one process,
with torch's own embedding optimizers, as the reference (see `global_batch`, `Model`).

Faults, injected here because a test cannot reach into the process otherwise:
--kill-at STEP: rank 1, on torchrun's first attempt, pushes half of the keys it owns at step
STEP, then kills itself with SIGKILL (a push half applied, a rank dead mid-step).
--slow-pushes S: rank 1's pushes each take S seconds longer (async staleness).
--probe adds a table whose row 0 every sample looks up with gradient (1, 0, ...): under SGD
with lr 1 from a zero row, minus its first value is the number of pushes applied.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from tierps.client.distributed import TrainerGroup
from tierps.client.embedding import EmbeddingClient
from tierps.client.pooled_lookup import Feature
from tierps.client.torch import EmbeddingBagCollection

VOCAB = 40  # keys per table: ranks' batches share many of them
PROBE_DIM = 4
BAG = 3  # ids per bag
GLOBAL_BATCH = 16
# suffix: dim of each table, two dims exchanged together; test_distributed gives the optimizers
TABLES = {"adam": 4, "adagrad": 4, "adam8": 8}


def global_batch(step: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The global batch of a step (from 1): ids [GLOBAL_BATCH, BAG] per table, labels."""
    rng = np.random.default_rng(1000 + step)
    ids = {t: rng.integers(0, VOCAB, (GLOBAL_BATCH, BAG), dtype=np.int64) for t in TABLES}
    labels = rng.integers(0, 2, GLOBAL_BATCH).astype(np.float32)
    return ids, labels


def rank_share(step: int, rank: int, world: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Rank `rank`'s contiguous share of the global batch of `step`."""
    ids, labels = global_batch(step)
    share = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    return {t: v[share] for t, v in ids.items()}, labels[share]


def dense_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(sum(TABLES.values()), 4), nn.Tanh(), nn.Linear(4, 1))


def loss_of(dense: nn.Module, pooled: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    logits = dense(torch.cat(pooled, dim=1)).squeeze(1)
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--addresses", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--slow-pushes", type=float, default=0.0)
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    client = EmbeddingClient(args.addresses.split(","), timeout_s=30.0)
    tables = [f"{args.prefix}{t}" for t in TABLES]
    probe = f"{args.prefix}probe"
    names = [*tables, probe] if args.probe else tables
    ebc = EmbeddingBagCollection(client, [Feature(t, t) for t in names])
    dense = nn.parallel.DistributedDataParallel(dense_model())
    optimizer = torch.optim.SGD(dense.parameters(), lr=0.5)
    group = TrainerGroup(client, [ebc], mode=args.mode, staleness=args.staleness)
    state = group.load_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if state is not None:
        dense.load_state_dict(state["dense"])
        optimizer.load_state_dict(state["optimizer"])
    resumed_at = group.step

    push = client.push_unique
    if rank == 1 and args.slow_pushes:

        def slow_push(pushes: Any, step: Any) -> int:
            time.sleep(args.slow_pushes)
            return push(pushes, step)

        client.push_unique = slow_push  # type: ignore[method-assign]
    if rank == 1 and args.kill_at and attempt == 0:

        def half_push_then_die(pushes: Any, step: Any) -> int:
            if step != args.kill_at:
                return push(pushes, step)
            half = {t: (k[: k.size // 2], g[: k.size // 2]) for t, (k, g) in pushes.items()}
            push(half, step)
            os.kill(os.getpid(), signal.SIGKILL)
            raise AssertionError("unreachable")

        client.push_unique = half_push_then_die  # type: ignore[method-assign]

    def batch_of(step: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        ids, labels = rank_share(step, rank, world)
        features = {f"{args.prefix}{t}": v for t, v in ids.items()}
        if args.probe:  # key 0 in every bag: its row counts the pushes applied (SGD, lr 1)
            features[probe] = np.zeros((labels.size, 1), dtype=np.int64)
        return features, labels

    seen: list[dict[str, Any]] = []
    batches = (batch_of(step) for step in range(group.step + 1, args.steps + 1))
    for features, labels in group.pipeline(batches, (ebc, lambda batch: batch[0])):
        pooled = ebc(features)
        loss = loss_of(dense, [pooled[t] for t in tables], torch.from_numpy(labels))
        if args.probe:  # d loss / d row 0 = (1, 0, ..., 0) on every rank
            loss = loss + pooled[probe][:, 0].sum() / labels.size
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        applied = -float(pooled[probe][0, 0]) if args.probe else None
        seen.append(
            {"step": group.step, "staleness": group.staleness_seen, "probe_pushes_applied": applied}
        )
        if args.checkpoint_every and group.step % args.checkpoint_every == 0:
            group.save_checkpoint(
                args.checkpoint_dir,
                {"dense": dense.state_dict(), "optimizer": optimizer.state_dict()},
            )
    group.flush()
    dist.barrier()
    result = {
        "rank": rank,
        "attempt": attempt,
        "resumed_at": resumed_at,
        "step": group.step,
        "table_steps": {t: client.table_step(t) for t in tables},
        "max_staleness_seen": group.max_staleness_seen,
        "seen": seen,
        "dense": {name: p.detach().tolist() for name, p in dense.module.state_dict().items()},
    }
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(result))
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
