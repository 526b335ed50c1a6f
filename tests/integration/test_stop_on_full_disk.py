"""A `tierps serve` stopped (SIGTERM) while its data disk is full, with write-back updates
not yet flushed: the last flush fails, the shard exits 1 without a clean stop, the updates
acknowledged since the last flush are gone after a restart, and a client that knew that life
is told with DATA_LOSS (README, What an acknowledged update survives). A real full disk: a
small tmpfs (tests/fault_fs.py; skipped where mounting is not permitted)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests.commands import serve_command
from tests.fault_fs import fill, small_tmpfs
from tierps.client import EmbeddingClient, ShardError, TableConfig, optim
from tierps.server.lives import LIVES_FILE

TIMEOUT_S = 60.0
DIM = 4
KEYS = np.arange(200_000, dtype=np.int64)  # 3 MiB of rows: more than the disk has left


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Shard:
    """`tierps serve` on a fixed port (a client keeps its address across restarts), with
    no background flush: dirty rows reach RocksDB only at stop."""

    def __init__(self, data_dir: Path, port: int) -> None:
        port_file = data_dir.parent / "port"
        port_file.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            serve_command(
                str(data_dir),
                "--port",
                str(port),
                "--port-file",
                str(port_file),
                "--flush-interval-s",
                "0",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + TIMEOUT_S
        while not port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                pytest.fail(f"the shard did not start: {self.process.communicate()[1][-2000:]}")
            time.sleep(0.1)

    def stop(self) -> tuple[int, str]:
        """SIGTERM; (exit status, stderr)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            _, err = self.process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        return self.process.returncode, err


@pytest.fixture
def start_shard() -> Iterator[Callable[[Path, int], Shard]]:
    """Shard(data_dir, port); any still running at teardown is killed."""
    started: list[Shard] = []

    def start(data_dir: Path, port: int) -> Shard:
        started.append(Shard(data_dir, port))
        return started[-1]

    yield start
    for shard in started:
        if shard.process.poll() is None:
            shard.process.kill()
            shard.process.communicate()


def _push(client: EmbeddingClient) -> None:
    client.push_gradients("t", KEYS, -np.ones((KEYS.size, DIM), np.float32))


@pytest.mark.slow
def test_a_stop_on_a_full_disk_exits_1_loses_the_unflushed_updates_and_tells_the_client(
    tmp_path: Path, start_shard: Callable[[Path, int], Shard]
) -> None:
    port = _free_port()
    address = [f"127.0.0.1:{port}"]
    with small_tmpfs(tmp_path / "fs", megabytes=30) as fs:
        data_dir = fs / "shard"
        shard = start_shard(data_dir, port)
        with EmbeddingClient(address) as first:
            first.create_table(TableConfig("t", DIM, optimizer=optim.SGD(lr=1.0)))
            _push(first)
            flushed = first.lookup("t", KEYS, create=False)
        assert shard.stop()[0] == 0  # a clean stop: the rows above are in RocksDB

        shard = start_shard(data_dir, port)
        old = EmbeddingClient(address)
        try:
            assert np.array_equal(old.lookup("t", KEYS, create=False), flushed)
            filler = fill(fs, leave_bytes=4 << 10)
            _push(old)  # acknowledged: write-back keeps it in memory
            assert np.allclose(old.lookup("t", KEYS, create=False), flushed + 1)
            code, err = shard.stop()
            assert code == 1, err[-2000:]
            assert "stopped without a clean flush" in err and "No space left" in err, err[-2000:]
            assert json.loads((data_dir / LIVES_FILE).read_text())["running"] is True

            filler.unlink()
            shard = start_shard(data_dir, port)
            with pytest.raises(ShardError) as told:
                old.lookup("t", KEYS[:3], create=False)
            assert told.value.code is grpc.StatusCode.DATA_LOSS
            assert "unclean stop" in str(told.value) and "may be lost" in str(told.value)
        finally:
            old.close()
        with EmbeddingClient(address) as new:  # a new client goes on, with the flushed rows
            assert np.array_equal(new.lookup("t", KEYS, create=False), flushed)
        assert shard.stop()[0] == 0
