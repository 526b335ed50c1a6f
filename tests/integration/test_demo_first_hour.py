"""`tierps demo` (a real subprocess) as a new user meets it: on a running cluster given by
TIERPS_ADDRESSES it refuses to drop a table it did not create unless --replace, fails fast
on stale addresses, and prunes the snapshots it writes there; on its own cluster it keeps
no other dataset's table (snapshots hold only the run's); Ctrl-C ends it with one line,
exit code 130, its cluster stopped, its ranks gone and no partial snapshot left."""

from __future__ import annotations

import importlib.util
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from tierps.client import EmbeddingClient, TableConfig  # noqa: E402
from tierps.demo import data  # noqa: E402
from tierps.server.cluster import LocalCluster  # noqa: E402
from tierps.server.daemon import ShardServer  # noqa: E402
from tierps.storage.snapshot_format import MANIFEST  # noqa: E402

pytestmark = pytest.mark.slow  # demo subprocesses that train, and are interrupted

TIMEOUT_S = 180.0
STOP_S = 30.0  # Ctrl-C to exit: the cluster stopped, the ranks killed, the snapshot removed
TINY = ("--dataset", "synthetic", "--samples", "3000", "--epochs", "1", "--batch-size", "256")
requires_recbole = pytest.mark.skipif(
    importlib.util.find_spec("recbole") is None, reason="MovieLens-100k comes with recbole"
)


