"""The `tierps` command line as tests run it: `python -m tierps.server.cli` of this
interpreter, so the tree under test runs whatever `tierps` the PATH holds."""

from __future__ import annotations

import os
import sys


def tierps_command(*args: str) -> list[str]:
    """argv that runs `tierps ARGS...`."""
    return [sys.executable, "-m", "tierps.server.cli", *args]


def serve_command(
    data_dir: str | os.PathLike[str], *flags: str, shard_id: int = 0, num_shards: int = 1
) -> list[str]:
    """argv of `tierps serve` for shard `shard_id` of `num_shards` on `data_dir`, then FLAGS."""
    return tierps_command(
        "serve",
        "--shard-id",
        str(shard_id),
        "--num-shards",
        str(num_shards),
        "--data-dir",
        str(data_dir),
        *flags,
    )
