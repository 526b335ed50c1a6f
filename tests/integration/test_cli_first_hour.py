"""What a new user meets first, against one real subprocess cluster (LocalCluster): the
admin CLI's flags after the subcommand and TIERPS_ADDRESSES, `create --config` with the
list `tables --json` prints, a config clash named field by field, snapshot progress (no
carriage returns into a pipe; a fixed total and whole rows on a terminal; NOT_FOUND listing
the snapshots there), a reader that goes away, a second `tierps cluster` on a data dir in
use, --version, and `tierps admin top --once`."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import socket
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
import torch

from tierps.client import EmbeddingClient, TableConfig, optim
from tierps.server import cli
from tierps.server.cluster import LocalCluster, ShardStartError

TIMEOUT_S = 60.0
TABLE = TableConfig("clicks", 8, optimizer=optim.Adagrad(lr=0.1), seed=3)
KEYS = np.arange(0, 5000, dtype=np.int64)


def tierps(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierps.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        env=env,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("first-hour")
    with LocalCluster(2, root / "data", root / "snapshots", metrics=True) as running:
        with EmbeddingClient(running.addresses) as client:
            client.create_table(TABLE)
            client.lookup(TABLE.name, KEYS)
        yield running


@pytest.fixture
def env(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """TIERPS_ADDRESSES set to the cluster's, here and in the environment returned."""
    monkeypatch.setenv("TIERPS_ADDRESSES", ",".join(cluster.addresses))
    return {**os.environ}


