"""Many trainers (tierps.client.distributed): real `torchrun` with 2 gloo ranks on 127.0.0.1
against a real 2-shard LocalCluster. Each rank runs tests/integration/dist_trainer.py.

References: one process training the same model on the global batch (both ranks' batches
together) with torch's own embedding optimizers (SparseAdam, Adagrad) on
torch.nn.EmbeddingBag, which is what sync mode must equal (its tables of two dims exchanged
together by key owner); and, for async mode, a probe row
whose value counts the pushes applied before each lookup.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from tests.integration import dist_trainer as trainer  # noqa: E402
from tierps.client.embedding import EmbeddingClient  # noqa: E402
from tierps.core.config import TableConfig  # noqa: E402
from tierps.demo.trainers import torchrun_on_this_machine  # noqa: E402
from tierps.server.cluster import LocalCluster  # noqa: E402
from tierps.storage import optim  # noqa: E402

pytestmark = pytest.mark.slow  # real torchrun jobs, a killed rank among them

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
STEPS = 6
ADAM = dict(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-6)
ADAGRAD_LR = 0.1
TORCHRUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("distributed")
    with LocalCluster(2, root / "data", root / "snapshots") as running:
        yield running


def initial_rows(table: str, dim: int) -> np.ndarray:
    return (
        np.random.default_rng(sum(map(ord, table)))
        .normal(0.0, 0.3, (trainer.VOCAB, dim))
        .astype(np.float32)
    )


def create_tables(cluster: LocalCluster, prefix: str, probe: bool = False) -> None:
    keys = np.arange(trainer.VOCAB, dtype=np.int64)
    with EmbeddingClient(cluster.addresses) as client:
        for suffix, dim in trainer.TABLES.items():
            optimizer = optim.Adagrad(lr=ADAGRAD_LR) if suffix == "adagrad" else optim.Adam(**ADAM)
            config = TableConfig(f"{prefix}{suffix}", dim, optimizer=optimizer)
            client.create_table(config, initial=(keys, initial_rows(f"{prefix}{suffix}", dim)))
        if probe:
            zeros = np.zeros((1, trainer.PROBE_DIM), dtype=np.float32)
            config = TableConfig(f"{prefix}probe", trainer.PROBE_DIM, optimizer=optim.SGD(lr=1.0))
            client.create_table(config, initial=(keys[:1], zeros))


def torchrun(
    cluster: LocalCluster, out: Path, *args: str, max_restarts: int = 0
) -> list[dict[str, object]]:
    """Run dist_trainer on WORLD ranks under real torchrun; each rank's JSON report."""
    out.mkdir(parents=True, exist_ok=True)
    command, env = torchrun_on_this_machine(
        WORLD,
        "tests.integration.dist_trainer",
        ["--addresses", ",".join(cluster.addresses), "--out", str(out), *args],
        max_restarts=max_restarts,
    )
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S
    )
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(WORLD)]


