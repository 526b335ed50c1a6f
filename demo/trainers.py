"""`tierps demo --trainers N`: the demo's DeepFM trained by N data-parallel trainers.

`launch` (called by `tierps demo` once its cluster serves and its tables exist) runs
`torchrun --nproc-per-node N -m tierps.demo.trainers ...` on 127.0.0.1; `main` is one rank:
it loads the dataset, trains on its share of each batch (CTRDataset.batches: the ranks'
shares of a step make one batch of --batch-size, so N = 1 and N = 2 train on the same
batches), with the dense part under DistributedDataParallel (gloo) and the embeddings under
a TrainerGroup (tierps.client.distributed) in the --mode given. After each epoch the ranks
evaluate their shares of the test rows, rank 0 prints train and test logloss and AUC over all
ranks' samples and the samples/s of all ranks together, and the job saves a checkpoint (and
one at its start); a rank that dies is restarted by torchrun (--max-restarts), and the job
resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tierps.client import security
from tierps.client.command_line import Parser  # no flag prefixes; usage errors hide secrets
from tierps.client.distributed import MODES, RESTARTABLE

# The client's TLS and token flags (tierps.client.security) the ranks are given as the demo was.
SECURITY_FLAGS = (
    "--tls-ca",
    "--tls-client-cert",
    "--tls-client-key",
    "--tls-server-name",
    "--token-file",
)
MAX_RESTARTS = 1  # torchrun restarts a job whose rank died once; it resumes from a checkpoint


def torchrun_on_this_machine(
    ranks: int, module: str, arguments: list[str], *, threads: int = 1, max_restarts: int = 0
) -> tuple[list[str], dict[str, str]]:
    """The command and environment that run `python -m module arguments` as `ranks` ranks
    under torchrun on 127.0.0.1, gloo on the loopback interface, restartable
    (tierps.client.distributed.RESTARTABLE) `max_restarts` times."""
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"),
        *("--nproc-per-node", str(ranks), "--max-restarts", str(max_restarts)),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"),
        *("--monitor-interval", "0.5", "-m", module, *arguments),
    ]
    environment = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": str(threads),
        **RESTARTABLE,
    }
    return command, environment


def launch(
    args: argparse.Namespace,
    addresses: list[str],
    *,
    epochs: int,
    batch_size: int,
    staleness: int,
    checkpoint_dir: Path,
    torch_threads: int,
) -> int:
    """Run the N ranks under torchrun on this machine; their exit code (0: all finished)."""
    flags = {
        "--addresses": ",".join(addresses),
        "--dataset": args.dataset,
        "--seed": args.seed,
        "--samples": args.samples,
        "--dim": args.dim,
        "--lr": args.lr,
        "--epochs": epochs,
        "--batch-size": batch_size,
        "--mode": args.mode,
        "--staleness": staleness,
        "--checkpoint-dir": checkpoint_dir,
        "--torch-threads": torch_threads,
    }
    for flag in SECURITY_FLAGS:  # paths only: a token never goes on a command line
        value = getattr(args, flag.removeprefix("--").replace("-", "_"), None)
        if value is not None:
            flags[flag] = value
    command, environment = torchrun_on_this_machine(
        args.trainers,
        "tierps.demo.trainers",
        [str(part) for flag, value in flags.items() for part in (flag, value)],
        threads=torch_threads,
        max_restarts=MAX_RESTARTS,
    )
    # Its own session: a Ctrl-C on the terminal reaches the demo, which ends the job
    # (stop_job) instead of torchrun and each rank printing their tracebacks.
    job = subprocess.Popen(command, env=environment, start_new_session=True)
    try:
        return job.wait()
    except BaseException:
        stop_job(job)
        raise


def stop_job(job: subprocess.Popen[bytes]) -> None:
    """End a torchrun job at once, its ranks first (torchrun starts each in a session of
    its own): torchrun is paused so it starts no rank meanwhile, then killed."""
    if job.poll() is not None:
        return
    os.kill(job.pid, signal.SIGSTOP)
    children: list[int] = []
    for task in Path(f"/proc/{job.pid}/task").glob("*/children"):
        try:
            children += [int(pid) for pid in task.read_text().split()]
        except OSError:
            pass  # a thread that ended meanwhile
    for pid in children:
        for kill in (os.killpg, os.kill):  # its session's group; or it alone
            try:
                kill(pid, signal.SIGKILL)
                break
            except (ProcessLookupError, PermissionError):
                continue
    job.kill()
    job.wait()
    for pid in children:  # reaped by no one else once torchrun is gone: wait until gone
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m tierps.demo.trainers",
        description="One rank of `tierps demo --trainers N` (run by torchrun).",
    )
    parser.add_argument("--addresses", required=True, help="the shards, comma-separated")
    parser.add_argument("--dataset", choices=("movielens", "synthetic"), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--dim", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True, help="of all ranks together")
    parser.add_argument("--mode", choices=MODES, default="sync")
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--torch-threads", type=int, default=1)
    security.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """One rank of the job (torchrun set RANK, WORLD_SIZE and the rendezvous)."""
    args = _parser().parse_args(argv)
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tierps.client import EmbeddingClient
    from tierps.client.distributed import TrainerGroup
    from tierps.demo.data import load_dataset
    from tierps.demo.training import (
        auc,
        build_tierps_model,
        dense_optimizer_for,
        epoch_seed,
        logloss,
        predict,
        train_epoch,
    )

    torch.set_num_threads(args.torch_threads)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    share = (rank, ranks)
    dataset = load_dataset(args.dataset, seed=args.seed, samples=args.samples)
    with EmbeddingClient(args.addresses.split(","), security=security.from_args(args)) as client:
        model = build_tierps_model(client, dataset, dim=args.dim, seed=args.seed)
        collection = model.embeddings.collection
        group = TrainerGroup(client, [collection], mode=args.mode, staleness=args.staleness)
        dense = DistributedDataParallel(model)
        dense_optimizer = dense_optimizer_for(model, args.lr)
        state = group.load_checkpoint(args.checkpoint_dir)
        if state is not None:
            model.load_state_dict(state["model"])
            dense_optimizer.load_state_dict(state["optimizer"])
        else:  # the job's start is its first checkpoint: a rank dying in epoch 1 resumes here
            group.save_checkpoint(
                args.checkpoint_dir,
                {"model": model.state_dict(), "optimizer": dense_optimizer.state_dict()},
            )
        steps_per_epoch = dataset.num_batches("train", args.batch_size, ranks)
        first_epoch = group.step // steps_per_epoch + 1  # checkpoints end epochs
        if rank == 0 and state is not None:
            print(f"resumed from the checkpoint of step {group.step} (epoch {first_epoch - 1})")

        def gathered(*arrays: np.ndarray) -> list[np.ndarray]:
            parts: list[Any] = [None] * ranks
            dist.all_gather_object(parts, arrays)
            return [np.concatenate([part[i] for part in parts]) for i in range(len(arrays))]

        for epoch in range(first_epoch, args.epochs + 1):
            _, _, seconds, samples = train_epoch(
                model,
                dataset,
                dense_optimizer,
                None,
                batch_size=args.batch_size,
                shuffle_seed=epoch_seed(args.seed, epoch),
                share=share,
                progress=f"train epoch {epoch}/{args.epochs}" if rank == 0 else None,
                steps=lambda batches: group.pipeline(
                    batches, (collection, lambda batch: batch.features)
                ),
                forward=dense,
            )
            totals = torch.tensor([float(samples), seconds], dtype=torch.float64)
            dist.all_reduce(totals[:1])  # samples of all ranks
            dist.all_reduce(totals[1:], op=dist.ReduceOp.MAX)  # the slowest rank's time
            labels, logits = gathered(*predict(model, dataset, "test", share=share))
            group.save_checkpoint(
                args.checkpoint_dir,
                {"model": model.state_dict(), "optimizer": dense_optimizer.state_dict()},
            )
            if rank == 0:
                print(
                    f"epoch {epoch}: test logloss {logloss(labels, logits):.4f} AUC "
                    f"{auc(labels, logits):.4f} | {totals[0] / totals[1]:,.0f} samples/s over "
                    f"{ranks} trainer(s) ({totals[1]:.1f} s; {args.mode}"
                    + (f", staleness {args.staleness}" if args.mode == "async" else "")
                    + f"; largest staleness seen {group.max_staleness_seen})",
                    flush=True,
                )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
