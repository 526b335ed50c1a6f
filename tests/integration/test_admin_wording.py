"""What `tierps admin` and `tierps serve` print agrees with itself: a tier no lookup reached
shows its hit rate as "-" in describe and stats (as top shows it), counts of shards are
worded in the singular for one, and the JSON log writes a missing snapshot dir as null."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.commands import serve_command
from tierps.client import EmbeddingClient, TableConfig
from tierps.server import cli
from tierps.server.daemon import ShardServer

TIMEOUT_S = 60.0


def admin(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = cli.main(["admin", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_describe_and_stats_show_no_hit_rate_before_any_lookup(
    tmp_path: Path,
    shard_server: Callable[..., ShardServer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    address = f"127.0.0.1:{shard_server().port}"
    config = tmp_path / "table.json"
    config.write_text(json.dumps(TableConfig("fresh", 4).to_dict()))
    out = admin(capsys, "create", "--config", str(config), "--addresses", address)
    assert out == "table 'fresh' created on 1 shard\n", out
    for action in (["describe", "fresh"], ["stats"]):
        out = admin(capsys, *action, "--addresses", address)
        rows = [line.split() for line in out.splitlines() if " host " in f" {line} "]
        assert rows and all(row[-1] == "-" for row in rows), out
        assert "0.0%" not in out, out
    with EmbeddingClient([address]) as client:
        client.lookup("fresh", [1, 2, 3])
    out = admin(capsys, "describe", "fresh", "--addresses", address)
    assert "0.0%" in out and " - " not in out.splitlines()[-1], out  # 3 misses: a rate now


def test_the_serving_log_line_writes_no_snapshot_dir_as_null(tmp_path: Path) -> None:
    command = serve_command(str(tmp_path / "data"))
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = threading.Timer(TIMEOUT_S, process.kill)  # bounds the read below
    deadline.start()
    try:
        serving = None
        assert process.stdout is not None
        for line in process.stdout:  # ends at the "serving" line, or when the shard exits
            if line.startswith("{") and json.loads(line).get("msg") == "serving":
                serving = json.loads(line)
                break
    finally:
        deadline.cancel()
        process.terminate()
        process.wait(TIMEOUT_S)
    assert serving is not None
    assert serving["snapshot_dir"] is None and serving["data_dir"] == str(tmp_path / "data")
