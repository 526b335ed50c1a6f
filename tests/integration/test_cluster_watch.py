"""`tierps cluster` (a real subprocess) watches its shards: when one is killed (kill -9), it
prints one line naming the shard, its pid, the signal and its log, stops the other shards,
removes its addresses file and exits with status 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a subprocess cluster started and one shard killed

TIMEOUT_S = 60.0


def test_a_killed_shard_is_named_and_the_cluster_stops(tmp_path: Path) -> None:
    data = tmp_path / "data"
    command = [
        sys.executable,
        "-m",
        "tierps.server.cli",
        "cluster",
        "--shards",
        "2",
        "--data-dir",
        str(data),
    ]
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = threading.Timer(TIMEOUT_S, process.kill)  # bounds the reads below
    deadline.start()
    pids: list[int] = []
    try:
        assert process.stdout is not None and process.stderr is not None
        for line in process.stdout:
            if line.startswith("export TIERPS_ADDRESSES="):
                break
        assert (data / "addresses").exists(), "the cluster never served"
        pids = [json.loads((data / f"shard-{i}.port").read_text())["pid"] for i in range(2)]
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        assert process.wait(TIMEOUT_S) == 1
        assert time.monotonic() - started < 20  # noticed within a poll, the other stopped
        err = process.stderr.read()
    finally:
        deadline.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert err == (
        f"tierps cluster: shard 1 (pid {pids[1]}) exited on its own (killed by SIGKILL); its "
        f"log: {data / 'shard-1.log'}; stopping the other shards\n"
    ), err
    for pid in pids:  # both reaped: no zombie, no shard left serving
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (data / "addresses").exists()
    assert '"stopped"' in (data / "shard-0.log").read_text()  # the other one: a graceful stop