def run_demo(*args: str, cwd: Path, addresses: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TIERPS_ADDRESSES"}
    if addresses is not None:
        env["TIERPS_ADDRESSES"] = addresses
    return subprocess.run(
        [sys.executable, "-m", "tierps.server.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        env=env,
    )


@requires_recbole
def test_a_movielens_table_on_a_running_cluster_is_not_dropped_without_replace(
    tmp_path: Path, shard_server: Callable[..., ShardServer]
) -> None:
    servers = [shard_server(i, 2) for i in range(2)]
    addresses = ",".join(f"127.0.0.1:{server.port}" for server in servers)
    keys = np.arange(100)
    with EmbeddingClient(addresses.split(",")) as client:
        client.create_table(TableConfig(data.MOVIELENS_TABLE, 4))
        client.assign(data.MOVIELENS_TABLE, keys, np.full((100, 4), 7.0, np.float32))
    result = run_demo("--data-dir", str(tmp_path / "data"), cwd=tmp_path, addresses=addresses)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr == (
        f"tierps demo: the cluster at {addresses} (from $TIERPS_ADDRESSES) has table(s) "
        f"'movielens': the demo would drop and create them afresh, losing their rows. Give "
        f"--replace to let it, or train on the demo's own cluster (no --addresses, "
        f"TIERPS_ADDRESSES unset)\n"
    ), result.stderr
    with EmbeddingClient(addresses.split(",")) as client:  # untouched
        assert [config.dim for config in client.list_tables()] == [4]
        assert (client.lookup(data.MOVIELENS_TABLE, keys) == 7.0).all()


def test_on_a_running_cluster_replace_trains_and_its_snapshots_are_pruned(
    tmp_path: Path, shard_server: Callable[..., ShardServer]
) -> None:
    servers = [shard_server(i, 2, snapshot_dir=tmp_path / "theirs") for i in range(2)]
    addresses = ",".join(f"127.0.0.1:{server.port}" for server in servers)
    with EmbeddingClient(addresses.split(",")) as client:
        client.create_table(TableConfig(data.SYNTHETIC_TABLE, 4))
        client.create_table(TableConfig("users-own", 4))
        client.save_snapshot("users-own-snapshot")
    data_dir = str(tmp_path / "data")
    refused = run_demo(*TINY, "--data-dir", data_dir, cwd=tmp_path, addresses=addresses)
    assert refused.returncode == 1 and "'synthetic.criteo'" in refused.stderr, refused.stderr
    saved = []
    for run in (1, 2):
        result = run_demo(
            *TINY, "--replace", "--data-dir", data_dir, cwd=tmp_path, addresses=addresses
        )
        assert result.returncode == 0, f"run {run}:\n{result.stdout}\n{result.stderr}"
        saved.append(result.stdout.split("snapshot '")[1].split("'")[0])
    assert f"deleted 1 older demo snapshot(s) (--keep-snapshots 1): {saved[0]}" in result.stdout
    with EmbeddingClient(addresses.split(",")) as client:
        assert sorted(s["name"] for s in client.list_snapshots()) == [
            saved[1],
            "users-own-snapshot",
        ]
        assert {c.name for c in client.list_tables()} == {data.SYNTHETIC_TABLE, "users-own"}
    assert not (tmp_path / "data" / "demo-cluster-2").exists()  # no cluster of its own


def test_on_a_running_cluster_job_checkpoints_are_pruned_there(
    tmp_path: Path, shard_server: Callable[..., ShardServer]
) -> None:
    servers = [shard_server(i, 2, snapshot_dir=tmp_path / "theirs") for i in range(2)]
    addresses = ",".join(f"127.0.0.1:{server.port}" for server in servers)
    data_dir = tmp_path / "data"
    for run in (1, 2):  # 2 checkpoints a job (its start, its epoch); 1 kept after each
        result = run_demo(
            *TINY,
            "--trainers",
            "1",
            "--replace",
            "--data-dir",
            str(data_dir),
            cwd=tmp_path,
            addresses=addresses,
        )
        assert result.returncode == 0, f"run {run}:\n{result.stdout}\n{result.stderr}"
    assert "deleted 2 older job checkpoint(s) (--keep-snapshots 1)" in result.stdout
    (kept,) = data_dir.glob("checkpoints/*/*.pt")
    with EmbeddingClient(addresses.split(",")) as client:
        assert [s["name"] for s in client.list_snapshots()] == [kept.stem]


def test_stale_addresses_fail_fast_with_a_hint(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    result = run_demo(*TINY, cwd=tmp_path, addresses=f"127.0.0.1:{port}")
    assert result.returncode == 1, result.stdout + result.stderr
    assert time.monotonic() - started < 15  # imports, then ~1.5 s of retries; no dataset
    assert "is the shard running? A cluster restarted since has new ports" in result.stderr
    assert "Traceback" not in result.stderr and "synthetic" not in result.stdout
    result = run_demo(*TINY, cwd=tmp_path, addresses="127.0.0.1")
    assert result.returncode == 1
    assert "address '127.0.0.1' (from $TIERPS_ADDRESSES) expected host:port" in result.stderr


def test_the_demo_cluster_keeps_only_the_tables_of_the_dataset_it_trains(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with (
        LocalCluster(2, data_dir / "demo-cluster-2", data_dir / "snapshots") as cluster,
        EmbeddingClient(cluster.addresses) as client,
    ):  # an earlier run's table of the other dataset
        client.create_table(TableConfig(data.MOVIELENS_TABLE, 17))
        client.lookup(data.MOVIELENS_TABLE, np.arange(5000))
    crashed = data_dir / "snapshots" / "ckpt-step0000000063-0123abcd" / "0123abcd"
    crashed.mkdir(parents=True)  # a save a killed run left: no manifest
    (crashed / "part-00000-of-00002.json").write_text("{}")
    result = run_demo(*TINY, "--data-dir", str(data_dir), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "removed 1 incomplete snapshot path(s) an earlier run left" in result.stdout
    (snapshot,) = (data_dir / "snapshots").iterdir()
    with (
        LocalCluster(2, data_dir / "demo-cluster-2", data_dir / "snapshots") as cluster,
        EmbeddingClient(cluster.addresses) as client,
    ):
        assert [c.name for c in client.list_tables()] == [data.SYNTHETIC_TABLE]
        (info,) = client.list_snapshots()
        assert info["name"] == snapshot.name and list(info["table_rows"]) == [data.SYNTHETIC_TABLE]


def _processes_naming(text: str) -> list[str]:
    """The command lines of the processes that name `text` (a test's tmp dir)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in line and cmdline.parent.name != str(os.getpid()):
            found.append(line)
    return found


@pytest.mark.parametrize(
    ("trainers", "stop"),
    [(None, "ctrl-c"), (2, "ctrl-c"), (2, "sigterm")],
    ids=["one-trainer", "two-trainers", "two-trainers-sigterm"],
)
def test_ctrl_c_stops_the_demo_with_one_line(
    tmp_path: Path, trainers: int | None, stop: str
) -> None:
    """SIGINT to the demo's process group, as a terminal's Ctrl-C sends it, mid-training
    (at a snapshot being written, if one is seen first); or SIGTERM to the demo alone, as
    `kill PID` sends it, which its torchrun (in a session of its own) does not hear."""
    data_dir = tmp_path / "data"
    args = [
        "--dataset",
        "synthetic",
        "--samples",
        "20000",
        "--epochs",
        "30",
        "--batch-size",
        "256",
        "--data-dir",
        str(data_dir),
    ]
    if trainers:
        args += ["--trainers", str(trainers)]
    env = {k: v for k, v in os.environ.items() if k != "TIERPS_ADDRESSES"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tierps.server.cli", "demo", *args],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = _until_training(process, data_dir / "snapshots")
        if stop == "ctrl-c":
            os.killpg(process.pid, signal.SIGINT)
        else:
            os.kill(process.pid, signal.SIGTERM)
        started = time.monotonic()
        # communicate drains both pipes while it waits: a demo blocked writing to a full
        # stderr pipe (tqdm's progress) could not exit, whatever its signal handling.
        rest_out, rest_err = process.communicate(timeout=STOP_S)
        code = process.returncode
        seconds = time.monotonic() - started
        err += rest_err.decode()
        out += rest_out.decode()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert code == 130, f"{out}\n{err}"
    assert seconds < STOP_S
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    messages = [line for line in lines if not line.startswith(("train epoch", " "))]  # tqdm's
    assert len(messages) == 1, err
    assert messages[0].startswith("tierps demo: interrupted: the demo's cluster stopped; ")
    assert "Traceback" not in err and "Warning" not in err, err
    left = _processes_naming(str(tmp_path))  # shards, torchrun and ranks all name it
    assert not left, left
    snapshots = data_dir / "snapshots"
    made = list(snapshots.iterdir()) if snapshots.exists() else []  # none before a save
    partial = [path.name for path in made if not (path / MANIFEST).exists()]
    assert not partial, (partial, messages[0])


def _until_training(process: subprocess.Popen, snapshots: Path) -> tuple[str, str]:
    """Read the demo's output until it trains (an epoch's first lines, or a snapshot being
    written); what it printed to stdout and stderr. Both pipes are read: one left unread
    fills and blocks the demo."""
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ, "out")
    selector.register(process.stderr, selectors.EVENT_READ, "err")
    printed = {"out": "", "err": ""}
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the demo ended early:\n{printed['out']}"
        if snapshots.is_dir() and any(not (p / MANIFEST).exists() for p in snapshots.iterdir()):
            return printed["out"], printed["err"]  # a save under way: the worst moment
        for ready, _ in selector.select(timeout=0.01):
            chunk = os.read(ready.fileobj.fileno(), 1 << 16)
            printed[ready.data] += chunk.decode(errors="replace")
        if "\nepoch 1: " in printed["out"]:  # epoch 2 trains now
            return printed["out"], printed["err"]
    pytest.fail(f"the demo did not start training in {TIMEOUT_S:.0f} s:\n{printed['out']}")