def admin(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`tierps admin ARGS` run in this process (its parser and code, this cluster; a
    subprocess would only add a second of imports): (exit status, stdout, stderr)."""
    code = cli.main(["admin", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_flags_after_the_subcommand_and_addresses_from_the_environment(
    env: dict[str, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = admin(capsys, "tables", "--json", "--timeout-s", "20")
    assert code == 0, err
    assert json.loads(out) == [TABLE.to_dict()]
    code, out, err = admin(capsys, "snapshot", "list", "--json")
    assert code == 0, err
    assert isinstance(json.loads(out), list)
    monkeypatch.delenv("TIERPS_ADDRESSES")
    code, out, err = admin(capsys, "tables")
    assert code == 1 and "TIERPS_ADDRESSES" in err, err


def test_create_takes_the_tables_json_list_and_names_a_clashing_field(
    env: dict[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    listed = tmp_path / "tables.json"
    listed.write_text(admin(capsys, "tables", "--json")[1])
    code, out, err = admin(capsys, "create", "--config", str(listed))
    assert code == 0, err
    assert "'clicks' exists already" in out

    other = TableConfig("clicks", 16, optimizer=optim.Adagrad(lr=0.2), seed=3)
    clash = tmp_path / "clash.json"
    clash.write_text(json.dumps(other.to_dict()))
    code, out, err = admin(capsys, "create", "--config", str(clash))
    assert code == 1
    assert "field 'dim' expected 8 (the table's), got 16" in err, err
    assert "field 'optimizer.lr' expected 0.1 (the table's), got 0.2" in err
    assert "'seed'" not in err
    assert len(err) < 400, err  # not two whole configs


@pytest.mark.slow  # real subprocesses: seconds
def test_snapshot_progress_in_a_pipe_and_on_a_terminal(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = admin(capsys, "snapshot", "save", "first-piped")  # stderr: not a tty
    assert code == 0, err
    assert "\r" not in err and "\r" not in out and err == ""
    assert f"saved snapshot 'first-piped': {KEYS.size:,} rows" in out

    # On a terminal: a bar whose total never changes, in whole rows, never past it.
    terminal, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100
    process = subprocess.Popen(
        [sys.executable, "-m", "tierps.server.cli", "admin", "snapshot", "load", "first-piped"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=child,
        env=env,
    )
    os.close(child)
    seen = b""
    while True:
        try:
            chunk = os.read(terminal, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(terminal)
    assert process.wait(TIMEOUT_S) == 0
    process.stdout.close()
    bars = re.findall(r"(\d+)/(\d+) \[", seen.decode(errors="replace"))
    assert bars, seen
    totals = {int(total) for _, total in bars}
    assert totals == {2 * KEYS.size}, seen  # each of 2 shards reads every part: fixed
    done = [int(n) for n, _ in bars]
    assert done == sorted(done) and done[-1] == 2 * KEYS.size, seen


def test_a_missing_snapshot_lists_what_exists(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert admin(capsys, "snapshot", "save", "first-listed")[0] == 0
    code, out, err = admin(capsys, "snapshot", "load", "no-such")
    assert code == 1
    assert "NOT_FOUND" in err and "first-listed" in err, err
    assert err.count("\n") == 1, err


@pytest.mark.slow  # real subprocesses: seconds
def test_a_reader_that_goes_away_ends_it_quietly(env: dict[str, str]) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "tierps.server.cli", "admin", "stats", "--json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    process.stdout.close()  # as `| head` does once it has its lines
    _, stderr = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 141, stderr
    assert b"Broken pipe" not in stderr and b"Traceback" not in stderr, stderr


@pytest.mark.slow  # real subprocesses: seconds
def test_a_second_cluster_on_a_data_dir_in_use_is_refused_cleanly(cluster: LocalCluster) -> None:
    port_files = sorted(cluster.data_dir.glob("shard-*.port"))
    before = {path: path.read_text() for path in port_files}
    assert len(before) == 2
    result = tierps("cluster", "--shards", "2", "--data-dir", str(cluster.data_dir))
    assert result.returncode == 1
    assert "in use by a running shard" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert {path: path.read_text() for path in port_files} == before
    with EmbeddingClient(cluster.addresses) as client:  # the running cluster serves on
        assert client.lookup(TABLE.name, KEYS[:3], create=False).shape == (3, 8)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"tierps {version('tierps')}"


def test_top_once_shows_each_shard_tier_and_table(
    env: dict[str, str], capsys: pytest.CaptureFixture[str], cluster: LocalCluster
) -> None:
    """Totals against the keys this test sends (EmbeddingClient sends each distinct key once
    to its shard); rates and latencies from traffic running while top samples."""
    code, out, err = admin(capsys, "top", "--once", "--interval-s", "0.1", "--json")
    assert code == 0, err
    before = {t["name"]: t for t in json.loads(out)["tables"]}[TABLE.name]
    looked, pushed = np.arange(100, 400, dtype=np.int64), np.arange(7, 107, dtype=np.int64)
    stop = threading.Event()
    with EmbeddingClient(cluster.addresses) as client:
        for _ in range(3):
            client.lookup(TABLE.name, np.concatenate([looked, looked[:10], [-1]]))
        client.push_gradients(TABLE.name, pushed, np.ones((pushed.size, 8), np.float32), step=1)

        def traffic() -> None:
            while not stop.is_set():
                client.lookup(TABLE.name, KEYS[:64], create=False)

        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            code, out, err = admin(capsys, "top", "--once", "--interval-s", "0.5", "--json")
            text = admin(capsys, "top", "--once", "--interval-s", "0.2")
        finally:
            stop.set()
            thread.join()
    assert code == 0, err
    figures = json.loads(out)
    after = {t["name"]: t for t in figures["tables"]}[TABLE.name]
    during = after["keys_looked_up"] - before["keys_looked_up"] - 3 * looked.size
    # whole calls of 64 keys, 32 on each shard (a call may be counted on one shard so far)
    assert during > 0 and during % 32 == 0, (before, after)
    assert after["keys_pushed"] - before["keys_pushed"] == pushed.size
    assert after["keys_looked_up_per_s"] > 0
    assert [s["address"] for s in figures["shards"]] == cluster.addresses
    for shard in figures["shards"]:
        lookup = shard["rpc"]["LookupUnary"]
        assert lookup["calls_per_s"] > 0 and 0 < lookup["p50_s"] <= lookup["p99_s"], shard
        assert [t["name"] for t in shard["tiers"]] == ["host", "rocksdb"]
    assert text[0] == 0, text[2]
    for needle in ("LookupUnary", "p99", "host", "rocksdb", TABLE.name, *cluster.addresses):
        assert needle in text[1], (needle, text[1])


def test_the_demo_trains_on_the_cluster_in_tierps_addresses(
    env: dict[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With TIERPS_ADDRESSES set, `tierps demo` trains on that cluster and starts none."""
    threads = torch.get_num_threads()  # the demo sets torch's threads: this process's too
    try:
        demo = tmp_path / "demo"
        code = cli.main(
            [
                "demo",
                "--dataset",
                "synthetic",
                "--samples",
                "2000",
                "--epochs",
                "1",
                "--batch-size",
                "512",
                "--data-dir",
                str(demo),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"the running cluster at {', '.join(env['TIERPS_ADDRESSES'].split(','))}" in out
    assert "epoch 1: train logloss" in out and "snapshot 'deepfm-synthetic-" in out, out
    assert not (tmp_path / "demo").exists()  # no cluster of its own, no snapshots pruned


def test_a_port_clash_is_explained_with_this_start_s_log_only(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-0.log").write_text("an old line of an earlier start\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ShardStartError) as refused:
            LocalCluster(1, data, base_port=port).start()
    assert f"cannot bind 127.0.0.1:{port}" in str(refused.value), refused.value
    assert "an old line" not in str(refused.value)