def one_trainer_with_the_global_batch(prefix: str, steps: int) -> dict[str, np.ndarray]:
    """The reference: the whole global batch in one process, torch's own optimizers."""
    bags = {}
    for suffix, dim in trainer.TABLES.items():
        bag = nn.EmbeddingBag(trainer.VOCAB, dim, mode="sum", sparse=True)
        with torch.no_grad():
            bag.weight.copy_(torch.from_numpy(initial_rows(f"{prefix}{suffix}", dim)))
        bags[suffix] = bag
    dense = trainer.dense_model()
    optimizers = [
        torch.optim.SGD(dense.parameters(), lr=0.5),
        torch.optim.Adagrad(bags["adagrad"].parameters(), lr=ADAGRAD_LR),
        *(
            torch.optim.SparseAdam(
                bag.parameters(),
                lr=ADAM["lr"],
                betas=(ADAM["beta1"], ADAM["beta2"]),
                eps=ADAM["eps"],
            )
            for suffix, bag in bags.items()
            if suffix != "adagrad"
        ),
    ]
    for step in range(1, steps + 1):
        ids, labels = trainer.global_batch(step)
        pooled = [bags[t](torch.from_numpy(ids[t])) for t in trainer.TABLES]
        trainer.loss_of(dense, pooled, torch.from_numpy(labels)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    result = {f"rows:{prefix}{t}": bags[t].weight.detach().numpy() for t in trainer.TABLES}
    result |= {f"dense:{n}": p.detach().numpy() for n, p in dense.state_dict().items()}
    return result


def assert_equals_reference(
    cluster: LocalCluster, prefix: str, reports: list[dict[str, object]]
) -> None:
    expected = one_trainer_with_the_global_batch(prefix, STEPS)
    keys = np.arange(trainer.VOCAB, dtype=np.int64)
    with EmbeddingClient(cluster.addresses) as client:
        for suffix in trainer.TABLES:
            table = f"{prefix}{suffix}"
            rows = client.lookup(table, keys, create=False)
            np.testing.assert_allclose(rows, expected[f"rows:{table}"], rtol=0, atol=1e-5)
    for report in reports:
        for name, value in report["dense"].items():  # type: ignore[union-attr]
            np.testing.assert_allclose(
                np.asarray(value, np.float32), expected[f"dense:{name}"], rtol=0, atol=1e-5
            )


def test_sync_equals_one_trainer_with_the_global_batch(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    create_tables(cluster, "a_")
    reports = torchrun(cluster, tmp_path, "--prefix", "a_", "--steps", str(STEPS))
    assert_equals_reference(cluster, "a_", reports)
    # one step clock: every rank at the same step, every table on every shard at it
    for report in reports:
        assert report["step"] == STEPS
        assert report["table_steps"] == {f"a_{t}": STEPS for t in trainer.TABLES}
        assert report["max_staleness_seen"] == 0


def test_a_rank_killed_mid_step_resumes_from_the_last_checkpoint(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Rank 1 pushes half of the keys it owns at step 5 and dies (SIGKILL); torchrun
    restarts both ranks, which resume from the checkpoint of step 4 and finish: the result
    is the uninterrupted run's (the reference), the half push erased."""
    create_tables(cluster, "b_")
    reports = torchrun(
        cluster,
        tmp_path / "out",
        "--prefix",
        "b_",
        "--steps",
        str(STEPS),
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "2",
        "--kill-at",
        "5",
        max_restarts=1,
    )
    for report in reports:
        assert (report["attempt"], report["resumed_at"], report["step"]) == (1, 4, STEPS)
        assert report["table_steps"] == {f"b_{t}": STEPS for t in trainer.TABLES}
    assert_equals_reference(cluster, "b_", reports)


def test_async_lookups_are_never_more_than_staleness_steps_behind(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Rank 1's pushes are slow; the probe row counts the pushes applied before each step's
    lookup: every rank's pushes of steps <= step - 1 - k must be in, and none of a later
    step (DDP's all-reduce keeps the ranks within a step of each other)."""
    k, steps = 2, 10
    create_tables(cluster, "c_", probe=True)
    reports = torchrun(
        cluster,
        tmp_path,
        "--prefix",
        "c_",
        "--mode",
        "async",
        "--staleness",
        str(k),
        "--steps",
        str(steps),
        "--slow-pushes",
        "0.15",
        "--probe",
    )
    behind = 0
    for report in reports:
        assert 0 < report["max_staleness_seen"] <= k
        for seen in report["seen"]:  # type: ignore[union-attr]
            step, applied = seen["step"], seen["probe_pushes_applied"]
            # at most: every push before this step, and the other ranks' of this step (a
            # rank's backward may push before a slower rank has looked up the same step)
            assert WORLD * max(0, step - 1 - k) <= applied <= WORLD * step - 1, seen
            behind += applied < WORLD * (step - 1)
    assert behind, "no lookup missed a push: the slow pushes did not exercise the bound"
    with EmbeddingClient(cluster.addresses) as client:  # every push in at the end
        row = client.lookup("c_probe", np.zeros(1, np.int64), create=False)
        assert row[0, 0] == -WORLD * steps
